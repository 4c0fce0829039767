"""OpenAI's Responses API (`POST /v1/responses`) over the chat completions path: a request's
`input` items, `instructions`, flat function `tools` and `text.format` become a chat request,
and the chat reply (or its stream of chunks) becomes a Response (or its stream of events).

What vLLM's `/v1/responses` serves without a store: text, function calls (`function_call`
items, and `function_call_output` items sent back), reasoning (with `--reasoning-parser`), JSON
output through `text.format`, the tokens' log probabilities (`include` with
"message.output_text.logprobs", and `top_logprobs`), streamed as OpenAI's typed events. `previous_response_id` and
`background` need responses kept on the server, which Atom does not do: a 400 says so.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import attrs

# Request fields passed on to the chat request under the same name.
SAME_FIELDS = ("model", "temperature", "top_p", "seed", "stream", "top_k", "min_p", "repetition_penalty",
               "presence_penalty", "frequency_penalty", "stop", "chat_template_kwargs", "parallel_tool_calls")  # fmt: skip
# Fields a response echoes back as they were asked (None where not given).
ECHOED = ("instructions", "max_output_tokens", "metadata", "temperature", "top_p", "user", "previous_response_id",
          "top_logprobs")  # fmt: skip
# `include` asks for these extra outputs; only the first has anything to add here (no
# built-in tools, images or encrypted reasoning), and OpenAI refuses any other name.
LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = (LOGPROBS, "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
              "web_search_call.action.sources", "message.input_image.image_url",
              "computer_call_output.output.image_url", "code_interpreter_call.outputs")  # fmt: skip


class BadResponsesRequest(ValueError):
    """A request the translation refuses; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_of(content: Any, where: str) -> str:
    """A message's content: a string, or its input_text / output_text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadResponsesRequest(f"{where}.content must be a string or a list of parts, got {content!r}", "input")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise BadResponsesRequest(
                f"{where}.content[{k}]: only input_text and output_text parts are supported, got {kind!r}", "input"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages: function calls an assistant turn's
    `tool_calls`, their outputs `tool` turns."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadResponsesRequest(f"instructions must be a string, got {instructions!r}", "instructions")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadResponsesRequest(f"input must be a string or a non-empty list of items, got {items!r}", "input")
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise BadResponsesRequest(f"input[{i}].role must be user, assistant, system or developer, got {role!r}", "input")  # fmt: skip
            content = text_of(item.get("content"), f"input[{i}]")
            messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}  # fmt: skip
            if not isinstance(call["id"], str) or not isinstance(item.get("name"), str):
                raise BadResponsesRequest(f"input[{i}]: a function_call needs call_id and name strings", "input")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)  # calls made together: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str | list):
                raise BadResponsesRequest(f"input[{i}]: a function_call_output needs call_id and output", "input")
            content = output if isinstance(output, str) else text_of(output, f"input[{i}].output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": content})
        elif kind == "reasoning":
            continue  # earlier reasoning is not shown to the model again, as chat templates drop it
        else:
            raise BadResponsesRequest(f"input[{i}]: items of type {kind!r} are not supported", "input")
    return messages


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    """The Responses API's flat function tools as chat tools."""
    if not isinstance(tools, list):
        raise BadResponsesRequest(f"tools must be a list, got {tools!r}", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise BadResponsesRequest(
                f"tools[{i}]: only function tools with a name are supported, got {kind!r}", "tools"
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise BadResponsesRequest(f"tool_choice must be none, auto, required or a function, got {choice!r}", "tool_choice")


def chat_format(text: Any) -> dict[str, Any] | None:
    """`text.format` as a chat `response_format`."""
    if text is None:
        return None
    form = text.get("format") if isinstance(text, dict) else None
    kind = form.get("type") if isinstance(form, dict) else None
    if form is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(form.get("schema"), dict):
        schema = {"name": form.get("name", "response"), "schema": form["schema"], "strict": form.get("strict")}
        return {"type": "json_schema", "json_schema": schema}
    raise BadResponsesRequest(
        f"text.format must be text, json_object or json_schema with a schema, got {form!r}", "text"
    )


def chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completions request a Responses request asks for (BadResponsesRequest naming
    the field it cannot take)."""
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise BadResponsesRequest(
                f"{name} needs responses kept on the server, which this server does not do; send the whole "
                "conversation as input",
                name,
            )
    if body.get("background"):
        raise BadResponsesRequest("background responses are not supported", "background")
    chat: dict[str, Any] = {k: body[k] for k in SAME_FIELDS if body.get(k) is not None}
    chat["messages"] = chat_messages(body)
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
    form = chat_format(body.get("text"))
    if form is not None:
        chat["response_format"] = form
    if LOGPROBS in included(body.get("include")):  # the chat path checks top_logprobs against max_logprobs
        chat["logprobs"], chat["top_logprobs"] = True, body.get("top_logprobs", 0)
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    return chat


def included(include: Any) -> list[str]:
    if include is None:
        return []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise BadResponsesRequest(f"include must be a list of strings, got {include!r}", "include")
    unknown = [x for x in include if x not in INCLUDABLE]
    if unknown:
        raise BadResponsesRequest(f"include: {unknown[0]!r} is not one of {', '.join(INCLUDABLE)}", "include")
    return include


def logprobs_of(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice's (or chunk's) token entries, which the Responses API lists as they are."""
    return (choice.get("logprobs") or {}).get("content") or []


def usage_of(chat_usage: dict[str, Any] | None, reasoning_text: str, count: Any) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": count(reasoning_text) if reasoning_text else 0},
        "total_tokens": chat_usage["total_tokens"],
    }


@attrs.define
class ResponseShape:
    """What every Response of one request carries besides its output and usage."""

    body: dict[str, Any]
    model: str
    id: str = attrs.field(factory=lambda: new_id("resp"))
    created_at: int = attrs.field(factory=lambda: int(time.time()))

    def response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
        incomplete: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": status, "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            **{k: body.get(k) for k in ECHOED},
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "text": body.get("text") or {"format": {"type": "text"}}, "store": False,
            "background": False, "reasoning": body.get("reasoning"), "truncation": "disabled",
        }  # fmt: skip


