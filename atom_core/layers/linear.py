"""A linear layer that several checkpoint tensors fill (q/k/v, gate/up): one GEMM instead of three."""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """Rows of `weight` are the named shards stacked in order.

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
