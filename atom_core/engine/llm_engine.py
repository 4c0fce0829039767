"""The user-facing engine: prompts in, text out, with continuous batching underneath.

`generate` and `chat` run everything to completion; `add_request` / `step` / `abort`
are the incremental interface a server builds on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from pathlib import Path
from typing import Any, cast

import attrs

from atom_core.config import Config, check_device
from atom_core.engine.output_processor import OutputProcessor, RequestState, text_before_stop
from atom_core.plugins.options import check_plugin_options, declared_options
from atom_core.request import RequestOutput
from atom_core.sampling_params import SamplingParams
from atom_core.sched.scheduler import Scheduler
from atom_core.sequence import Sequence

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_CONFIG_FIELDS = {f.name for f in attrs.fields(Config)}


def resolve_model(model: str | Path | None) -> Path:
    """A folder with config.json: the given one, a .gguf file converted once, or the default model."""
    if model is None:
        from atom_core.engine.fetch import fetch_default_model

        return fetch_default_model()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from atom_core.engine.fetch import default_cache_dir
        from atom_core.loading.checkpoint import GGUF_BLOCKS_FILE
        from atom_core.loading.gguf.blocks import write_gguf_blocks
        from atom_core.loading.gguf.convert import gguf_to_hf_folder

        # Named by the file's full path as well as its size and modification time (in ns):
        # two files of one name, size and copied timestamp (two fine-tunes at one quant type,
        # `cp -p`) must not share a converted folder.
        stat = path.stat()
        where = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
        out = default_cache_dir() / "models" / f"{path.stem}-{stat.st_size:x}-{stat.st_mtime_ns:x}-{where}"
        try:
            if not (out / "config.json").exists():
                return gguf_to_hf_folder(path, out)
            if not (out / GGUF_BLOCKS_FILE).exists():  # converted before Atom kept the quantized blocks
                write_gguf_blocks(path, out)
        except Exception as e:  # gguf's and numpy's messages ("GGUF magic invalid", an IndexError
            # from a cut-off header, a reshape of a cut-off tensor) do not name the file
            raise ValueError(
                f"{path}: not a GGUF file Atom can read (truncated or corrupt?): {type(e).__name__}: {e}"
            ) from e
        return out
    if (path / "config.json").is_file():
        return path
    raise FileNotFoundError(
        f"model {str(model)!r} is neither a folder with config.json nor a .gguf file "
        "(Atom does not download from a model hub; `atom fetch` installs the default model)"
    )


def text_config_of(hf_config: Any) -> Any:
    """The language model's config of a multimodal checkpoint (Atom runs its text model), under the
    checkpoint's own `architectures`, by which a model plugin registers it; a text config as is."""
    text = hf_config.get_text_config()
    if text is not hf_config:
        text.architectures = hf_config.architectures
    return text


def _is_token_id_like(value: Any) -> bool:
    """An integer (int, numpy integer), not a bool: what a prompt's token ids may be."""
    return not isinstance(value, bool) and hasattr(value, "__index__")


def _is_token_list(prompt: Any) -> bool:
    """A list of token ids, not a list of prompts."""
    if not isinstance(prompt, SequenceABC) or isinstance(prompt, str) or len(prompt) == 0:
        return False
    return _is_token_id_like(prompt[0])


