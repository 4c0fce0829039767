"""Linear layers whose GEMM is picked once the weights are loaded (vLLM's `process_weights_after_loading`).

On CPU, torch's float32 `F.linear` runs through MKL, which on the AMD EPYC machines we
measure is 1.1-1.6x slower than oneDNN on the model's layer shapes and 2-2.5x slower on
the vocab-sized LM head (`benchmarks/throughput.py`; figures in README). oneDNN takes the
plain row-major weight, so nothing is copied or repacked. Other devices and dtypes keep
`F.linear` (bf16 already runs through oneDNN). A kernel plugin replaces `pick_gemm`.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

Gemm = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def pick_gemm(weight: torch.Tensor) -> Gemm:
    """oneDNN for float32 on CPU (off with ATOM_DISABLE_ONEDNN=1), `F.linear` elsewhere."""
    if (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and not os.environ.get("ATOM_DISABLE_ONEDNN")
    ):
        return _onednn_linear
    return F.linear


class Linear(nn.Linear):
    gemm: Gemm = staticmethod(F.linear)

    def process_weights_after_loading(self) -> None:
        self.gemm = pick_gemm(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Rows of `weight` are the named shards stacked in order: one GEMM instead of three.

    The loader calls `weight_loader(param, tensor, shard)` for each checkpoint tensor a
    model's `packed_modules_mapping` sends here.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shards.items():
            self.shard_offsets[name] = (offset, size)
            offset += size
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        offset, size = self.shard_offsets[shard]
        if loaded.shape[0] != size:
            raise ValueError(f"shard {shard!r} expects {size} rows, the checkpoint tensor has shape {tuple(loaded.shape)}")
        param.data[offset : offset + size].copy_(loaded)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        return list(out.split([s for _, s in self.shard_offsets.values()], dim=-1))
