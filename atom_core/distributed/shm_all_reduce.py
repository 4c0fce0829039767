"""All-reduce and all-gather through shared memory, for tensor-parallel ranks that share one host.

gloo's collectives go through loopback TCP and cost most of a millisecond each, whatever their
size; a decode step makes two per layer. Here each rank copies its tensor into its own slot of
one shared segment, raises its flag to the call's number, waits until every rank has raised
its flag, and sums (or joins) the slots in rank order. Every rank therefore gets the same bits,
and a call costs a few microseconds. vLLM's CPU backend does the same. Two sets of slots take
turns: a rank starts call n + 1 only after every rank has finished reading call n - 1's set.

Set up by `communication.enable_shared_memory_collectives` when every rank is on this host, and
used by its collectives for CPU tensors up to `SLOT_BYTES`.
Anything larger, or ranks on several hosts, or another device, takes torch.distributed.
A rank that waits checks now and then that its peers are alive, so a dead rank is an error
within a second or so, not a wait of `distributed_timeout` seconds.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch

# Bytes of one rank's slot: a 2,048-token prefill's hidden states at 576 float32 fit.
SLOT_BYTES = 8 << 20
_FLAG_STRIDE = 8  # int64s per rank's flag: one cache line each
_SPINS_BEFORE_YIELD = 200


class SharedMemoryCollectives:
    """One segment shared by `world_size` ranks on this host (made by `enable`)."""

    def __init__(self, rank: int, world_size: int, path: str, create: bool, timeout_s: float):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        header = world_size * _FLAG_STRIDE * 8 * 2  # flags, then pids
        size = header + 2 * world_size * SLOT_BYTES
        if create:
            with open(path, "xb") as f:
                f.truncate(size)
        raw = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        self._raw = raw  # keeps the mapping alive
        words = raw[:header].view(torch.int64).numpy().reshape(2, world_size, _FLAG_STRIDE)
        self.flags, self.pids = words[0, :, 0], words[1, :, 0]
        self.slots = raw[header:].view(2, world_size, SLOT_BYTES)
        self.pids[rank] = os.getpid()
        self.seq = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= SLOT_BYTES

    def _post(self, x: torch.Tensor) -> torch.Tensor:
        """Copy `x` into this rank's slot, say so, wait for the others; the call's slots."""
        self.seq += 1
        slots = self.slots[self.seq & 1]
        n = x.numel() * x.element_size()
        slots[self.rank, :n].view(x.dtype).view(x.shape).copy_(x)
        self.flags[self.rank] = self.seq  # after the data: x86 keeps stores in order
        self._wait(self.seq)
        return slots[:, :n]

    def _wait(self, seq: int) -> None:
        flags = self.flags
        spins = 0
        deadline = None
        while flags.min() < seq:
            spins += 1
            if spins % _SPINS_BEFORE_YIELD == 0:
                os.sched_yield()  # more ranks than cores: let the one we wait for run
                now = time.monotonic()
                if deadline is None:
                    deadline, next_check = now + self.timeout_s, now + 0.5
                elif now > next_check:
                    self._check_peers(seq)
                    next_check = now + 0.5
                    if now > deadline:
                        raise RuntimeError(
                            f"shared-memory collective {seq}: ranks {np.nonzero(flags < seq)[0].tolist()} did not "
                            f"arrive within distributed_timeout={self.timeout_s} s"
                        )

    def _check_peers(self, seq: int) -> None:
        for r in np.nonzero(self.flags < seq)[0].tolist():
            pid = int(self.pids[r])
            if not _alive(pid):
                raise RuntimeError(
                    f"tensor-parallel rank {r} (pid {pid}) is gone; a shared-memory collective waited for it"
                )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's `x`, in rank order, written into `x`."""
        parts = self._post(x)
        acc = parts[0].view(x.dtype).clone()
        for r in range(1, self.world_size):
            acc += parts[r].view(x.dtype)
        return x.copy_(acc.view(x.shape))

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        parts = self._post(x.contiguous())
        return torch.cat([parts[r].view(x.dtype).view(x.shape) for r in range(self.world_size)], dim=dim)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
