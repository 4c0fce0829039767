"""What a stream consumer receives as tokens arrive."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.define
class RequestOutput:
    request_id: int
    output_tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None
    # When the request asked for them (SamplingParams.logprobs / prompt_logprobs), as vLLM
    # streams them: one {token_id: logprob} dict per token of `output_tokens`, and the
    # prompt's (None for its first token) with the request's first tokens.
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # With the first tokens: seconds from its arrival to its first step (vLLM's queue time).
    queue_time: float | None = attrs.field(default=None, eq=False)  # a timing, not what was said

    @classmethod
    def of(cls, seq: Any, new_tokens: list[int]) -> RequestOutput:
        """The stream item for `seq`'s latest `new_tokens` (the last of its completion so far),
        with their log probabilities and, with its first tokens, the prompt's."""
        params = seq.sampling_params
        start = seq.num_completion_tokens - len(new_tokens)
        return cls(
            request_id=seq.id,
            output_tokens=new_tokens,
            finished=seq.is_finished,
            finish_reason=seq.leave_reason or None,
            logprobs=None if params.logprobs is None else seq.logprobs[start : start + len(new_tokens)],
            prompt_logprobs=(
                seq.prompt_logprobs if params.prompt_logprobs is not None and new_tokens and start == 0 else None
            ),
            queue_time=(
                seq.first_scheduled_time - seq.arrive_time
                if new_tokens and start == 0 and seq.first_scheduled_time
                else None
            ),
        )