class LLMEngine:
    """`LLMEngine(model=None, **config)`: keywords are `Config` fields (dtype, device, ...) or
    settings a plugin declares (`prefill_chunk_size` of the spyre policy, ...), which go into
    `Config.additional_config`."""

    def __init__(self, model: str | Path | None = None, **kwargs: Any):
        kwargs = self._route_plugin_settings(kwargs)
        from transformers import AutoConfig

        check_device(Config(**kwargs).device)  # bad settings are named before a GGUF file is converted
        folder = resolve_model(model)
        hf_config = text_config_of(AutoConfig.from_pretrained(folder))
        config = Config(model=str(folder), **kwargs)
        config = attrs.evolve(config, **self._model_defaults(config, hf_config, folder))
        self.tokenizer = self._load_tokenizer(folder)
        from atom_core.runner.model_runner import ModelRunner

        self.runner = ModelRunner(config, hf_config)
        if self.runner.device.type == "cpu":
            from atom_core.layers.cpp import summary

            logger.info("atom: %s", summary())
        self.config = config  # as the user set it; what the runner sized is `kv_plan`
        self.kv_plan = self.runner.kv_plan
        self.hf_config = hf_config
        self.vocab_size: int = hf_config.vocab_size
        self.scheduler = Scheduler(self.config, plan=self.kv_plan)
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler)
        self._requests: dict[int, RequestState] = {}
        self._held_results: list[dict[str, Any]] = []  # others' results that generate() ran to the end
        self._structured_backends: dict[str, Any] = {}  # built on the first request that names one
        self.timings = self.runner.timings  # seconds per phase, summed over steps

    @staticmethod
    def _route_plugin_settings(kwargs: dict[str, Any]) -> dict[str, Any]:
        """`kwargs` with the names that are no `Config` field moved into `additional_config`,
        each checked against the settings the installed plugins declare (before any model loads)."""
        extra = {k: kwargs[k] for k in kwargs if k not in _CONFIG_FIELDS}
        settings = {**(kwargs.get("additional_config") or {}), **extra}
        try:
            check_plugin_options(settings)
        except TypeError:
            declared = sorted(declared_options())
            unknown = sorted(set(settings) - set(declared))
            raise TypeError(
                f"unknown LLMEngine option(s) {', '.join(map(repr, unknown))}; options are Config fields: "
                f"{', '.join(sorted(_CONFIG_FIELDS - {'model'}))}; and plugin settings: {', '.join(declared)}"
            ) from None
        kwargs = {k: v for k, v in kwargs.items() if k in _CONFIG_FIELDS}
        if settings:
            kwargs["additional_config"] = settings
        return kwargs

    @staticmethod
    def _model_defaults(config: Config, hf_config: Any, folder: Path) -> dict[str, Any]:
        """max_model_len and stop ids from the checkpoint, where the user set none."""
        out: dict[str, Any] = {}
        max_pos = getattr(hf_config, "max_position_embeddings", None)
        if config.max_model_len is None:
            out["max_model_len"] = max_pos or 4096
        elif max_pos is not None and config.max_model_len > max_pos:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings={max_pos}"
            )
        gen_path = folder / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        eos = gen.get("eos_token_id", getattr(hf_config, "eos_token_id", None))
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if config.eos_token_id is None and eos_ids:
            out["eos_token_id"] = eos_ids[0]
        if not config.stop_token_ids and len(eos_ids) > 1:
            out["stop_token_ids"] = eos_ids[1:]
        bos = gen.get("bos_token_id", getattr(hf_config, "bos_token_id", None))
        if config.bos_token_id is None and isinstance(bos, int):
            out["bos_token_id"] = bos
        return out

    @staticmethod
    def _load_tokenizer(folder: Path):
        if not any((folder / name).exists() for name in _TOKENIZER_FILES):
            return None  # token-id prompts still work
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(folder)
        except Exception as e:  # tokenizers raises a bare Exception on a corrupt vocabulary
            raise ValueError(f"{folder}: its tokenizer files cannot be loaded: {type(e).__name__}: {e}") from e

    # -- requests ----------------------------------------------------------------------

    def _token_ids(self, prompt: str | list[int]) -> list[int]:
        """Tokenize and validate one prompt; every error names the problem."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.config.model} has no tokenizer files; pass prompts as token-id lists")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, SequenceABC):
            ids = list(prompt)
        else:
            raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty: it must hold at least one token")
        for i, t in enumerate(ids):
            if not _is_token_id_like(t):
                raise ValueError(f"prompt token {i} is {t!r}, not a token id")
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt token {i} is {t}, outside the vocabulary [0, {self.vocab_size})")
        assert self.config.max_model_len is not None  # set from the checkpoint in __init__
        if len(ids) > self.config.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than max_model_len={self.config.max_model_len}")
        return [int(t) for t in ids]

    def _check_params(self, params: SamplingParams) -> SamplingParams:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer, and this model folder has none")
        # The request keeps its own copy (as vLLM clones): reusing or changing the caller's
        # object later does not reach a request already queued.
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
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids holds {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in params.logit_bias or () if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias names token {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
        return params

    def _grammar(self, params: SamplingParams) -> Any:
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
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        stream_callback: Callable[[RequestOutput], None] | None = None,
    ) -> int:
        """Queue one prompt; returns its request id. Errors leave nothing queued."""
        params = self._check_params(sampling_params or SamplingParams())
        ids = self._token_ids(prompt)
        return self._add(ids, prompt, params, stream_callback, self._grammar(params))

    def _add(self, ids: list[int], prompt: Any, params: SamplingParams, callback=None, grammar=None) -> int:
        seq = Sequence(
            ids,
            self.config.kv_cache_block_size,
            params,
            has_per_req_cache=self.kv_plan.num_state_groups > 0,  # stateful attention (GDN)
        )
        seq.grammar = grammar
        state = self._requests[seq.id] = RequestState(seq, prompt, callback)
        self.scheduler.add(seq)
        self.output_processor.emit(state)  # one that can never run ends here
        return seq.id

    def abort(self, request_id: int) -> bool:
        """Stop a request and free its blocks; False if it is not queued or running."""
        seq = self.scheduler.abort(request_id)
        state = self._requests.get(request_id)
        if seq is not None and state is not None:
            self.output_processor.emit(state)
        return seq is not None

    def has_unfinished_requests(self) -> bool:
        """Requests waiting or running, or ended ones whose results the next `step()` hands out
        (an aborted or unschedulable request's): a `step()` loop on this misses no result."""
        if self.scheduler.has_unfinished_requests() or self._held_results:
            return True
        return any(seq.id in self._requests for seq in self.scheduler.peek_finished())

    def step(self) -> list[dict[str, Any]]:
        """Run one scheduled batch; returns the results of requests that finished (also those
        that finished inside a `generate` call that was not theirs)."""
        results, self._held_results = self._held_results + self._step(), []
        return results

    def _step(self) -> list[dict[str, Any]]:
        t0 = time.perf_counter()
        scheduled = self.scheduler.schedule()
        self.timings["schedule"] += time.perf_counter() - t0
        if scheduled is not None:
            batch, seqs = scheduled
            try:
                output = self.runner.forward(batch, seqs)
            except Exception:
                # The step's requests end with finish_reason "error" (their results come
                # from the next step()); every other request carries on.
                self.scheduler.fail(batch, seqs)
                self.output_processor.process(self._requests[r] for r in seqs if r in self._requests)
                raise
            t1 = time.perf_counter()
            for rid, first in zip(batch.req_ids, batch.num_computed_tokens):
                req = self._requests[rid]
                if req.num_cached_tokens is None:  # its first step starts past the prefix it took from
                    req.num_cached_tokens = first  # the cache (a policy may recompute part of a hit)
            self.scheduler.postprocess(seqs, output)
            self.output_processor.process(self._requests[r] for r in seqs if r in self._requests)
            self.timings["postprocess"] += time.perf_counter() - t1
            self.timings["steps"] += 1
        return self._collect(scheduled[1].values() if scheduled else ())

    def get_spec_stats(self) -> dict[str, Any]:
        """Speculative-decoding counts with vLLM's meanings (all zero without speculation)."""
        return self.scheduler.spec_stats.as_dict()

    def _collect(self, seqs) -> list[dict[str, Any]]:
        done = [s for s in seqs if s.is_finished] + self.scheduler.pop_finished()
        results, seen = [], set()
        for seq in done:
            if seq.id not in seen and seq.id in self._requests:
                seen.add(seq.id)
                state = self._requests.pop(seq.id)
                self.output_processor.emit(state)  # ended outside a step (unschedulable): its end, once
                results.append(self._result(state))
        return results

    def _result(self, req: RequestState) -> dict[str, Any]:
        seq = req.seq
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True)
            text = text_before_stop(text, seq.leave_reason, seq.stop_reason)
        n = seq.num_completion_tokens
        ttft = seq.first_token_time - seq.arrive_time if seq.first_token_time else None
        tpot = (seq.leave_time - seq.first_token_time) / (n - 1) if seq.first_token_time and n > 1 else None
        return {
            "request_id": seq.id,
            "prompt": req.prompt if isinstance(req.prompt, str) else None,
            "text": text,
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

    # -- run to completion -------------------------------------------------------------

    def generate(
        self,
        prompts: str | list[int] | SequenceABC[str | list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict[str, Any]]:
        """One result per prompt, in prompt order. Requests queued with `add_request` run
        alongside; their results stay for `step()` to return."""
        if isinstance(prompts, str) or _is_token_list(prompts):
            prompts = [cast("str | list[int]", prompts)]
        elif not isinstance(prompts, SequenceABC):
            raise TypeError(
                f"prompts must be a string, a list of token ids or a list of those, got {type(prompts).__name__}"
            )
        prompts = list(cast("SequenceABC[str | list[int]]", prompts))
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(
                    f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts; pass one, or one per prompt"
                )
            params = [self._check_params(p) for p in sampling_params]
        else:
            params = [self._check_params(sampling_params or SamplingParams())] * len(prompts)
        token_ids = [self._token_ids(p) for p in prompts]  # every prompt checked before any is queued
        grammars = [self._grammar(sp) for sp in params]
        ids = [self._add(t, p, sp, None, g) for t, p, sp, g in zip(token_ids, prompts, params, grammars)]
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[int], use_tqdm: bool) -> list[dict[str, Any]]:
        from tqdm.auto import tqdm

        results: dict[int, dict[str, Any]]
        wanted, results = set(ids), {}
        start, num_tokens = time.perf_counter(), 0
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm, dynamic_ncols=True) as bar:
            try:
                while wanted - results.keys():
                    for r in self._step():
                        if r["request_id"] not in wanted:  # added with add_request: step() hands it out
                            self._held_results.append(r)
                            continue
                        results[r["request_id"]] = r
                        num_tokens += len(r["token_ids"])
                        bar.update(1)
                        bar.set_postfix(tok_s=f"{num_tokens / (time.perf_counter() - start):.1f}")
            except BaseException:
                for rid in wanted - results.keys():  # leave nothing of ours in flight
                    self.abort(rid)
                    self._requests.pop(rid, None)
                raise
        return [results[i] for i in ids]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict[str, Any]]:
        """Apply the model's chat template to one conversation or a list of them."""
        conversations = cast(
            "list[list[dict[str, str]]]",
            [messages] if messages and isinstance(messages[0], dict) else list(messages),
        )
        return self.generate([self.apply_chat_template(c) for c in conversations], sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[dict[str, str]]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{self.config.model} has no chat template; use generate() with plain prompts")
        for i, message in enumerate(conversation):  # else the template fails inside jinja
            # (no 'content' is required: an assistant message with tool_calls may have none)
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError(f"chat message {i} must be a dict with a 'role' string, got {message!r}")
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)
