"""`prefill_first`: AMD ATOM's policy. A step runs prompts if any can run, else every decode."""

from __future__ import annotations

from atom_core.sched.policy import SchedulingPolicy, StepBuilder


class PrefillFirstPolicy(SchedulingPolicy):
    """Ongoing chunked prefills first, then FIFO admission; decode waits while prompts run."""

    name = "prefill_first"

    def schedule(self, step: StepBuilder) -> None:
        # A prompt chunk that needs another request's blocks waits while decodes can run:
        # preempting a decoding request for it made two requests preempt each other in turns.
        prefilling = step.prefilling()
        for seq in prefilling:
            step.schedule(seq, preempt=False)
        while step.admit():
            pass
        if step.is_empty:
            step.schedule_all(step.decoding())
        if step.is_empty:  # nothing decodes: a chunk may preempt now
            step.schedule_all(prefilling)
        if step.is_empty:  # decoding preempted every running request: their blocks are free again
            while step.admit():
                pass
