"""DeepSeek-R1's (and QwQ's, and the Qwen3 "Thinking" models'): the chat template writes
`<think>` into the prompt, so every reply opens in reasoning, up to `</think>` (a reply that
never closes it, cut by max_tokens, is all reasoning)."""

from __future__ import annotations

from atom_core.serve.reasoning_parser import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    def opens_in_reasoning(self, text: str) -> bool:
        return True
