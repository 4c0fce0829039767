"""The contract of a reasoning parser: how `atom serve --reasoning-parser NAME` splits a
reasoning model's reply into its reasoning and its answer, vLLM's `reasoning` field (and
`reasoning_content`, its older name) beside `content`.

Models think between tags (`<think>` ... `</think>`), but differ in whether the reply opens
in reasoning: DeepSeek-R1's template writes `<think>` into the prompt, so every reply does;
Qwen3's writes it only when thinking is on. A `ReasoningParser` subclass says which
(`opens_in_reasoning`); the splitting, whole and streamed, is the server's (`ReasoningStream`),
and what comes after the reasoning goes on to the tool-call parser as the reply's text.
"""

from __future__ import annotations

import attrs

from atom_core.serve.text_stream import held


class ReasoningParser:
    """One reasoning format: `start` and `end` tags, and whether a reply opens in reasoning."""

    start, end = "<think>", "</think>"

    def opens_in_reasoning(self, text: str) -> bool:
        """Whether the reply (`text`: it has got past anything that may still become `start`)
        begins with reasoning. Here: when it opens with `start` (Qwen3's thinking mode)."""
        return text.lstrip().startswith(self.start)

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, answer) of the reply so far: before the end, what may still be a tag is
        in neither."""
        head = text.lstrip()
        if not final and len(head) < len(self.start) and self.start.startswith(head):
            return "", ""  # may yet be the opening tag: nothing can be told yet
        if not self.opens_in_reasoning(text):
            return "", text
        begin = len(text) - len(head) + len(self.start) if head.startswith(self.start) else 0
        close = text.find(self.end, begin)
        if close < 0:
            end = len(text) if final else len(text) - held(self.end, text)
            return text[begin:end], ""
        return text[begin:close], text[close + len(self.end) :].lstrip("\n")


@attrs.define
class ReasoningStream:
    """One choice's reply through a reasoning parser as its text grows: the reasoning sent so
    far, and the answer's text (what the tool calls or plain content read)."""

    parser: ReasoningParser
    reasoning_sent: int = 0

    def add(self, text: str, final: bool) -> tuple[str, str]:
        """(new reasoning to send, the answer's text so far) for the reply's `text` so far."""
        reasoning, answer = self.parser.split(text, final)
        new = reasoning[self.reasoning_sent :]
        self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
        return new, answer
