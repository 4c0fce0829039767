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
from pathlib import Path
from typing import Any

from atom_core.config import Config
from atom_core.distributed.parallel_state import init_tensor_parallel, resolve_backend
from atom_core.executor.executor import DistributedExecutor, threads_per_rank
from atom_core.executor.worker import read_error

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
        world = config.tensor_parallel_size
        store = self.open_store("127.0.0.1", config)
        threads = threads_per_rank(world)
        env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}  # its own rendezvous, not torchrun's
        for rank in range(1, world):
            rank_env = env | self.rank_env(rank, config, store, "127.0.0.1", world, threads)
            rank_env["ATOM_WORKER_ERROR_FILE"] = self._error_file(rank)
            self.processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "atom_core.executor.worker"], env=rank_env, stdin=subprocess.DEVNULL
                )
            )
        self.await_ranks(store, world, self._exited)
        backend = resolve_backend(config.distributed_backend, config.device)
        init_tensor_parallel(
            0, world, backend=backend, timeout_s=config.distributed_timeout, local_world_size=world, store=store
        )

    def _exited(self) -> str | None:
        """A started rank that exited, named; None while all run."""
        for rank, p in enumerate(self.processes, 1):
            if p.poll() is not None:
                return f"tensor-parallel rank {rank} exited with code {p.returncode} while starting"
        return None

    def _error_file(self, rank: int) -> str:
        return str(Path(self._dir) / f"rank{rank}.json")

    def rank_failure(self) -> str | None:
        """What a failed rank reported, given up to `EXIT_GRACE_S` to exit. Its error file comes
        first: a rank writes it before it exits, while its exit code may be lost (where this
        program ignores SIGCHLD, the kernel reaps the ranks and `Popen` reads 0)."""
        deadline = time.monotonic() + EXIT_GRACE_S
        while True:
            running = False
            for rank, p in enumerate(self.processes, 1):
                code = p.poll()  # before the file: a rank seen exited has written all it will
                reported = read_error(self._error_file(rank))
                if reported is not None:
                    return reported
                if code:
                    return f"tensor-parallel rank {rank} exited with code {code}"
                running |= code is None
            if not running or time.monotonic() > deadline:
                return None
            time.sleep(0.02)

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
