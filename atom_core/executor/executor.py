"""The boundary between the engine core and the model: one `ModelExecutor` per engine.

`UniProcExecutor` is one rank: the `ModelRunner` in this process. `DistributedExecutor` is
rank 0 of a tensor-parallel group: its runner schedules nothing, but before each step's model
runs it sends the step (`step_message.py`) to the other ranks, which run the same model on their
slices of the weights (`worker.py`); only rank 0 samples, computes log probabilities and
proposes. How the other ranks start is each subclass's: `MultiprocExecutor` ("mp") starts them
on this host, `TorchrunExecutor` ("torchrun") finds them started; a plugin registers more under
"distributed_executors".
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import attrs
import torch

from atom_core.config import Config
from atom_core.distributed.communication import all_gather, broadcast_bytes, enable_shared_memory_collectives
from atom_core.distributed.parallel_state import (
    ParallelGroup,
    destroy_tensor_parallel,
    get_tp_group,
    resolve_backend,
    use_group,
)
from atom_core.executor.step_message import send_shutdown, send_step
from atom_core.runner.model_runner import ModelRunner
from atom_core.sched.batch import ScheduledBatch, ScheduledBatchOutput
from atom_core.sequence import Sequence

logger = logging.getLogger(__name__)

# How long the ranks an executor starts may take to come up (import torch and Atom) and say so.
STARTUP_TIMEOUT_S = 300.0
# What each such rank sets in rank 0's store once it is up (`worker.join`).
READY_KEY = "atom_worker_ready_{rank}"


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed (or the group is gone): the engine cannot run more steps."""


class ModelExecutor:
    """Runs each scheduled batch on every rank; `runner` is this process's (rank 0's), built and
    stepped in the executor's own `group` (whatever group another engine of this process uses)."""

    runner: ModelRunner
    group: ParallelGroup

    def execute(self, batch: ScheduledBatch, seqs: dict[int, Sequence]) -> ScheduledBatchOutput:
        with use_group(self.group):
            return self.runner.forward(batch, seqs)

    def close(self) -> None:
        """Stop the other ranks, if any, and leave their group; idempotent."""


class UniProcExecutor(ModelExecutor):
    """One rank."""

    def __init__(self, config: Config, hf_config: Any):
        with use_group(ParallelGroup()):
            self.runner = ModelRunner(config, hf_config)
            self.group = get_tp_group()


def config_json(config: Config) -> bytes:
    """The engine's resolved `Config` as the other ranks receive it (JSON, not pickle)."""
    return json.dumps(attrs.asdict(config)).encode()


def config_from_json(data: bytes) -> Config:
    return Config(**json.loads(data))


def gather_pool_sizes(runner: ModelRunner) -> list[tuple[int, int]]:
    """(KV blocks, bytes of KV and state) of every rank's pool, in rank order: each rank calls it
    once its runner is built, and rank 0 checks they agree."""
    nbytes = sum(t.nbytes for t in runner.kv_cache_tensors.values())
    nbytes += sum(t.nbytes for t in runner.per_req_cache_tensors.values())
    mine = torch.tensor([[runner.kv_plan.num_blocks, nbytes]], dtype=torch.int64)
    return [(int(b), int(n)) for b, n in all_gather(mine, dim=0).tolist()]


