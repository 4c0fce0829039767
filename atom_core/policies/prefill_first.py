"""`prefill_first`: ATOM's policy. A step runs prompts if any can run, else every decode."""

from __future__ import annotations

from atom_core.policy import SchedulingPolicy, StepBuilder


class PrefillFirstPolicy(SchedulingPolicy):
    """Ongoing chunked prefills first, then FIFO admission; decode waits while prompts run."""

    name = "prefill_first"

    def schedule(self, step: StepBuilder) -> None:
        step.schedule_all(step.prefilling())
        while step.admit():
            pass
        if step.is_empty:
            step.schedule_all(step.decoding())
        if step.is_empty:  # decoding preempted every running request: their blocks are free again
            while step.admit():
                pass
