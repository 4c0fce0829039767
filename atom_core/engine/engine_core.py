"""The engine core: the scheduler, the model runner and the step, over token ids.

What an engine-core process of `atom serve` runs, and what `LLMEngine` wraps for offline use
(tokenizing, chat templates, text in results, run to completion). Stop strings and grammars run
here, with the tokenizer if the model has one, so a consumer is never handed a token past a
stop; results carry token ids, not text.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from typing import Any

import attrs
import msgspec

from atom_core.config import Config
from atom_core.engine.model_source import ModelSource
from atom_core.engine.output_processor import OutputProcessor, RequestState
from atom_core.request import RequestOutput
from atom_core.sampling_params import SamplingParams, truncate_prompt
from atom_core.sched.scheduler import Scheduler
from atom_core.sequence import Sequence

logger = logging.getLogger(__name__)


def is_token_id_like(value: Any) -> bool:
    """An integer (int, numpy integer), not a bool: what a prompt's token ids may be."""
    return not isinstance(value, bool) and hasattr(value, "__index__")


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """The token sequences `SamplingParams.bad_words` ban, as vLLM builds them: each word as
    it is written and, where that makes other tokens of the same count (a word in mid-text),
    after a space."""
    out: list[list[int]] = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(alone)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            out.append(spaced)
    return [ids for ids in out if ids]