def threads_per_rank(ranks_here: int) -> int:
    """This process's torch threads (all cores, or an engine core's share under data parallel, or
    what torchrun's OMP_NUM_THREADS says) shared among the ranks on this host, at least one each."""
    return max(1, torch.get_num_threads() // ranks_here)


class DistributedExecutor(ModelExecutor):
    """Rank 0 of `config.tensor_parallel_size` ranks. Subclasses start or find the other ranks and
    form the group in `join_group`; the rest (the config sent out, each step sent, a failed rank
    named, the group stopped) is here."""

    def __init__(self, config: Config, hf_config: Any):
        self.world_size = config.tensor_parallel_size
        self.failure: str | None = None  # set once a rank failed: the engine runs no more steps
        self._closed = False
        self._threads = torch.get_num_threads()
        self.group = ParallelGroup()
        with use_group(self.group):  # this engine's group, not another engine's of this process
            try:
                self.join_group(config)
                tp = get_tp_group()
                torch.set_num_threads(threads_per_rank(tp.local_world_size))
                enable_shared_memory_collectives(config.distributed_timeout)
                broadcast_bytes(config_json(config))
                self.runner = ModelRunner(config, hf_config)
                # each rank's (blocks, bytes): every rank allocated rank 0's block count
                self.rank_pools = gather_pool_sizes(self.runner)
                if len({blocks for blocks, _ in self.rank_pools}) != 1:
                    raise TensorParallelError(
                        f"the ranks' KV pools disagree: (blocks, bytes) per rank {self.rank_pools}"
                    )
                self.group = get_tp_group()
            except BaseException as e:
                self.group = get_tp_group()
                # A setting the model refuses fails every rank alike: rank 0's own error says it.
                # Anything else may be another rank's failure seen through a collective.
                failure = None if isinstance(e, (ValueError, TypeError)) else self.rank_failure()
                self.failure = failure or f"rank 0 failed while starting: {type(e).__name__}: {e}"
                self.close()
                if failure is not None:
                    raise TensorParallelError(failure) from e
                raise
        self.runner.announce = send_step
        logger.info(
            "atom: tensor parallel over %d ranks (%s executor), %d threads a rank on this host",
            self.world_size, config.distributed_executor, torch.get_num_threads(),
        )  # fmt: skip

    def join_group(self, config: Config) -> None:
        """Start or find the other ranks and `init_tensor_parallel` as rank 0."""
        raise NotImplementedError

    # -- for executors that start the other ranks themselves (the "mp" and "ray" ones) --------

    @staticmethod
    def open_store(host: str, config: Config) -> Any:
        """Rank 0's `TCPStore` on `host`, on a free port: where the ranks it starts meet it."""
        import torch.distributed as dist

        return dist.TCPStore(
            host, 0, config.tensor_parallel_size, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=config.distributed_timeout),
        )  # fmt: skip

    @staticmethod
    def rank_env(rank: int, config: Config, store: Any, host: str, ranks_here: int, threads: int) -> dict[str, str]:
        """The environment `worker.run_worker` reads, for rank `rank` of the group `store` meets."""
        return {
            "RANK": str(rank), "WORLD_SIZE": str(config.tensor_parallel_size), "LOCAL_WORLD_SIZE": str(ranks_here),
            "MASTER_ADDR": host, "MASTER_PORT": str(store.port),
            "ATOM_DISTRIBUTED_BACKEND": resolve_backend(config.distributed_backend, config.device),
            "ATOM_DISTRIBUTED_TIMEOUT": str(config.distributed_timeout), "ATOM_WORKER_THREADS": str(threads),
        }  # fmt: skip

    def await_ranks(self, store: Any, world: int, ended: Callable[[], str | None]) -> None:
        """Wait until each rank it started says it is up, before anyone waits in a rendezvous;
        `ended()` names a rank that ended instead (then what it reported is raised)."""
        keys = [READY_KEY.format(rank=r) for r in range(1, world)]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not store.check(keys):
            gone = ended()
            if gone is not None:
                raise TensorParallelError(self.rank_failure() or gone)
            if time.monotonic() > deadline:
                raise TensorParallelError(f"the tensor-parallel ranks did not start within {STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def rank_failure(self) -> str | None:
        """What a failed rank reported (None if none is known to have failed)."""
        return None

    def execute(self, batch: ScheduledBatch, seqs: dict[int, Sequence]) -> ScheduledBatchOutput:
        if self.failure is not None:
            raise TensorParallelError(f"the tensor-parallel group is down: {self.failure}")
        if self._closed:
            raise TensorParallelError("the engine is closed")
        try:
            return super().execute(batch, seqs)
        except BaseException as e:
            # The ranks' collectives no longer line up: stop them all.
            self.failure = self.rank_failure() or f"rank 0 failed during a step: {type(e).__name__}: {e}"
            self.close()
            raise TensorParallelError(self.failure) from e

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with use_group(self.group):
            if self.failure is None and self.group.world_size > 1:
                try:
                    send_shutdown()
                except Exception:  # a rank already gone: stopped below
                    pass
            destroy_tensor_parallel()
        self.group = ParallelGroup()
        torch.set_num_threads(self._threads)
        self.stop_ranks()

    def stop_ranks(self) -> None:
        """Wait for (or end) the ranks this executor started."""


def make_executor(config: Config, hf_config: Any) -> ModelExecutor:
    """One rank: this process's runner. More: the "distributed_executors" class `config` names."""
    if config.tensor_parallel_size == 1:
        return UniProcExecutor(config, hf_config)
    from atom_core.plugins.manager import get_registry

    return get_registry("distributed_executors").get(config.distributed_executor)(config, hf_config)
