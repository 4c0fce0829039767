"""The pythonic format of Llama 3.2 and Llama 4 (vLLM's `pythonic`): a reply that is calls is a
Python list of them, `[get_weather(city="Paris", days=2), get_time()]`, keyword arguments with
literal values (Llama 4 may wrap the list in `<|python_start|>` ... `<|python_end|>`)."""

from __future__ import annotations

import ast
import json

from atom_core.serve.tool_parser import ParsedCall, ParsedReply, ToolParser

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


class PythonicToolParser(ToolParser):
    start = "["

    def calls_begin(self, text: str) -> int:
        body = text.lstrip()
        return len(text) - len(body) if body.removeprefix(PYTHON_START).lstrip().startswith("[") else -1

    def held_back(self, text: str) -> int:
        body = text.lstrip()  # blanks so far, or the tag's start, may still open calls
        return len(text) if not body or PYTHON_START.startswith(body) else 0

    def parse(self, text: str, final: bool) -> ParsedReply:
        if self.calls_begin(text) < 0:
            return ParsedReply(text if text.strip() else None, [])
        source = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
        try:
            tree = ast.parse(source, mode="eval").body
        except SyntaxError:  # not written whole yet, or not Python
            return ParsedReply(text, [], malformed=True) if final else ParsedReply(None, [])
        calls = [call(node) for node in tree.elts] if isinstance(tree, ast.List) else [None]
        if not calls or any(c is None for c in calls):
            return ParsedReply(text, [], malformed=True)
        return ParsedReply(None, [c for c in calls if c is not None])


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
