"""Prefill-first continuous batching over the block manager.

Each `schedule()` returns either a prefill batch (new or preempted requests) or a
decode batch (every running request, one token each plus any speculative drafts),
never a mix. Admission is FIFO: when the head of the waiting queue cannot get blocks
now, nothing behind it jumps the queue and the step decodes instead, so a long
request is never starved by a stream of short ones.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from atom_core.block_manager import BlockManager
from atom_core.config import Config
from atom_core.request import RequestOutput
from atom_core.sequence import Sequence, SequenceStatus, SequenceType

logger = logging.getLogger("atom")


class ScheduledBatch:
    """A snapshot of one step's work, in batch order, for the model runner."""

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
        is_dummy_run: bool = False,
        num_spec_step: int = 0,
        scheduled_spec_decode_tokens: dict[int, list[int]] | None = None,
    ):
        values = list(seqs.values())
        self.req_ids = list(seqs.keys())
        self.num_scheduled_tokens = list(num_scheduled_tokens)
        self.num_cached_tokens = [s.num_cached_tokens for s in values]
        self.context_lens = [len(s) for s in values]
        # The sequences' own tables, as ATOM passes them: valid until the next schedule().
        self.block_tables = [s.block_table for s in values if s.block_table]
        self.last_block_num_tokens = [s.last_block_num_tokens for s in values]
        self.temperatures = [s.temperature for s in values]
        self.top_ks = [s.top_k for s in values]
        self.top_ps = [s.top_p for s in values]
        self.per_req_cache_groups = [s.per_req_cache_group for s in values if s.has_per_req_cache]
        spec = self.scheduled_spec_decode_tokens = dict(scheduled_spec_decode_tokens or {})
        # The tokens whose KV this step writes, flattened in batch order: the uncached
        # prompt tail for a prefill, the last token plus its drafts for a decode.
        if not spec and len(values) == len(self.num_scheduled_tokens) == total_tokens_num:
            self.scheduled_tokens = [s.last_token for s in values]  # plain decode
        else:
            tokens: list[int] = []
            for s, n in zip(values, self.num_scheduled_tokens):
                drafts = spec.get(s.id, ())
                end = len(s)
                tokens.extend(s.token_ids[end - (n - len(drafts)) : end])
                tokens.extend(drafts)
            self.scheduled_tokens = tokens
        self.total_tokens_num = total_tokens_num
        self.total_tokens_num_prefill = total_tokens_num_prefill
        self.total_tokens_num_decode = total_tokens_num_decode
        self.total_seqs_num = total_seqs_num
        self.total_seqs_num_prefill = total_seqs_num_prefill
        self.total_seqs_num_decode = total_seqs_num_decode
        self.is_dummy_run = is_dummy_run
        self.num_spec_step = num_spec_step

    @property
    def is_prefill(self) -> bool:
        return self.total_seqs_num_prefill > 0

    def __repr__(self) -> str:
        kind = "prefill" if self.is_prefill else "decode"
        return f"ScheduledBatch({kind}, req_ids={self.req_ids}, num_scheduled_tokens={self.num_scheduled_tokens})"


class ScheduledBatchOutput:
    """What one forward pass produced: accepted tokens and next-step drafts per request."""

    def __init__(self, token_ids: dict[int, tuple[int, ...]], draft_token_ids: dict[int, list[int]] | None = None):
        self.req_ids = list(token_ids.keys())
        self.token_ids = token_ids
        self.draft_token_ids = draft_token_ids


