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
from typing import Any

import attrs
import torch

from atom_core.config import Config
from atom_core.distributed.communication import all_gather, broadcast_bytes, enable_shared_memory_collectives
from atom_core.distributed.parallel_state import ParallelGroup, destroy_tensor_parallel, get_tp_group, use_group
from atom_core.executor.step_message import send_shutdown, send_step
from atom_core.runner.model_runner import ModelRunner
from atom_core.sched.batch import ScheduledBatch, ScheduledBatchOutput
from atom_core.sequence import Sequence

logger = logging.getLogger(__name__)


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed (or the group is gone): the engine cannot run more steps."""


class ModelExecutor:
    """Runs each scheduled batch on every rank; `runner` is this process's (rank 0's)."""

    runner: ModelRunner

    def execute(self, batch: ScheduledBatch, seqs: dict[int, Sequence]) -> ScheduledBatchOutput:
        return self.runner.forward(batch, seqs)

    def close(self) -> None:
        """Stop the other ranks, if any, and leave their group; idempotent."""


class UniProcExecutor(ModelExecutor):
    """One rank, in its own one-rank group (whatever group another engine of this process uses)."""

    def __init__(self, config: Config, hf_config: Any):
        with use_group(ParallelGroup()):
            self.runner = ModelRunner(config, hf_config)
            self.group = get_tp_group()

    def execute(self, batch: ScheduledBatch, seqs: dict[int, Sequence]) -> ScheduledBatchOutput:
        with use_group(self.group):
            return self.runner.forward(batch, seqs)


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

    def rank_failure(self) -> str | None:
        """What a failed rank reported (None if none is known to have failed)."""
        return None

    def execute(self, batch: ScheduledBatch, seqs: dict[int, Sequence]) -> ScheduledBatchOutput:
        if self.failure is not None:
            raise TensorParallelError(f"the tensor-parallel group is down: {self.failure}")
        if self._closed:
            raise TensorParallelError("the engine is closed")
        try:
            with use_group(self.group):
                return self.runner.forward(batch, seqs)
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
