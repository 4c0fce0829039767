"""Mistral's format (vLLM's `mistral`): `[TOOL_CALLS]`, then the calls as a JSON list
`[{"name": ..., "arguments": {...}}, ...]` (Mistral 7B Instruct v0.3, Mixtral 8x22B) or, from
tokenizer v11 on (Mistral Small 3.2, Devstral, Magistral), each call as `[TOOL_CALLS]name[ARGS]{...}`.

`[TOOL_CALLS]` is a special token: the reply's text keeps special tokens under this parser
(`skip_special_tokens = False`), as vLLM's Mistral parser asks of its requests.
"""

from __future__ import annotations

import json
from typing import Any

from atom_core.serve.tool_parser import CallsRead, JsonCallReader, ParsedCall, ParsedReply, ToolParser, call_of

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    start = TOOL_CALLS
    skip_special_tokens = False

    def __init__(self, functions: dict[str, dict[str, Any]]):
        super().__init__(functions)
        self.listed = JsonCallReader(lists=True)
        self.named = NamedCallReader()

    def parse(self, text: str, final: bool) -> ParsedReply:
        begin = self.calls_begin(text)
        if begin < 0:
            return ParsedReply(text if text.strip() else None, [])
        content = text[:begin] if text[:begin].strip() else None
        body = text[begin + len(TOOL_CALLS) :].lstrip()
        if body[:1] in ("[", "{") or (not body and not final):
            calls = self.listed.read(body, final)
        else:
            calls = self.named.read(text[begin:], final)
        if calls is None:  # not (yet) calls: wait for the end, then the whole reply is text
            return ParsedReply(text, [], malformed=True) if final else ParsedReply(content, [])
        return ParsedReply(content, calls)


class NamedCallReader:
    """The calls of the `[TOOL_CALLS]name[ARGS]{...}` form that are complete, read on from the
    last one as the reply grows (`CallsRead`); a last one cut short at the end leaves the ones
    before it. None if the first is none."""

    def __init__(self) -> None:
        self.decoder = json.JSONDecoder()
        self.done = CallsRead()

    def read(self, text: str, final: bool) -> list[ParsedCall] | None:
        at, calls = self.done.resume(text)
        while (marker := text.find(TOOL_CALLS, at)) >= 0:
            begin = marker + len(TOOL_CALLS)
            after = text.find(TOOL_CALLS, begin)
            piece = text[begin:] if after < 0 else text[begin:after]  # the text up to the next call
            name, sep, arguments = piece.partition(ARGS)
            call, end = None, 0
            if name.strip() and sep:
                start = len(piece) - len(arguments.lstrip())
                try:
                    value, end = self.decoder.raw_decode(piece, start)
                    call = call_of({"name": name.strip(), "arguments": value})
                except json.JSONDecodeError:
                    pass
            if call is None:
                return calls if calls or not final else None
            calls.append(call)
            at = begin + end
            self.done.keep(text, at, calls)
        return calls
