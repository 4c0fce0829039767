"""A request's state from arrival to finish: tokens, blocks, status and timing."""

from __future__ import annotations

import sys
from collections.abc import Callable
from enum import Enum, auto
from itertools import count
from numbers import Integral
from typing import TYPE_CHECKING, Any

from atom_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from atom_core.sched.speculative import DraftGate
    from atom_core.structured_output.backend import Grammar


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class FinishReason(Enum):
    """Why a request ended. The value is the `finish_reason` string results carry (a stop
    token's is `stop_<id>`, an unschedulable request's the message saying why)."""

    EOS = "eos"
    STOP_TOKEN = "stop_token"  # one of the model's or the request's stop token ids (`stop_reason`)
    STOP_SEQUENCE = "stop_sequence"  # a stop token sequence
    STOP = "stop"  # a stop string (`stop_reason`)
    MAX_TOKENS = "max_tokens"
    MAX_MODEL_LEN = "max_model_len"
    ABORT = "abort"
    GRAMMAR = "grammar"  # its output completed its grammar (structured output): nothing may follow
    ERROR = "error"  # its step's forward pass raised, or it sampled a token its grammar refuses
    UNSCHEDULABLE = "unschedulable"  # could never run under the settings (`finish_detail` says why)


class SequenceType(Enum):
    DUMMY = auto()
    PREFILL = auto()
    DECODE = auto()


_DEFAULT_PARAMS = SamplingParams()


def _token_id(i: int, t: Any) -> int:
    """Accept numpy and other integral types; refuse anything that is not a token id."""
    if isinstance(t, bool) or not isinstance(t, Integral) or t < 0:
        raise ValueError(f"token_ids[{i}] must be a token id (an integer >= 0), got {t!r}")
    return int(t)


class Sequence:
    counter = count()

    def __init__(
        self,
        token_ids: list[int],
        block_size: int,
        sampling_params: SamplingParams = _DEFAULT_PARAMS,
        stop_token_sequences: list[list[int]] | None = None,
        stream_callback: Callable[[Any], None] | None = None,
        id: int | None = None,
        has_per_req_cache: bool = False,
    ):
        token_ids = list(token_ids)
        if not token_ids:
            raise ValueError("token_ids must hold at least one token, got an empty prompt")
        if not all(type(t) is int and t >= 0 for t in token_ids):
            token_ids = [_token_id(i, t) for i, t in enumerate(token_ids)]
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.id = id if id is not None else next(Sequence.counter)
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        # PREFILL from admission until its first sampled token (however many chunks), then DECODE.
        self.type = SequenceType.DUMMY
        self.token_ids = token_ids
        self.last_token = self.token_ids[-1]
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_cached_tokens = 0  # prefix served by shared KV blocks
        # Positions whose KV is written (or scheduled to be this step): a prompt being
        # prefilled in chunks has num_computed_tokens < num_tokens - 1.
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.sampling_params = sampling_params
        # 0 for every greedy request (a temperature under 1e-5, or top_k 1): samplers take its argmax
        self.temperature = 0.0 if sampling_params.is_greedy else sampling_params.temperature
        self.top_k = sampling_params.top_k
        self.top_p = sampling_params.top_p
        # None: no limit of its own (the context limit, max_model_len, still ends it)
        self.max_tokens = sys.maxsize if sampling_params.max_tokens is None else sampling_params.max_tokens
        self.ignore_eos = sampling_params.ignore_eos
        self.stop_strings = list(sampling_params.stop_strings)
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.stop_token_sequences = [list(s) for s in (stop_token_sequences or []) if s]
        self.stream_callback = stream_callback
        self.output_tokens: list[int] = []  # new tokens not yet streamed
        self.spec_token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []  # per generated token, when asked for
        self.prompt_logprobs: list[dict[int, float] | None] = [None]  # per prompt token; the first has none
        self.spec_token_probs = None  # the proposer's distributions for spec_token_ids, if it has them
        self.draft_gate: DraftGate | None = None  # speculative decoding: whether this request keeps drafting
        self.grammar: Grammar | None = None  # structured output: the matcher its tokens follow
        # SamplingParams.bad_words as token sequences (set by the engine, which has the tokenizer)
        self.bad_words_token_ids: list[list[int]] = []
        # The ids that would end it (EOS, stop token ids): banned while it has fewer than
        # min_tokens tokens. Set by the scheduler, which knows the model's.
        self.min_tokens_stop_ids: frozenset[int] = self.stop_token_ids
        self.num_placeholder = 0
        # Stateful attention (GDN) keeps one state group per request outside the paged pool.
        self.has_per_req_cache = has_per_req_cache
        self.per_req_cache_group = -1
        self.arrive_time = 0.0
        self.first_scheduled_time = 0.0  # its first step (the end of its time in the queue)
        self.first_token_time = 0.0
        self.leave_time = 0.0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.finish_detail: str | None = None  # why an unschedulable request can never run

    def __len__(self) -> int:
        return self._num_tokens

    def __getitem__(self, key):
        return self.token_ids[key]

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.id}, status={self.status.name}, type={self.type.name}, "
            f"num_tokens={self._num_tokens}, num_prompt_tokens={self.num_prompt_tokens}, "
            f"block_table={self.block_table})"
        )

    @property
    def num_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self._num_tokens

    @num_tokens.setter
    def num_tokens(self, value: int) -> None:
        self._num_tokens = value

    @property
    def num_blocks(self) -> int:
        return (self._num_tokens + self.block_size - 1) // self.block_size

    @property
    def last_block_num_tokens(self) -> int:
        return self._num_tokens - (self.num_blocks - 1) * self.block_size

    @property
    def leave_reason(self) -> str:
        """The finish reason as a string ("" while running): what results and streams carry."""
        reason = self.finish_reason
        if reason is None:
            return ""
        if reason is FinishReason.STOP_TOKEN:
            return f"stop_{self.stop_reason}"
        if reason is FinishReason.UNSCHEDULABLE:
            return self.finish_detail or reason.value
        return reason.value

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None, detail: str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason, self.stop_reason, self.finish_detail = reason, stop_reason, detail

    def truncate(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` tokens (a finished request cut after its stop string)."""
        if not self.num_prompt_tokens <= num_tokens <= self._num_tokens:
            raise ValueError(f"cannot truncate {self._num_tokens} tokens to {num_tokens}")
        del self.token_ids[num_tokens:]
        del self.logprobs[num_tokens - self.num_prompt_tokens :]
        self._num_tokens = num_tokens
        self.last_token = self.token_ids[-1]
        self.num_computed_tokens = min(self.num_computed_tokens, num_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self._num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens : self._num_tokens]

    @property
    def num_cached_blocks(self) -> int:
        return self.num_cached_tokens // self.block_size

    def block(self, i: int) -> list[int]:
        """Token ids that block `i` of this sequence holds."""
        if not 0 <= i < self.num_blocks:
            raise IndexError(f"block index {i} out of range for a sequence of {self.num_blocks} blocks")
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.output_tokens.append(token_id)
        self._num_tokens += 1
