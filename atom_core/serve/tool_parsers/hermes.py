"""Hermes' format, which Qwen2.5, Qwen3 and the Hermes models write: each call a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`."""

from __future__ import annotations

import json

from atom_core.serve.tool_parser import ParsedCall, TaggedToolParser, call_of


class HermesToolParser(TaggedToolParser):
    def call(self, body: str) -> ParsedCall | None:
        try:
            return call_of(json.loads(body))
        except json.JSONDecodeError:
            return None