class Scheduler:
    def __init__(self, config: Config):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.bos_token_id = config.bos_token_id
        self.eos_token_id = config.eos_token_id
        self.stop_token_ids = list(config.stop_token_ids)
        self._stop_token_set = frozenset(self.stop_token_ids)
        self.block_size = config.kv_cache_block_size
        self.block_manager = BlockManager(config)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.prev_time = 0.0
        self.prev_prompt = False
        self.last_prompt_latency = 0.0
        self.delay_factor = config.scheduler_delay_factor
        self.use_spec = config.speculative_config is not None
        self.mtp_k: int = config.num_speculative_tokens
        self.total_draft_tokens = 0
        self.total_accepted_tokens = 0
        self._finished_outside_step: list[Sequence] = []
        self._queued: dict[int, Sequence] = {}  # every waiting or running request, by id

    # -- queue management ----------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a request. One that can never run finishes here, with the reason."""
        if seq.block_size != self.block_size:
            raise ValueError(
                f"sequence {seq.id} has block_size={seq.block_size}, the scheduler's "
                f"kv_cache_block_size is {self.block_size}"
            )
        if seq.status != SequenceStatus.WAITING or seq.block_table:
            raise ValueError(f"sequence {seq.id} is {seq.status.name}, only a new WAITING sequence can be added")
        if seq.id in self._queued:
            raise ValueError(f"a request with id {seq.id} is already queued")
        if not seq.arrive_time:
            seq.arrive_time = time.perf_counter()
        reason = self._unschedulable_reason(seq)
        if reason is not None:
            self._finish_outside_step(seq, reason)
            return
        self._queued[seq.id] = seq
        self.waiting.append(seq)

    def abort(self, seq_id: int, reason: str = "abort") -> Sequence | None:
        """Remove a waiting or running request and free its blocks; None if unknown.

        The engine also ends requests this way for reasons only it can see (a stop string).
        """
        seq = self._queued.get(seq_id)
        if seq is None:
            return None
        (self.waiting if seq.status == SequenceStatus.WAITING else self.running).remove(seq)
        self.block_manager.deallocate(seq)
        self._finish_outside_step(seq, reason)
        return seq

    def pop_finished(self) -> list[Sequence]:
        """Requests that ended outside `postprocess` (rejected, unschedulable, aborted) since the last call."""
        out, self._finished_outside_step = self._finished_outside_step, []
        return out

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def is_finished(self) -> bool:
        return not self.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def _unschedulable_reason(self, seq: Sequence) -> str | None:
        if self.max_model_len is not None and seq.num_tokens > self.max_model_len:
            return f"unschedulable: {seq.num_tokens} tokens exceed max_model_len={self.max_model_len}"
        bm = self.block_manager
        if seq.num_blocks > bm.num_blocks:
            return (
                f"unschedulable: {seq.num_tokens} tokens need {seq.num_blocks} KV blocks of "
                f"{self.block_size} tokens, the whole pool has {bm.num_blocks}"
            )
        if seq.has_per_req_cache and bm.num_per_req_cache_groups == 0:
            return "unschedulable: the request needs a per-request cache group and num_per_req_cache_groups is 0"
        return None

    # -- scheduling ----------------------------------------------------------------

    def schedule(self) -> tuple[ScheduledBatch, dict[int, Sequence]] | None:
        """The next step's batch, or None when no request is left to run."""
        if not self.waiting and not self.running:
            return None
        now = time.perf_counter()
        scheduled = self._schedule_prefill(now)
        if scheduled is None:
            scheduled = self._schedule_decode()
        if scheduled is None:
            # Decoding preempted every running request; their blocks are free again.
            scheduled = self._schedule_prefill(now)
        return scheduled

    def _passed_delay(self, now: float) -> bool:
        if self.prev_prompt:
            self.last_prompt_latency = now - self.prev_time
        self.prev_time, self.prev_prompt = now, False
        if self.delay_factor > 0 and self.waiting:
            earliest_arrival_time = min(seq.arrive_time for seq in self.waiting)
            return (now - earliest_arrival_time) > self.delay_factor * self.last_prompt_latency or not self.running
        return True

    def _schedule_prefill(self, now: float) -> tuple[ScheduledBatch, dict[int, Sequence]] | None:
        if not self.waiting or not self._passed_delay(now):
            return None
        bm = self.block_manager
        seqs: dict[int, Sequence] = {}
        num_tokens: list[int] = []
        num_batched = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            reason = self._unschedulable_reason(seq)  # a preempted request may have outgrown the pool
            if reason is not None:
                self.waiting.popleft()
                self._finish_outside_step(seq, reason)
                continue
            if not bm.can_allocate(seq):
                break
            num_new = seq.num_tokens - bm.num_prefix_cached_tokens(seq)
            # Over the token budget waits for the next step, unless it is first: a prompt
            # longer than the whole budget then runs alone.
            if seqs and num_batched + num_new > self.max_num_batched_tokens:
                break
            bm.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            seq.type = SequenceType.PREFILL
            self.waiting.popleft()
            self.running.append(seq)
            seqs[seq.id] = seq
            num_tokens.append(num_new)
            num_batched += num_new
            if num_batched >= self.max_num_batched_tokens:
                break
        if not seqs:
            return None
        self.prev_prompt = True
        batch = ScheduledBatch(
            seqs,
            num_tokens,
            num_batched,
            total_tokens_num_prefill=num_batched,
            total_seqs_num=len(seqs),
            total_seqs_num_prefill=len(seqs),
        )
        return batch, seqs

    def _schedule_decode(self) -> tuple[ScheduledBatch, dict[int, Sequence]] | None:
        bm = self.block_manager
        running = self.running
        num_new = self.mtp_k + 1
        max_seqs, budget = self.max_num_seqs, self.max_num_batched_tokens
        seqs: dict[int, Sequence] = {}
        num_tokens: list[int] = []
        spec_tokens: dict[int, list[int]] = {}
        num_batched = 0
        while running and len(seqs) < max_seqs:
            if seqs and num_batched + num_new > budget:
                break
            seq = running.popleft()
            while not bm.try_append(seq, num_new):
                if running:
                    self.preempt(running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                seq.type = SequenceType.DECODE
                n = 1
                if seq.spec_token_ids:
                    spec_tokens[seq.id] = list(seq.spec_token_ids)
                    n += len(seq.spec_token_ids)
                seqs[seq.id] = seq
                num_tokens.append(n)
                num_batched += n
        running.extendleft(reversed(seqs.values()))
        if not seqs:
            return None
        batch = ScheduledBatch(
            seqs,
            num_tokens,
            num_batched,
            total_tokens_num_decode=num_batched,
            total_seqs_num=len(seqs),
            total_seqs_num_decode=len(seqs),
            num_spec_step=self.mtp_k,
            scheduled_spec_decode_tokens=spec_tokens,
        )
        return batch, seqs

    def preempt(self, seq: Sequence) -> None:
        """Free all of a running request's blocks; it re-prefills from the queue's front."""
        seq.status = SequenceStatus.WAITING
        seq.spec_token_ids = []
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    # -- after the forward pass ----------------------------------------------------

    def postprocess(
        self,
        seqs: Iterable[Sequence] | dict[int, Sequence],
        fwd_output: ScheduledBatchOutput,
        stream_output_queue: Any = None,
    ) -> list[Sequence]:
        """Append sampled tokens, apply stop conditions, stream, and free finished requests."""
        if isinstance(seqs, dict):
            seqs = seqs.values()
        now = time.perf_counter()
        finished: list[Sequence] = []
        outputs: list[RequestOutput] = []
        drafts = fwd_output.draft_token_ids or {}
        for seq in seqs:
            token_ids = fwd_output.token_ids.get(seq.id)
            if token_ids is None or seq.status != SequenceStatus.RUNNING:
                continue  # aborted or preempted since it was scheduled
            if self.use_spec and seq.type == SequenceType.DECODE and seq.id in drafts:
                self.update_spec_stats(len(token_ids))
            reason = None
            for token_id in token_ids:
                seq.append_token(token_id)
                if not seq.first_token_time:
                    seq.first_token_time = now
                reason = self._stop_reason(seq, token_id)
                if reason is not None:
                    break  # tokens accepted after a stop are dropped
            if reason is None and seq.id in drafts:
                seq.spec_token_ids = list(drafts[seq.id])
            if reason is not None:
                seq.status = SequenceStatus.FINISHED
                seq.leave_time = now
                seq.leave_reason = reason
                seq.spec_token_ids = []
                self.block_manager.deallocate(seq)
                del self._queued[seq.id]
                finished.append(seq)
            if stream_output_queue is not None or seq.stream_callback is not None:
                out = self._emit(seq, reason)
                if stream_output_queue is not None:
                    outputs.append(out)
            else:
                seq.output_tokens.clear()
        if finished:
            self.running = deque(s for s in self.running if s.status == SequenceStatus.RUNNING)
        if outputs:
            stream_output_queue.put_nowait(outputs)
        return finished

    def _stop_reason(self, seq: Sequence, token_id: int) -> str | None:
        """The seed's order: stop sequences, EOS, stop token ids (model's, then request's), max_tokens (then the context limit)."""
        num_tokens = len(seq)
        num_completion = num_tokens - seq.num_prompt_tokens
        for stop in seq.stop_token_sequences:
            n = len(stop)
            if n <= num_completion and seq.token_ids[-n:] == stop:
                return "stop_sequence"
        if not seq.ignore_eos:
            # The model's own stop ids (generation config) count as EOS, as in vLLM.
            if token_id == self.eos_token_id:
                return "eos"
            if token_id in self._stop_token_set:
                return f"stop_{token_id}"
        if token_id in seq.stop_token_ids:  # the request's own: ignore_eos does not lift them
            return f"stop_{token_id}"
        if num_completion >= seq.max_tokens:
            return "max_tokens"
        if self.max_model_len is not None and num_tokens >= self.max_model_len:
            return "max_model_len"
        return None

    def _emit(self, seq: Sequence, reason: str | None) -> RequestOutput:
        """Hand new tokens to the request's callback; return the stream item."""
        out = RequestOutput(
            request_id=seq.id,
            output_tokens=seq.output_tokens,
            finished=reason is not None,
            finish_reason=reason,
        )
        seq.output_tokens = []
        if seq.stream_callback is not None:
            try:
                seq.stream_callback(out)
            except Exception:  # one consumer's bug must not stop everyone else's tokens
                logger.exception("stream callback of request %s raised", seq.id)
        return out

    def _finish_outside_step(self, seq: Sequence, reason: str) -> None:
        self._queued.pop(seq.id, None)
        seq.status = SequenceStatus.FINISHED
        seq.leave_time = time.perf_counter()
        seq.leave_reason = reason
        self._finished_outside_step.append(seq)
        self._emit(seq, reason)

    def update_spec_stats(self, num_accepted_tokens: int) -> None:
        """Count one verified step; the first accepted token is the target's own, not a draft."""
        self.total_draft_tokens += self.mtp_k
        self.total_accepted_tokens += num_accepted_tokens - 1
        if self.total_draft_tokens and self.total_draft_tokens % 1000 == 0:
            logger.info(
                "[MTP Stats] Total draft tokens: %d, Accepted: %d, Acceptance rate: %.2f%%",
                self.total_draft_tokens,
                self.total_accepted_tokens,
                100.0 * self.total_accepted_tokens / self.total_draft_tokens,
            )
