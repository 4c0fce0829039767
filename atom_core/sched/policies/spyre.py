"""`spyre`: the constrained-hardware scheduler and padding of sendnn-inference.

Hardware with static shapes (IBM Spyre) runs either one prefill chunk of one request or
one decode step of the whole batch, over a rectangular block table. The rules, in the
words of its design notes:

- One prefill at a time, one `prefill_chunk_size` chunk per prefill step; an ongoing
  prefill goes before any new request; with `interleave_prefill_decode`, no two prefill
  steps in a row while any request decodes; and no idle steps (a decode step runs when
  a prefill cannot).
- First chunk: a free slot under `max_num_seqs` and no other prefill in progress.
  Last chunk: room in the decode batch, every request's last tkv within
  `max_model_len` once the new request has realigned the batch, and the volumetric
  check `batch_size x max_tkv <= max_batch_tkv_limit` at every decode step ahead as the
  batch shrinks in its finishing order (evaluated exactly: sendnn-inference's per-request
  projection lets the product pass the limit when a short request runs beside a longer
  context, as sendnn-inference's later slack acknowledges).
- Padding: a prompt is right-padded to a block boundary and left-padded with whole
  blocks to a multiple of the chunk size; at decode every row is left-padded with
  whole blocks to the widest request's block count. Block 0 is the padding block.
  A request's tkv is its left padding plus its computed tokens plus one.
- Prefix caching: cached chunks are skipped, the chunk straddling the cache boundary
  is recomputed with its writes to cached blocks sent to the padding block, and the
  last chunk is always recomputed. A request with per-request state resumes only
  at a chunk start where a state checkpoint is, the latest one at or before the cache
  boundary (from the beginning if there is none).
"""

from __future__ import annotations

import attrs

from atom_core._validators import boolean, positive
from atom_core.config import Config
from atom_core.sched.policy import SchedulingPolicy, StepBuilder
from atom_core.sequence import Sequence

PAD_BLOCK = 0


@attrs.frozen(kw_only=True)
class SpyreOptions:
    """The `spyre` policy's settings (`Config.additional_config`, or by name to `LLMEngine`)."""

    # Tokens per prefill chunk (a multiple of kv_cache_block_size); None = max_num_batched_tokens
    # floored to a block multiple.
    prefill_chunk_size: int | None = attrs.field(default=None, validator=positive)
    # No two prefill steps in a row while any request is decoding.
    interleave_prefill_decode: bool = attrs.field(default=True, validator=boolean)
    # Ceiling on batch_size x max tkv at every decode step (the hardware's KV volume).
    max_batch_tkv_limit: int = attrs.field(default=131072, validator=positive)


