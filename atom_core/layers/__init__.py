"""Torch building blocks that model plugins share (they import torch; `atom_core` does not).

Tensor parallel (docs/parallel.md): the parallel linears, `vocab_embedding` / `lm_head` /
`compute_logits`, `shard_rows` for a plain parameter, and the group (`get_tp_group`, `divide`,
`all_reduce`, `all_gather`); at one rank each is its plain counterpart.
"""

from atom_core.distributed.communication import all_gather, all_reduce
from atom_core.distributed.parallel_state import divide, get_tp_group
from atom_core.layers.attention import Attention
from atom_core.layers.embed_head import compute_logits, lm_head, vocab_embedding
from atom_core.layers.linear import (
    ColumnParallelLinear,
    Linear,
    MergedColumnParallelLinear,
    MergedLinear,
    QKVParallelLinear,
    RowParallelLinear,
    shard_rows,
)
from atom_core.layers.mla import MLAAttention
from atom_core.layers.moe import FusedMoE, register_router, select_experts
from atom_core.layers.norm import RMSNorm
from atom_core.layers.ops import (
    act_and_mul,
    add_rms_norm,
    apply_rotary,
    apply_rotary_interleaved,
    rms_norm,
    silu_and_mul,
)
from atom_core.layers.rotary import RotaryEmbedding, get_rope

__all__ = [
    "Attention",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "RowParallelLinear",
    "act_and_mul",
    "all_gather",
    "all_reduce",
    "compute_logits",
    "divide",
    "get_tp_group",
    "shard_rows",
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
