"""Incremental detokenizing of one reply, for the server's streams and `atom chat`."""

from __future__ import annotations

from typing import Any

from atom_core.engine.output_processor import final_text


def held(tag: str, text: str) -> int:
    """How many characters at the end of `text` are the start of `tag` (0 if none): what a
    stream keeps back until the next text shows whether the tag follows."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class TextStream:
    """Detokenizes one choice as its tokens arrive, without ever handing out half a UTF-8
    character or the start of a stop string that may yet complete.

    The tokens are decoded incrementally, as vLLM does: each step decodes only its new tokens
    together with the ones of the step before (a token's text can depend on its neighbour: a
    leading space, a character split over several tokens), so a long reply costs the same per
    token as a short one. The finished text is decoded whole, once (`final_text`)."""

    def __init__(self, tokenizer: Any, stop: list[str], include_stop: bool = False, skip_special: bool = True):
        self.tokenizer, self.stop, self.include_stop, self.skip_special = tokenizer, stop, include_stop, skip_special
        self.token_ids: list[int] = []
        self.sent = 0  # characters handed out
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # the whole text once finished (up to its stop string)
        self.decoded = ""  # the text of token_ids[: self.read]
        self.prefix = self.read = 0  # the window decoded with the next tokens starts at `prefix`

    def add(
        self, token_ids: list[int], finished: bool = False, finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> str:  # fmt: skip
        """The text the new tokens complete (empty while a character or a stop string may go on)."""
        self.token_ids += token_ids
        if finished:
            text = self.text = final_text(
                self.tokenizer, self.token_ids, finish_reason, stop_reason, self.include_stop, self.skip_special
            )
            end = len(text)
        else:
            self._advance()
            text = self.decoded
            end = len(text) - self.hold  # below `sent` (or 0) while the text is shorter than a stop string
        if end <= self.sent:
            return ""
        new, self.sent = text[self.sent : end], end
        return new

    def _advance(self) -> None:
        """Add the new tokens' text to `decoded` once it ends in a whole character."""
        if self.read == len(self.token_ids):
            return
        before = self._decode(self.token_ids[self.prefix : self.read])
        after = self._decode(self.token_ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):  # "\ufffd": a character goes on
            self.decoded += after[len(before) :]
            self.prefix, self.read = self.read, len(self.token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special) if ids else ""
