"""Mistral's format (vLLM's `mistral`): `[TOOL_CALLS]`, then the calls as a JSON list
`[{"name": ..., "arguments": {...}}, ...]` (Mistral 7B Instruct v0.3, Mixtral 8x22B) or, from
tokenizer v11 on (Mistral Small 3.2, Devstral, Magistral), each call as `[TOOL_CALLS]name[ARGS]{...}`.

`[TOOL_CALLS]` is a special token: the reply's text keeps special tokens under this parser
(`skip_special_tokens = False`), as vLLM's Mistral parser asks of its requests.
"""

from __future__ import annotations

import json

from atom_core.serve.tool_parser import ParsedCall, ParsedReply, ToolParser, call_of

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
            calls = json_calls(body)
        else:
            calls = named_calls(text[begin:], final)
        if calls is None:  # not (yet) calls: wait for the end, then the whole reply is text
            return ParsedReply(text, [], malformed=True) if final else ParsedReply(content, [])
        return ParsedReply(content, calls)


def json_calls(body: str) -> list[ParsedCall] | None:
    """The calls of the JSON form: a list of call objects (or objects one after another), those
    written whole so far; None until the first is, or if it is no calls."""
    decoder, at, calls = json.JSONDecoder(), 0, list[ParsedCall]()
    while body[at:].strip():
        rest = body[at:].lstrip()
        try:
            value, end = decoder.raw_decode(rest)
        except json.JSONDecodeError:  # not written whole yet, or text after the calls
            break
        items = value if isinstance(value, list) else [value]
        found = [c for c in map(call_of, items) if c is not None]
        if not found or len(found) < len(items):
            return None
        calls += found
        at = len(body) - len(rest) + end
    return calls or None


def named_calls(text: str, final: bool) -> list[ParsedCall] | None:
    """The calls of the `[TOOL_CALLS]name[ARGS]{...}` form that are complete; a last one cut
    short at the end leaves the ones before it. None if the first is none."""
    calls: list[ParsedCall] = []
    for piece in text.split(TOOL_CALLS)[1:]:
        name, sep, arguments = piece.partition(ARGS)
        try:
            value, _ = json.JSONDecoder().raw_decode(arguments.lstrip()) if sep else (None, 0)
        except json.JSONDecodeError:
            value = None
        call = call_of({"name": name.strip(), "arguments": value}) if name.strip() and value is not None else None
        if call is None:
            return calls if calls or not final else None
        calls.append(call)
    return calls
