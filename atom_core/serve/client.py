"""The API server's side of an engine-core process: start it, send requests, route its output.

The two sockets live in a private (0700) temporary directory as `ipc://` endpoints, bound
here; the core connects. Each request gets an asyncio queue its deltas go to; a request
whose consumer goes away (a client disconnecting) is aborted in the core.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
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
    Ping,
    Pong,
    Ready,
    RequestError,
    Shutdown,
    StepOutput,
    encoder,
    from_core_decoder,
)

logger = logging.getLogger("atom")


class EngineDead(RuntimeError):
    """The engine-core process is gone (or does not answer)."""


class RequestFailed(Exception):
    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class EngineClient:
    def __init__(self, model: str | None, config: dict[str, Any], threads: int | None = None):
        self.model, self.config = model, config
        self.threads = threads or max(1, os.cpu_count() or 1)
        self.ready: Ready | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._pongs: dict[int, asyncio.Future] = {}
        self._nonce = itertools.count()
        self._process: Any = None
        self._reader: asyncio.Task | None = None
        self.dead: str | None = None
        self.on_stats: Any = None  # called with each step's EngineStats (the API's metrics)

    async def start(self, timeout: float = 600.0) -> Ready:
        """Start the core and wait until its model is loaded; raise if it dies first."""
        self._dir = tempfile.mkdtemp(prefix="atom-")
        os.chmod(self._dir, 0o700)
        self._context = zmq.asyncio.Context()
        self._to_core = self._context.socket(zmq.PUSH)
        self._to_core.bind(f"ipc://{self._dir}/in")
        self._from_core = self._context.socket(zmq.PULL)
        self._from_core.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._from_core.bind(f"ipc://{self._dir}/out")
        spawn = multiprocessing.get_context("spawn")
        self._process = spawn.Process(
            target=run_core,
            args=(self.model, self.config, f"ipc://{self._dir}/in", f"ipc://{self._dir}/out", self.threads),
            daemon=True,
        )
        self._process.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.ready is None:
            if not self._process.is_alive():
                raise EngineDead(f"the engine core exited with code {self._process.exitcode} before it was ready")
            if loop.time() > deadline:
                raise EngineDead(f"the engine core was not ready within {timeout:.0f} s")
            if await self._from_core.poll(200):
                message = self._decode(await self._from_core.recv())
                if isinstance(message, Ready):
                    self.ready = message
        self._reader = asyncio.create_task(self._read())
        return self.ready

    async def close(self) -> None:
        if self._process is not None and self._process.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                await self._to_core.send(encoder.encode(Shutdown()))
            await asyncio.get_running_loop().run_in_executor(None, self._process.join, 10)
            if self._process.is_alive():
                self._process.kill()
        if self._reader is not None:
            self._reader.cancel()
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _decode(self, frame: bytes) -> Any:
        try:
            return from_core_decoder.decode(frame)
        except msgspec.DecodeError as e:
            logger.warning("atom: dropped a frame from the engine core that does not decode: %s", e)
            return None

    async def _read(self) -> None:
        """Route the core's messages until it dies; then fail whatever is in flight."""
        while True:
            if not await self._from_core.poll(500):
                if not self._process.is_alive():
                    self._fail_all(f"the engine core exited with code {self._process.exitcode}")
                    return
                continue
            message = self._decode(await self._from_core.recv())
            if isinstance(message, StepOutput):
                if self.on_stats is not None:
                    self.on_stats(message.stats)
                for delta in message.deltas:
                    queue = self._queues.get(delta.id)
                    if queue is not None:
                        queue.put_nowait(delta)
            elif isinstance(message, RequestError):
                queue = self._queues.get(message.id)
                if queue is not None:
                    queue.put_nowait(RequestFailed(message.message, message.status))
            elif isinstance(message, Pong):
                future = self._pongs.pop(message.nonce, None)
                if future is not None and not future.done():
                    future.set_result(message)

    def _fail_all(self, why: str) -> None:
        self.dead = why
        for queue in self._queues.values():
            queue.put_nowait(EngineDead(why))
        for future in self._pongs.values():
            if not future.done():
                future.set_exception(EngineDead(why))

    async def ping(self, timeout: float) -> Pong:
        if self.dead is not None:
            raise EngineDead(self.dead)
        nonce = next(self._nonce)
        future = self._pongs[nonce] = asyncio.get_running_loop().create_future()
        await self._to_core.send(encoder.encode(Ping(nonce)))
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise EngineDead(f"the engine core did not answer within {timeout} s") from None
        finally:
            self._pongs.pop(nonce, None)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: dict[str, Any]
    ) -> AsyncIterator[Delta]:
        """The request's deltas as the core sends them, up to the finished one. Leaving early
        (the consumer is cancelled or stops iterating) aborts it in the core."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            await self._to_core.send(encoder.encode(AddRequest(request_id, prompt_token_ids, params)))
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished and self.dead is None:
                with contextlib.suppress(zmq.ZMQError):
                    await self._to_core.send(encoder.encode(AbortRequest(request_id)))
