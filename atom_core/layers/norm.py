"""RMSNorm computed in float32 and cast back, exactly as transformers does."""

from __future__ import annotations

import torch
from torch import nn

from atom_core.layers.ops import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
