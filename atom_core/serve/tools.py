"""Tool calls the way vLLM makes them.

`tool_choice` naming a function, or `"required"`, constrains the reply to the calls' JSON with
structured output (`ForcedToolCalls`): a named function's reply is its arguments (a JSON object
of its `parameters` schema); a required one's is a JSON array of `{"name", "parameters"}`
objects, one of the tools each. `"auto"` (the default with tools) lets the model write calls
its own way, read by the tool-call parser the server was started with (`AutoToolCalls`,
`--enable-auto-tool-choice --tool-call-parser NAME`); `"none"` writes text as without tools.

Both answer the server in the same terms: the reply's `message`, its finish `reason`, and a
`stream` per choice that turns the reply's text as it comes into chat deltas.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import attrs

from atom_core.serve.tool_parser import ToolParser

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


def tool_calls_for(
    body: dict[str, Any], parser: type[ToolParser] | None = None
) -> ForcedToolCalls | AutoToolCalls | None:
    """From a chat request's `tools` and `tool_choice`; None where the reply is text (no
    tools, or "none"); `parser`: the server's for "auto", if it was started with one.
    ValueError for what cannot be served, naming the field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise ValueError(f"tool_choice {choice!r} needs tools")
        return None
    functions = tool_functions(tools)
    if choice == "none":
        return None
    if choice in (None, "auto"):
        if parser is None:
            raise ValueError(
                'tool_choice "auto" (the default with tools) needs the server started with '
                "--enable-auto-tool-choice and --tool-call-parser (as vLLM's); without them use "
                '"required", a named function, or "none"'
            )
        return AutoToolCalls(parser, functions)
    if choice == "required":
        return ForcedToolCalls(None, functions)
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise ValueError(
            f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
            f"{{'name': ...}}}}, got {choice!r}"
        )
    if name not in functions:
        raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")
    return ForcedToolCalls(name, functions)


@attrs.define
class ForcedToolCalls:
    """The reply of a request whose `tool_choice` names a function (`name`) or is "required"
    (`name` None): its grammar, and the `tool_calls` its text makes."""

    name: str | None
    functions: dict[str, dict[str, Any]]

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

    def reason(self, reason: str | None) -> str | None:
        """OpenAI's finish reason for a reply that made its calls: "tool_calls" for required calls
        that ended as the grammar completed, "stop" (as it was) for a named function's, as vLLM
        has them."""
        return "tool_calls" if self.name is None and reason == "stop" else reason

    def message(self, text: str) -> dict[str, Any] | None:
        """The reply as an assistant message with `tool_calls`; None (plain text) if cut short."""
        calls = self.calls(text)
        return None if calls is None else {"role": "assistant", "content": None, "tool_calls": calls}

    def stream(self) -> ForcedStream:
        return ForcedStream(self)

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


@attrs.define
class ForcedStream:
    """One choice's deltas: a named function's arguments as they come (its id and name with
    the first); a required reply's calls whole once its JSON is complete (as text, should it
    have been cut short)."""

    tools: ForcedToolCalls
    started: bool = False  # a named call's first delta went out (its id and name)
    made_calls: bool = False  # a required reply's calls went out (not its text)

    def delta(self, new: str, text: str, finished: bool) -> dict[str, Any]:
        """`new`: the text this step completed; `text`: all of it so far. {}: nothing to send."""
        if self.tools.name is not None:
            if not new:
                return {}
            call: dict[str, Any] = {"index": 0, "function": {"arguments": new}}
            if not self.started:
                first = tool_call(self.tools.name, new)
                call = {"index": 0, "id": first["id"], "type": "function", "function": first["function"]}
                self.started = True
            return {"tool_calls": [call]}
        if not finished:
            return {}
        calls = self.tools.calls(text)
        if calls is None:
            return {"content": text}
        self.made_calls = True
        return {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}

    def reason(self, reason: str | None) -> str | None:
        return self.tools.reason(reason) if self.tools.name is not None or self.made_calls else reason


@attrs.define
class AutoToolCalls:
    """tool_choice "auto": the reply is text, in which the server's tool-call parser finds the
    calls the model wrote (vLLM's `--enable-auto-tool-choice`)."""

    parser: type[ToolParser]
    functions: dict[str, dict[str, Any]]

    def message(self, text: str) -> dict[str, Any] | None:
        """The reply's content and calls; None (plain text) where it made none, or made them
        in a form the parser cannot read."""
        reply = self.parser(self.functions).parse(text, final=True)
        if reply.malformed or not reply.calls:
            return None
        calls = [tool_call(c.name, c.arguments) for c in reply.calls]
        return {"role": "assistant", "content": reply.content, "tool_calls": calls}

    def reason(self, reason: str | None) -> str | None:
        """The finish reason of a reply that made calls: "tool_calls" (vLLM's, whatever ended it)."""
        return "tool_calls"

    def stream(self) -> AutoStream:
        return AutoStream(self.parser(self.functions))


@attrs.define
class AutoStream:
    """One choice's deltas under "auto": its text as content up to where calls begin (holding
    back what may yet open one), then each call whole as soon as the parser reads it complete.
    A reply whose calls cannot be read is sent as the text it is."""

    parser: ToolParser
    sent: int = 0  # characters of the text sent as content
    calls_sent: int = 0

    def delta(self, new: str, text: str, finished: bool) -> dict[str, Any]:
        begin = self.parser.calls_begin(text)
        calls = []
        if begin < 0:
            end = len(text) if finished else len(text) - self.parser.held_back(text)
        else:
            reply = self.parser.parse(text, finished)
            if reply.malformed:  # wait for the end; then what the calls could not be, as text
                end = len(text) if finished and not self.calls_sent else self.sent
            else:
                end, calls = begin, reply.calls[self.calls_sent :]
        out: dict[str, Any] = {}
        if end > self.sent:
            out["content"], self.sent = text[self.sent : end], end
        if calls:
            out["tool_calls"] = [
                {"index": self.calls_sent + k, **tool_call(c.name, c.arguments)} for k, c in enumerate(calls)
            ]
            self.calls_sent += len(calls)
        return out

    def reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls_sent else reason
