"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health,
tokenize / detokenize.

The API server tokenizes, applies the chat template and detokenizes as tokens arrive; the
engine core sees token ids only. Errors have OpenAI's shape, `{"error": {"message", "type",
"param", "code"}}`, with messages naming the field, the value and the limit: a malformed or
out-of-range body is a 400 (never FastAPI's 422), an unknown model a 404, a failed forward
pass a 500, a dead engine core a 503. A client that disconnects aborts its request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from collections.abc import Sequence as SequenceABC
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from atom_core.engine.chat_template import chat_text
from atom_core.sampling_params import MAX_N, choice_seed, truncate_prompt
from atom_core.serve.client import EngineClient, EngineDead, RequestFailed
from atom_core.serve.metrics import Metrics, RequestTimer
from atom_core.serve.protocol import Delta
from atom_core.serve.reasoning_parser import ReasoningParser, ReasoningStream
from atom_core.serve.responses_api import (
    BadResponsesRequest,
    ResponseEvents,
    ResponseShape,
    chat_request,
    response_events,
    response_of,
)
from atom_core.serve.text_stream import TextStream
from atom_core.serve.tool_parser import ToolParser
from atom_core.serve.tools import AutoToolCalls, ForcedToolCalls, tool_calls_for

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    500: "server_error",
    503: "unavailable_error",
}
# The engine's reasons mapped to OpenAI's two: the string or token that stopped it is `stop_reason`.
LENGTH_REASONS = ("max_tokens", "max_model_len")
REFUSED_FIELDS = ("best_of", "suffix")
# Fields a request may carry that this server reads; others are logged once and ignored.
KNOWN_FIELDS = frozenset(
    "model prompt messages max_tokens max_completion_tokens temperature top_p top_k min_p n stop stream "
    "stream_options logprobs top_logprobs echo seed presence_penalty frequency_penalty repetition_penalty "
    "ignore_eos stop_token_ids user tools tool_choice best_of suffix logit_bias min_tokens prompt_logprobs "
    "include_stop_str_in_output chat_template_kwargs add_generation_prompt continue_final_message "
    "structured_outputs response_format guided_json guided_regex guided_choice guided_grammar "
    "allowed_token_ids bad_words truncate_prompt_tokens skip_special_tokens".split()
)
# vLLM's older per-kind fields, read as `structured_outputs` entries.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# SamplingParams fields under another name in a request body
API_NAMES = {"stop_strings": "stop", "structured_output": "response_format"}


logger = logging.getLogger("atom")
_ignored: set[str] = set()  # unknown fields already logged


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def param_of(message: str) -> str | None:
    """The request field a `SamplingParams` error names (its messages start with the field)."""
    import attrs

    from atom_core.sampling_params import SamplingParams

    word = message.split(" ", 1)[0].strip(":,")
    if word not in {f.name for f in attrs.fields(SamplingParams)}:
        return None
    return API_NAMES.get(word, word)


async def watch_disconnect(request: Request, every: float = 0.5) -> None:
    """Return once the client has gone (a non-streamed request is aborted then)."""
    while not await request.is_disconnected():
        await asyncio.sleep(every)


def openai_finish_reason(reason: str | None) -> str | None:
    if reason is None:
        return None
    return "length" if reason in LENGTH_REASONS else "stop"


def _field(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise ApiError(400, f"{name} must be {names}, got {value!r}", name)
    return value


def logprob_count(body: dict[str, Any], name: str, limit: int, default: int | None = None) -> int | None:
    """A count of log probabilities a request asks for, checked here so the 400 names the API's
    field (the engine checks SamplingParams' `logprobs`); `limit`: the server's max_logprobs."""
    n = _field(body, name, (int,), default)
    if n is not None and n < 0 and n != -1:
        raise ApiError(400, f"{name} must be at least 0 (or -1, the whole vocabulary), got {n}", name)
    if n is not None and limit != -1 and (n == -1 or n > limit):
        raise ApiError(400, f"{name}={n} exceeds this server's max_logprobs={limit}", name)
    return n


def sampling_params(body: dict[str, Any], default_max_tokens: int | None, max_logprobs: int) -> dict[str, Any]:
    """SamplingParams fields from an OpenAI request body (vLLM's extras included); its own
    validators name field, value and limit (checked again in the core)."""
    for name in REFUSED_FIELDS:
        if body.get(name) is not None:
            raise ApiError(400, f"{name} is not supported", name)
    if body.get("stream_options") is not None and not body.get("stream"):
        raise ApiError(400, "stream_options is only allowed with stream=true", "stream_options")
    unknown = sorted(set(body) - KNOWN_FIELDS - _ignored)
    if unknown:
        _ignored.update(unknown)
        logger.warning("atom: ignoring request field(s) this server does not read: %s", ", ".join(unknown))
    number = (int, float)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ApiError(400, f"stop must be a string or a list of strings, got {stop!r}", "stop")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", default_max_tokens))
    params: dict[str, Any] = {
        "temperature": _field(body, "temperature", number, 1.0),
        "top_p": _field(body, "top_p", number, 1.0),
        "top_k": _field(body, "top_k", (int,), -1),
        "min_p": _field(body, "min_p", number, 0.0),
        "presence_penalty": _field(body, "presence_penalty", number, 0.0),
        "frequency_penalty": _field(body, "frequency_penalty", number, 0.0),
        "repetition_penalty": _field(body, "repetition_penalty", number, 1.0),
        "max_tokens": max_tokens,
        "seed": _field(body, "seed", (int,)),
        "stop_strings": stop or [],
        "stop_token_ids": _field(body, "stop_token_ids", (list,), []),
        "ignore_eos": _field(body, "ignore_eos", (bool,), False),
        "min_tokens": _field(body, "min_tokens", (int,), 0),
        "include_stop_str_in_output": _field(body, "include_stop_str_in_output", (bool,), False),
        "logit_bias": _field(body, "logit_bias", (dict,)),
        "structured_output": structured_output(body),
        "allowed_token_ids": _field(body, "allowed_token_ids", (list,)),
        "bad_words": _field(body, "bad_words", (list,), []),
        "truncate_prompt_tokens": _field(body, "truncate_prompt_tokens", (int,)),
        "skip_special_tokens": _field(body, "skip_special_tokens", (bool,), True),
    }
    prompt_logprobs = logprob_count(body, "prompt_logprobs", max_logprobs)
    if prompt_logprobs is not None:
        params["prompt_logprobs"] = prompt_logprobs
    return params  # checked whole by `run`, once the endpoint has added its own fields


def structured_output(body: dict[str, Any]) -> dict[str, Any] | None:
    """The request's grammar: vLLM's `structured_outputs` (or its older `guided_*` fields), or
    OpenAI's `response_format` (`json_object`, `json_schema`; `text` is none)."""
    spec = _field(body, "structured_outputs", (dict,))
    guided = {kind: body[name] for name, kind in GUIDED_FIELDS.items() if body.get(name) is not None}
    response_format = _field(body, "response_format", (dict,))
    if response_format is not None:
        kind = response_format.get("type")
        if kind == "json_object":
            guided["json_object"] = True
        elif kind == "json_schema":
            schema = (response_format.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise ApiError(
                    400, "response_format.json_schema.schema must be a JSON schema object", "response_format"
                )
            guided["json"] = schema
        elif kind != "text":
            raise ApiError(
                400, f"response_format.type must be text, json_object or json_schema, got {kind!r}", "response_format"
            )
    if spec is not None and guided:
        raise ApiError(400, "give structured_outputs or response_format (or guided_*), not both", "structured_outputs")
    return spec if spec is not None else guided or None  # its fields are checked by SamplingParams


def build_app(
    client: EngineClient, tokenizer: Any, served_model_name: str, health_timeout: float = 5.0,
    tool_parser: type[ToolParser] | None = None, reasoning_parser: type[ReasoningParser] | None = None,
) -> FastAPI:  # fmt: skip
    app = FastAPI(title="Atom", docs_url=None, redoc_url=None)
    ready = client.ready
    assert ready is not None
    max_model_len = ready.max_model_len

    metrics = Metrics()
    metrics.start(client.size)
    client.on_stats = metrics.engine_stats

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(error_body(e.status, e.message, e.param), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(400, str(e)), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code)

    @app.exception_handler(EngineDead)
    async def _dead(request: Request, e: EngineDead) -> JSONResponse:
        return JSONResponse(error_body(503, str(e)), status_code=503)

    async def read_body(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON: {e}") from None
        except RecursionError:
            raise ApiError(400, "the body is not valid JSON: nested too deeply") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}")
        model = body.get("model")
        if model is not None and model != served_model_name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {served_model_name!r}", "model")
        return body

    def encode(text: str, field: str, **options: Any) -> list[int]:
        """`text`'s token ids; text the tokenizer cannot take (a lone UTF-16 surrogate) is a 400."""
        try:
            return tokenizer.encode(text, **options)
        except (TypeError, ValueError, UnicodeError) as e:
            raise ApiError(400, f"{field} is not text the tokenizer can read: {e}", field) from None

    def check_token_ids(ids: list[int], field: str) -> None:
        bad = next((t for t in ids if not 0 <= t < ready.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"{field} token {bad} is outside the vocabulary [0, {ready.vocab_size})", field)

    def truncated(ids: list[int], params: dict[str, Any]) -> list[int]:
        """The prompt as `truncate_prompt_tokens` leaves it (its last k tokens)."""
        try:
            return truncate_prompt(ids, params["truncate_prompt_tokens"], max_model_len)
        except ValueError as e:
            raise ApiError(400, str(e), "truncate_prompt_tokens") from None

    def check_prompt(ids: list[int], max_tokens: int | None) -> None:
        if not ids:
            raise ApiError(400, "the prompt is empty: it must hold at least one token", "prompt")
        check_token_ids(ids, "prompt")
        if len(ids) + (max_tokens or 0) > max_model_len:
            raise ApiError(
                400,
                f"the prompt's {len(ids)} tokens plus max_tokens={max_tokens} exceed max_model_len={max_model_len}",
                "max_tokens",
            )

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while every engine core lives and speaks (through a long step too), else 503."""
        try:
            client.check_health(health_timeout)
        except EngineDead as e:
            return JSONResponse(error_body(503, str(e)), status_code=503)
        return JSONResponse({})

    @app.get("/version")
    async def version() -> dict[str, str]:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as package_version

        try:
            return {"version": package_version("atom-engine")}
        except PackageNotFoundError:  # run from a source tree that was never installed
            return {"version": "unknown"}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": served_model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "atom",
                    "max_model_len": max_model_len,
                }
            ],
        }

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await read_body(request)
        if "messages" in body:
            ids = chat_prompt(body)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise ApiError(400, f"prompt must be a string, got {prompt!r}", "prompt")
            ids = encode(prompt, "prompt", add_special_tokens=_field(body, "add_special_tokens", (bool,), True))
        return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        """What a client needs to tokenize through this server (lm-eval's remote tokenizer)."""
        return {
            "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token,
            "pad_token": tokenizer.pad_token,
            "chat_template": getattr(tokenizer, "chat_template", None),
            "model_max_length": max_model_len,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await read_body(request)
        tokens = body.get("tokens")
        if not (isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)):
            raise ApiError(400, f"tokens must be a list of token ids, got {tokens!r}", "tokens")
        check_token_ids(tokens, "tokens")
        return {"prompt": tokenizer.decode(tokens)}

    def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
        kwargs = _field(body, "chat_template_kwargs", (dict,), {})
        reserved = sorted(
            set(kwargs)
            & {"messages", "conversation", "tools", "tokenize", "add_generation_prompt", "continue_final_message"}
        )
        if reserved:
            raise ApiError(400, f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
        return kwargs

    def chat_prompt(body: dict[str, Any]) -> list[int]:
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, "this model has no chat template; use /v1/completions")
        generation_prompt = _field(body, "add_generation_prompt", (bool,), True)
        continue_final = _field(body, "continue_final_message", (bool,), False)
        if generation_prompt and continue_final:
            raise ApiError(
                400, "continue_final_message needs add_generation_prompt=false (vLLM's rule)", "continue_final_message"
            )
        try:
            text = chat_text(
                tokenizer, body.get("messages"), body.get("tools"), template_kwargs(body), generation_prompt,
                continue_final,
            )  # fmt: skip
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        return encode(text, "messages", add_special_tokens=False)

    def prompts_of(body: dict[str, Any]) -> list[list[int]]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return [encode(prompt, "prompt")]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [list(prompt)]
        if isinstance(prompt, list) and prompt:
            out = []
            for p in prompt:
                if isinstance(p, str):
                    out.append(encode(p, "prompt"))
                elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                    out.append(list(p))
                else:
                    raise ApiError(400, f"prompt items must be strings or lists of token ids, got {p!r}", "prompt")
            return out
        raise ApiError(400, f"prompt must be a string, token ids, or a list of those, got {prompt!r}", "prompt")

    async def run(
        request: Request, kind: str, prompts: list[list[int]], params: dict[str, Any], body: dict[str, Any],
        tools: ForcedToolCalls | AutoToolCalls | None = None, reasoning: type[ReasoningParser] | None = None,
    ) -> Any:  # fmt: skip
        from atom_core.sampling_params import SamplingParams

        try:
            SamplingParams(**params)
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e), param_of(str(e))) from None
        for ids in prompts:
            check_prompt(ids, params["max_tokens"])
        n = _field(body, "n", (int,), 1)
        if not 1 <= n <= MAX_N:
            raise ApiError(400, f"n must be between 1 and {MAX_N}, got {n}", "n")
        # One request per choice: prompt p's children are choices p * n ... p * n + n - 1, a
        # seeded request's child j seeded seed + j (greedy children are alike).
        jobs = [(ids, {**params, "seed": choice_seed(params["seed"], j)}) for ids in prompts for j in range(n)]
        created, rid = int(time.time()), f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        stream = bool(body.get("stream"))
        stream_options = body.get("stream_options") or {}
        usage_wanted = bool(stream_options.get("include_usage")) if stream else True
        # vLLM's: every chunk carries the usage so far
        usage_always = usage_wanted and stream and bool(stream_options.get("continuous_usage_stats"))
        merged: asyncio.Queue = asyncio.Queue()  # (choice, delta or exception), every choice at once

        rank = client.pick_rank(len(jobs))  # every choice of a request on one rank (its children share blocks)

        async def pump(i: int, ids: list[int], job_params: dict[str, Any]) -> None:
            timer = RequestTimer(metrics, len(ids), rank)
            try:
                async for delta in client.generate(f"{rid}-{i}", ids, job_params, rank):
                    timer.add(delta, openai_finish_reason(delta.finish_reason))
                    merged.put_nowait((i, delta))
            except asyncio.CancelledError:  # the client left (or a sibling choice failed): aborted
                timer.abort()
                raise
            except Exception as e:  # RequestFailed, EngineDead: to the consumer
                merged.put_nowait((i, e))
            finally:
                client.done(rank)

        tasks = [asyncio.create_task(pump(i, ids, p)) for i, (ids, p) in enumerate(jobs)]

        async def deltas() -> AsyncIterator[tuple[int, Delta]]:
            """Every choice's deltas as they come, until each has finished; cancelling the pumps
            (on leaving early) aborts their requests in the core."""
            left = len(jobs)
            try:
                while left:
                    i, item = await merged.get()
                    if isinstance(item, Exception):
                        raise item
                    left -= item.finished
                    yield i, item
            finally:
                for task in tasks:
                    task.cancel()

        texts = [
            TextStream(tokenizer, params["stop_strings"], params["include_stop_str_in_output"],
                       params["skip_special_tokens"])
            for _ in jobs
        ]  # fmt: skip
        chat_logprobs = kind == "chat" and bool(body.get("logprobs"))
        wants_logprobs = params.get("logprobs") is not None
        top_n = params.get("logprobs") or 0
        echo = kind == "completion" and bool(body.get("echo"))
        score_only = bool(body.get("_score_only"))
        wants_prompt_lp = body.get("prompt_logprobs") is not None
        object_name = "chat.completion" if kind == "chat" else "text_completion"

        def usage(finals: list[Delta | None], num_completion: int) -> dict[str, Any]:
            prompt_tokens = sum(len(p) for p in prompts)
            cached = sum(d.num_cached_tokens for d in finals[::n] if d is not None)
            return {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": num_completion,
                "total_tokens": prompt_tokens + num_completion,
                "prompt_tokens_details": {"cached_tokens": cached},
            }

        if not stream:
            finals: list[Delta | None] = [None] * len(jobs)
            logprobs: list[list[dict[int, float]]] = [[] for _ in jobs]
            prompt_logprobs: list[list[dict[int, float] | None]] = [[] for _ in jobs]

            async def collect() -> None:
                async for i, delta in deltas():
                    texts[i].add(delta.token_ids, delta.finished, delta.finish_reason, delta.stop_reason)
                    logprobs[i] += delta.logprobs or []
                    prompt_logprobs[i] += delta.prompt_logprobs or []
                    if delta.finished:
                        finals[i] = delta

            collecting = asyncio.create_task(collect())
            watching = asyncio.create_task(watch_disconnect(request))
            try:
                await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                watching.cancel()
                if not collecting.done():  # the client left: abort the choices still running
                    collecting.cancel()
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(collecting, return_exceptions=True)
            if collecting.cancelled():
                raise ApiError(499, "the client disconnected")
            try:
                collecting.result()
            except RequestFailed as e:
                raise ApiError(e.status, str(e)) from None
            choices = []
            for i, (text, final) in enumerate(zip(texts, finals)):
                assert final is not None
                content = text.text
                reason = openai_finish_reason(final.finish_reason)
                if final.finish_reason == "error":
                    raise ApiError(500, "the engine's forward pass failed for this request")
                choice: dict[str, Any] = {"index": i, "finish_reason": reason, "stop_reason": final.stop_reason}
                if wants_prompt_lp:  # vLLM's extra: per prompt token, id -> entry
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt_logprobs[i])
                tokens = text.token_ids
                if score_only:  # echo with max_tokens 0: the token run to score the prompt is dropped
                    tokens, content, logprobs[i] = [], "", []
                    choice["finish_reason"], choice["stop_reason"] = "length", None
                thought: dict[str, Any] = {}
                if reasoning is not None:  # vLLM's field, and its older name
                    said, content = reasoning().split(content, final=True)
                    thought = {"reasoning": said or None, "reasoning_content": said or None}
                message = tools.message(content) if tools is not None else None
                if tools is not None and message is not None:  # the reply made calls: OpenAI's tool calls
                    choice["message"] = {**message, **thought}
                    choice["finish_reason"] = tools.reason(reason)
                    choice["logprobs"] = chat_logprob_entries(tokens, logprobs[i], top_n) if chat_logprobs else None
                elif kind == "chat":
                    choice["message"] = {"role": "assistant", "content": content, **thought}
                    choice["logprobs"] = chat_logprob_entries(tokens, logprobs[i], top_n) if chat_logprobs else None
                else:
                    prompt_text = tokenizer.decode(jobs[i][0]) if echo else ""
                    choice["text"] = prompt_text + content
                    choice["logprobs"] = None
                    if wants_logprobs:
                        lp = completion_logprobs(tokens, logprobs[i], len(prompt_text), top_n)
                        if echo:
                            lp = join_logprobs(completion_logprobs(jobs[i][0], prompt_logprobs[i], 0, top_n), lp)
                        choice["logprobs"] = lp
                choices.append(choice)
            num_completion = 0 if score_only else sum(len(t.token_ids) for t in texts)
            return {
                "id": rid, "object": object_name, "created": created, "model": served_model_name,
                "choices": choices, "usage": usage(finals, num_completion),
            }  # fmt: skip

        streams = [tools.stream() for _ in jobs] if tools is not None else None
        thinking = [ReasoningStream(reasoning()) for _ in jobs] if reasoning is not None else None
        sent_text = [""] * len(jobs)  # each choice's text handed out so far
        answers = [""] * len(jobs)  # each choice's text after its reasoning, so far

        def chat_delta(i: int, new: str, finished: bool) -> dict[str, Any]:
            """A chat delta: the reasoning this text adds, then the answer's new text as content or
            what the tool calls make of it (content, `tool_calls`); {}: nothing to send yet."""
            sent_text[i] += new
            text = texts[i].text if finished else sent_text[i]
            said = ""
            if thinking is not None:
                said, answer = thinking[i].add(text, finished)
                new, answers[i] = answer[len(answers[i]) :], answer
            else:
                answers[i] = text
            message = (
                ({"content": new} if new else {}) if streams is None else streams[i].delta(new, answers[i], finished)
            )
            return {"reasoning": said, "reasoning_content": said, **message} if said else message

        async def events() -> AsyncIterator[str]:
            chunk_name = "chat.completion.chunk" if kind == "chat" else "text_completion"

            def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
                body = {
                    "id": rid,
                    "object": chunk_name,
                    "created": created,
                    "model": served_model_name,
                    "choices": choices,
                }
                if usage_always and "usage" not in extra:
                    extra["usage"] = usage(finals, sum(len(t.token_ids) for t in texts))
                return f"data: {json.dumps({**body, **extra})}\n\n"

            finals: list[Delta | None] = [None] * len(jobs)
            offsets = [0] * len(jobs)  # characters streamed, for completions' text_offset
            if kind == "chat":
                for i in range(len(jobs)):
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            try:
                async for i, delta in deltas():
                    if delta.finished and delta.finish_reason == "error":
                        raise ApiError(500, "the engine's forward pass failed for this request")
                    new = texts[i].add(delta.token_ids, delta.finished, delta.finish_reason, delta.stop_reason)
                    # vLLM's extra, streamed with a choice's first tokens
                    prompt_lp = (
                        vllm_prompt_logprobs(delta.prompt_logprobs)
                        if wants_prompt_lp and delta.prompt_logprobs
                        else None
                    )
                    if kind == "chat":
                        message = chat_delta(i, new, delta.finished)
                        new = message.get("content", "")
                    else:
                        message = {"content": new} if new else {}
                    if message or prompt_lp or (delta.token_ids and (chat_logprobs or wants_logprobs)):
                        lp = delta.logprobs or []
                        if kind == "chat":
                            piece: dict[str, Any] = {"delta": message or {"content": ""}}
                            if chat_logprobs:
                                piece["logprobs"] = chat_logprob_entries(delta.token_ids, lp, top_n)
                        else:
                            piece = {"text": new}
                            if wants_logprobs:
                                piece["logprobs"] = completion_logprobs(delta.token_ids, lp, offsets[i], top_n)
                        if prompt_lp:
                            piece["prompt_logprobs"] = prompt_lp
                        offsets[i] += len(new)
                        yield chunk([{"index": i, **piece, "finish_reason": None}])
                    if delta.finished:
                        finals[i] = delta
                        reason = openai_finish_reason(delta.finish_reason)
                        if streams is not None:
                            reason = streams[i].reason(reason)
                        end: dict[str, Any] = {"delta": {}} if kind == "chat" else {"text": ""}
                        yield chunk([{"index": i, **end, "finish_reason": reason, "stop_reason": delta.stop_reason}])
                if usage_wanted:
                    yield chunk([], usage=usage(finals, sum(len(t.token_ids) for t in texts)))
            except (ApiError, RequestFailed, EngineDead) as e:
                status = getattr(e, "status", 503)
                yield f"data: {json.dumps(error_body(status, str(e)))}\n\n"
            finally:  # a client gone mid-stream closes this generator: abort what still runs
                for task in tasks:
                    task.cancel()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id])

    def top_entries(entries: dict[int, float], count: int) -> list[tuple[int, float]]:
        return sorted(entries.items(), key=lambda kv: -kv[1])[:count]

    def completion_logprobs(
        tokens: list[int], entries: SequenceABC[dict[int, float] | None], offset: int, top_n: int
    ) -> dict[str, Any]:
        """The completions API's logprobs: per token its text, its log probability and the top
        ones (null where there is no entry: an echoed prompt's first token)."""
        texts = [token_text(t) for t in tokens]
        offsets = []
        for piece in texts:
            offsets.append(offset)
            offset += len(piece)
        entries = (list(entries) + [None] * len(tokens))[: len(tokens)]
        return {
            "tokens": texts,
            "token_logprobs": [None if e is None else e.get(t) for t, e in zip(tokens, entries)],
            # the top ones and the chosen token, as vLLM lists them (up to logprobs + 1 entries)
            "top_logprobs": [
                None
                if e is None
                else {token_text(k): v for k, v in [*top_entries(e, top_n), (t, e.get(t))] if v is not None}
                for t, e in zip(tokens, entries)
            ],
            "text_offset": offsets,
        }

    def vllm_prompt_logprobs(entries: list[dict[int, float] | None]) -> list[dict[str, Any] | None]:
        return [
            None if e is None else {str(t): {"logprob": v, "decoded_token": token_text(t)} for t, v in e.items()}
            for e in entries
        ]

    def join_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
        return {k: first[k] + second[k] for k in first}

    def chat_logprob_entries(tokens: list[int], entries: list[dict[int, float]], top_n: int) -> dict[str, Any]:
        """The chat API's logprobs: `content`, one entry per token, with its `top_logprobs`."""

        def entry(token_id: int, logprob: float | None) -> dict[str, Any]:
            text = token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                {**entry(t, e.get(t)), "top_logprobs": [entry(k, v) for k, v in top_entries(e, top_n)]}
                for t, e in zip(tokens, entries)
            ]
        }

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await read_body(request)
        if body.get("tools"):
            raise ApiError(400, "tools are not supported on completions (chat completions take them)", "tools")
        params = sampling_params(body, 16, ready.max_logprobs)
        logprobs = logprob_count(body, "logprobs", ready.max_logprobs)
        if logprobs is not None:
            params["logprobs"] = logprobs
        if _field(body, "echo", (bool,), False):
            if body.get("stream"):
                raise ApiError(400, "echo is not supported with stream", "echo")
            if logprobs is not None:
                params["prompt_logprobs"] = max(logprobs, params.get("prompt_logprobs") or 0)
            if params["max_tokens"] == 0:  # score the prompt only: one token is run, then dropped
                params["max_tokens"] = 1
                body = {**body, "_score_only": True}
        elif params["max_tokens"] == 0:
            raise ApiError(400, "max_tokens=0 is only allowed with echo (scoring the prompt)", "max_tokens")
        return await run(request, "completion", [truncated(ids, params) for ids in prompts_of(body)], params, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await chat_response(request, await read_body(request))

    @app.post("/v1/responses")
    async def responses(request: Request) -> Any:
        """OpenAI's Responses API, answered through the chat path (responses_api.py)."""
        body = await read_body(request)
        try:
            chat = chat_request(body)
        except BadResponsesRequest as e:
            raise ApiError(400, str(e), e.param) from None
        shape = ResponseShape(body, served_model_name)

        def count(text: str) -> int:
            return len(tokenizer.encode(text, add_special_tokens=False))

        try:
            result = await chat_response(request, chat)
        except ApiError as e:  # the chat path's names for the fields, as this request gave them
            if e.param == "max_tokens":
                raise ApiError(
                    e.status, str(e).replace("max_tokens", "max_output_tokens"), "max_output_tokens"
                ) from None
            raise
        if isinstance(result, StreamingResponse):
            events = response_events(ResponseEvents(shape, count), result.body_iterator)
            return StreamingResponse(events, media_type="text/event-stream")
        return response_of(shape, result, count)

    async def chat_response(request: Request, body: dict[str, Any]) -> Any:
        try:
            tools = tool_calls_for(body, tool_parser)
        except ValueError as e:
            raise ApiError(400, str(e), "tool_choice" if "tool_choice" in str(e) else "tools") from None
        params = sampling_params(body, None, ready.max_logprobs)
        if isinstance(tools, AutoToolCalls) and not tools.parser.skip_special_tokens:
            params["skip_special_tokens"] = False  # the calls' markers are special tokens
        ids = truncated(chat_prompt(body), params)
        if isinstance(tools, ForcedToolCalls):
            if params["structured_output"] is not None:
                raise ApiError(
                    400, "give tool_choice or response_format (or structured_outputs), not both", "tool_choice"
                )
            params["structured_output"] = {"json": tools.schema()}
        if _field(body, "logprobs", (bool,), False):
            params["logprobs"] = logprob_count(body, "top_logprobs", ready.max_logprobs, 0)
        elif body.get("top_logprobs") is not None:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        if params["max_tokens"] is None:
            params["max_tokens"] = max(1, max_model_len - len(ids))
        # a reply a grammar shapes from its first token has no reasoning to split off
        thinks = reasoning_parser if params["structured_output"] is None else None
        return await run(request, "chat", [ids], params, body, tools, thinks)

    return app
