"""A tensor-parallel rank other than 0: join the group, receive the engine's config, load this
rank's slices of the model, then run each step rank 0 sends until it says shut down.

Started as `python -m atom_core.executor.worker` by the "mp" executor, or as `atom worker` under
torchrun; the rank, the group's size and its rendezvous come from the environment (torchrun's
RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). A rank that fails writes what
happened to `ATOM_WORKER_ERROR_FILE` (torchrun's `TORCHELASTIC_ERROR_FILE`), as JSON, and exits:
its closed sockets fail rank 0's next collective, which then reports it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from datetime import timedelta


def error_file() -> str | None:
    return os.environ.get("ATOM_WORKER_ERROR_FILE") or os.environ.get("TORCHELASTIC_ERROR_FILE")


def write_error(path: str | None, rank: int, e: BaseException) -> None:
    if not path:
        return
    message = {"rank": rank, "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(message, f)
    os.replace(partial, path)  # whole or absent: rank 0 may read it before this rank exits


def read_error(path: str) -> str | None:
    """'rank N failed: <the error>' from a worker's error file, or None if it wrote none."""
    try:
        with open(path) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return None
    return f"tensor-parallel rank {found['rank']} failed: {found['message']}"


def join(rank: int, world_size: int, backend: str, timeout_s: float) -> None:
    """Join rank 0's group: through its store (MASTER_ADDR/MASTER_PORT), saying this rank is up
    first, as the "mp" executor waits for; under torchrun, through `env://`."""
    from atom_core.distributed.parallel_state import init_tensor_parallel
    from atom_core.executor.executor import READY_KEY

    if os.environ.get("TORCHELASTIC_RUN_ID"):  # torchrun's rendezvous
        init_tensor_parallel(rank, world_size, "env://", backend, timeout_s=timeout_s)
        return
    import torch.distributed as dist

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )  # fmt: skip
    store.set(READY_KEY.format(rank=rank), "1")
    init_tensor_parallel(rank, world_size, backend=backend, timeout_s=timeout_s, store=store)


def run_worker(model: str | None = None) -> int:
    """This rank's whole life; returns the exit code. `model` overrides the folder rank 0 named
    (for a host where the same files sit elsewhere)."""
    rank = int(os.environ["RANK"])
    path = error_file()
    try:
        import torch

        from atom_core.distributed.communication import broadcast_bytes, enable_shared_memory_collectives
        from atom_core.distributed.parallel_state import destroy_tensor_parallel, get_tp_group
        from atom_core.executor.executor import config_from_json, gather_pool_sizes, threads_per_rank
        from atom_core.executor.step_message import recv_step
        from atom_core.loading.hf_config import read_hf_config
        from atom_core.runner.model_runner import ModelRunner

        backend = os.environ.get("ATOM_DISTRIBUTED_BACKEND", "auto")
        timeout_s = float(os.environ.get("ATOM_DISTRIBUTED_TIMEOUT", "300"))
        threads = int(os.environ.get("ATOM_WORKER_THREADS", 0))  # rank 0's share, from the "mp" executor
        join(rank, int(os.environ["WORLD_SIZE"]), backend, timeout_s)
        torch.set_num_threads(threads or threads_per_rank(get_tp_group().local_world_size))
        enable_shared_memory_collectives(timeout_s)
        config = config_from_json(broadcast_bytes(None))
        if model is not None:
            import attrs

            config = attrs.evolve(config, model=model)
        assert config.model is not None
        runner = ModelRunner(config, read_hf_config(config.model))
        gather_pool_sizes(runner)  # rank 0 checks every rank's pool
        while (step := recv_step()) is not None:
            runner.execute_model(step)
        destroy_tensor_parallel()
        return 0
    except BaseException as e:
        write_error(path, rank, e)
        logging.getLogger(__name__).error("atom worker rank %d failed", rank, exc_info=True)
        return 1


def main() -> None:
    logging.basicConfig(level=os.environ.get("ATOM_LOG_LEVEL", "WARNING"))
    code = run_worker(sys.argv[1] if len(sys.argv) > 1 else None)
    sys.stdout.flush()
    sys.stderr.flush()
    # Without the interpreter's shutdown: gloo's threads may abort it, and rank 0 has what it needs.
    os._exit(code)


if __name__ == "__main__":
    main()
