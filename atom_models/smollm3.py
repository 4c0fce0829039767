"""SmolLM3: Llama with NoPE layers (every fourth layer has no rope: `no_rope_layers`)."""

from __future__ import annotations

from atom_models.llama import LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """Llama's layers read `no_rope_layers` (and any sliding window) from the config."""
