"""The "mp" executor: rank 0 starts the other ranks on this host, as `python -m
atom_core.executor.worker` processes, and meets them through a `TCPStore` on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

from atom_core.config import Config
from atom_core.distributed.parallel_state import init_tensor_parallel, resolve_backend
from atom_core.executor.executor import DistributedExecutor, TensorParallelError, threads_per_rank
from atom_core.executor.worker import READY_KEY, read_error

# How long the other ranks may take to start (import torch and Atom) and say so.
STARTUP_TIMEOUT_S = 300.0
# How long a failed rank may take to exit after rank 0 saw its sockets close.
EXIT_GRACE_S = 5.0


class MultiprocExecutor(DistributedExecutor):
    def __init__(self, config: Config, hf_config: Any):
        self.processes: list[subprocess.Popen] = []
        self._dir = tempfile.mkdtemp(prefix="atom-tp-")
        # An engine dropped without close(), or the interpreter's exit, still ends its ranks.
        weakref.finalize(self, _kill, self.processes)
        super().__init__(config, hf_config)

    def join_group(self, config: Config) -> None:
        import torch.distributed as dist

        world = config.tensor_parallel_size
        backend = resolve_backend(config.distributed_backend, config.device)
        store = dist.TCPStore(
            "127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=config.distributed_timeout),
        )  # fmt: skip
        env = {
            **os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "ATOM_DISTRIBUTED_BACKEND": backend,
            "ATOM_DISTRIBUTED_TIMEOUT": str(config.distributed_timeout),
            "ATOM_WORKER_THREADS": str(threads_per_rank(world)),
        }  # fmt: skip
        env.pop("TORCHELASTIC_RUN_ID", None)
        for rank in range(1, world):
            rank_env = env | {"RANK": str(rank), "ATOM_WORKER_ERROR_FILE": self._error_file(rank)}
            self.processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "atom_core.executor.worker"], env=rank_env, stdin=subprocess.DEVNULL
                )
            )
        keys = [READY_KEY.format(rank=r) for r in range(1, world)]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not store.check(keys):  # each worker says it is up before anyone waits in a rendezvous
            for rank, p in enumerate(self.processes, 1):
                if p.poll() is not None:
                    raise TensorParallelError(
                        self.rank_failure()
                        or f"tensor-parallel rank {rank} exited with code {p.returncode} while starting"
                    )
            if time.monotonic() > deadline:
                raise TensorParallelError(f"the tensor-parallel ranks did not start within {STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
        init_tensor_parallel(
            0, world, backend=backend, timeout_s=config.distributed_timeout, local_world_size=world, store=store
        )

    def _error_file(self, rank: int) -> str:
        return str(Path(self._dir) / f"rank{rank}.json")

    def rank_failure(self) -> str | None:
        deadline = time.monotonic() + EXIT_GRACE_S
        for rank, p in enumerate(self.processes, 1):
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                continue
            if p.returncode:
                return (
                    read_error(self._error_file(rank)) or f"tensor-parallel rank {rank} exited with code {p.returncode}"
                )
        return None

    def stop_ranks(self) -> None:
        for p in self.processes:
            if self.failure is not None:  # the others may wait in a collective that never completes
                p.kill()
            try:
                p.wait(EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


def _kill(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        if p.poll() is None:
            p.kill()
            p.wait()
