"""What happens to a step's tokens after the scheduler has appended them: stop strings, then
what each request's stream callback receives.

The scheduler ends requests on token ids (EOS, stop tokens, token sequences, lengths); a stop
string is text, which only the engine can see, so the engine checks it here, after the
scheduler's `postprocess`, token by token over what the step appended: a request that hits one
is cut right after the token that completed it and ended with `FinishReason.STOP`, its stop
string kept as its `stop_reason`. Stream callbacks are called here too, so a consumer never
sees a token past a stop. The server's text streaming reuses this step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from atom_core.request import RequestOutput
from atom_core.sched.scheduler import Scheduler
from atom_core.sequence import FinishReason, Sequence

logger = logging.getLogger("atom")


def completed_at(text: str, before: str, stop: str) -> int:
    """Where `stop` starts in `text` if the text's last token (`text` minus `before`, the text
    without it) completes it; else -1. An earlier occurrence does not count: it was either
    seen at its own token or came before `min_tokens` (vLLM's rule: only the new characters)."""
    stable = len(before.rstrip("\ufffd"))  # an unfinished character may change with the token
    return text.find(stop, max(0, stable - len(stop) + 1))


def final_text(
    tokenizer: Any, token_ids: list[int], finish_reason: str | None, stop_reason: int | str | None,
    include_stop: bool = False, skip_special: bool = True,
) -> str:  # fmt: skip
    """A finished request's text, up to the stop string its last token completed (as vLLM
    returns it; through it with `include_stop`, vLLM's `include_stop_str_in_output`), special
    tokens left out unless `skip_special` is False. A stop token's own text (EOS, a stop token id)
    is left out too, unless `include_stop` keeps it, as in vLLM."""
    stop_token = finish_reason == FinishReason.EOS.value or (finish_reason or "").removeprefix("stop_").isdigit()
    if stop_token and not include_stop and token_ids:
        token_ids = token_ids[:-1]
    text = tokenizer.decode(token_ids, skip_special_tokens=skip_special)
    if finish_reason != FinishReason.STOP.value or not isinstance(stop_reason, str):
        return text
    cut = completed_at(text, tokenizer.decode(token_ids[:-1], skip_special_tokens=skip_special), stop_reason)
    return text if cut < 0 else text[: cut + len(stop_reason) * include_stop]


@attrs.define
class RequestState:
    """The engine's side of one request: what its consumer has been handed so far."""

    seq: Sequence
    prompt: Any
    callback: Callable[[RequestOutput], None] | None = None
    num_cached_tokens: int | None = None
    num_emitted: int = 0  # completion tokens handed to the callback
    num_checked: int = 0  # completion tokens checked for stop strings
    final_sent: bool = False


class OutputProcessor:
    def __init__(self, tokenizer: Any, scheduler: Scheduler):
        self.tokenizer = tokenizer
        self.scheduler = scheduler

    def process(self, states: Iterable[RequestState]) -> None:
        """Stop strings, then the stream callbacks, for the requests a step touched (or that
        ended outside a step)."""
        for state in states:
            seq = state.seq
            if seq.stop_strings and seq.num_completion_tokens > state.num_checked:
                self._check_stop_strings(state)
            self.emit(state)

    def stop_string_at(self, seq: Sequence, start: int) -> tuple[int, str] | None:
        """The first completion length n >= `start` whose text holds one of `seq.stop_strings`,
        with that string; None if none does up to the sequence's end."""
        tokens = seq.completion_token_ids
        # Every token carries at least one byte of text (a character may take several tokens: an
        # emoji is three of a byte-level vocabulary), so a stop string of n UTF-8 bytes lies
        # within the last n tokens: decode only that tail.
        window = max(len(s.encode("utf-8")) for s in seq.stop_strings) + 4
        skip = seq.sampling_params.skip_special_tokens  # the text the stop strings are looked for in
        # under min_tokens no stop string counts (vLLM's rule: only past min_tokens tokens)
        for n in range(max(start, 1, seq.sampling_params.min_tokens + 1), len(tokens) + 1):
            tail = self.tokenizer.decode(tokens[max(0, n - window) : n], skip_special_tokens=skip)
            if not any(s in tail for s in seq.stop_strings):
                continue
            before = self.tokenizer.decode(tokens[max(0, n - window) : n - 1], skip_special_tokens=skip)
            for s in seq.stop_strings:
                if completed_at(tail, before, s) >= 0:
                    return n, s
        return None

    def _check_stop_strings(self, state: RequestState) -> None:
        seq = state.seq
        hit = self.stop_string_at(seq, state.num_checked + 1)
        state.num_checked = seq.num_completion_tokens
        if hit is None:
            return
        length, stop = hit
        if not seq.is_finished:
            self.scheduler.abort(seq.id, FinishReason.STOP, stop)  # frees its blocks
        else:  # ended later in the same step on a token id: the stop string came first
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop
        seq.truncate(seq.num_prompt_tokens + length)
        state.num_checked = length

    def emit(self, state: RequestState) -> None:
        """Hand the request's consumer its tokens since the last call (and the end, once)."""
        if state.callback is None or state.final_sent:
            return
        seq = state.seq
        new = seq.completion_token_ids[state.num_emitted :]
        if not new and not seq.is_finished:
            return
        out = RequestOutput.of(seq, new)
        state.num_emitted += len(new)
        state.final_sent = seq.is_finished
        try:
            state.callback(out)
        except Exception:  # one consumer's bug must not stop everyone else's tokens
            logger.exception("stream callback of request %s raised", seq.id)
