"""`atom chat`: a streamed conversation on the terminal (or a pipe), with history.

Against a running `atom serve` (`--url`), or an engine loaded in this process. Ctrl-C stops
the reply being written, not the chat; an empty line or end of input ends it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from atom_core.serve.sse import StreamError, sse_event
from atom_core.serve.text_stream import TextStream


def remote_reply(url: str, api_key: str | None, max_tokens: int | None, temperature: float) -> Callable:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def reply(messages: list[dict[str, str]]) -> Iterator[str]:
        body: dict[str, Any] = {"messages": messages, "stream": True, "temperature": temperature}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        with httpx.stream(
            "POST", f"{url.rstrip('/')}/v1/chat/completions", json=body, headers=headers, timeout=None
        ) as r:
            if r.status_code != 200:
                r.read()
                raise ValueError(f"the server answered {r.status_code}: {r.text}")
            for line in r.iter_lines():
                try:
                    event = sse_event(line)
                except StreamError as e:
                    raise ValueError(str(e)) from None
                for choice in (event or {}).get("choices", []):
                    piece = choice.get("delta", {}).get("content")
                    if piece:
                        yield piece

    return reply


def local_reply(engine: Any, max_tokens: int | None, temperature: float) -> Callable:
    from atom_core.sampling_params import SamplingParams

    def reply(messages: list[dict[str, str]]) -> Iterator[str]:
        ids = engine.apply_chat_template(messages)
        limit = max_tokens or max(1, engine.config.max_model_len - len(ids))
        params = SamplingParams(temperature=temperature, max_tokens=limit)
        stream = TextStream(engine.tokenizer, [])
        news: list[Any] = []
        rid = engine.add_request(ids, params, stream_callback=news.append)
        try:
            while engine.has_unfinished_requests():
                engine.step()
                for out in news:
                    piece = stream.add(out.output_tokens, out.finished, out.finish_reason)
                    if piece:
                        yield piece
                news.clear()
        finally:
            engine.abort(rid)

    return reply


def chat(reply: Callable, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> None:
    messages: list[dict[str, str]] = []
    interactive = stdin.isatty()
    while True:
        if interactive:
            stdout.write("> ")
            stdout.flush()
        line = stdin.readline()
        if not line or not line.strip():
            return
        messages.append({"role": "user", "content": line.strip()})
        answer = []
        try:
            for piece in reply(messages):
                answer.append(piece)
                stdout.write(piece)
                stdout.flush()
        except KeyboardInterrupt:
            stdout.write(" [stopped]")
        stdout.write("\n")
        stdout.flush()
        messages.append({"role": "assistant", "content": "".join(answer)})
