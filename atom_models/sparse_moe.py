"""The softmax-routed sparse MoE block Qwen3-MoE and Mixtral share: a `gate` Linear router and stacked `experts`."""

from __future__ import annotations

import torch
from torch import nn

from atom_core.layers import FusedMoE, Linear, select_experts


class SparseMoeBlock(nn.Module):
    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, *, renormalize: bool,
        reduce_results: bool = True,
    ):  # fmt: skip
        """`reduce_results=False`: the tensor-parallel ranks' outputs are left for the caller to sum."""
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.gate.quantizable = False  # routing is discrete: a small layer kept exact (as vLLM does)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, reduce_results=reduce_results)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(h), self.top_k, "softmax", renormalize=self.renormalize)
        return self.experts(h, weights, ids)
