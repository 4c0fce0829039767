"""Tool calls the way vLLM makes them without a model-specific parser: `tool_choice` naming a
function, or `"required"`, constrains the reply to the calls' JSON with structured output.

A named function's reply is its arguments (a JSON object of its `parameters` schema); a
required one's is a JSON array of `{"name", "parameters"}` objects, one of the tools each.
`"auto"` would need a parser for each model's way of writing calls, which this server does
not have (vLLM asks for `--tool-call-parser` too); `"none"` writes text as without tools.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import attrs

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def tool_functions(tools: Any) -> dict[str, dict[str, Any]]:
    """name -> the function's `parameters` schema, from OpenAI's `tools` list (ValueError naming
    the entry that is not a function tool)."""
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list of function tools, got {tools!r}")
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}, got {tool!r}")
        assert isinstance(function, dict)  # a name was found in it
        parameters = function.get("parameters") or ANY_OBJECT
        if not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object, got {parameters!r}")
        out[name] = parameters
    return out


@attrs.define
class ForcedToolCalls:
    """The reply of a request whose `tool_choice` names a function (`name`) or is "required"
    (`name` None): its grammar, and the `tool_calls` its text makes."""

    name: str | None
    functions: dict[str, dict[str, Any]]

    @classmethod
    def of(cls, body: dict[str, Any]) -> ForcedToolCalls | None:
        """From a chat request's `tools` and `tool_choice`; None where the reply is text
        (no tools, or "none"). ValueError for what cannot be served, naming the field."""
        tools, choice = body.get("tools"), body.get("tool_choice")
        if not tools:
            if choice not in (None, "none"):
                raise ValueError(f"tool_choice {choice!r} needs tools")
            return None
        functions = tool_functions(tools)
        if choice == "none":
            return None
        if choice in (None, "auto"):
            raise ValueError(
                'tool_choice "auto" (the default with tools) needs a parser of the model\'s tool calls, which this '
                'server does not have: use "required", a named function, or "none"'
            )
        if choice == "required":
            return cls(None, functions)
        name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
        if not isinstance(name, str):
            raise ValueError(
                f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                f"{{'name': ...}}}}, got {choice!r}"
            )
        if name not in functions:
            raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")
        return cls(name, functions)

    def schema(self) -> dict[str, Any]:
        """The JSON schema the reply follows."""
        if self.name is not None:
            return self.functions[self.name]
        calls = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,  # a call is its name and parameters: nothing to run on
            }
            for name, parameters in self.functions.items()
        ]
        return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" for required calls that ended as the grammar completed, "stop"
        (as it was) for a named function's, as vLLM has them."""
        return "tool_calls" if self.name is None and reason == "stop" else reason

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The reply's `tool_calls`; None where a required reply was cut short (its JSON does not parse)."""
        if self.name is not None:
            return [tool_call(self.name, text)]
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return None
        return [tool_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
