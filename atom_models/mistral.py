"""Mistral: Llama with a sliding window on every layer (`sliding_window`; None in the releases
since v0.2, which then attend fully) and an explicit head_dim."""

from __future__ import annotations

from atom_models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's layers read the window from the config (`sliding_window_of`)."""
