"""What a stream consumer receives as tokens arrive."""

from __future__ import annotations

import attrs


@attrs.define
class RequestOutput:
    request_id: int
    output_tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None
