"""The messages between the API server and an engine-core process, as msgspec msgpack structs.

Tagged structs decoded against a union, never pickle: a frame that is not one of these
(garbage, a wrong type, an unknown tag, over `MAX_FRAME_BYTES`) is refused, logged and dropped,
and the process serves on. Token ids only cross: the front end tokenizes and detokenizes.
"""

from __future__ import annotations

from typing import Any

import msgspec

from atom_core.engine.engine_core import EngineStats

# Largest frame a receiver accepts (zmq.MAXMSGSIZE): a prompt of a million token ids fits.
MAX_FRAME_BYTES = 16 << 20


class AddRequest(msgspec.Struct, tag="add"):
    """Queue a request: its prompt's token ids and its `SamplingParams` fields."""

    id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]


class AbortRequest(msgspec.Struct, tag="abort"):
    id: str


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class Ready(msgspec.Struct, tag="ready"):
    """Sent once the model is loaded."""

    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    rank: int = 0
    max_logprobs: int = 20  # how many log probabilities a token may ask for (-1: any)


class Delta(msgspec.Struct):
    """One request's news from one step: the tokens it gained, and its end."""

    id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # the engine's string ("eos", "stop_2", "max_tokens", ...)
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    queue_time: float | None = None  # with the first tokens: seconds from arrival to the first step


class StepOutput(msgspec.Struct, tag="step"):
    deltas: list[Delta]
    stats: EngineStats = msgspec.field(default_factory=EngineStats)
    rank: int = 0


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    """Sent every `HEARTBEAT_SECONDS` by a thread of the core process, through a long step too:
    the process is alive and its interpreter runs (`/health`)."""

    rank: int = 0


# How often a core says it is alive; `/health` fails a core silent for its timeout.
HEARTBEAT_SECONDS = 0.5


class RequestError(msgspec.Struct, tag="error"):
    """A request refused (`status` 400: its message names the field) or failed (500)."""

    id: str
    message: str
    status: int = 400


ToCore = AddRequest | AbortRequest | Shutdown
FromCore = Ready | StepOutput | RequestError | Heartbeat

encoder = msgspec.msgpack.Encoder()
to_core_decoder = msgspec.msgpack.Decoder(ToCore)
from_core_decoder = msgspec.msgpack.Decoder(FromCore)