def message_item(
    text: str, status: str = "completed", item_id: str | None = None, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    parts = [part] if status == "completed" else []
    return {"type": "message", "id": item_id or new_id("msg"), "role": "assistant", "status": status, "content": parts}


def reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def call_item(call: dict[str, Any], status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "function_call", "id": item_id or new_id("fc"), "call_id": call["id"],
        "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status,
    }  # fmt: skip


def response_of(shape: ResponseShape, completion: dict[str, Any], count: Any) -> dict[str, Any]:
    """A chat completion (one choice) as a Response: reasoning, then the message, then its calls."""
    choice = completion["choices"][0]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    reasoning_text = message.get("reasoning") or ""
    if reasoning_text:
        output.append(reasoning_item(reasoning_text))
    if message.get("content"):  # every token's log probability, the reasoning's and calls' too, as vLLM's
        output.append(message_item(message["content"], logprobs=logprobs_of(choice)))
    output += [call_item(c) for c in message.get("tool_calls") or []]
    incomplete = "max_output_tokens" if choice["finish_reason"] == "length" else None
    usage = usage_of(completion.get("usage"), reasoning_text, count)
    return shape.response("incomplete" if incomplete else "completed", output, usage, incomplete)


@attrs.define
class OpenItem:
    """The output item a stream is writing: its kind ("reasoning", "message" or "call"), id,
    place in the output, text so far, and for a call its id and name."""

    kind: str
    id: str
    index: int
    text: str = ""
    call: dict[str, Any] | None = None
    logprobs: list[dict[str, Any]] = attrs.field(factory=list)  # a message's tokens'


@attrs.define
class ResponseEvents:
    """Chat chunks in, Responses stream events out: each output item opened when its first
    piece comes (reasoning, the message, each call) and closed when the next begins or the
    reply ends, as OpenAI's stream orders them."""

    shape: ResponseShape
    count: Any  # text -> its token count (usage's reasoning_tokens)
    sequence: int = 0
    output: list[dict[str, Any]] = attrs.field(factory=list)  # closed items
    open: OpenItem | None = None
    finish: str | None = None
    usage: dict[str, Any] | None = None
    # log probabilities of tokens whose text has not been streamed yet (held back by the
    # detokenizer or a stop string): they go out with the message's next text
    pending: list[dict[str, Any]] = attrs.field(factory=list)

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def start(self) -> list[str]:
        opening = self.shape.response("in_progress", [])
        return [self.event("response.created", response=opening), self.event("response.in_progress", response=opening)]

    def _open(self, kind: str, item: dict[str, Any], call: dict[str, Any] | None = None) -> list[str]:
        out = self.close()
        self.open = OpenItem(kind, item["id"], len(self.output), call=call)
        out.append(self.event("response.output_item.added", output_index=self.open.index, item=item))
        part = {
            "message": {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            "reasoning": {"type": "reasoning_text", "text": ""},
        }.get(kind)
        if part is not None:
            where = {"item_id": item["id"], "output_index": self.open.index, "content_index": 0}
            out.append(self.event("response.content_part.added", **where, part=part))
        return out

    def close(self) -> list[str]:
        o, self.open = self.open, None
        if o is None:
            return []
        out, where = [], {"item_id": o.id, "output_index": o.index}
        if o.kind == "message":
            o.logprobs += self.pending
            self.pending = []
            item = message_item(o.text, item_id=o.id, logprobs=o.logprobs)
            part = item["content"][0]
            out.append(self.event("response.output_text.done", **where, content_index=0, text=o.text, logprobs=o.logprobs))  # fmt: skip
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        elif o.kind == "reasoning":
            out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=o.text))
            part = {"type": "reasoning_text", "text": o.text}
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
            item = reasoning_item(o.text, item_id=o.id)
        else:
            assert o.call is not None
            item = call_item({**o.call, "function": {**o.call["function"], "arguments": o.text}}, item_id=o.id)
            out.append(self.event("response.function_call_arguments.done", **where, name=item["name"], arguments=o.text))  # fmt: skip
        self.output.append(item)
        out.append(self.event("response.output_item.done", output_index=o.index, item=item))
        return out

    def chunk(self, chunk: dict[str, Any]) -> list[str]:
        """The events one chat chunk makes."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[str] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            self.pending += logprobs_of(choice)
            if (delta.get("reasoning") or delta.get("tool_calls")) and not delta.get("content"):
                self.pending = []  # the reasoning's and the calls' tokens: a stream lists the text's alone
            if delta.get("reasoning"):
                if self.open is None or self.open.kind != "reasoning":
                    out += self._open(
                        "reasoning", {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": []}
                    )
                out += self._text(delta["reasoning"], "response.reasoning_text.delta")
            text_goes_on = self.pending and self.open is not None and self.open.kind == "message"
            if delta.get("content") or text_goes_on:  # a token that adds no text yet (the end, say): ""
                if self.open is None or self.open.kind != "message":
                    out += self._open("message", message_item("", "in_progress"))
                assert self.open is not None
                logprobs, self.pending = self.pending, []
                self.open.logprobs += logprobs
                out += self._text(delta.get("content") or "", "response.output_text.delta", logprobs=logprobs)
            for call in delta.get("tool_calls") or []:
                arguments = (call.get("function") or {}).get("arguments") or ""
                if call.get("id"):  # a new call (its first delta has its id and name)
                    whole = {"id": call["id"], "function": {"name": call["function"]["name"], "arguments": ""}}
                    out += self._open("call", call_item(whole, "in_progress"), whole)
                if arguments and self.open is not None:
                    out += self._text(arguments, "response.function_call_arguments.delta")
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def _text(self, piece: str, kind: str, **extra: Any) -> list[str]:
        assert self.open is not None
        self.open.text += piece
        where = {"item_id": self.open.id, "output_index": self.open.index}
        if kind != "response.function_call_arguments.delta":
            where["content_index"] = 0
        return [self.event(kind, **where, delta=piece, **extra)]

    def end(self) -> list[str]:
        out = self.close()
        incomplete = "max_output_tokens" if self.finish == "length" else None
        reasoning_text = "".join(i["content"][0]["text"] for i in self.output if i["type"] == "reasoning")
        usage = usage_of(self.usage, reasoning_text, self.count)
        final = self.shape.response("incomplete" if incomplete else "completed", self.output, usage, incomplete)
        return [*out, self.event("response.incomplete" if incomplete else "response.completed", response=final)]

    def failed(self, message: str) -> list[str]:
        final = self.shape.response("failed", self.output)
        final["error"] = {"code": "server_error", "message": message}
        return [self.event("response.failed", response=final)]


async def response_events(events: ResponseEvents, chat_stream: AsyncIterable[Any]) -> AsyncIterator[str]:
    """A chat completion's server-sent events as a Response's. Closing this stream (a client
    that left) closes the chat stream at once, which aborts its request in the core."""
    try:
        for e in events.start():
            yield e
        async for raw in chat_stream:
            text = raw.decode() if isinstance(raw, bytes) else raw
            for line in text.splitlines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    for e in events.failed(chunk["error"].get("message", "the request failed")):
                        yield e
                    return
                for e in events.chunk(chunk):
                    yield e
        for e in events.end():
            yield e
    finally:
        close = getattr(chat_stream, "aclose", None)
        if close is not None:
            await close()
