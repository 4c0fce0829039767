"""What a stream consumer receives as tokens arrive."""

from __future__ import annotations

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
