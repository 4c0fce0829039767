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


class ReasoningParser:
    """One reasoning format: `start` and `end` tags, and whether a reply opens in reasoning."""

    start, end = "<think>", "</think>"

    def opens_in_reasoning(self, text: str) -> bool | None:
        """Whether the reply (`text`, so far) begins with reasoning; None while it cannot tell
        yet. Here: when it opens with `start` (Qwen3's thinking mode)."""
        head = text.lstrip()
        if head.startswith(self.start):
            return True
        return None if self.start.startswith(head) else False

    def split(self, text: str, final: bool) -> tuple[str, str, bool]:
        """(reasoning, answer, decided) of the reply so far: before the end, what may still be
        a tag is in neither; `decided` is False while nothing can be sent yet."""
        opens = self.opens_in_reasoning(text)
        if opens is None:
            return ("", text, True) if final else ("", "", False)
        if not opens:
            return "", text, True
        head = text.lstrip()
        if not final and len(head) < len(self.start) and self.start.startswith(head):
            return "", "", False  # may yet be the opening tag (a reply that opens in reasoning regardless)
        begin = len(text) - len(head) + len(self.start) if head.startswith(self.start) else 0
        close = text.find(self.end, begin)
        if close < 0:
            end = len(text) if final else len(text) - held(self.end, text)
            return text[begin:end], "", True
        return text[begin:close], text[close + len(self.end) :].lstrip("\n"), True


def held(tag: str, text: str) -> int:
    """How many characters at the end of `text` are the start of `tag` (0 if none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@attrs.define
class ReasoningStream:
    """One choice's reply through a reasoning parser as its text grows: the reasoning sent so
    far, and the answer's text (what the tool calls or plain content read)."""

    parser: ReasoningParser
    reasoning_sent: int = 0

    def add(self, text: str, final: bool) -> tuple[str, str]:
        """(new reasoning to send, the answer's text so far) for the reply's `text` so far."""
        reasoning, answer, _ = self.parser.split(text, final)
        new = reasoning[self.reasoning_sent :]
        self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
        return new, answer
