"""The "ray" executor (the optional `atom-engine[ray]` extra): Ray places one actor per rank
other than 0 in a placement group, on whichever nodes of the cluster have room, and each actor
runs the same worker as the "mp" executor's processes (`worker.run_worker`) against rank 0's
`TCPStore`; the ranks then form the same torch.distributed group (vLLM's Ray executor does the
same). Ray only places the processes: each step still travels by `dist.broadcast`, and what Ray
carries (each actor's environment, its exit message) is plain strings.

Uses the Ray cluster this process is connected to (`ray.init(address=...)` first), or starts a
local one.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from atom_core.config import Config
from atom_core.distributed.parallel_state import init_tensor_parallel, resolve_backend
from atom_core.executor.executor import STARTUP_TIMEOUT_S, DistributedExecutor, threads_per_rank

# Ray lowers its workers' priority (niceness 15) so that its own services stay responsive; a rank,
# though, steps in lockstep with rank 0, and under any other load on its cores a niced rank gets a
# few percent of a core and every collective waits for it (a two-rank start took minutes beside one
# busy process). The ranks keep the raylet's niceness instead, as Ray's own job drivers do.
RANK_RUNTIME_ENV = {"env_vars": {"RAY_worker_niceness": "0"}}


class RankActor:
    """One rank other than 0, as a Ray actor (made `ray.remote` by the executor)."""

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def run(self, env: dict[str, str]) -> str | None:
        """The rank's whole life; None when it ended cleanly, else what failed."""
        import tempfile

        from atom_core.executor.worker import read_error, run_worker

        fd, path = tempfile.mkstemp(prefix="atom-rank-", suffix=".json")
        os.close(fd)  # the worker writes its error here, if it has one
        os.environ.update(env, ATOM_WORKER_ERROR_FILE=path)
        try:
            code = run_worker()
            return (
                None
                if code == 0
                else (read_error(path) or f"tensor-parallel rank {env['RANK']} exited with code {code}")
            )
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)  # read above; one file a rank's run otherwise stays in the temp folder


class RayExecutor(DistributedExecutor):
    def __init__(self, config: Config, hf_config: Any):
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ValueError(
                "distributed_executor='ray' needs Ray: pip install 'atom-engine[ray]' (or use 'mp' or 'torchrun')"
            ) from None
        self.actors: list[Any] = []
        self.runs: list[Any] = []
        self.placement: Any = None
        super().__init__(config, hf_config)

    def join_group(self, config: Config) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init()
        world = config.tensor_parallel_size
        here = ray.util.get_node_ip_address()
        store = self.open_store(here, config)
        self.placement = placement_group([{"CPU": 1}] * (world - 1))
        ray.get(self.placement.ready(), timeout=STARTUP_TIMEOUT_S)
        actor_cls = ray.remote(num_cpus=1)(RankActor)
        self.actors = [
            actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=i),
                runtime_env=RANK_RUNTIME_ENV,
            ).remote()
            for i in range(world - 1)
        ]
        nodes = [ray.get_runtime_context().get_node_id()] + ray.get([a.node_id.remote() for a in self.actors])
        per_node = {n: nodes.count(n) for n in nodes}
        threads = threads_per_rank(per_node[nodes[0]])
        self.runs = [
            actor.run.remote(self.rank_env(rank, config, store, here, per_node[nodes[rank]], threads))
            for rank, actor in enumerate(self.actors, 1)
        ]
        self.await_ranks(store, world, self._ended)
        backend = resolve_backend(config.distributed_backend, config.device)
        init_tensor_parallel(
            0, world, backend=backend, timeout_s=config.distributed_timeout, local_world_size=per_node[nodes[0]],
            store=store,
        )  # fmt: skip

    def _ended(self) -> str | None:
        import ray

        done, _ = ray.wait(self.runs, timeout=0)
        return "a tensor-parallel rank ended while starting" if done else None

    def rank_failure(self) -> str | None:
        import ray

        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=5.0) if self.runs else ([], [])
        for ref in done:
            try:
                message = ray.get(ref)
            except Exception as e:  # the actor itself died
                return f"a tensor-parallel rank's Ray actor died: {type(e).__name__}: {e}"
            if message:
                return message
        return None

    def stop_ranks(self) -> None:
        import ray

        if self.failure is None and self.runs:
            ray.wait(self.runs, num_returns=len(self.runs), timeout=10.0)
        for actor in self.actors:
            ray.kill(actor)
        if self.placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement)
        self.actors, self.runs, self.placement = [], [], None