class EngineStats(msgspec.Struct):
    """The core's state after a step (totals since it started); a msgspec struct, as an
    engine-core process sends it to the API server's `/metrics`."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # share of the pool's usable blocks in use, 0 to 1
    num_preemptions: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class EngineCore:
    """`EngineCore(ModelSource)`: `add_request(token_ids, params)`, `step()`, `abort(id)`."""

    def __init__(self, source: ModelSource):
        from atom_core.executor.executor import make_executor

        config, hf_config = source.config, source.hf_config
        self.tokenizer = source.tokenizer
        # One rank, or rank 0 of a tensor-parallel group (`config.tensor_parallel_size`).
        self.executor = make_executor(config, hf_config)
        self.runner = self.executor.runner
        if self.runner.device.type == "cpu":
            from atom_core.layers.cpp import summary

            logger.info("atom: %s", summary())
        self.config: Config = config  # as the user set it; what the runner sized is `kv_plan`
        self.kv_plan = self.runner.kv_plan
        self.hf_config = hf_config
        self.vocab_size: int = hf_config.vocab_size
        self.scheduler = Scheduler(config, plan=self.kv_plan)
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler)
        self.requests: dict[int, RequestState] = {}
        self._structured_backends: dict[str, Any] = {}  # built on the first request that names one
        self.timings = self.runner.timings  # seconds per phase, summed over steps

    # -- requests ----------------------------------------------------------------------

    def check_token_ids(self, ids: SequenceABC[Any]) -> list[int]:
        """A prompt's token ids, checked against the vocabulary and the context; errors name the problem."""
        ids = list(ids)
        if not ids:
            raise ValueError("the prompt is empty: it must hold at least one token")
        for i, t in enumerate(ids):
            if not is_token_id_like(t):
                raise ValueError(f"prompt token {i} is {t!r}, not a token id")
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt token {i} is {t}, outside the vocabulary [0, {self.vocab_size})")
        assert self.config.max_model_len is not None  # set from the checkpoint by load_model_source
        if len(ids) > self.config.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than max_model_len={self.config.max_model_len}")
        return [int(t) for t in ids]

    def check_params(self, params: SamplingParams) -> SamplingParams:
        """The request's own copy of `params`, checked against the model (as vLLM clones: reusing
        or changing the caller's object later does not reach a request already queued)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        for name in ("stop_strings", "bad_words"):
            if getattr(params, name) and self.tokenizer is None:
                raise ValueError(f"{name} need a tokenizer, and this model folder has none")
        params = attrs.evolve(params)
        limit = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            n = asked = getattr(params, name)
            if n == -1:  # the whole vocabulary
                n = self.vocab_size
                setattr(params, name, n)
            if n is not None and limit != -1 and n > limit:
                whole = f" (the whole vocabulary, {n} tokens)" if asked == -1 else ""
                raise ValueError(f"{name}={asked}{whole} exceeds max_logprobs={limit}")
            if n is not None and n > self.vocab_size:
                raise ValueError(f"{name}={n} exceeds the model's vocabulary of {self.vocab_size} tokens")
        named = (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ()),
                 ("allowed_token_ids", params.allowed_token_ids or ()))  # fmt: skip
        for name, ids in named:
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} names token {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
        return params

    def grammar(self, params: SamplingParams) -> Any:
        """A fresh matcher for a request with `structured_output` (None without): ValueError for a
        grammar that does not compile or a backend no plugin registers."""
        spec = params.structured_output
        if spec is None:
            return None
        from atom_core.plugins.manager import get_registry
        from atom_core.plugins.registry import RegistryError
        from atom_core.structured_output.backend import DEFAULT_BACKEND

        name = spec.backend or DEFAULT_BACKEND
        backend = self._structured_backends.get(name)
        if backend is None:
            try:
                cls = get_registry("structured_output_backends").get(name)
            except RegistryError as e:
                raise ValueError(f"structured_output.backend: {e}") from None
            eos = [t for t in (self.config.eos_token_id, *self.config.stop_token_ids) if t is not None]
            backend = self._structured_backends[name] = cls(self.tokenizer, self.vocab_size, eos)
        return backend.compile(spec)

    def add_request(
        self,
        token_ids: SequenceABC[int],
        sampling_params: SamplingParams | None = None,
        stream_callback: Callable[[RequestOutput], None] | None = None,
        prompt: Any = None,
    ) -> int:
        """Queue one prompt's token ids; returns the request id. Errors leave nothing queued."""
        params = self.check_params(sampling_params or SamplingParams())
        assert self.config.max_model_len is not None
        ids = self.check_token_ids(truncate_prompt(token_ids, params.truncate_prompt_tokens, self.config.max_model_len))
        return self.add_checked(ids, params, stream_callback, self.grammar(params), prompt)

    def add_checked(
        self, ids: list[int], params: SamplingParams, callback: Any = None, grammar: Any = None, prompt: Any = None
    ) -> int:
        """Queue a request whose ids and params `check_token_ids` / `check_params` passed."""
        seq = Sequence(
            ids,
            self.config.kv_cache_block_size,
            params,
            has_per_req_cache=self.kv_plan.num_state_groups > 0,  # stateful attention (GDN)
        )
        seq.grammar = grammar
        seq.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        state = self.requests[seq.id] = RequestState(seq, prompt, callback)
        self.scheduler.add(seq)
        self.output_processor.emit(state)  # one that can never run ends here
        return seq.id

    def abort(self, request_id: int) -> bool:
        """Stop a request and free its blocks; False if it is not queued or running."""
        seq = self.scheduler.abort(request_id)
        state = self.requests.get(request_id)
        if seq is not None and state is not None:
            self.output_processor.emit(state)
        return seq is not None

    def has_unfinished_requests(self) -> bool:
        """Requests waiting or running, or ended ones whose results the next `step()` hands out."""
        if self.scheduler.has_unfinished_requests():
            return True
        return any(seq.id in self.requests for seq in self.scheduler.peek_finished())

    # -- one step ----------------------------------------------------------------------

    def step(self) -> list[dict[str, Any]]:
        """Run one scheduled batch; the results of the requests that ended (token ids, no text).

        A forward pass that raises ends that step's requests with finish_reason "error" (their
        results come from the next step) and raises; every other request carries on."""
        t0 = time.perf_counter()
        scheduled = self.scheduler.schedule()
        self.timings["schedule"] += time.perf_counter() - t0
        if scheduled is not None:
            batch, seqs = scheduled
            try:
                output = self.executor.execute(batch, seqs)
            except Exception:
                self.scheduler.fail(batch, seqs)
                self.output_processor.process(self.requests[r] for r in seqs if r in self.requests)
                raise
            t1 = time.perf_counter()
            for rid, first in zip(batch.req_ids, batch.num_computed_tokens):
                req = self.requests[rid]
                if req.num_cached_tokens is None:  # its first step starts past the prefix it took from
                    req.num_cached_tokens = first  # the cache (a policy may recompute part of a hit)
            self.scheduler.postprocess(seqs, output)
            self.output_processor.process(self.requests[r] for r in seqs if r in self.requests)
            self.timings["postprocess"] += time.perf_counter() - t1
            self.timings["steps"] += 1
        return self._collect(scheduled[1].values() if scheduled else ())

    def _collect(self, seqs) -> list[dict[str, Any]]:
        done = [s for s in seqs if s.is_finished] + self.scheduler.pop_finished()
        results, seen = [], set()
        for seq in done:
            if seq.id not in seen and seq.id in self.requests:
                seen.add(seq.id)
                state = self.requests.pop(seq.id)
                self.output_processor.emit(state)  # ended outside a step (unschedulable): its end, once
                results.append(self._result(state))
        return results

    @staticmethod
    def _result(req: RequestState) -> dict[str, Any]:
        seq = req.seq
        n = seq.num_completion_tokens
        ttft = seq.first_token_time - seq.arrive_time if seq.first_token_time else None
        tpot = (seq.leave_time - seq.first_token_time) / (n - 1) if seq.first_token_time and n > 1 else None
        return {
            "request_id": seq.id,
            "prompt": req.prompt if isinstance(req.prompt, str) else None,
            "token_ids": list(seq.completion_token_ids),
            "finish_reason": seq.leave_reason,
            "stop_reason": seq.stop_reason,
            "num_prompt_tokens": seq.num_prompt_tokens,
            "num_cached_tokens": req.num_cached_tokens or 0,
            "logprobs": seq.logprobs if seq.sampling_params.logprobs is not None else None,
            "prompt_logprobs": seq.prompt_logprobs if seq.sampling_params.prompt_logprobs is not None else None,
            "ttft": ttft,
            "tpot": tpot,
        }

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (a later engine in this process forms its
        own group); idempotent. A one-rank engine holds nothing that needs it."""
        self.executor.close()

    def get_spec_stats(self) -> dict[str, Any]:
        """Speculative-decoding counts with vLLM's meanings (all zero without speculation)."""
        return self.scheduler.spec_stats.as_dict()

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        pool = scheduler.block_manager
        usable = pool.num_blocks - len(pool.reserved_block_ids)
        spec = scheduler.spec_stats
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_cache_usage=(usable - pool.num_free_blocks) / usable if usable else 0.0,
            num_preemptions=scheduler.num_preemptions,
            spec_draft_tokens=spec.num_draft_tokens,
            spec_accepted_tokens=spec.num_accepted_tokens,
        )
