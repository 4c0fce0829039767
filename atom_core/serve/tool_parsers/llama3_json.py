"""Llama 3.1-3.3's JSON format: a reply that is calls starts with one (after `<|python_tag|>`
where the special token is kept), `{"name": ..., "parameters": {...}}`, several joined by "; "."""

from __future__ import annotations

from typing import Any

from atom_core.serve.tool_parser import JsonCallReader, ParsedReply, ToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    start = "{"

    def __init__(self, functions: dict[str, dict[str, Any]]):
        super().__init__(functions)
        self.reader = JsonCallReader(";")

    def calls_begin(self, text: str) -> int:
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            return len(text) - len(body)
        return len(text) - len(body) if body.startswith("{") else -1

    def held_back(self, text: str) -> int:
        body = text.lstrip()  # a reply of blanks so far, or the tag's start, may still be a call
        return len(text) if not body or PYTHON_TAG.startswith(body) else 0

    def parse(self, text: str, final: bool) -> ParsedReply:
        begin = self.calls_begin(text)
        if begin < 0:
            return ParsedReply(text if text.strip() else None, [])
        body = text[begin:].removeprefix(PYTHON_TAG)
        calls = self.reader.read(body)
        if calls is None:  # not (yet) calls: wait for the end, then the whole reply is text
            return ParsedReply(text, [], malformed=True) if final and body.strip() else ParsedReply(None, [])
        return ParsedReply(None, calls)
