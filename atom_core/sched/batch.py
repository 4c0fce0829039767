"""What passes between the scheduler and the model runner each step: the batch to run and what it produced.

In their own module (as vLLM v1 keeps its batch types apart from the scheduler) so the
runner, the attention builders and the proposers read a batch without importing the scheduler.
"""

from __future__ import annotations

from typing import Any

from atom_core.sequence import Sequence


class ScheduledBatch:
    """A snapshot of one step's work for the model runner: decode rows first, then prefill chunks.

    Per request, in batch order: `num_scheduled_tokens` (its query length),
    `num_computed_tokens` (the first position it computes), `context_lens` (tokens in
    its KV once the step has written) and `do_sample` (whether its tokens reach the end
    of the sequence: a middle prompt chunk samples nothing). A padding policy (spyre)
    also fills `left_pad_blocks`, `tkvs` and `pad_block`; other policies leave them None.

    With prefix caching on a model with per-request state, `state_loads` maps a row to
    the checkpoint slot whose state it starts from (instead of its group's), and
    `state_saves` maps a row to `(position, slot)` pairs: copy the state after the
    sequence's first `position` tokens into that checkpoint slot. Slots are numbered
    after the groups. Both are empty otherwise.
    """

    def __init__(
        self,
        seqs: dict[int, Sequence],
        num_scheduled_tokens: list[int],
        total_tokens_num: int,
        total_tokens_num_prefill: int = 0,
        total_tokens_num_decode: int = 0,
        total_seqs_num: int = 0,
        total_seqs_num_prefill: int = 0,
        total_seqs_num_decode: int = 0,
        num_spec_step: int = 0,
        scheduled_spec_decode_tokens: dict[int, list[int]] | None = None,
        *,
        num_computed_tokens: list[int] | None = None,
        left_pad_blocks: list[int] | None = None,
        tkvs: list[int] | None = None,
        pad_block: int | None = None,
        state_loads: dict[int, int] | None = None,
        state_saves: dict[int, list[tuple[int, int]]] | None = None,
    ):
        values = list(seqs.values())
        self.req_ids = list(seqs.keys())
        self.num_scheduled_tokens = num_scheduled_tokens
        spec = self.scheduled_spec_decode_tokens = dict(scheduled_spec_decode_tokens or {})
        if num_computed_tokens is None:  # a hand-built batch: each request runs up to its end
            num_computed_tokens = [len(s) - n + len(spec.get(s.id, ())) for s, n in zip(values, num_scheduled_tokens)]
        self.num_computed_tokens = num_computed_tokens
        self.num_cached_tokens = [s.num_cached_tokens for s in values]
        if total_tokens_num == len(values):  # one token a request
            self.context_lens = [f + 1 for f in num_computed_tokens]
        else:
            self.context_lens = [f + n for f, n in zip(num_computed_tokens, num_scheduled_tokens)]
        # The sequences' own tables, as AMD ATOM passes them: valid until the next schedule().
        self.block_tables = [s.block_table for s in values]
        self._seqs = values
        self.temperatures = [s.temperature for s in values]
        self.top_ks = [s.top_k for s in values]
        self.top_ps = [s.top_p for s in values]
        self.per_req_cache_groups = [s.per_req_cache_group for s in values if s.has_per_req_cache]
        if not spec and total_seqs_num_decode == len(values) and total_tokens_num == len(values):
            # A plain decode step: each request's last token, every one sampling.
            self.scheduled_tokens = [s.last_token for s in values]
            self.do_sample = [True] * len(values)
        else:
            self._flatten(values)
        self.total_tokens_num = total_tokens_num
        self.total_tokens_num_prefill = total_tokens_num_prefill
        self.total_tokens_num_decode = total_tokens_num_decode
        self.total_seqs_num = total_seqs_num
        self.total_seqs_num_prefill = total_seqs_num_prefill
        self.total_seqs_num_decode = total_seqs_num_decode
        self.num_spec_step = num_spec_step
        self.left_pad_blocks = left_pad_blocks
        self.tkvs = tkvs
        self.pad_block = pad_block
        self.state_loads = state_loads or {}
        self.state_saves = state_saves or {}

    @property
    def last_block_num_tokens(self) -> list[int]:
        """Tokens in each request's last block (AMD ATOM's field; computed when asked)."""
        return [s.last_block_num_tokens for s in self._seqs]

    def _flatten(self, values: list[Sequence]) -> None:
        """The tokens whose KV this step writes, in batch order, and which requests sample."""
        spec = self.scheduled_spec_decode_tokens
        tokens: list[int] = []
        do_sample: list[bool] = []
        for s, n, first in zip(values, self.num_scheduled_tokens, self.num_computed_tokens):
            drafts = spec.get(s.id, ())
            end = first + n - len(drafts)
            tokens.extend(s.token_ids[first:end])
            tokens.extend(drafts)
            do_sample.append(end >= s.num_tokens)
        self.scheduled_tokens = tokens
        self.do_sample = do_sample

    def __repr__(self) -> str:
        return (
            f"ScheduledBatch(decode={self.total_seqs_num_decode}, prefill={self.total_seqs_num_prefill}, "
            f"req_ids={self.req_ids}, num_scheduled_tokens={self.num_scheduled_tokens})"
        )


class ScheduledBatchOutput:
    """What one forward pass produced: accepted tokens and next-step drafts per request."""

    def __init__(
        self,
        token_ids: dict[int, tuple[int, ...]],
        draft_token_ids: dict[int, list[int]] | None = None,
        draft_probs: dict[int, Any] | None = None,
    ):
        self.req_ids = list(token_ids.keys())
        self.token_ids = token_ids
        self.draft_token_ids = draft_token_ids
        self.draft_probs = draft_probs  # per request [num_drafts, vocab], from proposers that have them
        # Requests that asked for them: per emitted token, and (first prompt index, entries) per chunk.
        self.logprobs: dict[int, list[dict[int, float]]] = {}
        self.prompt_logprobs: dict[int, tuple[int, list[dict[int, float]]]] = {}
