"""SmolLM3: Llama with NoPE layers (every fourth layer has no rope: `no_rope_layers`)."""

from __future__ import annotations

from atom_core.plugin_api import GGUFArchitecture, GGUFFile
from atom_models.llama import LLAMA_GGUF_PERMUTED, LLAMA_GGUF_TENSORS, LlamaForCausalLM, gguf_attention_config

# llama.cpp's "smollm3" has no key for it: every fourth layer is NoPE, as SmolLM3's releases
# (and transformers' default `no_rope_layer_interval`) have it.
GGUF_NO_ROPE_INTERVAL = 4


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """Llama's layers read `no_rope_layers` (and any sliding window) from the config."""


def _gguf_config(file: GGUFFile, config: dict) -> dict:
    layers = config["num_hidden_layers"]
    return gguf_attention_config(file, config) | {
        "architectures": ["SmolLM3ForCausalLM"],
        "model_type": "smollm3",
        "no_rope_layer_interval": GGUF_NO_ROPE_INTERVAL,
        "no_rope_layers": [int((i + 1) % GGUF_NO_ROPE_INTERVAL != 0) for i in range(layers)],
        "use_sliding_window": False,
    }


# Written as Llama is (Q and K rows permuted for llama.cpp's rope).
GGUF_SMOLLM3 = GGUFArchitecture(_gguf_config, LLAMA_GGUF_TENSORS, LLAMA_GGUF_PERMUTED)
