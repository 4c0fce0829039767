"""What passes between the scheduler and the model runner each step: the batch to run and what it produced.

In their own module (as vLLM v1 keeps its batch types apart from the scheduler) so the
runner, the attention builders and the proposers read a batch without importing the scheduler.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any

from atom_core.sequence import Sequence

# A batch as int64 data (`ScheduledBatch.to_ints` / `from_ints`): what rank 0 broadcasts to
# the other tensor-parallel ranks each step, as a fixed-size header of section lengths and one
# payload, never pickled. The fields the model and the attention builders read, in this order.
BATCH_FORMAT_VERSION = 1
BATCH_SECTIONS = (
    "scalars", "req_ids", "num_scheduled_tokens", "num_computed_tokens", "num_cached_tokens", "context_lens",
    "do_sample", "block_table_lens", "block_tables", "scheduled_tokens", "per_req_cache_groups", "spec_counts",
    "spec_tokens", "left_pad_blocks", "tkvs", "state_loads", "state_saves",
)  # fmt: skip
BATCH_HEADER_LEN = 1 + len(BATCH_SECTIONS)  # the version, then each section's length
_SCALARS = (
    "total_tokens_num", "total_tokens_num_prefill", "total_tokens_num_decode", "total_seqs_num",
    "total_seqs_num_prefill", "total_seqs_num_decode", "num_spec_step",
)  # fmt: skip


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

    def to_ints(self) -> tuple[list[int], list[int]]:
        """(header, payload): the fields the model and the attention builders read, as int64
        values; `from_ints` rebuilds the batch on another rank."""
        spec = self.scheduled_spec_decode_tokens
        optional = [self.pad_block is not None, self.left_pad_blocks is not None, self.tkvs is not None]
        sections: dict[str, list[int]] = {
            "scalars": [getattr(self, n) for n in _SCALARS] + [-1 if self.pad_block is None else self.pad_block]
            + [int(b) for b in optional],
            "req_ids": self.req_ids,
            "num_scheduled_tokens": self.num_scheduled_tokens,
            "num_computed_tokens": self.num_computed_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "context_lens": self.context_lens,
            "do_sample": [int(d) for d in self.do_sample],
            "block_table_lens": [len(t) for t in self.block_tables],
            "block_tables": [b for t in self.block_tables for b in t],
            "scheduled_tokens": self.scheduled_tokens,
            "per_req_cache_groups": self.per_req_cache_groups,
            "spec_counts": [len(spec.get(r, ())) for r in self.req_ids],
            "spec_tokens": [t for r in self.req_ids for t in spec.get(r, ())],
            "left_pad_blocks": self.left_pad_blocks or [],
            "tkvs": self.tkvs or [],
            "state_loads": [v for row, slot in self.state_loads.items() for v in (row, slot)],
            "state_saves": [v for row, saves in self.state_saves.items() for pos, slot in saves for v in (row, pos, slot)],
        }  # fmt: skip
        header = [BATCH_FORMAT_VERSION] + [len(sections[name]) for name in BATCH_SECTIONS]
        return header, [int(v) for name in BATCH_SECTIONS for v in sections[name]]

    @classmethod
    def from_ints(cls, header: list[int], payload: list[int]) -> ScheduledBatch:
        """The batch `to_ints` described, without its sequences (a tensor-parallel rank runs the
        model on it; only rank 0 samples, so it has none of the sampling fields)."""
        if len(header) != BATCH_HEADER_LEN or header[0] != BATCH_FORMAT_VERSION:
            raise ValueError(f"not a batch header of format {BATCH_FORMAT_VERSION}: {header[:4]}...")
        ends = list(accumulate(header[1:]))
        if ends[-1] != len(payload):
            raise ValueError(f"the batch header describes {ends[-1]} values, the payload has {len(payload)}")
        parts = {name: payload[end - n : end] for name, n, end in zip(BATCH_SECTIONS, header[1:], ends)}
        batch = cls.__new__(cls)
        scalars = parts["scalars"]
        for name, value in zip(_SCALARS, scalars):
            setattr(batch, name, value)
        pad_block, has_pad, has_left_pad, has_tkvs = scalars[len(_SCALARS) :]
        batch.pad_block = pad_block if has_pad else None
        batch.left_pad_blocks = parts["left_pad_blocks"] if has_left_pad else None
        batch.tkvs = parts["tkvs"] if has_tkvs else None
        for name in ("req_ids", "num_scheduled_tokens", "num_computed_tokens", "num_cached_tokens", "context_lens",
                     "scheduled_tokens", "per_req_cache_groups"):  # fmt: skip
            setattr(batch, name, parts[name])
        batch.do_sample = [bool(d) for d in parts["do_sample"]]
        lens = parts["block_table_lens"]
        flat = parts["block_tables"]
        batch.block_tables = [flat[end - n : end] for n, end in zip(lens, accumulate(lens))]
        counts, drafts = parts["spec_counts"], parts["spec_tokens"]
        batch.scheduled_spec_decode_tokens = {
            r: drafts[end - n : end] for r, n, end in zip(batch.req_ids, counts, accumulate(counts)) if n
        }
        loads = parts["state_loads"]
        batch.state_loads = dict(zip(loads[0::2], loads[1::2]))
        saves: dict[int, list[tuple[int, int]]] = {}
        triples = parts["state_saves"]
        for row, pos, slot in zip(triples[0::3], triples[1::3], triples[2::3]):
            saves.setdefault(row, []).append((pos, slot))
        batch.state_saves = saves
        batch._seqs = []
        batch.temperatures, batch.top_ks, batch.top_ps = [], [], []
        return batch

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
