"""An engine-core process: the scheduler, the runner and the step loop, talking token ids.

Started by the API server (`multiprocessing` with spawn); it loads the model, says `Ready`,
then loops: take every message waiting (blocking briefly when idle), run one step, send one
`StepOutput` with each request's new tokens. A forward pass that raises ends only that
step's requests (finish reason "error"); a frame that does not decode is logged and dropped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any

import msgspec
import zmq

from atom_core.serve.protocol import (
    HEARTBEAT_SECONDS,
    MAX_FRAME_BYTES,
    AbortRequest,
    AddRequest,
    Delta,
    Heartbeat,
    Ready,
    RequestError,
    Shutdown,
    StepOutput,
    encoder,
    to_core_decoder,
)

logger = logging.getLogger("atom")

IDLE_POLL_MS = 50


def run_core(
    model: str | None, config: dict[str, Any], in_address: str, out_address: str, threads: int, rank: int = 0
) -> None:
    """The process's main: load, say Ready, serve until `Shutdown` (or the parent's end)."""
    import torch

    torch.set_num_threads(threads)
    logging.basicConfig(level=os.environ.get("ATOM_LOG_LEVEL", "WARNING"))
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    inbox.connect(in_address)
    outbox = context.socket(zmq.PUSH)
    outbox.connect(out_address)
    core = None
    stop = threading.Event()
    try:
        core = EngineCoreLoop(model, config, rank)
        outbox.send(encoder.encode(core.ready()))
        beat = threading.Thread(target=heartbeat, args=(context, out_address, rank, stop), daemon=True)
        beat.start()
        core.serve(inbox, outbox)
    finally:
        stop.set()
        if core is not None:
            core.core.close()  # its tensor-parallel ranks, if any
        outbox.close(linger=1000)
        inbox.close(linger=0)
        context.term()


def heartbeat(context: zmq.Context, out_address: str, rank: int, stop: threading.Event) -> None:
    """Say the process is alive every HEARTBEAT_SECONDS, from a socket of this thread's own:
    a step of many seconds (a long prompt) runs in torch's kernels, which let this thread
    run, so `/health` stays up while the step goes on, as vLLM's does."""
    sock = context.socket(zmq.PUSH)
    sock.connect(out_address)
    try:
        beat = encoder.encode(Heartbeat(rank))
        while not stop.wait(HEARTBEAT_SECONDS):
            with contextlib.suppress(zmq.Again):  # an API process that reads nothing: skip, never block
                sock.send(beat, zmq.NOBLOCK)
    finally:
        sock.close(linger=0)


class EngineCoreLoop:
    """An `EngineCore` behind two sockets: requests in, one `StepOutput` per step out."""

    def __init__(self, model: str | None, config: dict[str, Any], rank: int = 0):
        from atom_core.engine.engine_core import EngineCore
        from atom_core.engine.model_source import load_model_source

        self.rank = rank
        self.core = EngineCore(load_model_source(model, **config))
        self.ids: dict[int, str] = {}  # engine request id -> the server's id
        self.rids: dict[str, int] = {}
        self.pending: list[Delta] = []

    def ready(self) -> Ready:
        core = self.core
        assert core.config.max_model_len is not None
        return Ready(
            core.config.max_model_len, core.vocab_size, core.kv_plan.num_blocks, self.rank, core.config.max_logprobs
        )

    def serve(self, inbox: zmq.Socket, outbox: zmq.Socket) -> None:
        core = self.core
        while True:
            timeout = 0 if core.has_unfinished_requests() else IDLE_POLL_MS
            while inbox.poll(timeout):
                timeout = 0
                try:
                    message = to_core_decoder.decode(inbox.recv())
                except msgspec.DecodeError as e:
                    logger.warning("atom core: dropped a frame that is not a request: %s", e)
                    continue
                if isinstance(message, Shutdown):
                    return
                reply = self.handle(message)
                if reply is not None:
                    outbox.send(encoder.encode(reply))
            stepped = core.has_unfinished_requests()
            if stepped:
                try:
                    results = core.step()
                except Exception:  # the step's requests end with "error"; the others go on
                    logger.exception("atom core: a step failed")
                    results = []
                self.finish(results)
            if self.pending or stepped:
                outbox.send(encoder.encode(StepOutput(self.pending, core.stats(), self.rank)))
                self.pending = []

    def handle(self, message: Any) -> Any:
        if isinstance(message, AddRequest):
            return self.add(message)
        if isinstance(message, AbortRequest):
            rid = self.rids.get(message.id)
            if rid is not None:
                self.core.abort(rid)
            return None
        return None

    def add(self, message: AddRequest) -> RequestError | None:
        from atom_core.sampling_params import SamplingParams

        if message.id in self.rids:
            return RequestError(message.id, f"request id {message.id!r} is already in flight")
        try:
            params = SamplingParams(**message.params)
            sid = message.id
            rid = self.core.add_request(
                message.prompt_token_ids, params, stream_callback=lambda out: self.collect(sid, out)
            )
        except (ValueError, TypeError) as e:
            return RequestError(message.id, str(e))
        self.ids[rid], self.rids[message.id] = message.id, rid
        return None

    def collect(self, sid: str, out: Any) -> None:
        """A request's stream item: its new tokens, and its end."""
        self.pending.append(
            Delta(
                sid, list(out.output_tokens), out.finished, out.finish_reason,
                logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs, queue_time=out.queue_time,
            )
        )  # fmt: skip

    def finish(self, results: list[dict[str, Any]]) -> None:
        """Counts only a result has, onto the request's last delta; then forget the request."""
        ended = {r["request_id"]: r for r in results}
        for delta in self.pending:
            rid = self.rids.get(delta.id)
            r = ended.get(rid) if rid is not None else None
            if delta.finished and r is not None:
                delta.stop_reason = r["stop_reason"]
                delta.num_prompt_tokens = r["num_prompt_tokens"]
                delta.num_cached_tokens = r["num_cached_tokens"]
        for rid in ended:
            sid = self.ids.pop(rid, None)
            if sid is not None:
                self.rids.pop(sid, None)