def batch_tkv_volume(rows: list[tuple[int, int]], block_size: int) -> int:
    """The largest `batch_size x max_tkv` of the decode steps ahead of a rectangular batch.

    `rows`: per request (its position at the next decode step, how many decode steps it
    has left). Each step every position grows by one and a request leaves after its last
    step. A row's tkv is its offset in its last block plus the batch's width in whole
    blocks before it, so max_tkv = (width - 1) * block_size + the largest offset, which
    between two departures peaks at the last step or at the last step where some row's
    block is full (then max_tkv = width * block_size): both are evaluated. sendnn-inference's
    projection (each request's own last tkv, sorted) misses that while a short request
    runs the batch's max tkv is another, longer-context request's.
    """
    bs, peak, start = block_size, 0, 1
    for end in sorted({r for _, r in rows}):
        running = [p for p, r in rows if r >= end]

        def max_tkv(t: int) -> int:
            pos = [p + t - 1 for p in running]
            return (max(-(-q // bs) for q in pos) - 1) * bs + max((q - 1) % bs + 1 for q in pos)

        # each row's last step with a full last block, in this stretch
        full = [t for t in (end - (p + end - 1) % bs for p in running) if t >= start]
        steps = [end, max(full)] if full else [end]
        peak = max(peak, len(running) * max(max_tkv(t) for t in steps))
        start = end + 1
    return peak


class SpyrePolicy(SchedulingPolicy):
    name = "spyre"
    reserved_blocks = (PAD_BLOCK,)
    pads_batches = True
    options_class = SpyreOptions

    def __init__(self, config: Config):
        super().__init__(config)
        options: SpyreOptions = self.options
        bs = config.kv_cache_block_size
        if options.prefill_chunk_size is not None and options.prefill_chunk_size % bs:
            raise ValueError(
                f"prefill_chunk_size must be a multiple of kv_cache_block_size={bs}, got {options.prefill_chunk_size}"
            )
        # The chunk: prefill_chunk_size, or the token budget floored to whole blocks (at least one block).
        chunk_size = options.prefill_chunk_size or max(bs, config.max_num_batched_tokens // bs * bs)
        if config.speculative_config is not None:
            raise ValueError(
                "scheduling_policy='spyre' does not support speculative decoding (sendnn-inference runs "
                "exactly one token per request per decode step); unset speculative_config or pick another policy"
            )
        if not config.enable_chunked_prefill:
            raise ValueError(
                "scheduling_policy='spyre' always prefills in chunks of prefill_chunk_size (sendnn-inference's "
                "chunked prefill); enable_chunked_prefill=False is not supported with it"
            )
        if chunk_size > config.max_num_batched_tokens:
            raise ValueError(
                f"the prefill chunk of {chunk_size} tokens (prefill_chunk_size={options.prefill_chunk_size}; "
                f"unset: the budget floored to whole blocks, at least one) exceeds max_num_batched_tokens="
                f"{config.max_num_batched_tokens}: a spyre prefill step runs one whole chunk within the token budget"
            )
        if chunk_size > options.max_batch_tkv_limit:
            raise ValueError(
                f"the prefill chunk of {chunk_size} tokens exceeds max_batch_tkv_limit="
                f"{options.max_batch_tkv_limit}: every prompt is padded to whole chunks, so no request could run; "
                "lower prefill_chunk_size (or max_num_batched_tokens) or raise the limit"
            )
        self.block_size = config.kv_cache_block_size
        self.chunk_size = chunk_size
        self.limit = options.max_batch_tkv_limit
        self.max_model_len = config.max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.last_step_was_prefill = False

    # -- geometry ----------------------------------------------------------------------

    def left_pad(self, seq: Sequence) -> int:
        """Padding tokens (whole blocks) before the prompt: right-padded to a block, the total is a chunk multiple."""
        padded = -(-seq.num_tokens // self.block_size) * self.block_size
        return -padded % self.chunk_size

    def resume_point(self, seq: Sequence, cached: int) -> int:
        """First prompt position to compute: the start of the chunk holding the cache boundary,
        never past the start of the last chunk."""
        left = self.left_pad(seq)
        last_chunk = (left + seq.num_tokens - 1) // self.chunk_size
        chunk = min((left + cached) // self.chunk_size, last_chunk)
        return max(0, chunk * self.chunk_size - left)

    def remaining(self, seq: Sequence, num_tokens: int | None = None, num_completion: int | None = None) -> int:
        """Tokens a request may still generate: by its max_tokens and by max_model_len."""
        n = seq.num_tokens if num_tokens is None else num_tokens
        done = seq.num_completion_tokens if num_completion is None else num_completion
        left = seq.max_tokens - done
        if self.max_model_len is not None:
            left = min(left, self.max_model_len - n)
        return max(0, left)

    def unschedulable_reason(self, seq: Sequence) -> str | None:
        """Over the volume even alone: its prefill's padded tkv (a batch of one, chunk-aligned) or
        its last decode step's (the prefill samples the first new token; each decode step one more)."""
        left = self.remaining(seq)
        alone = seq.num_tokens + max(left - 1, 0)
        padded = self.left_pad(seq) + -(-seq.num_tokens // self.block_size) * self.block_size
        if max(alone, padded) <= self.limit:
            return None
        what = f"{seq.num_tokens} prompt tokens"
        if seq.num_completion_tokens:  # preempted: its prompt and what it generated are prefilled again
            what = (
                f"{seq.num_tokens} tokens to prefill again after a preemption ({seq.num_completion_tokens} generated)"
            )
        if padded >= alone:
            return (
                f"unschedulable: {what}, padded to whole chunks of {self.chunk_size}, reach a prefill tkv of "
                f"{padded}, over max_batch_tkv_limit={self.limit}"
            )
        return (
            f"unschedulable: {what} plus up to {left} new ones reach a decode tkv of {alone}, over "
            f"max_batch_tkv_limit={self.limit} even in a batch of one"
        )

    # -- one step ----------------------------------------------------------------------

    def schedule(self, step: StepBuilder) -> None:
        decoding = step.decoding()
        may_prefill = not (self.options.interleave_prefill_decode and self.last_step_was_prefill and decoding)
        if may_prefill and self._prefill(step, decoding):
            self.last_step_was_prefill = True
            return
        self.last_step_was_prefill = False
        self._decode(step, decoding)
        if step.is_empty:  # decoding preempted every running request: no idle step
            self.last_step_was_prefill = self._prefill(step, step.decoding())

    def _prefill(self, step: StepBuilder, decoding: list[Sequence]) -> bool:
        ongoing = step.prefilling()
        seq: Sequence | None
        if ongoing:
            seq, new = ongoing[0], False
            first = seq.num_computed_tokens
        else:
            seq, new = step.peek_waiting(), True
            if seq is None or step.num_running >= self.max_num_seqs:
                return False  # first chunk: a free slot, no prefill in progress
            first = self.resume_point(seq, step.num_prefix_cached_tokens(seq))
            while first and not step.can_resume_at(seq, first):
                first = self.resume_point(seq, first - 1)  # the chunk before
        left = self.left_pad(seq)
        chunk_start = (left + first) // self.chunk_size * self.chunk_size
        end = min(chunk_start + self.chunk_size - left, seq.num_tokens)
        if end == seq.num_tokens and not self.last_chunk_fits(seq, decoding):
            return False
        n = end - first
        # A prompt chunk never preempts: a decoding request's prompt and generated tokens,
        # prefilled again in whole chunks, may pass the volume where its decode did not. The
        # decode step runs instead (no idle steps) and frees blocks as requests finish.
        got = step.admit(seq, num_tokens=n, start=first) if new else step.schedule(seq, num_tokens=n, preempt=False)
        if not got:
            return False
        step.pad_block = PAD_BLOCK
        step.left_pad_blocks = {seq.id: left // self.block_size}
        step.tkvs = {seq.id: left + end}
        return True

    def _decode(self, step: StepBuilder, decoding: list[Sequence]) -> None:
        step.schedule_all(decoding)
        if step.is_empty:
            return
        # After scheduling, num_computed_tokens counts the token this step writes.
        bs = self.block_size
        nblocks = {s.id: -(-s.num_computed_tokens // bs) for s in step.seqs}
        width = max(nblocks.values())
        step.pad_block = PAD_BLOCK
        step.left_pad_blocks = {sid: width - nb for sid, nb in nblocks.items()}
        step.tkvs = {s.id: (width - nblocks[s.id]) * bs + s.num_computed_tokens for s in step.seqs}

    # -- the last-chunk constraints ---------------------------------------------------

    def last_chunk_fits(self, seq: Sequence, decoding: list[Sequence]) -> bool:
        """Room in the decode batch, max_model_len and the volumetric limit, once `seq` joins."""
        if len(decoding) >= self.max_num_seqs:
            return False
        rows = self.decode_rows(seq, decoding)
        if self.max_model_len is not None and any(t > self.max_model_len for t in self._last_tkvs(rows)):
            return False
        return batch_tkv_volume(rows, self.block_size) <= self.limit

    def decode_rows(self, seq: Sequence, decoding: list[Sequence]) -> list[tuple[int, int]]:
        """(position at the next decode step, decode steps left) per request once `seq` joins:
        a decoding request computes its last token, the new one the token its last chunk samples."""
        rows = [(s.num_tokens, self.remaining(s)) for s in decoding]
        new_remaining = self.remaining(seq, seq.num_tokens + 1, seq.num_completion_tokens + 1)
        if new_remaining > 0:
            rows.append((seq.num_tokens + 1, new_remaining))
        return rows

    def _last_tkvs(self, rows: list[tuple[int, int]]) -> list[int]:
        """Each request's tkv at its last decode step, in the rectangle the new request sets."""
        if not rows:
            return []
        bs = self.block_size
        nblocks = [-(-p // bs) for p, _ in rows]
        width = max(nblocks)
        return [(width - nb) * bs + p + r - 1 for (p, r), nb in zip(rows, nblocks)]
