"""Phi-3 (and Phi-3.5, Phi-4-mini): Llama's layers, with q/k/v and gate/up fused on disk
(`qkv_proj`, `gate_up_proj`, which the loader splits into the fused layers' shards),
partial rotary (`partial_rotary_factor`), LongRoPE, and a sliding window in some releases."""

from __future__ import annotations

from atom_models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama's classes read every difference from the config; the checkpoint's fused tensors
    load into the same fused layers (`MergedLinear.load_fused`)."""
