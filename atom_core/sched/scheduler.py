"""Continuous batching over the block manager; a pluggable policy decides each step's rows.

The `Scheduler` owns the queues, the block manager, preemption, stop conditions,
streaming and statistics. What runs in a step (prefill-first, mixed prefill and decode,
sendnn-inference's padded steps, or a third party's) is the `SchedulingPolicy` named by
`Config.scheduling_policy` (see `atom_core.sched.policy`). Admission is FIFO in every built-in
policy: when the head of the waiting queue cannot start, nothing behind it jumps ahead.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Sized
from typing import Any, cast

from atom_core.compat import AtomSchedulerCounters, as_config
from atom_core.config import Config
from atom_core.kv.block_manager import BlockManager
from atom_core.kv.layout import KVPoolPlan
from atom_core.request import RequestOutput
from atom_core.sched.batch import ScheduledBatch, ScheduledBatchOutput
from atom_core.sched.policy import SchedulingPolicy, StepBuilder, policy_class
from atom_core.sched.speculative import DraftGate, SpecStats, crowded, wanted_drafts
from atom_core.sequence import FinishReason, Sequence, SequenceStatus, SequenceType

logger = logging.getLogger("atom")


class Scheduler(AtomSchedulerCounters):
    def __init__(self, config: Config, pm: Any = None, plan: KVPoolPlan | None = None):
        """`plan`: the KV pool a model runner planned; without one, `config`'s counts (`BlockManager`)."""
        config = as_config(config)  # a stand-in with AMD ATOM's fields works too
        self.config = config
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.bos_token_id = config.bos_token_id
        self.eos_token_id = config.eos_token_id
        self.stop_token_ids = list(config.stop_token_ids)
        self._stop_token_set = frozenset(self.stop_token_ids)
        self.block_size = config.kv_cache_block_size
        self.block_manager = BlockManager(config, plan)
        self.num_preemptions = 0  # since the start, for metrics
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.prev_time = 0.0
        self.prev_prompt = False
        self.last_prompt_latency = 0.0
        self.delay_factor = config.scheduler_delay_factor
        spec = config.speculative_config
        self.use_spec = spec is not None
        self.mtp_k: int = config.num_speculative_tokens
        self.spec_stats = SpecStats(self.mtp_k)
        # Stop strings are text: the engine, which holds the tokenizer, sets this checker.
        self._finished_outside_step: list[Sequence] = []
        self._queued: dict[int, Sequence] = {}  # every waiting or running request, by id
        self.policy: SchedulingPolicy = policy_class(config.scheduling_policy, pm)(config)
        for block_id in self.policy.reserved_blocks:
            self.block_manager.reserve(block_id)

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
        if seq.sampling_params.min_tokens:
            model_stops = () if seq.ignore_eos else (self.eos_token_id, *self.stop_token_ids)
            seq.min_tokens_stop_ids = seq.stop_token_ids | {t for t in model_stops if t is not None}
        if self.use_spec and seq.draft_gate is None:
            spec = self.config.speculative_config
            assert spec is not None  # use_spec
            seq.draft_gate = DraftGate(spec.min_acceptance_rate, spec.draft_retry_after)
        why = self._unschedulable_reason(seq)
        if why is not None:
            self._finish_outside_step(seq, FinishReason.UNSCHEDULABLE, detail=why)
            return
        self._queued[seq.id] = seq
        self.waiting.append(seq)

    def abort(
        self, seq_id: int, reason: FinishReason = FinishReason.ABORT, stop_reason: int | str | None = None
    ) -> Sequence | None:
        """Remove a waiting or running request and free its blocks; None if unknown.

        The engine also ends requests this way for reasons only it can see (a stop string).
        """
        seq = self._queued.get(seq_id)
        if seq is None:
            return None
        (self.waiting if seq.status == SequenceStatus.WAITING else self.running).remove(seq)
        self.block_manager.deallocate(seq)
        self._finish_outside_step(seq, reason, stop_reason)
        return seq

    def fail(self, batch: ScheduledBatch, seqs: dict[int, Sequence]) -> None:
        """End every request of a step whose forward pass raised, freeing their blocks.

        Scheduling moved them past tokens that were never computed and published blocks
        whose KV was never written; left so, they could never run again, and a later
        prompt could hit the unwritten blocks. Requests outside the step are untouched.
        """
        for rid, first in zip(batch.req_ids, batch.num_computed_tokens):
            seq = seqs[rid]
            if self._queued.get(rid) is seq:
                self.block_manager.unpublish(seq, first)
                self.abort(rid, FinishReason.ERROR)

    def peek_finished(self) -> list[Sequence]:
        """What `pop_finished` would return, left in place."""
        return list(self._finished_outside_step)

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
        return self.policy.unschedulable_reason(seq)

    # -- scheduling ----------------------------------------------------------------

    def schedule(self) -> tuple[ScheduledBatch, dict[int, Sequence]] | None:
        """The next step's batch, or None when no request is left to run."""
        if not self.waiting and not self.running:
            return None
        step = StepBuilder(self)
        self.policy.schedule(step)
        if step.is_empty:
            if self.waiting or self.running:
                raise RuntimeError(
                    f"scheduling policy {self.config.scheduling_policy!r} scheduled nothing with "
                    f"{len(self.waiting)} waiting and {len(self.running)} running requests"
                )
            return None  # every waiting request turned out unschedulable
        return self._build_batch(step)

    def _waiting_head(self) -> Sequence | None:
        """The first waiting request that can ever run; the others finish as unschedulable."""
        waiting = self.waiting
        while waiting:
            seq = waiting[0]
            why = self._unschedulable_reason(seq)  # a preempted request may have outgrown the pool
            if why is None:
                return seq
            waiting.popleft()
            self._finish_outside_step(seq, FinishReason.UNSCHEDULABLE, detail=why)
        return None

    def _passed_delay(self, now: float) -> bool:
        if self.prev_prompt:
            self.last_prompt_latency = now - self.prev_time
        self.prev_time, self.prev_prompt = now, False
        if self.delay_factor > 0 and self.waiting:
            earliest_arrival_time = min(seq.arrive_time for seq in self.waiting)
            return (now - earliest_arrival_time) > self.delay_factor * self.last_prompt_latency or not self.running
        return True

    def _build_batch(self, step: StepBuilder) -> tuple[ScheduledBatch, dict[int, Sequence]]:
        rows, num_tokens, firsts = step.seqs, step.num_tokens, step.firsts
        num_prefill = step.num_prefill_rows
        num_decode = len(rows) - num_prefill
        if num_prefill and num_decode:  # decode rows first, each kind in the order it was scheduled
            decode = SequenceType.DECODE
            kinds = [s.type is decode for s in rows]
            order = [i for i, k in enumerate(kinds) if k] + [i for i, k in enumerate(kinds) if not k]
            rows = [rows[i] for i in order]
            num_tokens = [num_tokens[i] for i in order]
            firsts = [firsts[i] for i in order]
        seqs = {s.id: s for s in rows}
        now = time.perf_counter()
        for s in rows[num_decode:]:
            if not s.first_scheduled_time:
                s.first_scheduled_time = now
        spec = {s.id: list(s.spec_token_ids) for s in rows[:num_decode] if s.spec_token_ids} if self.use_spec else {}
        total = sum(num_tokens)
        decode_tokens = sum(num_tokens[:num_decode]) if num_prefill else total
        pads, tkvs = step.left_pad_blocks, step.tkvs
        loads = saves = None
        if num_prefill and self.block_manager.state_checkpoints is not None:
            # Last, after every lookup of this step: a checkpoint saved now serves from the next step.
            loads, saves = self.block_manager.plan_state_checkpoints(rows, firsts, num_tokens)
        batch = ScheduledBatch(
            seqs,
            num_tokens,
            total,
            total_tokens_num_prefill=total - decode_tokens,
            total_tokens_num_decode=decode_tokens,
            total_seqs_num=len(rows),
            total_seqs_num_prefill=num_prefill,
            total_seqs_num_decode=num_decode,
            num_spec_step=self.mtp_k if num_decode else 0,
            scheduled_spec_decode_tokens=spec,
            num_computed_tokens=firsts,
            left_pad_blocks=[pads[i] for i in seqs] if pads is not None else None,
            tkvs=[tkvs[i] for i in seqs] if tkvs is not None else None,
            pad_block=step.pad_block,
            state_loads=loads,
            state_saves=saves,
        )
        if num_prefill:
            self.prev_prompt = True
        return batch, seqs

    def preempt(self, seq: Sequence) -> None:
        """Free all of a running request's blocks; it re-prefills from the queue's front."""
        self.num_preemptions += 1
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.spec_token_ids, seq.spec_token_probs = [], None
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
        elif not hasattr(seqs, "__len__"):
            seqs = list(seqs)
        now = time.perf_counter()
        finished: list[Sequence] = []
        outputs: list[RequestOutput] = []
        drafts = fwd_output.draft_token_ids or {}
        draft_probs = fwd_output.draft_probs or {}
        get_tokens = fwd_output.token_ids.get
        running, decode = SequenceStatus.RUNNING, SequenceType.DECODE
        stats, verified = self.spec_stats, False
        busy = crowded(self.config.speculative_config, len(cast(Sized, seqs))) if drafts else False
        prompt_logprobs, logprobs = fwd_output.prompt_logprobs, fwd_output.logprobs
        for seq in seqs:
            if prompt_logprobs and seq.id in prompt_logprobs and seq.status is running:
                start, entries = prompt_logprobs[seq.id]
                seq.prompt_logprobs.extend(entries[len(seq.prompt_logprobs) - start :])
            token_ids = get_tokens(seq.id)
            if token_ids is None or seq.status is not running:
                continue  # a middle prompt chunk, or aborted or preempted since it was scheduled
            if seq.num_computed_tokens < seq._num_tokens:
                continue  # a middle chunk samples nothing, whatever the runner sent
            # Token by token: nothing after a stop reaches the sequence, the output or the counts.
            reason: tuple[Any, ...] | None = None
            committed = 0
            token_logprobs = logprobs.get(seq.id) if logprobs else None
            for token_id in token_ids:
                seq.append_token(token_id)
                if token_logprobs is not None:
                    seq.logprobs.append(token_logprobs[committed])
                committed += 1
                if not seq.first_token_time:
                    seq.first_token_time = now
                reason = self._stop_reason(seq, token_id)
                if seq.grammar is not None and reason is None:
                    reason = self._grammar_stop(seq, token_id)
                if reason is not None:
                    break
            num_drafted = len(seq.spec_token_ids) if seq.type is decode else 0
            if num_drafted:
                stats.record(num_drafted, len(token_ids) - 1, committed)
                if seq.draft_gate is not None:
                    seq.draft_gate.record(num_drafted, len(token_ids) - 1, seq.num_completion_tokens)
                verified = True
            seq.type = decode
            seq.num_computed_tokens = seq._num_tokens - 1  # all but the token just sampled (drafts rejected)
            seq.spec_token_ids, seq.spec_token_probs = [], None
            if reason is None and seq.id in drafts:
                n = wanted_drafts(seq, 0, self.mtp_k, self.max_model_len, busy)
                seq.spec_token_ids = list(drafts[seq.id][:n])
                probs = draft_probs.get(seq.id)
                if probs is not None and seq.spec_token_ids:
                    seq.spec_token_probs = probs[:n]
            if reason is not None:
                seq.finish(*reason)
                seq.leave_time = now
                self.block_manager.deallocate(seq)
                self._queued.pop(seq.id, None)  # a request queued by hand was never in it
                finished.append(seq)
            if stream_output_queue is not None or seq.stream_callback is not None:
                out = self._emit(seq)
                if stream_output_queue is not None:
                    outputs.append(out)
            else:
                seq.output_tokens.clear()
        if verified:
            stats.end_step()
        if finished:
            self.running = deque(s for s in self.running if s.status == SequenceStatus.RUNNING)
        if outputs:
            stream_output_queue.put_nowait(outputs)
        return finished

    @staticmethod
    def _grammar_stop(seq: Sequence, token_id: int) -> tuple[FinishReason, int | None, str | None] | None:
        """The grammar follows the token; the request ends when the grammar is complete (or was
        broken: a sampler that ignored its mask)."""
        assert seq.grammar is not None
        if not seq.grammar.accept_token(token_id):
            return FinishReason.ERROR, None, f"token {token_id} does not match the request's structured_output"
        if seq.grammar.is_terminated():
            return FinishReason.GRAMMAR, None, None
        return None

    def _stop_reason(self, seq: Sequence, token_id: int) -> tuple[FinishReason, int | None] | None:
        """Why `seq` ends at `token_id`, with the stop token if one ended it; None if it goes on.

        In AMD ATOM's order: stop sequences, EOS, stop token ids (model's, then request's),
        max_tokens, then the context limit. Stop strings are text: the engine checks them
        (`atom_core.engine.output_processor`)."""
        num_tokens = seq._num_tokens
        num_completion = num_tokens - seq.num_prompt_tokens
        if num_completion < seq.sampling_params.min_tokens:  # nothing but the limits ends it yet
            return self._length_reason(seq, num_tokens, num_completion)
        for stop in seq.stop_token_sequences:
            n = len(stop)
            if n <= num_completion and seq.token_ids[-n:] == stop:
                return FinishReason.STOP_SEQUENCE, None
        if not seq.ignore_eos:
            # The model's own stop ids (generation config) count as EOS, as in vLLM.
            if token_id == self.eos_token_id:
                return FinishReason.EOS, None
            if token_id in self._stop_token_set:
                return FinishReason.STOP_TOKEN, token_id
        if token_id in seq.stop_token_ids:  # the request's own: ignore_eos does not lift them
            return FinishReason.STOP_TOKEN, token_id
        return self._length_reason(seq, num_tokens, num_completion)

    def _length_reason(self, seq: Sequence, num_tokens: int, num_completion: int) -> tuple[FinishReason, None] | None:
        if num_completion >= seq.max_tokens:
            return FinishReason.MAX_TOKENS, None
        if self.max_model_len is not None and num_tokens >= self.max_model_len:
            return FinishReason.MAX_MODEL_LEN, None
        return None

    def _emit(self, seq: Sequence) -> RequestOutput:
        """Hand new tokens to the request's callback; return the stream item."""
        out = RequestOutput.of(seq, seq.output_tokens)
        seq.output_tokens = []
        if seq.stream_callback is not None:
            try:
                seq.stream_callback(out)
            except Exception:  # one consumer's bug must not stop everyone else's tokens
                logger.exception("stream callback of request %s raised", seq.id)
        return out

    def _finish_outside_step(
        self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None, detail: str | None = None
    ) -> None:
        self._queued.pop(seq.id, None)
        seq.finish(reason, stop_reason, detail)
        seq.leave_time = time.perf_counter()
        self._finished_outside_step.append(seq)
        self._emit(seq)
