"""The user-facing engine: prompts in, text out, with continuous batching underneath.

`generate` and `chat` run everything to completion; `add_request` / `step` / `abort`
are the incremental interface. The scheduling, the model and stop conditions are the
`EngineCore`'s (token ids); this adds tokenizing, chat templates and text.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from pathlib import Path
from typing import Any, cast

from atom_core.engine.chat_template import chat_text
from atom_core.engine.engine_core import EngineCore, is_token_id_like
from atom_core.engine.model_source import load_model_source
from atom_core.engine.output_processor import final_text
from atom_core.request import RequestOutput
from atom_core.sampling_params import SamplingParams, truncate_prompt

# A result's keys that belong to one completion (vLLM's CompletionOutput); the rest (prompt,
# its token counts and logprobs, timings of the first) are the request's.
COMPLETION_KEYS = ("request_id", "text", "token_ids", "finish_reason", "stop_reason", "logprobs")


def _with_outputs(choices: list[dict[str, Any]]) -> dict[str, Any]:
    """One prompt's result from its n completions' own: the first one's keys, and under
    "outputs" every completion's `COMPLETION_KEYS` with its index (vLLM's `outputs`)."""
    outputs = [{"index": j, **{k: r[k] for k in COMPLETION_KEYS}} for j, r in enumerate(choices)]
    return {**choices[0], "outputs": outputs}


def _is_token_list(prompt: Any) -> bool:
    """A list of token ids, not a list of prompts."""
    if not isinstance(prompt, SequenceABC) or isinstance(prompt, str) or len(prompt) == 0:
        return False
    return is_token_id_like(prompt[0])


class LLMEngine:
    """`LLMEngine(model=None, **config)`: keywords are `Config` fields (dtype, device, ...) or
    settings a plugin declares (`prefill_chunk_size` of the spyre policy, ...), which go into
    `Config.additional_config`."""

    def __init__(self, model: str | Path | None = None, **kwargs: Any):
        core = self.core = EngineCore(load_model_source(model, **kwargs))
        self.tokenizer = core.tokenizer
        # the core's parts, for callers that inspect or drive them (tests, benchmarks)
        self.runner, self.scheduler, self.output_processor = core.runner, core.scheduler, core.output_processor
        self.config, self.kv_plan, self.hf_config, self.vocab_size = (
            core.config,
            core.kv_plan,
            core.hf_config,
            core.vocab_size,
        )
        self.timings = core.timings
        self._held_results: list[dict[str, Any]] = []  # others' results that generate() ran to the end
        # requests whose text is not the default's: (include_stop_str_in_output, skip_special_tokens)
        self._text_options: dict[int, tuple[bool, bool]] = {}

    # -- requests ----------------------------------------------------------------------

    def _token_ids(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Tokenize, truncate (`truncate_prompt_tokens`) and validate one prompt; every error names the problem."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.config.model} has no tokenizer files; pass prompts as token-id lists")
            ids: Any = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (bytes, bytearray)):  # a Sequence of ints, but text: decode it first
            raise TypeError("a prompt must be a string or a list of token ids, got bytes (decode them to a str)")
        elif isinstance(prompt, SequenceABC):
            ids = prompt
        else:
            raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        assert self.config.max_model_len is not None
        return self.core.check_token_ids(truncate_prompt(ids, params.truncate_prompt_tokens, self.config.max_model_len))

    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        stream_callback: Callable[[RequestOutput], None] | None = None,
    ) -> int:
        """Queue one prompt; returns its request id. Errors leave nothing queued."""
        params = self.core.check_params(sampling_params or SamplingParams())
        if params.n != 1:
            raise ValueError(
                f"n={params.n}: add_request queues one completion (queue the prompt n times with "
                "sampling_params.for_choice(j)); generate() and chat() take n"
            )
        ids = self._token_ids(prompt, params)
        return self._add(ids, params, stream_callback, self.core.grammar(params), prompt)

    def _add(self, ids: list[int], params: SamplingParams, callback: Any, grammar: Any, prompt: Any) -> int:
        rid = self.core.add_checked(ids, params, callback, grammar, prompt)
        options = (params.include_stop_str_in_output, params.skip_special_tokens)
        if options != (False, True):
            self._text_options[rid] = options
        return rid

    def abort(self, request_id: int) -> bool:
        """Stop a request and free its blocks; False if it is not queued or running."""
        return self.core.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """Requests waiting or running, or ended ones whose results the next `step()` hands out
        (an aborted or unschedulable request's): a `step()` loop on this misses no result."""
        return bool(self._held_results) or self.core.has_unfinished_requests()

    def step(self) -> list[dict[str, Any]]:
        """Run one scheduled batch; returns the results of requests that finished (also those
        that finished inside a `generate` call that was not theirs)."""
        results, self._held_results = self._held_results + self._step(), []
        return results

    def _step(self) -> list[dict[str, Any]]:
        return [self._with_text(r) for r in self.core.step()]

    def _with_text(self, result: dict[str, Any]) -> dict[str, Any]:
        text = None
        keep_stop, skip_special = self._text_options.pop(result["request_id"], (False, True))
        if self.tokenizer is not None:
            text = final_text(
                self.tokenizer, result["token_ids"], result["finish_reason"], result["stop_reason"], keep_stop,
                skip_special,
            )  # fmt: skip
        return {**result, "text": text}

    def get_spec_stats(self) -> dict[str, Any]:
        """Speculative-decoding counts with vLLM's meanings (all zero without speculation)."""
        return self.core.get_spec_stats()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any; `with LLMEngine(...) as engine:` does it too."""
        self.core.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- run to completion -------------------------------------------------------------

    def generate(
        self,
        prompts: str | list[int] | SequenceABC[str | list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict[str, Any]]:
        """One result per prompt, in prompt order; a prompt whose `n` asks for more than one
        completion gets them under the result's "outputs" (its other keys: the first's).
        Requests queued with `add_request` run alongside; their results stay for `step()`."""
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
            params = [self.core.check_params(p) for p in sampling_params]
        else:
            params = [self.core.check_params(sampling_params or SamplingParams())] * len(prompts)
        token_ids = [self._token_ids(p, sp) for p, sp in zip(prompts, params)]  # all checked before any is queued
        grammars = [self.core.grammar(sp) for sp in params]
        ids = [
            [self._add(t, sp.for_choice(j), None, g, p) for j in range(sp.n)]
            for t, p, sp, g in zip(token_ids, prompts, params, grammars)
        ]
        done = self._run([i for choices in ids for i in choices], use_tqdm)
        return [_with_outputs([done[i] for i in choices]) for choices in ids]

    def _run(self, ids: list[int], use_tqdm: bool) -> dict[int, dict[str, Any]]:
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
                    self.core.requests.pop(rid, None)
                raise
        return results

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[dict[str, Any]]:
        """Apply the model's chat template to one conversation or a list of them (the keywords
        as vLLM's `LLM.chat` has them: OpenAI `tools` for a template that lists them, the
        template's own variables, or the last message left open for the model to go on)."""
        conversations = cast(
            "list[list[dict[str, str]]]",
            [messages] if messages and isinstance(messages[0], dict) else list(messages),
        )
        prompts = [
            self.apply_chat_template(
                c,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
            )  # fmt: skip
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(
        self, conversation: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:  # fmt: skip
        """The token ids of `conversation` (OpenAI-style messages: content a string, a list of
        text parts, or none) through the model's chat template, ready for the reply."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{self.config.model} has no chat template; use generate() with plain prompts")
        text = chat_text(
            self.tokenizer, conversation, tools, chat_template_kwargs, add_generation_prompt, continue_final_message
        )
        return self.tokenizer.encode(text, add_special_tokens=False)
