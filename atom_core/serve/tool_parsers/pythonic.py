"""The pythonic format of Llama 3.2 and Llama 4 (vLLM's `pythonic`): a reply that is calls is a
Python list of them, `[get_weather(city="Paris", days=2), get_time()]`, keyword arguments with
literal values (Llama 4 may wrap the list in `<|python_start|>` ... `<|python_end|>`)."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from atom_core.serve.tool_parser import CallsRead, ParsedCall, ParsedReply, ToolParser

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
SEPARATOR = re.compile(r"[,\]]")


class PythonicToolParser(ToolParser):
    """Each call is read once it is written whole, on from the last one as the reply grows: an
    element of the list ends at the first comma or closing bracket after which its text parses
    (a comma inside a string or a call's arguments leaves it unbalanced; one after a whole
    expression is the list's)."""

    start = "["

    def __init__(self, functions: dict[str, dict[str, Any]]):
        super().__init__(functions)
        self.read = CallsRead()

    def calls_begin(self, text: str) -> int:
        body = text.lstrip()
        return len(text) - len(body) if body.removeprefix(PYTHON_START).lstrip().startswith("[") else -1

    def held_back(self, text: str) -> int:
        body = text.lstrip()  # blanks so far, or the tag's start, may still open calls
        return len(text) if not body or PYTHON_START.startswith(body) else 0

    def parse(self, text: str, final: bool) -> ParsedReply:
        begin = self.calls_begin(text)
        if begin < 0:
            return ParsedReply(text if text.strip() else None, [])
        at, calls = self.read.resume(text)
        element = self.read.state  # where the element being read starts; -1 once the list closed
        if element is None:
            at = element = text.index("[", begin) + 1
        while element >= 0 and (sep := SEPARATOR.search(text, at)):
            at = sep.end()
            source = text[element : sep.start()].strip()
            if not source and sep.group() == "]" and calls:
                element = -1  # a trailing comma: `[f(), ]`
                continue
            try:
                node = ast.parse(source, mode="eval").body
            except (SyntaxError, ValueError):  # the separator is inside the element (or it is no Python)
                continue
            found = call(node)
            if found is None:
                return ParsedReply(text, [], malformed=True)
            calls.append(found)
            element = at if sep.group() == "," else -1
        self.read.keep(text, at, calls, element)
        tail = text[at:].strip() if element < 0 else ""  # after the list: its closing tag at most
        if (final and element >= 0) or (tail not in ("", PYTHON_END) and (final or not PYTHON_END.startswith(tail))):
            return ParsedReply(text, [], malformed=True)  # not closed at the end, or more than calls
        return ParsedReply(None, calls)


def call(node: ast.expr) -> ParsedCall | None:
    """`name(key=literal, ...)` as a call; None for anything else."""
    if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
        return None
    if not isinstance(node.func, (ast.Name, ast.Attribute)):  # a dotted name (`brave_search.call`) is a name too
        return None
    try:
        arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        return ParsedCall(ast.unparse(node.func), json.dumps(arguments, ensure_ascii=False))
    except (ValueError, TypeError, SyntaxError):  # not a literal, or not JSON (a set, bytes)
        return None
