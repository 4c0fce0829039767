"""`mixed`: every running decode gets its token first, prompt chunks fill the rest of the budget.

vLLM's default: decode keeps streaming while long prompts are prefilled in chunks, all in
one forward pass.
"""

from __future__ import annotations

from atom_core.sched.policy import SchedulingPolicy, StepBuilder


class MixedPolicy(SchedulingPolicy):
    name = "mixed"

    def schedule(self, step: StepBuilder) -> None:
        if not self.config.enable_chunked_prefill and self._head_needs_a_step_alone(step):
            if step.admit():
                return
        step.schedule_all(step.decoding())
        step.schedule_all(step.prefilling())
        while step.admit():
            pass
        if step.is_empty:  # decoding preempted every running request: their blocks are free again
            while step.admit():
                pass

    def _head_needs_a_step_alone(self, step: StepBuilder) -> bool:
        """Unchunked, a prompt longer than the whole budget runs in a step of its own."""
        head = step.peek_waiting()
        if head is None:
            return False
        return head.num_tokens - step.num_prefix_cached_tokens(head) > self.config.max_num_batched_tokens
