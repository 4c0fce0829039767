"""The API server's side of an engine-core process: start it, send requests, route its output.

The two sockets live in a private (0700) temporary directory as `ipc://` endpoints, bound
here; the core connects. Each request gets an asyncio queue its deltas go to; a request
whose consumer goes away (a client disconnecting) is aborted in the core.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from atom_core.serve.core_process import run_core
from atom_core.serve.protocol import (
    MAX_FRAME_BYTES,
    AbortRequest,
    AddRequest,
    Delta,
    Ready,
    RequestError,
    Shutdown,
    StepOutput,
    encoder,
    from_core_decoder,
)

logger = logging.getLogger("atom")


def available_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's or taskset's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


class EngineDead(RuntimeError):
    """The engine-core process is gone (or does not answer)."""


class RequestFailed(Exception):
    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class EngineClient:
    """`data_parallel_size` engine-core processes behind one interface. A request goes to the
    rank with the fewest outstanding requests (`pick_rank`: the API sends an `n` request's
    children to one rank); a rank that dies fails its requests at once and makes the client
    refuse new ones (`EngineDead`)."""

    def __init__(self, model: str | None, config: dict[str, Any], threads: int | None = None):
        self.model, self.config = model, config
        self.size = int(config.get("data_parallel_size", 1))
        if threads is not None and threads < 1:
            raise ValueError(f"core threads must be >= 1, got {threads}")
        # Every core goes to the engine cores: the API process is idle most of the time (measured in
        # docs/benchmarks.md against leaving it one core, as vLLM's CPU backend does).
        self.threads = threads or max(1, available_cores() // self.size)
        self.ready: Ready | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._rank_of: dict[str, int] = {}
        self._outstanding = [0] * self.size
        self._heard: dict[int, float] = {}  # rank -> loop time of its last message (heartbeats included)
        self._processes: list[Any] = []
        self._dir: str | None = None  # the ranks' socket folder (`launch`)
        self._reader: asyncio.Task | None = None
        self.dead: str | None = None
        self.on_stats: Any = None  # called with (EngineStats, rank) after every step of a rank

    def _rank_config(self) -> dict[str, Any]:
        """Each rank's settings: a share of the KV budget when there are several."""
        config = dict(self.config)
        if self.size > 1 and config.get("num_kvcache_blocks") is None:
            budget = config.get("kv_cache_memory")
            if budget is None and config.get("device", "cpu") == "cpu":
                import torch

                from atom_core.platform.memory import free_memory_bytes
                from atom_core.runner.kv_pool import CPU_KV_CACHE_FRACTION

                budget = int(free_memory_bytes(torch.device("cpu")) * CPU_KV_CACHE_FRACTION)
            if budget is not None:
                config["kv_cache_memory"] = budget // self.size
        return config

    def launch(self) -> None:
        """Start every rank's process, which begins loading the model at once: the API process
        can load its tokenizer meanwhile (`start` waits for them; it calls this if nobody has).
        A rank connects to sockets `start` binds later, as ZeroMQ allows."""
        if self._processes:
            return
        if self.size > 1:  # built once here, not raced by the ranks
            from atom_core.layers.cpp import build_all

            build_all()
        self._dir = tempfile.mkdtemp(prefix="atom-")
        os.chmod(self._dir, 0o700)
        spawn = multiprocessing.get_context("spawn")
        config = self._rank_config()
        for rank in range(self.size):
            process = spawn.Process(
                target=run_core,
                args=(self.model, config, f"ipc://{self._dir}/in{rank}", f"ipc://{self._dir}/out", self.threads, rank),
                daemon=True,
            )
            process.start()
            self._processes.append(process)

    def kill(self) -> None:
        """End the ranks `launch` started, where the server stops before `start` (its tokenizer
        failed to load, say)."""
        for process in self._processes:
            process.kill()
            process.join(10)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    async def start(self, timeout: float = 600.0) -> Ready:
        """Start every rank (`launch`) and wait until each has loaded the model; raise if one dies first."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.launch)  # (nothing, where the server launched them already)
        self._context = zmq.asyncio.Context()
        self._from_core = self._context.socket(zmq.PULL)
        self._from_core.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._from_core.bind(f"ipc://{self._dir}/out")
        self._to_core = []
        for rank in range(self.size):
            sock = self._context.socket(zmq.PUSH)
            sock.bind(f"ipc://{self._dir}/in{rank}")
            self._to_core.append(sock)
        deadline = loop.time() + timeout
        ready: dict[int, Ready] = {}
        while len(ready) < self.size:
            for rank, process in enumerate(self._processes):
                if not process.is_alive():
                    raise EngineDead(f"engine core {rank} exited with code {process.exitcode} before it was ready")
            if loop.time() > deadline:
                raise EngineDead(f"the engine cores were not ready within {timeout:.0f} s")
            if await self._from_core.poll(200):
                message = self._decode(await self._from_core.recv())
                if isinstance(message, Ready):
                    ready[message.rank] = message
                    self._heard[message.rank] = loop.time()
        self.ready = min(ready.values(), key=lambda r: r.num_kv_blocks)
        self._reader = asyncio.create_task(self._read())
        return self.ready

    async def close(self) -> None:
        for sock, process in zip(self._to_core, self._processes):
            if process.is_alive():
                with contextlib.suppress(zmq.ZMQError):
                    await sock.send(encoder.encode(Shutdown()))
        loop = asyncio.get_running_loop()
        for process in self._processes:
            await loop.run_in_executor(None, process.join, 10)
            if process.is_alive():
                process.kill()
        if self._reader is not None:
            self._reader.cancel()
        for sock in self._to_core:
            sock.close(linger=0)
        self._from_core.close(linger=0)
        self._context.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _decode(self, frame: bytes) -> Any:
        try:
            return from_core_decoder.decode(frame)
        except msgspec.DecodeError as e:
            logger.warning("atom: dropped a frame from an engine core that does not decode: %s", e)
            return None

    async def _read(self) -> None:
        """Route the cores' messages; when one dies, fail what is in flight and refuse more."""
        while True:
            if not await self._from_core.poll(200):
                for rank, process in enumerate(self._processes):
                    if not process.is_alive():
                        self._fail_all(f"engine core {rank} exited with code {process.exitcode}")
                        return
                continue
            message = self._decode(await self._from_core.recv())
            sender = getattr(message, "rank", None)
            if sender is not None:
                self._heard[sender] = asyncio.get_running_loop().time()
            if isinstance(message, StepOutput):
                if self.on_stats is not None:
                    self.on_stats(message.stats, message.rank)
                for delta in message.deltas:
                    queue = self._queues.get(delta.id)
                    if queue is not None:
                        queue.put_nowait(delta)
            elif isinstance(message, RequestError):
                queue = self._queues.get(message.id)
                if queue is not None:
                    queue.put_nowait(RequestFailed(message.message, message.status))

    def _fail_all(self, why: str) -> None:
        self.dead = why
        for queue in self._queues.values():
            queue.put_nowait(EngineDead(why))

    def check_health(self, timeout: float) -> None:
        """EngineDead if a rank has died, or has sent nothing (not even a heartbeat, which its
        process sends through the longest step) for `timeout` seconds."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        now = asyncio.get_running_loop().time()
        for rank, process in enumerate(self._processes):
            if not process.is_alive():
                raise EngineDead(f"engine core {rank} exited with code {process.exitcode}")
            silent = now - self._heard.get(rank, now)
            if silent > timeout:
                raise EngineDead(f"engine core {rank} has sent nothing for {silent:.1f} s (limit {timeout} s)")

    def pick_rank(self, count: int = 1) -> int:
        """The rank with the fewest outstanding requests, `count` more of which it now has: the
        caller gives each back with `done(rank)` (`generate` without a rank does both)."""
        rank = min(range(self.size), key=self._outstanding.__getitem__)
        self._outstanding[rank] += count
        return rank

    def done(self, rank: int) -> None:
        self._outstanding[rank] -= 1

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: dict[str, Any], rank: int | None = None
    ) -> AsyncIterator[Delta]:
        """The request's deltas as its rank sends them, up to the finished one. Leaving early
        (the consumer is cancelled or stops iterating) aborts it in the core."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        picked = rank is None
        rank = self.pick_rank() if rank is None else rank
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            await self._to_core[rank].send(encoder.encode(AddRequest(request_id, prompt_token_ids, params)))
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if picked:
                self.done(rank)
            self._queues.pop(request_id, None)
            if not finished and self.dead is None:
                with contextlib.suppress(zmq.ZMQError):
                    await self._to_core[rank].send(encoder.encode(AbortRequest(request_id)))
