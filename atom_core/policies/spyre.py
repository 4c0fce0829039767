"""`spyre`: the constrained-hardware scheduler and padding of sendnn-inference.

Hardware with static shapes (IBM Spyre) runs either one prefill chunk of one request or
one decode step of the whole batch, over a rectangular block table. The rules, in the
seed document's words:

- One prefill at a time, one `prefill_chunk_size` chunk per prefill step; an ongoing
  prefill goes before any new request; with `interleave_prefill_decode`, no two prefill
  steps in a row while any request decodes; and no idle steps (a decode step runs when
  a prefill cannot).
- First chunk: a free slot under `max_num_seqs` and no other prefill in progress.
  Last chunk: room in the decode batch, every request's last tkv within
  `max_model_len` once the new request has realigned the batch, and the volumetric
  check `batch_size x max_tkv <= max_batch_tkv_limit` over the projected finishing order.
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

from atom_core.config import Config
from atom_core.policy import SchedulingPolicy, StepBuilder
from atom_core.sequence import Sequence

PAD_BLOCK = 0


def batch_tkv_volume(projected_tkvs: list[int]) -> int:
    """The largest `batch_size x max_tkv` a batch reaches as its requests finish.

    Requests finish in order of increasing projected tkv; while the k-th shortest is
    still running, the batch holds it and every longer one, and its tkv is the max.
    """
    ordered = sorted(projected_tkvs)
    n = len(ordered)
    return max(((n - k) * v for k, v in enumerate(ordered)), default=0)


class SpyrePolicy(SchedulingPolicy):
    name = "spyre"
    reserved_blocks = (PAD_BLOCK,)

    def __init__(self, config: Config):
        super().__init__(config)
        if config.speculative_config is not None:
            raise ValueError(
                "scheduling_policy='spyre' does not support speculative decoding (sendnn-inference runs "
                "exactly one token per request per decode step); unset speculative_config or pick another policy"
            )
        self.block_size = config.kv_cache_block_size
        self.chunk_size = config.chunk_size
        self.limit = config.max_batch_tkv_limit
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
        alone = seq.num_tokens + self.remaining(seq)  # its last tkv when it decodes alone
        padded = self.left_pad(seq) + -(-seq.num_tokens // self.block_size) * self.block_size
        need = max(alone, padded)
        if need > self.limit:
            return (
                f"unschedulable: {seq.num_tokens} prompt tokens plus up to {self.remaining(seq)} new ones reach a "
                f"tkv of {need}, over max_batch_tkv_limit={self.limit} even in a batch of one"
            )
        return None

    # -- one step ----------------------------------------------------------------------

    def schedule(self, step: StepBuilder) -> None:
        decoding = step.decoding()
        may_prefill = not (self.config.interleave_prefill_decode and self.last_step_was_prefill and decoding)
        if may_prefill and self._prefill(step, decoding):
            self.last_step_was_prefill = True
            return
        self.last_step_was_prefill = False
        self._decode(step, decoding)
        if step.is_empty:  # decoding preempted every running request: no idle step
            self.last_step_was_prefill = self._prefill(step, step.decoding())

    def _prefill(self, step: StepBuilder, decoding: list[Sequence]) -> bool:
        ongoing = step.prefilling()
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
        got = step.admit(seq, num_tokens=n, start=first) if new else step.schedule(seq, num_tokens=n)
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
        rows = self._last_tkvs(seq, decoding)
        if self.max_model_len is not None and any(t > self.max_model_len for t, _ in rows):
            return False
        return batch_tkv_volume([t + slack for t, slack in rows]) <= self.limit

    def projected_tkvs(self, seq: Sequence, decoding: list[Sequence]) -> list[int]:
        """What the volumetric check walks: each request's last tkv once `seq` joins, a
        decoding request's plus one block for a padding realignment, in finishing order."""
        return sorted(t + slack for t, slack in self._last_tkvs(seq, decoding))

    def _last_tkvs(self, seq: Sequence, decoding: list[Sequence]) -> list[tuple[int, int]]:
        """(tkv at its last decode step, slack) per request, after `seq` realigns the batch.

        At the next decode step a decoding request computes its last token, the new one
        the token its last chunk samples; the rectangle is as wide as the widest of them.
        """
        bs = self.block_size
        rows = [(s.num_tokens - 1, self.remaining(s), bs) for s in decoding]
        new_remaining = self.remaining(seq, seq.num_tokens + 1, seq.num_completion_tokens + 1)
        if new_remaining > 0:
            rows.append((seq.num_tokens, new_remaining, 0))
        if not rows:
            return []
        nblocks = [-(-(c + 1) // bs) for c, _, _ in rows]
        width = max(nblocks)
        return [((width - nb) * bs + c + r, slack) for (c, r, slack), nb in zip(rows, nblocks)]
