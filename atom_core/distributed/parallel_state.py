"""Which tensor-parallel rank this process is, and its torch.distributed group.

One rank (the default) touches nothing of torch.distributed: every collective in
`communication.py` returns its input. `init_tensor_parallel` forms the group (gloo on CPU,
NCCL on CUDA, through torch.distributed's own rendezvous: a `tcp://` or `file://` init
method, or torchrun's environment with `env://`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import attrs

BACKENDS = ("gloo", "nccl", "mpi")


@attrs.define(frozen=True)
class ParallelGroup:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup; None for one rank

    @property
    def is_first(self) -> bool:
        return self.rank == 0


_tp = ParallelGroup()


def get_tp_group() -> ParallelGroup:
    return _tp


def resolve_backend(backend: str, device: str) -> str:
    """ "auto": NCCL for CUDA devices, gloo otherwise; else one of `BACKENDS`."""
    if backend == "auto":
        return "nccl" if str(device).startswith("cuda") else "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"distributed_backend must be 'auto' or one of {', '.join(BACKENDS)}, got {backend!r}")
    return backend


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str = "env://", backend: str = "auto", device: str = "cpu",
    timeout_s: float = 60.0,
) -> ParallelGroup:  # fmt: skip
    """Join a group of `world_size` ranks as `rank` and make it this process's tensor-parallel group."""
    global _tp
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of {world_size}")
    if world_size == 1:
        _tp = ParallelGroup()
        return _tp
    import torch.distributed as dist

    dist.init_process_group(
        backend=resolve_backend(backend, device), init_method=init_method, rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )  # fmt: skip
    _tp = ParallelGroup(rank, world_size, dist.group.WORLD)
    return _tp


def destroy_tensor_parallel() -> None:
    """Leave the group (if any): a later engine in this process forms its own."""
    global _tp
    if _tp.group is not None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    _tp = ParallelGroup()


def divide(numerator: int, denominator: int, what: str) -> int:
    """`numerator / denominator`, or a ValueError naming both counts."""
    if numerator % denominator:
        raise ValueError(f"{what}: {numerator} does not divide among {denominator} tensor-parallel ranks")
    return numerator // denominator
