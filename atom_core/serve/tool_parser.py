"""The contract of a tool-call parser: how `atom serve --enable-auto-tool-choice` reads the calls
a model writes into its reply when a request leaves `tool_choice` "auto".

Each model family writes calls its own way (Qwen's `<tool_call>` JSON, Llama 3's bare JSON
object, Qwen3-Coder's XML), so the format is a plugin: a `ToolParser` subclass registered by
name under the `atom_register_tool_parsers` hook and picked with `--tool-call-parser NAME`,
vLLM's flag. The server builds one per reply and hands it the reply's text as it grows; the
streaming (content up to the calls, each call once it is complete) is the server's, the same
for every parser.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

from atom_core.serve.text_stream import held


@attrs.frozen
class ParsedCall:
    """One call: the function's name and its arguments as a JSON object's text."""

    name: str
    arguments: str


@attrs.frozen
class ParsedReply:
    """What `ToolParser.parse` found: the text outside the calls (None if blank), the calls, and
    whether the calls part failed to read (then the server sends the whole reply as text)."""

    content: str | None
    calls: list[ParsedCall]
    malformed: bool = False


class ToolParser:
    """Reads the tool calls in one reply. Subclasses set `start` (the text that opens the calls)
    and implement `parse`; `calls_begin` and `held_back` serve most formats as they are.

    Built as `cls(functions)` per reply, `functions` being the request's tools as name ->
    `parameters` schema (`tools.tool_functions`: a parser that types arguments by their schema
    reads it; the others ignore it)."""

    start: str = ""
    # False where the format's markers are special tokens (Mistral's `[TOOL_CALLS]`): the reply's
    # text then keeps special tokens, as `SamplingParams.skip_special_tokens=False` does.
    skip_special_tokens: bool = True

    def __init__(self, functions: dict[str, dict[str, Any]]):
        self.functions = functions

    def calls_begin(self, text: str) -> int:
        """Where the calls begin in `text`, or -1 while none has: the text before is content."""
        return text.find(self.start) if self.start else -1

    def held_back(self, text: str) -> int:
        """How many characters at the end of `text` (which holds no call yet) could still turn
        out to open one: kept from the streamed content until the next text decides."""
        return held(self.start, text)

    def parse(self, text: str, final: bool) -> ParsedReply:
        """The calls in `text` (the reply so far; `final` once it has ended). Before the end,
        only the calls known complete: a call, once returned, is never taken back or changed."""
        raise NotImplementedError


class TaggedToolParser(ToolParser):
    """Calls each between `start` and `end` tags (Hermes' and Qwen's `<tool_call>`); the text
    before the first is content. Subclasses read one call's body (`call`)."""

    start, end = "<tool_call>", "</tool_call>"

    def __init__(self, functions: dict[str, dict[str, Any]]):
        super().__init__(functions)
        opening, closing = re.escape(self.start), re.escape(self.end)
        self.pattern = re.compile(f"{opening}(.*?){closing}|{opening}(.*)\\Z", re.DOTALL)
        self.read = CallsRead()

    def parse(self, text: str, final: bool) -> ParsedReply:
        begin = self.calls_begin(text)
        if begin < 0:
            return ParsedReply(text if text.strip() else None, [])
        at, calls = self.read.resume(text)
        for match in self.pattern.finditer(text, max(begin, at)):
            closed, unclosed = match.groups()
            if not closed and not final:  # the last call may still be written
                break
            call = self.call(closed or unclosed)
            if call is None:
                if not closed:  # cut short at the end (max_tokens): the calls before it stand
                    break
                return ParsedReply(text, [], malformed=True)
            calls.append(call)
            if closed:
                self.read.keep(text, match.end(), calls)
        content = text[:begin]
        return ParsedReply(content if content.strip() else None, calls)

    def call(self, body: str) -> ParsedCall | None:
        """One call from the text between the tags; None if it is not one."""
        raise NotImplementedError


class CallsRead:
    """The calls a parser has read whole from a reply, and the text they end at. A stream hands
    a parser the same reply, longer each time; reading on from there keeps a long reply of many
    calls from being read again whole on every delta. Text that does not begin with what was
    read is another reply, read from its start."""

    def __init__(self) -> None:
        self.text, self.calls = "", list[ParsedCall]()
        self.state: Any = None  # a parser's own note on where the read stands (None on a new reply)

    def resume(self, text: str) -> tuple[int, list[ParsedCall]]:
        """Where to read `text` on from, and the calls before that point (a copy)."""
        if not text.startswith(self.text):
            self.text, self.calls, self.state = "", [], None
        return len(self.text), list(self.calls)

    def keep(self, text: str, end: int, calls: list[ParsedCall], state: Any = None) -> None:
        self.text, self.calls, self.state = text[:end], list(calls), state


def call_of(item: Any, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall | None:
    """A JSON call object `{"name": ..., "arguments": {...}}` (or "parameters", Llama's word) as a
    ParsedCall; None if it is not one."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments: Any = next((item[k] for k in arguments_keys if k in item), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(item["name"], json.dumps(arguments, ensure_ascii=False))


class JsonCallReader:
    """JSON call objects one after another (`separator` between them; with `lists`, lists of
    them too), for one reply read again as it grows: the calls written whole so far, None until
    the first is whole or where a value is not a call. Text after the last whole value is not
    read (not written yet, or not calls). It reads on from the values already read
    (`CallsRead`), decoding in place, and a list's calls one by one as each is written whole;
    once the reply is final, a list that never closed counts for none of them."""

    BLANKS = re.compile(r"\s*")

    def __init__(self, separator: str = "", lists: bool = False):
        self.lists = lists
        self.gap = re.compile(r"\s*" + (f"(?:{re.escape(separator)}\\s*)?" if separator else ""))
        self.decoder = json.JSONDecoder()
        self.done = CallsRead()

    def read(self, body: str, final: bool = False) -> list[ParsedCall] | None:
        at, calls = self.done.resume(body)
        # where the read stands: None between values; in a list, "first" before its first
        # element, "value" before a later one, "next" after one (a comma or the end comes);
        # and how many calls came before the list
        inside, before = self.done.state or (None, 0)
        while True:
            blanks = (self.gap if inside is None else self.BLANKS).match(body, at)
            start = blanks.end() if blanks else at
            if start >= len(body):
                break
            if inside == "next":
                if body[start] not in ",]":
                    return None
                at, inside = start + 1, ("value" if body[start] == "," else None)
            elif inside is None and self.lists and body[start] == "[":
                at, inside, before = start + 1, "first", len(calls)
            else:
                if inside == "first" and body[start] == "]":
                    return None  # an empty list: no calls
                try:
                    value, at = self.decoder.raw_decode(body, start)
                except json.JSONDecodeError:
                    break  # not written whole yet (or not JSON: nothing more is read)
                call = call_of(value)
                if call is None:
                    return None
                calls.append(call)
                inside = None if inside is None else "next"
        self.done.keep(body, at, calls, (inside, before) if inside else None)
        if final and inside is not None:
            calls = calls[:before]
        return calls or None
