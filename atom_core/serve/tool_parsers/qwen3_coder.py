"""Qwen3-Coder's XML format, which Qwen3-Next and Qwen3.5 write too (vLLM's `qwen3_coder`):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is text; it is typed by the tool's schema (integers, numbers, booleans,
objects and arrays read as JSON), as the model's chat template wrote them.
"""

from __future__ import annotations

import json
import re
from typing import Any

from atom_core.serve.tool_parser import ParsedCall, TaggedToolParser

FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


def typed(value: str, schema: dict[str, Any]) -> Any:
    kind = schema.get("type")
    if value == "null" and kind != "string":
        return None
    try:
        if kind == "integer":
            return int(value)
        if kind == "number":
            number = float(value)
            return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
        if kind == "boolean":
            return {"true": True, "false": False}.get(value.lower(), value)
        if kind in ("object", "array"):
            return json.loads(value)
    except (ValueError, json.JSONDecodeError):
        return value  # left as written: the client sees what the model meant
    return value


class Qwen3CoderToolParser(TaggedToolParser):
    def call(self, body: str) -> ParsedCall | None:
        function = FUNCTION.search(body)
        if function is None:
            return None
        name = function.group(1)
        properties = self.functions.get(name, {}).get("properties") or {}
        arguments = {}
        for key, raw in PARAMETER.findall(function.group(2)):
            value = raw.removeprefix("\n").removesuffix("\n")
            arguments[key] = typed(value, properties.get(key) or {})
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))
