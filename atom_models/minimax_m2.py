"""MiniMax-M2: Llama-shaped attention whose q and k are RMS-normalised over the whole projection
(all heads at once, not per head) before a partial rope; every layer a sparse MoE block
(`block_sparse_moe`, Mixtral's expert names w1/w3/w2) routed by sigmoid scores with a
correction bias and no expert groups (DeepSeek-V3's `noaux_tc` with one group)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from atom_core.layers import FusedMoE, RMSNorm, all_reduce, get_tp_group, select_experts, shard_rows
from atom_core.layers.moe import MIXTRAL_EXPERT_NAMES
from atom_models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class ProjectionRMSNorm(RMSNorm):
    """RMSNorm over a whole projection that tensor parallel splits by heads: each rank holds its
    heads' part of the weight, and the mean of squares is summed over the ranks first."""

    def __init__(self, local_size: int, eps: float):
        super().__init__(local_size, eps)
        self.ranks = get_tp_group().world_size
        shard_rows(self.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if self.ranks == 1:
            return super().forward(x, residual)
        h = x.float()
        square_sum = all_reduce(h.pow(2).sum(-1, keepdim=True))
        h = h * torch.rsqrt(square_sum / (h.shape[-1] * self.ranks) + self.eps)
        return (h * self.weight.float()).to(x.dtype)


class MiniMaxM2Attention(LlamaAttention):
    def __init__(self, cfg: Any, layer_id: int):
        super().__init__(cfg, layer_id)
        eps, d = cfg.rms_norm_eps, self.head_dim
        self.q_norm = ProjectionRMSNorm(self.num_heads * d, eps)
        self.k_norm = ProjectionRMSNorm(self.num_kv_heads * d, eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, d, nq, nkv = h.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(h)
        q = self.q_norm(qkv[:, : nq * d].contiguous()).view(n, nq, d)
        k = self.k_norm(qkv[:, nq * d : (nq + nkv) * d].contiguous()).view(n, nkv, d)
        v = qkv[:, (nq + nkv) * d :]
        return self.o_proj(self.attn(self.rope(q, cos, sin), self.rope(k, cos, sin), v))


class MiniMaxM2Gate(nn.Module):
    def __init__(self, cfg: Any):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_local_experts, cfg.hidden_size), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(h, self.weight)


class MiniMaxM2SparseMoeBlock(nn.Module):
    def __init__(self, cfg: Any):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = MiniMaxM2Gate(cfg)
        # float32 whatever the model's dtype: it decides near ties
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(cfg.num_local_experts, dtype=torch.float32), requires_grad=False
        )
        self.experts = FusedMoE(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(
            self.gate(h), self.top_k, "noaux_tc", renormalize=True, routed_scaling_factor=1.0,
            correction_bias=self.e_score_correction_bias,
        )  # fmt: skip
        return self.experts(h, weights, ids)


class MiniMaxM2DecoderLayer(LlamaDecoderLayer):
    attention_cls = MiniMaxM2Attention

    def make_mlp(self, cfg: Any, layer_id: int) -> nn.Module:
        return MiniMaxM2SparseMoeBlock(cfg)


class MiniMaxM2Model(LlamaModel):
    layer_cls = MiniMaxM2DecoderLayer


class MiniMaxM2ForCausalLM(LlamaForCausalLM):
    model_cls = MiniMaxM2Model
    _experts = FusedMoE.checkpoint_mapping(MIXTRAL_EXPERT_NAMES)

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        """The hub's `block_sparse_moe` is our layers' `mlp`; per-expert w1/w3/w2 -> stacked experts."""
        if ".block_sparse_moe." not in name:
            return None
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return self._experts(name) or (name, None)
