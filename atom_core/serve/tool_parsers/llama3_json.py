"""Llama 3.1-3.3's JSON format: a reply that is calls starts with one (after `<|python_tag|>`
where the special token is kept), `{"name": ..., "parameters": {...}}`, several joined by "; "."""

from __future__ import annotations

import json

from atom_core.serve.tool_parser import ParsedCall, ParsedReply, ToolParser, call_of

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    start = "{"

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
        decoder, at = json.JSONDecoder(), 0
        calls: list[ParsedCall] = []
        while True:
            rest = body[at:].lstrip().removeprefix(";").lstrip()
            if not rest:
                break
            try:
                item, end = decoder.raw_decode(rest)
            except json.JSONDecodeError:  # not written yet, or not a call
                if final and not calls:
                    return ParsedReply(text, [], malformed=True)
                break
            call = call_of(item)
            if call is None:
                return ParsedReply(text, [], malformed=True)
            calls.append(call)
            at = len(body) - len(rest) + end
        return ParsedReply(None, calls)
