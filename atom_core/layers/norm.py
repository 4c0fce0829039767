"""RMSNorm computed in float32 and cast back, exactly as transformers does."""

from __future__ import annotations

import torch
from torch import nn

from atom_core.layers.ops import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with a residual, vLLM's fused add: (norm(x + residual), x + residual).

        The add rides along in the norm's pass instead of costing an op of its own; the sum
        may be written into `residual`'s buffer (see `ops.add_rms_norm`).
        """
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
