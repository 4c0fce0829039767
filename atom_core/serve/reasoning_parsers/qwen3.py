"""Qwen3's (and Qwen3-MoE's, Qwen3-Next's, Qwen3.5's) thinking: a reply in thinking mode opens
with `<think>`; with `chat_template_kwargs: {"enable_thinking": false}` it has no reasoning
and is all answer."""

from __future__ import annotations

from atom_core.serve.reasoning_parser import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    pass
