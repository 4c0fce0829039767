"""Qwen3-MoE: Qwen3 attention; each layer's MLP is a softmax-routed sparse MoE block, or a dense
MLP for layers in `mlp_only_layers` or off the `decoder_sparse_step` stride (as transformers)."""

from __future__ import annotations

from typing import Any

from gguf import MODEL_TENSOR as T
from gguf import Keys
from torch import nn

from atom_core.layers import FusedMoE
from atom_core.layers.moe import QWEN_EXPERT_NAMES
from atom_core.plugin_api import GGUFArchitecture, GGUFFile, moe_tensors
from atom_models.llama import LlamaMLP
from atom_models.qwen3 import (
    QWEN3_GGUF_TENSORS,
    Qwen3DecoderLayer,
    Qwen3ForCausalLM,
    Qwen3Model,
    qwen3_gguf_config,
)
from atom_models.sparse_moe import SparseMoeBlock


def is_sparse_layer(cfg: Any, layer_id: int) -> bool:
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return (
        layer_id not in (getattr(cfg, "mlp_only_layers", None) or [])
        and cfg.num_experts > 0
        and (layer_id + 1) % step == 0
    )


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, cfg: Any, layer_id: int) -> nn.Module:
        if not is_sparse_layer(cfg, layer_id):
            return LlamaMLP.from_config(cfg)
        return SparseMoeBlock(
            cfg.hidden_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            renormalize=bool(getattr(cfg, "norm_topk_prob", False)),  # transformers' default: off
        )


class Qwen3MoeModel(Qwen3Model):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    model_cls = Qwen3MoeModel
    # hub per-expert `mlp.experts.{e}.gate_proj|up_proj|down_proj` -> stacked experts
    map_checkpoint_name = FusedMoE.checkpoint_mapping()


# --- GGUF (atom_core/loading/gguf/architecture.py): Qwen3 plus the router and the stacked experts -------------

QWEN3_MOE_GGUF_TENSORS = QWEN3_GGUF_TENSORS | moe_tensors("mlp", QWEN_EXPERT_NAMES)


def _gguf_config(file: GGUFFile, config: dict) -> dict:
    sparse = file.layers_with(T.FFN_GATE_INP)
    return qwen3_gguf_config(file, config) | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": int(file.get(Keys.LLM.EXPERT_COUNT, required=True)),
        "num_experts_per_tok": int(file.get(Keys.LLM.EXPERT_USED_COUNT, required=True)),
        "moe_intermediate_size": int(file.get(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, required=True)),
        # llama.cpp's qwen3moe always renormalises the top-k weights; the file may say otherwise.
        "norm_topk_prob": bool(file.get(Keys.LLM.EXPERT_WEIGHTS_NORM, True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [b for b in range(file.block_count) if b not in sparse],
    }


GGUF_QWEN3_MOE = GGUFArchitecture(_gguf_config, QWEN3_MOE_GGUF_TENSORS)
