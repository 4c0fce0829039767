"""The collectives parallel layers call, over the tensor-parallel group (no-ops for one rank)."""

from __future__ import annotations

import torch

from atom_core.distributed.parallel_state import get_tp_group


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place; every rank gets the sum."""
    tp = get_tp_group()
    if tp.world_size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, group=tp.group)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's `x` joined along `dim`, in rank order, on every rank."""
    tp = get_tp_group()
    if tp.world_size == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(tp.world_size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=dim)
