"""Which tensor-parallel rank this process is, and its torch.distributed groups.

One rank (the default) touches nothing of torch.distributed: every collective in
`communication.py` returns its input. `init_tensor_parallel` forms the group (gloo on CPU,
NCCL on CUDA, through torch.distributed's own rendezvous: a `tcp://` or `file://` init
method, or torchrun's environment with `env://`).

Two groups over the same ranks: `group`, for the model's collectives, fails a collective
that waits longer than `timeout_s`; `control`, on which rank 0 broadcasts each step, does not
time out, since the other ranks wait on it for as long as the engine sits idle. A rank that
dies closes its sockets, which fails the others' next collective at once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import attrs

BACKENDS = ("gloo", "nccl", "mpi")
# What the step broadcasts wait: the other ranks wait between steps for as long as the engine is idle.
CONTROL_TIMEOUT = timedelta(days=365)


@attrs.define(frozen=True)
class ParallelGroup:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup for the model's collectives; None for one rank
    control: Any = None  # the same ranks, for the step broadcasts (no timeout)
    local_world_size: int = 1  # ranks on this host, which share its memory and cores
    # MoE layers give each rank whole experts (`Config.enable_expert_parallel`) instead of a
    # slice of every expert's intermediate size; set by the model runner before it builds the model.
    expert_parallel: bool = False
    # `shm_all_reduce.SharedMemoryCollectives` when every rank is on this host (set once joined)
    shm: Any = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0


_tp = ParallelGroup()


def get_tp_group() -> ParallelGroup:
    return _tp


@contextmanager
def use_group(group: ParallelGroup) -> Iterator[None]:
    """Make `group` this process's tensor-parallel group for the block: an engine builds and
    steps its model inside its own, so a one-rank engine and a tensor-parallel one can live in
    one process side by side. What the block sets (expert parallel, shared memory, a new group)
    is read with `get_tp_group()` before it ends."""
    global _tp
    previous, _tp = _tp, group
    try:
        yield
    finally:
        _tp = previous


def resolve_backend(backend: str, device: str) -> str:
    """ "auto": NCCL for CUDA devices, gloo otherwise; else one of `BACKENDS`."""
    if backend == "auto":
        return "nccl" if str(device).startswith("cuda") else "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"distributed_backend must be 'auto' or one of {', '.join(BACKENDS)}, got {backend!r}")
    return backend


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str = "env://", backend: str = "auto", device: str = "cpu",
    timeout_s: float = 300.0, local_world_size: int | None = None, store: Any = None,
) -> ParallelGroup:  # fmt: skip
    """Join a group of `world_size` ranks as `rank` and make it this process's tensor-parallel group.

    `local_world_size`: the ranks on this host (torchrun's LOCAL_WORLD_SIZE; all of them if unset).
    `store`: a `torch.distributed.Store` the ranks already share, instead of `init_method`."""
    global _tp
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of {world_size}")
    if world_size == 1:
        _tp = ParallelGroup()
        return _tp
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a torch.distributed group (another tensor-parallel engine "
            "still open?): close() that engine before making another"
        )
    backend = resolve_backend(backend, device)
    timeout = timedelta(seconds=timeout_s)
    where: dict[str, Any] = {"store": store} if store is not None else {"init_method": init_method}
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout, **where)
    ranks = list(range(world_size))
    group = dist.new_group(ranks, timeout=timeout, backend=backend)
    control = dist.new_group(ranks, timeout=CONTROL_TIMEOUT, backend=backend)
    local = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    _tp = ParallelGroup(rank, world_size, group, control, local)
    return _tp


def set_expert_parallel(enabled: bool) -> None:
    """How MoE layers built from now on split their experts (whole experts per rank or not)."""
    global _tp
    _tp = attrs.evolve(_tp, expert_parallel=enabled and _tp.world_size > 1)


def set_shared_memory(collectives: Any) -> None:
    global _tp
    _tp = attrs.evolve(_tp, shm=collectives)


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
