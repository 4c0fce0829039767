"""Mistral's format (vLLM's `mistral`): `[TOOL_CALLS]`, then the calls as a JSON list
`[{"name": ..., "arguments": {...}}, ...]` (Mistral 7B Instruct v0.3, Mixtral 8x22B) or, from
tokenizer v11 on (Mistral Small 3.2, Devstral, Magistral), each call as `[TOOL_CALLS]name[ARGS]{...}`.

`[TOOL_CALLS]` is a special token: the reply's text keeps special tokens under this parser
(`skip_special_tokens = False`), as vLLM's Mistral parser asks of its requests.
"""

from __future__ import annotations

import json

from atom_core.serve.tool_parser import ParsedCall, ParsedReply, ToolParser, call_of, json_calls

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    start = TOOL_CALLS
    skip_special_tokens = False

    def parse(self, text: str, final: bool) -> ParsedReply:
        begin = self.calls_begin(text)
        if begin < 0:
            return ParsedReply(text if text.strip() else None, [])
        content = text[:begin] if text[:begin].strip() else None
        body = text[begin + len(TOOL_CALLS) :].lstrip()
        if body[:1] in ("[", "{") or (not body and not final):
            calls = json_calls(body, lists=True)
        else:
            calls = named_calls(text[begin:], final)
        if calls is None:  # not (yet) calls: wait for the end, then the whole reply is text
            return ParsedReply(text, [], malformed=True) if final else ParsedReply(content, [])
        return ParsedReply(content, calls)


def named_calls(text: str, final: bool) -> list[ParsedCall] | None:
    """The calls of the `[TOOL_CALLS]name[ARGS]{...}` form that are complete; a last one cut
    short at the end leaves the ones before it. None if the first is none."""
    calls: list[ParsedCall] = []
    for piece in text.split(TOOL_CALLS)[1:]:
        name, sep, arguments = piece.partition(ARGS)
        call = None
        if name.strip() and sep:
            try:
                value, _ = json.JSONDecoder().raw_decode(arguments.lstrip())
                call = call_of({"name": name.strip(), "arguments": value})
            except json.JSONDecodeError:
                pass
        if call is None:
            return calls if calls or not final else None
        calls.append(call)
    return calls
