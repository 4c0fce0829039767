"""Mixtral: Llama attention; every layer's `block_sparse_moe` is a softmax top-k router whose
weights are always renormalised, over experts stored as w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from typing import Any

from gguf import Keys
from torch import nn

from atom_core.layers import FusedMoE
from atom_core.layers.moe import MIXTRAL_EXPERT_NAMES
from atom_core.plugin_api import GGUFArchitecture, GGUFFile, moe_tensors
from atom_models.llama import (
    LLAMA_GGUF_PERMUTED,
    LLAMA_GGUF_TENSORS,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    gguf_attention_config,
)
from atom_models.sparse_moe import SparseMoeBlock


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, cfg: Any, layer_id: int) -> nn.Module:
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported by Mixtral here; only 'silu'")
        return SparseMoeBlock(
            cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size, renormalize=True
        )


class MixtralModel(LlamaModel):
    layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    model_cls = MixtralModel
    _experts = FusedMoE.checkpoint_mapping(MIXTRAL_EXPERT_NAMES)

    def map_checkpoint_name(self, name: str) -> tuple[str, tuple[str, int] | None] | None:
        """The hub's `block_sparse_moe` is our layers' `mlp` (so Llama's forward serves unchanged)."""
        if ".block_sparse_moe." not in name:
            return None
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return self._experts(name) or (name, None)


# --- GGUF (atom_core/loading/gguf/architecture.py): written as "llama" with experts (GGUF_LLAMA picks this) ----

MIXTRAL_GGUF_TENSORS = LLAMA_GGUF_TENSORS | moe_tensors("block_sparse_moe", MIXTRAL_EXPERT_NAMES)


def _gguf_config(file: GGUFFile, config: dict) -> dict:
    return gguf_attention_config(file, config) | {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": int(file.get(Keys.LLM.EXPERT_COUNT, required=True)),
        "num_experts_per_tok": int(file.get(Keys.LLM.EXPERT_USED_COUNT, required=True)),
        "sliding_window": None,  # llama-arch files carry none
    }


GGUF_MIXTRAL = GGUFArchitecture(_gguf_config, MIXTRAL_GGUF_TENSORS, LLAMA_GGUF_PERMUTED)
