"""The "torchrun" executor: torchrun started every rank, here or on other hosts, and set the
rendezvous in the environment (`env://`). Rank 0 runs the engine; every other rank runs
`atom worker` (an engine made on such a rank serves as that worker and exits with it)."""

from __future__ import annotations

import os
import sys
from typing import Any

from atom_core.config import Config
from atom_core.distributed.parallel_state import init_tensor_parallel, resolve_backend
from atom_core.executor.executor import DistributedExecutor


class TorchrunExecutor(DistributedExecutor):
    def __init__(self, config: Config, hf_config: Any):
        world = os.environ.get("WORLD_SIZE")
        if world is None or "RANK" not in os.environ:
            raise ValueError(
                "distributed_executor='torchrun' needs the environment torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR, "
                "MASTER_PORT); start this program with torchrun, or use distributed_executor='mp'"
            )
        if int(world) != config.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size={config.tensor_parallel_size}, but torchrun started WORLD_SIZE={world} ranks"
            )
        if int(os.environ["RANK"]) != 0:  # this rank is a worker: serve rank 0, then end with it
            from atom_core.executor.worker import run_worker

            os.environ.setdefault(
                "ATOM_DISTRIBUTED_BACKEND", resolve_backend(config.distributed_backend, config.device)
            )
            os.environ.setdefault("ATOM_DISTRIBUTED_TIMEOUT", str(config.distributed_timeout))
            sys.exit(run_worker())
        super().__init__(config, hf_config)

    def join_group(self, config: Config) -> None:
        backend = resolve_backend(config.distributed_backend, config.device)
        init_tensor_parallel(0, config.tensor_parallel_size, "env://", backend, timeout_s=config.distributed_timeout)
