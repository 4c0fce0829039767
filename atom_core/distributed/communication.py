"""The collectives parallel layers and the executors call, over the tensor-parallel group
(no-ops for one rank)."""

from __future__ import annotations

import time

import attrs
import torch

from atom_core.distributed.parallel_state import get_tp_group


@attrs.define
class CollectiveStats:
    """The model's collectives this process ran, and the seconds it spent in them (waiting for the
    slowest rank included): what benchmarks/parallel.py reports per step."""

    calls: int = 0
    seconds: float = 0.0


collective_stats = CollectiveStats()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place; every rank gets the sum."""
    tp = get_tp_group()
    if tp.world_size == 1:
        return x
    import torch.distributed as dist

    start = time.perf_counter()
    if tp.shm is not None and tp.shm.fits(x):
        tp.shm.all_reduce(x)
    else:
        dist.all_reduce(x, group=tp.group)
    _count(start)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's `x` joined along `dim`, in rank order, on every rank."""
    tp = get_tp_group()
    if tp.world_size == 1:
        return x
    import torch.distributed as dist

    start = time.perf_counter()
    if tp.shm is not None and tp.shm.fits(x):
        out = tp.shm.all_gather(x, dim)
    else:
        parts = [torch.empty_like(x) for _ in range(tp.world_size)]
        dist.all_gather(parts, x.contiguous(), group=tp.group)
        out = torch.cat(parts, dim=dim)
    _count(start)
    return out


def _count(start: float) -> None:
    collective_stats.calls += 1
    collective_stats.seconds += time.perf_counter() - start


def broadcast_ints(values: list[int] | None, length: int) -> list[int]:
    """Rank 0's `values` (`length` int64s) on every rank, over the control group; the other
    ranks pass None. On CPU tensors: gloo's, and what the executors' step messages are."""
    tp = get_tp_group()
    if tp.world_size == 1:
        assert values is not None
        return list(values)
    import torch.distributed as dist

    if tp.rank == 0:
        assert values is not None and len(values) == length
        t = torch.tensor(values, dtype=torch.int64)
    else:
        t = torch.empty(length, dtype=torch.int64)
    if length:
        dist.broadcast(t, src=0, group=tp.control)
    return t.tolist()


def broadcast_bytes(data: bytes | None) -> bytes:
    """Rank 0's `data` on every rank (its length first), over the control group."""
    (n,) = broadcast_ints([len(data)] if data is not None else None, 1)
    tp = get_tp_group()
    if tp.world_size == 1:
        assert data is not None
        return data
    import torch.distributed as dist

    t = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if tp.rank == 0 and data
        else torch.empty(n, dtype=torch.uint8)
    )
    if n:
        dist.broadcast(t, src=0, group=tp.control)
    return bytes(t.numpy()) if tp.rank else data  # type: ignore[return-value]


def enable_shared_memory_collectives(timeout_s: float) -> bool:
    """Every rank calls this once after joining: when all of them sit on this host, the model's
    collectives go through one shared segment (`shm_all_reduce.py`) instead of gloo's loopback
    TCP. The segment is unlinked once every rank has mapped it, so nothing is left behind even
    after a crash. `ATOM_SHM_COLLECTIVES=0` keeps gloo. Whether it is on."""
    import os
    import uuid
    from pathlib import Path

    from atom_core.distributed.parallel_state import set_shared_memory
    from atom_core.distributed.shm_all_reduce import SharedMemoryCollectives

    tp = get_tp_group()
    if tp.world_size == 1 or tp.local_world_size != tp.world_size or os.environ.get("ATOM_SHM_COLLECTIVES") == "0":
        return False
    where = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    path = str(where / f"atom-tp-{uuid.uuid4().hex}") if tp.is_first else None
    if path is not None:
        collectives = SharedMemoryCollectives(tp.rank, tp.world_size, path, True, timeout_s)
    path = broadcast_bytes(path.encode() if path is not None else None).decode()
    if not tp.is_first:
        collectives = SharedMemoryCollectives(tp.rank, tp.world_size, path, False, timeout_s)
    broadcast_ints([1] if tp.is_first else None, 1)  # every rank has mapped it
    if tp.is_first:
        Path(path).unlink()
    set_shared_memory(collectives)
    return True
