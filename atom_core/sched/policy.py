"""The scheduling-policy contract: a policy picks which requests run in a step and how many tokens each.

The `Scheduler` keeps the queues, the block manager, stop handling, preemption and
statistics. Each step it hands the policy a `StepBuilder`, and the policy calls
`schedule(seq)` for running requests and `admit()` for the head of the waiting queue, in
the order it wants them served. The builder does the bookkeeping every policy shares:
the token budget, chunking a prompt, `max_num_seqs`, block allocation, and preemption
when a running request cannot grow. Policies are registered through
`atom_register_scheduler_policies` and picked by `Config.scheduling_policy`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from atom_core.config import Config
from atom_core.plugins.manager import get_registry
from atom_core.plugins.options import plugin_options
from atom_core.sequence import Sequence, SequenceStatus, SequenceType

if TYPE_CHECKING:
    from atom_core.sched.scheduler import Scheduler


def policy_class(name: str, pm: Any = None) -> type[SchedulingPolicy]:
    """The `SchedulingPolicy` subclass registered under `name` (`Config.scheduling_policy`)."""
    cls = get_registry("scheduler_policies", pm).get(name)
    if not (isinstance(cls, type) and issubclass(cls, SchedulingPolicy)):
        raise TypeError(
            f"scheduling policy {name!r} is registered as {cls!r}, which is not a subclass of "
            "atom_core.sched.policy.SchedulingPolicy"
        )
    return cls


class SchedulingPolicy:
    """Base class. Subclasses implement `schedule(step)`; `reserved_blocks` lists pool
    blocks the policy keeps for itself (padding), never handed to a request."""

    name = "base"
    reserved_blocks: tuple[int, ...] = ()
    # True for a policy whose batches carry a padded, rectangular layout (`left_pad_blocks`,
    # `tkvs`: spyre's); attention with options (sliding windows, sinks, soft-capping) refuses it.
    pads_batches: bool = False
    # The policy's own settings: an attrs class read from `Config.additional_config`
    # (atom_core/plugins/options.py); `self.options` is its instance, None without one.
    options_class: type | None = None

    def __init__(self, config: Config):
        self.config = config
        self.options: Any = plugin_options(type(self), getattr(config, "additional_config", None))

    def schedule(self, step: StepBuilder) -> None:
        raise NotImplementedError

    def unschedulable_reason(self, seq: Sequence) -> str | None:
        """Why `seq` can never run under this policy (it then finishes at once), or None."""
        return None


class StepBuilder:
    """One step under construction. Rows are recorded in call order; the batch puts decode rows first."""

    def __init__(self, scheduler: Scheduler):
        self._sched = scheduler
        cfg = scheduler.config
        self.budget: int = cfg.max_num_batched_tokens  # tokens left this step
        self.block_size = cfg.kv_cache_block_size
        self._chunked = cfg.enable_chunked_prefill
        self._threshold = cfg.long_prefill_token_threshold
        self._max_seqs = cfg.max_num_seqs
        # The rows so far, as parallel lists: request, tokens, first position computed.
        self.seqs: list[Sequence] = []
        self.num_tokens: list[int] = []
        self.firsts: list[int] = []
        self.num_prefill_rows = 0
        self._scheduled: set[int] = set()
        self.num_preempted = 0
        self._delay_passed: bool | None = None
        # Set by policies that pad (spyre), keyed by request id; the batch lists them in row order.
        self.left_pad_blocks: dict[int, int] | None = None
        self.tkvs: dict[int, int] | None = None
        self.pad_block: int | None = None

    # -- what the policy can see -------------------------------------------------------

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_running(self) -> int:
        return len(self._sched.running)

    def decoding(self) -> list[Sequence]:
        """Running requests whose prompt is done, in running order."""
        return [s for s in self._sched.running if s.type is SequenceType.DECODE]

    def prefilling(self) -> list[Sequence]:
        """Running requests partway through their prompt (chunked prefill), in running order."""
        return [s for s in self._sched.running if s.type is SequenceType.PREFILL]

    def peek_waiting(self) -> Sequence | None:
        """The head of the waiting queue; heads that can never run are finished on the way."""
        return self._sched._waiting_head()

    def waiting(self) -> list[Sequence]:
        """The waiting requests in arrival order (preempted ones first): for policies that admit out of order."""
        self._sched._waiting_head()
        return list(self._sched.waiting)

    def num_prefix_cached_tokens(self, seq: Sequence) -> int:
        return self._sched.block_manager.num_prefix_cached_tokens(seq)

    def can_resume_at(self, seq: Sequence, position: int) -> bool:
        """Whether a waiting request may be admitted with `start=position` (recomputing part of its
        cached prefix): a request with per-request state resumes only where a state checkpoint is."""
        return self._sched.block_manager.can_resume_at(seq, position)

    # -- the chunk rule ------------------------------------------------------------------

    def chunk(self, remaining: int) -> int:
        """How many of a prompt's `remaining` tokens fit this step.

        Over what is left of the budget (or `long_prefill_token_threshold`), the chunk is
        truncated and floored to whole blocks, unless that would leave the step empty.
        With chunking off, a prompt runs whole or waits; first in a step it runs whole
        even past the budget (alone).
        """
        if not self._chunked:
            if remaining <= self.budget or self.is_empty:
                return remaining
            return 0
        cap = self.budget
        if self._threshold:
            cap = min(cap, self._threshold)
        if remaining <= cap:
            return remaining
        n = cap // self.block_size * self.block_size
        if n == 0 and self.is_empty:
            n = cap
        return n

    # -- adding rows ---------------------------------------------------------------------

    def schedule(self, seq: Sequence, num_tokens: int | None = None, preempt: bool = True) -> int:
        """Schedule a running request: its next prompt chunk, or its decode token (plus drafts).

        Returns the tokens scheduled, 0 when it does not fit this step. A request that
        cannot get a block preempts the last running request this step has not
        scheduled, or is preempted itself when none is left; with `preempt=False` it
        waits instead (0), preempting nobody.
        """
        if seq.status != SequenceStatus.RUNNING or seq.id in self._scheduled:
            return 0
        if seq.type is SequenceType.DECODE:  # the last token and its drafts
            n = 1 + len(seq.spec_token_ids)
            if n > self.budget:  # the first row too: a step stays within the budget
                if self.budget < 1:
                    return 0
                params = seq.sampling_params
                if self.seqs and params.seed is not None and not params.is_greedy:
                    # Fewer drafts would change a seeded request's draws (a verified draft draws
                    # unlike a plain sample), so it waits for a step where it comes first, as alone.
                    return 0
                n = self.budget  # verify fewer drafts rather than skip the request
                seq.spec_token_ids = seq.spec_token_ids[: n - 1]
                if seq.spec_token_probs is not None:
                    seq.spec_token_probs = seq.spec_token_probs[: n - 1]
        else:
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = self.chunk(remaining) if num_tokens is None else min(num_tokens, remaining)
            if n <= 0:
                return 0
        sched = self._sched
        bm = sched.block_manager
        first = seq.num_computed_tokens
        while not bm.try_append(seq, n):
            if not preempt:
                return 0
            victim = self._preemption_victim(seq)
            sched.preempt(victim)
            self.num_preempted += 1
            if victim is seq:
                return 0
        self._add(seq, n, first)
        return n

    def schedule_all(self, seqs: list[Sequence]) -> None:
        """`schedule(seq)` for each of `seqs`, in order: the hot path of every decode step."""
        sched = self._sched
        try_append = sched.block_manager.try_append
        rows, scheduled = self.seqs, self._scheduled
        num_tokens, firsts = self.num_tokens, self.firsts
        running, decode = SequenceStatus.RUNNING, SequenceType.DECODE
        for seq in seqs:
            if seq.type is not decode or seq.spec_token_ids:
                self.schedule(seq)  # prompt chunks and drafts take the general path
                continue
            if seq.status is not running or seq.id in scheduled or (rows and self.budget < 1):
                continue
            first = seq.num_computed_tokens
            if not try_append(seq, 1):
                self.schedule(seq)  # no block: the general path preempts
                continue
            rows.append(seq)
            num_tokens.append(1)
            firsts.append(first)
            scheduled.add(seq.id)
            self.budget -= 1

    def admit(self, seq: Sequence | None = None, num_tokens: int | None = None, start: int | None = None) -> int:
        """Move a waiting request (default: the head of the queue) to running with its first chunk.

        Returns the tokens scheduled, 0 when it cannot start now (no slot under
        `max_num_seqs`, no blocks, no budget, the delay factor, or a preemption already
        made this step). The built-in policies admit FIFO and stop at the first 0.
        `start` lets a policy recompute part of a cached prefix (see `BlockManager.allocate`).
        """
        sched = self._sched
        head = sched._waiting_head()
        if seq is None:
            seq = head
        elif seq.status != SequenceStatus.WAITING or sched._unschedulable_reason(seq) is not None:
            return 0
        if seq is None or len(sched.running) >= self._max_seqs:
            return 0
        if self.num_preempted and self.seqs:
            return 0  # what was just preempted must not come straight back
        if self._delay_passed is None:
            self._delay_passed = sched._passed_delay(time.perf_counter())
        if not self._delay_passed:
            return 0
        bm = sched.block_manager
        first = bm.num_prefix_cached_tokens(seq) if start is None else start
        remaining = seq.num_tokens - first
        n = self.chunk(remaining) if num_tokens is None else min(num_tokens, remaining)
        if n <= 0 or not bm.can_allocate(seq, n, start):
            return 0
        bm.allocate(seq, n, start)
        if seq is head:
            sched.waiting.popleft()
        else:
            sched.waiting.remove(seq)
        sched.running.append(seq)
        seq.status = SequenceStatus.RUNNING
        seq.type = SequenceType.PREFILL  # until its first sampled token
        self._add(seq, n, seq.num_computed_tokens - n)
        return n

    def _add(self, seq: Sequence, n: int, first: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)
        self.firsts.append(first)
        if seq.type is not SequenceType.DECODE:
            self.num_prefill_rows += 1
        self._scheduled.add(seq.id)
        self.budget = max(0, self.budget - n)

    def _preemption_victim(self, seq: Sequence) -> Sequence:
        for other in reversed(self._sched.running):
            if other is not seq and other.id not in self._scheduled:
                return other
        return seq
