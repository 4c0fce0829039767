"""Torch building blocks that model plugins share (they import torch; `atom_core` does not)."""

from atom_core.layers.attention import Attention
from atom_core.layers.embed_head import compute_logits, lm_head, vocab_embedding
from atom_core.layers.linear import (
    ColumnParallelLinear,
    Linear,
    MergedColumnParallelLinear,
    MergedLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from atom_core.layers.mla import MLAAttention
from atom_core.layers.moe import FusedMoE, register_router, select_experts
from atom_core.layers.norm import RMSNorm
from atom_core.layers.ops import add_rms_norm, apply_rotary, apply_rotary_interleaved, rms_norm, silu_and_mul
from atom_core.layers.rotary import RotaryEmbedding, get_rope

__all__ = [
    "Attention",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "RowParallelLinear",
    "compute_logits",
    "lm_head",
    "vocab_embedding",
    "FusedMoE",
    "Linear",
    "MLAAttention",
    "MergedLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "add_rms_norm",
    "apply_rotary",
    "apply_rotary_interleaved",
    "get_rope",
    "register_router",
    "rms_norm",
    "select_experts",
    "silu_and_mul",
]
