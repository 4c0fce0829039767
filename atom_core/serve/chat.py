"""`atom chat`: a streamed conversation on the terminal (or a pipe), with history.

Against a running `atom serve` (`--url`), or an engine loaded in this process. Ctrl-C stops
the reply being written, not the chat; an empty line, end of input or Ctrl-C at the prompt
ends it. A conversation that outgrows the context drops its oldest turns (llama.cpp's
`llama-cli` shifts its context likewise), and a message too long on its own is refused
while the chat goes on.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from atom_core.serve.sse import StreamError, sse_event
from atom_core.serve.text_stream import TextStream


class ContextFull(ValueError):
    """The conversation no longer fits the model's context."""


def remote_reply(url: str, api_key: str | None, max_tokens: int | None, temperature: float) -> Callable:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def reply(messages: list[dict[str, str]]) -> Iterator[str]:
        body: dict[str, Any] = {"messages": messages, "stream": True, "temperature": temperature}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        try:
            with httpx.stream(
                "POST", f"{url.rstrip('/')}/v1/chat/completions", json=body, headers=headers, timeout=None
            ) as r:
                if r.status_code != 200:
                    r.read()
                    kind = ContextFull if r.status_code == 400 and "max_model_len" in r.text else ValueError
                    raise kind(f"the server answered {r.status_code}: {r.text}")
                for line in r.iter_lines():
                    try:
                        event = sse_event(line)
                    except StreamError as e:
                        raise ValueError(str(e)) from None
                    for choice in (event or {}).get("choices", []):
                        piece = choice.get("delta", {}).get("content")
                        if piece:
                            yield piece
        except httpx.HTTPError as e:  # no server there, a URL that is none, a connection cut
            raise ValueError(f"cannot talk to {url}: {type(e).__name__}: {e}") from None

    return reply


def local_reply(engine: Any, max_tokens: int | None, temperature: float) -> Callable:
    from atom_core.sampling_params import SamplingParams

    def reply(messages: list[dict[str, str]]) -> Iterator[str]:
        ids = engine.apply_chat_template(messages)
        if len(ids) >= engine.config.max_model_len:  # no room for a single token of reply
            raise ContextFull(f"the conversation has {len(ids)} tokens, max_model_len={engine.config.max_model_len}")
        limit = max_tokens or engine.config.max_model_len - len(ids)
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


def chat(reply: Callable, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout, stderr: TextIO = sys.stderr) -> None:
    messages: list[dict[str, str]] = []
    interactive = stdin.isatty()
    while True:
        if interactive:
            stdout.write("> ")
            stdout.flush()
        try:
            line = stdin.readline()
        except KeyboardInterrupt:  # Ctrl-C at the prompt: the end of the chat, as Ctrl-D is
            stdout.write("\n")
            return
        if not line or not line.strip():
            return
        before = list(messages)  # the history to come back to if this message fits no context
        messages.append({"role": "user", "content": line.strip()})
        dropped = 0
        while True:
            answer: list[str] = []
            try:
                for piece in reply(messages):
                    answer.append(piece)
                    stdout.write(piece)
                    stdout.flush()
            except KeyboardInterrupt:
                stdout.write(" [stopped]")
            except ContextFull as e:
                if len(messages) > 1:  # drop the oldest turn (its reply with it) and ask again
                    del messages[:2]
                    dropped += 1
                    continue
                stderr.write(f"[this message does not fit the context: {e}]\n")
                messages[:] = before  # nothing was dropped after all
                break
            stdout.write("\n")
            stdout.flush()
            if dropped:
                turns = "turn is" if dropped == 1 else f"{dropped} turns are"
                stderr.write(f"[the conversation outgrew the context: its oldest {turns} dropped]\n")
            messages.append({"role": "assistant", "content": "".join(answer)})
            break
