"""`atom serve` as a client sees it: the `openai` client and raw HTTP against a server process
on a free loopback port, with the default model; offline `LLMEngine` is the reference."""

from __future__ import annotations

import itertools
import json
import os
import random
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from conftest import CAT_SCHEMA

from atom_core import SamplingParams
from atom_core.engine.fetch import fetch_default_model
from atom_core.engine.llm_engine import LLMEngine
from atom_core.serve import protocol

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


# Where this worker's next port is looked for: a random start, so that two test runs at once
# seldom try the same ports first.
_PORTS = itertools.count(random.randrange(1000))


def free_port() -> int:
    """A free loopback port for a test's server: below Linux's ephemeral range (32768 up), in a
    block of 1000 for each pytest-xdist worker. A port the OS handed out (a bind to port 0,
    then closed) is back in that range until the server binds it, seconds later: any outgoing
    connection may take it as its local port meanwhile (the server then cannot bind), and
    another worker's server may be handed it too (the health check would answer for that one)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    base = 20000 + 1000 * (int(worker) % 12 if worker.isdigit() else 0)
    for _ in range(1000):
        port = base + next(_PORTS) % 1000
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use
                continue
            return port
    raise RuntimeError(f"no free port in {base}-{base + 999}")


def start_server(*flags: str, env: dict[str, str] | None = None, log=None):
    """`log`: a file for the server's output (else a pipe, read if it fails to start)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "atom_core.cli", "serve", "--port", str(port), "--max-model-len", "1024", *flags],
        stdout=subprocess.PIPE if log is None else log,
        stderr=subprocess.STDOUT,
        text=True,
        env=None if env is None else {**os.environ, **env},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        if proc.poll() is not None:
            pytest.fail(f"atom serve exited with {proc.returncode}:\n{proc.stdout.read() if log is None else ''}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail("atom serve was not healthy within 600 s")
        time.sleep(1)
    return proc, url


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def server():
    proc, url = start_server()
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def offline():
    return LLMEngine(fetch_default_model(quiet=True), max_model_len=1024)


def sse_events(response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_greedy_completion_equals_offline_and_counts_usage(client, model_name, offline):
    want = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.choices[0].text == want["text"]
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want["num_prompt_tokens"], 16)
    ids = offline.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=16, temperature=0)
    assert by_ids.choices[0].text == want["text"]


def test_streamed_text_equals_the_whole_for_completions_and_chat(client, model_name, offline):
    whole = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=24, temperature=0)
    parts = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in parts if c.choices) == whole.choices[0].text
    want = offline.chat(QUESTION, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    chat = client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=40, temperature=0)
    assert chat.choices[0].message.content == want["text"]
    chunks = list(
        client.chat.completions.create(
            model=model_name, messages=QUESTION, max_tokens=40, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want["text"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want["token_ids"])
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "stop"


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, model_name):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.completions.create(
            model=model_name, prompt=PROMPT, max_tokens=8, temperature=0, stream=True, stream_options=options
        )
    )
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 0 for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 8 and counts[0] < 8
    assert chunks[-1].choices == [] and all(
        c.usage.total_tokens == c.usage.prompt_tokens + n for c, n in zip(chunks, counts)
    )
    plain = list(
        client.completions.create(
            model=model_name, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert [c.usage is None for c in plain] == [True] * (len(plain) - 1) + [False]


def test_sse_framing_ends_with_done(server, model_name):
    body = {"model": model_name, "messages": QUESTION, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["delta"] == {} and events[-2]["choices"][0]["finish_reason"] == "length"


def test_a_stop_string_never_reaches_the_stream_and_is_named(client, model_name, offline):
    want = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]["text"]
    stop = want.split()[1]  # a word the greedy text holds
    chunks = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop], stream=True
    )
    texts, reasons = [], []
    for c in chunks:
        texts.append(c.choices[0].text)
        reasons.append((c.choices[0].finish_reason, getattr(c.choices[0], "stop_reason", None)))
    text = "".join(texts)
    assert stop not in text and text == want[: want.find(stop)]
    assert reasons[-1] == ("stop", stop)
    whole = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop)
    assert whole.choices[0].text == text and whole.choices[0].finish_reason == "stop"


def test_several_prompts_run_together_in_one_request(client, model_name, offline):
    prompts = [PROMPT, "Once upon a time"]
    want = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    r = client.completions.create(model=model_name, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [w["text"] for w in want]


def test_a_repeated_prompt_reports_cached_tokens(client, model_name):
    prompt = "Tell me about the sea. " * 40  # about 240 tokens: whole blocks to share
    for _ in range(2):
        r = client.completions.create(model=model_name, prompt=prompt, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"model": "nope", "prompt": "x"}, 404, "model 'nope' does not exist"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature must be"),
        ({"prompt": "x", "temperature": "hot"}, 400, "temperature must be int or float, got 'hot'"),
        ({"prompt": "x", "max_tokens": 100000}, 400, "exceed max_model_len=1024"),
        ({"prompt": "x", "structured_outputs": {"regexp": "a"}}, 400, "unknown field(s) regexp"),
        ({"prompt": [10**9]}, 400, "outside the vocabulary"),
        ({"prompt": 5}, 400, "prompt must be"),
        ({"prompt": "x", "best_of": 2}, 400, "best_of is not supported"),
        ({"prompt": "x", "stop": 3}, 400, "stop must be a string or a list of strings"),
        ({"prompt": "x", "tools": [{"type": "function"}]}, 400, "tools are not supported"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options is only allowed with stream"),
        ({"prompt": "x", "include_stop_str_in_output": "yes"}, 400, "include_stop_str_in_output must be bool"),
    ],
)
def test_bad_bodies_get_openai_errors_and_the_server_goes_on(server, body, status, says):
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert r.status_code == status
    error = r.json()["error"]
    assert says in error["message"] and error["code"] == status
    assert error["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    ok = httpx.post(f"{server}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "frobnicate": 1}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_a_sampling_error_names_its_field_as_param(server):
    for field, value in (("temperature", -1), ("top_p", 2), ("stop", [""])):
        r = httpx.post(f"{server}/v1/completions", json={"prompt": "x", field: value}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.json()
    # log probability counts: the API's own field named, the server's limit (vLLM's 20) and the value
    messages = [{"role": "user", "content": "x"}]
    for path, body, field in (
        ("completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("completions", {"prompt": "x", "prompt_logprobs": 25}, "prompt_logprobs"),
        ("completions", {"prompt": "x", "logprobs": -2}, "logprobs"),
        ("chat/completions", {"messages": messages, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat/completions", {"messages": messages, "prompt_logprobs": 21}, "prompt_logprobs"),
    ):
        r = httpx.post(f"{server}/v1/{path}", json=body, timeout=60)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == field and str(body[field]) in error["message"], error
        assert "max_logprobs=20" in error["message"] or body[field] < 0, error


@pytest.mark.parametrize(
    ("path", "content", "says"),
    [
        ("/v1/completions", b'{"prompt": "\\ud800 hi"}', "prompt is not text the tokenizer can read"),
        ("/v1/completions", b"[" * 100000, "nested too deeply"),
        ("/tokenize", b'{"prompt": "\\ud800"}', "prompt is not text the tokenizer can read"),
        ("/detokenize", b'{"tokens": [-1]}', "tokens token -1 is outside the vocabulary"),
        ("/detokenize", b'{"tokens": [99999999]}', "outside the vocabulary"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}',
            "needs logprobs",
        ),
    ],
)
def test_bodies_the_tokenizer_or_parser_cannot_take_are_400s(server, path, content, says):
    r = httpx.post(f"{server}{path}", content=content, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200


def test_a_wrong_method_is_a_client_error_and_version_answers(server):
    r = httpx.get(f"{server}/v1/completions", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    from importlib.metadata import version

    assert httpx.get(f"{server}/version", timeout=10).json() == {"version": version("atom-engine")}


def test_messages_without_content_render_as_empty_text(client, model_name):
    """An assistant turn that only called tools has `content: null` (OpenAI's own history)."""
    messages = [
        {"role": "user", "content": "What is the weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
        ]},
        {"role": "user"},
        {"role": "user", "content": "Thanks."},
    ]  # fmt: skip
    r = client.chat.completions.create(model=model_name, messages=messages, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.prompt_tokens > 0


WEATHER_TOOLS = [
    {"type": "function", "function": {
        "name": "weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"], "additionalProperties": False},
    }},
    {"type": "function", "function": {
        "name": "time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False},
    }},
]  # fmt: skip
TOOL_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_a_named_tool_choice_answers_with_that_call_whole_and_streamed(client, model_name):
    choice = {"type": "function", "function": {"name": "weather"}}
    ask = dict(
        model=model_name, messages=TOOL_QUESTION, tools=WEATHER_TOOLS, tool_choice=choice, temperature=0, max_tokens=40
    )
    r = client.chat.completions.create(**ask)
    message = r.choices[0].message
    assert message.content is None and len(message.tool_calls) == 1 and r.choices[0].finish_reason == "stop"
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "weather" and call.id.startswith("chatcmpl-tool-")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str) and len(arguments["city"]) <= 20
    chunks = [c for c in client.chat.completions.create(stream=True, **ask) if c.choices]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "weather" and all(d.index == 0 for d in deltas)
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert not any(c.choices[0].delta.content for c in chunks)


def test_a_required_tool_choice_answers_with_calls_of_the_tools(client, model_name):
    ask = dict(
        model=model_name,
        messages=TOOL_QUESTION,
        tools=WEATHER_TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=80,
    )
    r = client.chat.completions.create(**ask)
    calls = r.choices[0].message.tool_calls
    assert calls and all(c.function.name in ("weather", "time") for c in calls)
    assert r.choices[0].finish_reason == "tool_calls"  # OpenAI's and vLLM's for required calls
    for c in calls:
        arguments = json.loads(c.function.arguments)
        assert set(arguments) == ({"city"} if c.function.name == "weather" else {"zone"})
    chunks = [c for c in client.chat.completions.create(stream=True, **ask) if c.choices]
    streamed = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(d.function.name, d.function.arguments) for d in streamed] == [
        (c.function.name, c.function.arguments) for c in calls
    ]


@pytest.mark.parametrize(
    ("tools", "choice", "says"),
    [
        (WEATHER_TOOLS, "auto", 'tool_choice "auto"'),
        (WEATHER_TOOLS, None, 'tool_choice "auto"'),
        (WEATHER_TOOLS, {"type": "function", "function": {"name": "nope"}}, "'nope', which is not among the tools"),
        ([{"type": "function"}], "required", "tools[0] must be"),
        (None, "required", "tool_choice 'required' needs tools"),
    ],
)
def test_tool_choices_this_server_cannot_serve_are_400s(server, tools, choice, says):
    body = {
        "messages": TOOL_QUESTION,
        "max_tokens": 4,
        **({"tools": tools} if tools else {}),
        **({"tool_choice": choice} if choice else {}),
    }
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    ok = httpx.post(
        f"{server}/v1/chat/completions", json={**body, "tools": WEATHER_TOOLS, "tool_choice": "none"}, timeout=60
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


def test_malformed_json_is_a_400_not_a_422(server):
    r = httpx.post(f"{server}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": "hi"}, timeout=60)
    assert r.status_code == 400 and "messages must be a non-empty list" in r.json()["error"]["message"]


def test_a_client_that_leaves_mid_stream_does_not_stop_the_others(server, client, model_name):
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=120) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break  # leave: the server aborts the request
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200
    assert settles_idle(server, 5)  # the aborted request's blocks are back within a step or two


def test_a_stream_shorter_than_its_stop_string_is_sent_once(client, model_name, offline):
    """While the text is shorter than the longest stop string nothing may go out twice."""
    stop = "\nObservation: this never comes"
    want = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]["text"]
    assert len(want) < len(stop)
    for kind in ("completion", "chat"):
        if kind == "completion":
            chunks = client.completions.create(
                model=model_name, prompt=PROMPT, max_tokens=6, temperature=0, stop=[stop], stream=True
            )
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            assert text == want
        else:
            whole = client.chat.completions.create(
                model=model_name, messages=QUESTION, max_tokens=6, temperature=0, stop=[stop]
            )
            chunks = client.chat.completions.create(
                model=model_name, messages=QUESTION, max_tokens=6, temperature=0, stop=[stop], stream=True
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == whole.choices[0].message.content


def test_text_stream_hands_out_each_character_once_whatever_the_stop_strings(offline):
    from atom_core.serve.text_stream import TextStream

    ids = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]["token_ids"]
    whole = offline.tokenizer.decode(ids, skip_special_tokens=True)
    for stop in ([], ["zz"], ["\nObservation: a stop string longer than the first tokens' text"]):
        stream = TextStream(offline.tokenizer, stop)
        pieces = [stream.add([t]) for t in ids[:-1]] + [stream.add([ids[-1]], True, "max_tokens")]
        assert "".join(pieces) == whole == stream.text


def test_text_stream_decodes_incrementally_and_ends_on_the_whole_decode(offline):
    """Streamed pieces join to the text decoded whole, for text with characters split over
    several tokens and for random ids (special tokens kept or not), however the ids arrive;
    and, a token at a time, each decode before the end reads a few tokens, not the reply so far
    (random ids may leave a character unfinished for longer)."""
    import random

    from atom_core.serve.text_stream import TextStream

    tokenizer = offline.tokenizer
    text = "Grüße aus Köln 🎉🚀 — 東京タワー, naïve café; emoji 👩‍👩‍👧 end. " * 12
    rng = random.Random(7)
    sequences = [tokenizer.encode(text), [rng.randrange(len(tokenizer)) for _ in range(400)]]
    read = []

    class Counting:
        def decode(self, ids, **kw):
            read.append(len(ids))
            return tokenizer.decode(ids, **kw)

    for ids, bound in zip(sequences, (12, None)):
        for skip in (True, False):
            for chunk in (1, 3, 7):
                stream, pieces, read[:] = TextStream(Counting(), [], skip_special=skip), [], []
                for at in range(0, len(ids), chunk):
                    last = at + chunk >= len(ids)
                    pieces.append(stream.add(ids[at : at + chunk], last, "max_tokens" if last else None))
                    if not last and bound and chunk == 1:  # a decode step's token at a time
                        assert max(read, default=0) <= bound, max(read)
                assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip) == stream.text


def test_include_stop_str_in_output_keeps_the_stop_string(client, model_name, offline):
    want = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]["text"]
    stop = want.split()[1]
    kept = offline.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=16, stop_strings=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0]  # fmt: skip
    assert kept["text"] == want[: want.find(stop) + len(stop)] and kept["stop_reason"] == stop
    extra = {"include_stop_str_in_output": True}
    whole = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop], extra_body=extra
    )
    chunks = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop], stream=True, extra_body=extra
    )
    assert whole.choices[0].text == "".join(c.choices[0].text for c in chunks if c.choices) == kept["text"]


def settles_idle(server, seconds: float) -> bool:
    """Whether rank 0 runs no request and holds no KV block within `seconds` (/metrics)."""
    deadline = time.time() + seconds
    while True:
        values = metric_values(server)
        idle = [values[f'atom:{name}{{engine="0"}}'] for name in ("num_requests_running", "kv_cache_usage_perc")]
        if idle == [0.0, 0.0]:
            return True
        if time.time() > deadline:
            return False
        time.sleep(0.2)


def metric_values(server) -> dict[str, float]:
    text = httpx.get(f"{server}/metrics", timeout=10).text
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))}


def test_metrics_count_requests_and_tokens(server, client, model_name):
    before = metric_values(server)
    client.completions.create(model=model_name, prompt=PROMPT, max_tokens=3, temperature=0)
    after = metric_values(server)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew('atom:generation_tokens_total{engine="0"}') == 3
    assert grew('atom:request_success_total{engine="0",finished_reason="length"}') == 1
    assert grew('atom:prompt_tokens_total{engine="0"}') == grew('atom:prefix_cache_queries_total{engine="0"}') > 0
    assert grew('atom:time_to_first_token_seconds_count{engine="0"}') == 1
    assert grew('atom:request_queue_time_seconds_count{engine="0"}') == 1
    # the queue ends at the first step, the first token comes after that step
    queued = grew('atom:request_queue_time_seconds_sum{engine="0"}')
    assert 0 <= queued < grew('atom:time_to_first_token_seconds_sum{engine="0"}')
    assert after['atom:num_requests_waiting{engine="0"}'] == 0
    # every series is there from the start (at zero until it counts), as vLLM exports them
    assert 'atom:request_success_total{engine="0",finished_reason="abort"}' in after


def test_tokenize_and_detokenize(server, offline):
    r = httpx.post(f"{server}/tokenize", json={"prompt": PROMPT}).json()
    assert r["tokens"] == offline.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    assert httpx.post(f"{server}/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == PROMPT
    chat = httpx.post(f"{server}/tokenize", json={"messages": QUESTION}).json()
    assert chat["tokens"] == offline.apply_chat_template(QUESTION)


def test_the_core_refuses_frames_that_are_not_its_messages():
    """What arrives on the core's socket is decoded against the message union, never unpickled."""
    import msgspec

    good = protocol.encoder.encode(protocol.AddRequest("a", [1, 2], {"max_tokens": 2}))
    assert protocol.to_core_decoder.decode(good) == protocol.AddRequest("a", [1, 2], {"max_tokens": 2})
    bad = [
        b"\x80\x04garbage",  # a pickle header
        good[:-3],  # truncated
        protocol.encoder.encode({"type": "add", "id": 1, "prompt_token_ids": "x", "params": {}}),  # wrong types
        protocol.encoder.encode({"type": "exec", "code": "print(1)"}),  # unknown tag
    ]
    for frame in bad:
        with pytest.raises(msgspec.DecodeError):
            protocol.to_core_decoder.decode(frame)


def test_n_children_are_seeded_apart_and_repeatable(client, model_name):
    def texts(**kw):
        r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, n=2, **kw)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    seeded = texts(temperature=1.0, seed=11)
    assert len(seeded) == 2 and seeded[0] != seeded[1]
    assert texts(temperature=1.0, seed=11) == seeded
    greedy = texts(temperature=0)
    assert greedy[0] == greedy[1]
    one = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0)
    two = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, n=2, temperature=0)
    assert (two.usage.prompt_tokens, two.usage.completion_tokens) == (one.usage.prompt_tokens, 8)
    bad = httpx.post(f"{client.base_url}completions", json={"prompt": "x", "n": 0}, timeout=60)
    assert bad.status_code == 400 and "n must be between 1 and 64, got 0" in bad.json()["error"]["message"]


def test_logprobs_are_the_engines_in_openai_shapes(client, model_name, offline):
    want = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=2), use_tqdm=False)[0]
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    chosen = [entry[t] for t, entry in zip(want["token_ids"], want["logprobs"])]
    # a sampled token outside the top ones is listed with them (vLLM's logprobs + 1 entries)
    hot = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=2.0, seed=3, logprobs=1)
    hot_lp = hot.choices[0].logprobs
    assert all(
        tok in top and top[tok] == lp_
        for tok, top, lp_ in zip(hot_lp.tokens, hot_lp.top_logprobs, hot_lp.token_logprobs)
    )
    assert any(len(top) == 2 for top in hot_lp.top_logprobs)  # temperature 2 leaves the top one somewhere
    zero = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0)
    assert [list(top) for top in zero.choices[0].logprobs.top_logprobs] == [
        [t] for t in zero.choices[0].logprobs.tokens
    ]
    assert lp.token_logprobs == pytest.approx(chosen, abs=1e-5)
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.top_logprobs[0]) == 2
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    chat = client.chat.completions.create(
        model=model_name, messages=QUESTION, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)  # greedy: the top one
    streamed = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, stream=True
    )
    got = [x for c in streamed if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert got == pytest.approx(chosen, abs=1e-5)


def test_echo_scores_the_prompt_as_the_engine_does(client, model_name, offline):
    """lm-eval's loglikelihood request: echo, logprobs=1, max_tokens=0."""
    want = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    ids = offline.tokenizer.encode(PROMPT)
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == offline.tokenizer.decode(ids) and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [entry[t] for t, entry in zip(ids[1:], want["prompt_logprobs"][1:])]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-5)
    assert "".join(lp.tokens) == choice.text and len(lp.tokens) == len(ids)
    both = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=3, echo=True, temperature=0)
    assert both.choices[0].text.startswith(choice.text) and both.usage.completion_tokens == 3
    bad = httpx.post(f"{client.base_url}completions", json={"prompt": "x", "max_tokens": 0}, timeout=60)
    assert bad.status_code == 400 and "max_tokens=0 is only allowed with echo" in bad.json()["error"]["message"]


def test_a_client_that_leaves_a_whole_response_aborts_it(server, model_name):
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True}
    aborted = 'atom:request_success_total{engine="0",finished_reason="abort"}'
    before = metric_values(server)[aborted]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server}/v1/completions", json=body, timeout=1.5)
    deadline = time.time() + 3
    while metric_values(server)['atom:num_requests_running{engine="0"}'] and time.time() < deadline:
        time.sleep(0.2)
    assert metric_values(server)['atom:num_requests_running{engine="0"}'] == 0  # 1000 tokens would take longer
    assert metric_values(server)[aborted] == before + 1


def test_atom_chat_answers_on_a_pipe_with_history(server):
    out = subprocess.run(
        [sys.executable, "-m", "atom_core.cli", "chat", "--url", server, "--max-tokens", "20"],
        input="What is the capital of France?\nAnd of Italy?\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert "Paris" in lines[0] and "Rome" in lines[1]  # the second question reads the first


def test_a_chat_that_outgrows_the_context_drops_its_oldest_turns_and_goes_on(offline):
    import io

    from atom_core.serve.chat import ContextFull, chat, local_reply

    with pytest.raises(ContextFull, match="max_model_len=1024"):
        next(local_reply(offline, 4, 0.0)([{"role": "user", "content": "hello " * 1100}]))
    seen = []

    def reply(messages):  # a context of 3 messages; a message of "x" * 9 fits in none
        seen.append([m["content"] for m in messages])
        if len(messages) > 3 or any(len(m["content"]) > 8 for m in messages):
            raise ContextFull("too long")
        yield "ok"

    out, err = io.StringIO(), io.StringIO()
    chat(reply, io.StringIO("a\nb\n" + "x" * 9 + "\nc\n"), out, err)
    assert out.getvalue() == "ok\nok\nok\n"  # a, b (a dropped), c; the long message refused
    assert seen[-1] == ["b", "ok", "c"]
    assert err.getvalue().count("dropped") == 1  # for c; the refused message dropped nothing
    assert "oldest turn is dropped" in err.getvalue() and "does not fit the context" in err.getvalue()


def test_ctrl_c_at_the_prompt_ends_the_chat_and_no_server_is_one_line():
    import io

    from atom_core.serve.chat import chat

    class Interrupted(io.StringIO):
        def readline(self, *args):
            raise KeyboardInterrupt

    out = io.StringIO()
    chat(lambda messages: iter(["never"]), Interrupted(), out)
    assert out.getvalue() == "\n"
    for url in ("http://127.0.0.1:1", "notaurl"):
        r = subprocess.run(
            [sys.executable, "-m", "atom_core.cli", "chat", "--url", url],
            input="hi\n", capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 2 and r.stderr.startswith(f"atom: error: cannot talk to {url}"), r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1
    r = subprocess.run(
        [sys.executable, "-m", "atom_core.cli", "chat", "--url", "http://127.0.0.1:1", "--max-tokens", "0"],
        input="hi\n", capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "--max-tokens must be >= 1" in r.stderr


def test_ctrl_c_stops_the_reply_not_the_chat():
    import io

    from atom_core.serve.chat import chat

    seen = []

    def reply(messages):
        seen.append([m["content"] for m in messages])
        yield "Hello"
        if len(messages) == 1:
            raise KeyboardInterrupt
        yield " again"

    out = io.StringIO()
    chat(reply, io.StringIO("hi\nmore\n"), out)
    assert out.getvalue() == "Hello [stopped]\nHello again\n"
    assert seen[1] == ["hi", "Hello", "more"]  # the stopped reply stays in the history as far as it got


def test_two_ranks_give_one_ranks_greedy_outputs_and_both_serve(offline):
    from concurrent.futures import ThreadPoolExecutor

    proc, url = start_server("--data-parallel-size", "2", "--kv-cache-memory", str(256 << 20))
    try:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        prompts = [PROMPT, "Once upon a time", "The sea is", "My favourite colour is"]
        want = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
        with ThreadPoolExecutor(4) as pool:
            got = list(
                pool.map(lambda p: api.completions.create(model=api.models.list().data[0].id, prompt=p,
                                                          max_tokens=24, temperature=0).choices[0].text, prompts)
            )  # fmt: skip
        assert got == [w["text"] for w in want]
        values = metric_values(url)
        served = [values.get(f'atom:generation_tokens_total{{engine="{r}"}}', 0) for r in (0, 1)]
        assert all(n > 0 for n in served) and sum(served) == sum(len(w["token_ids"]) for w in want)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        stop_server(proc)


def core_pids(server_pid: int) -> list[int]:
    """The server's engine-core processes (spawned children; not multiprocessing's resource tracker)."""
    out = subprocess.run(["pgrep", "-P", str(server_pid)], capture_output=True, text=True).stdout.split()
    pids = []
    for pid in map(int, out):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            pids.append(pid)
    return pids


def test_a_rank_killed_mid_stream_fails_its_requests_and_the_server_says_so():
    import signal

    proc, url = start_server("--api-key", "sesame")
    try:
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        wrong = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}, timeout=10)
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        key = {"Authorization": "Bearer sesame"}
        body = {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}
        (core,) = core_pids(proc.pid)
        start = time.time()
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=key, timeout=30) as r:
            events = []
            for i, line in enumerate(r.iter_lines()):
                if i == 4:
                    os.kill(core, signal.SIGKILL)
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
        assert json.loads(events[-2])["error"]["code"] == 503
        assert time.time() - start < 10
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, headers=key, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "unavailable_error"
    finally:
        stop_server(proc)


@pytest.mark.parametrize("where", ["serve", "offline"])
def test_atom_bench_reports_json_with_goodput(server, where):
    target = ["--base-url", server] if where == "serve" else ["--max-model-len", "256"]
    out = subprocess.run(
        [sys.executable, "-m", "atom_core.cli", "bench", where, *target, "--num-prompts", "4",
         "--input-len", "16", "--output-len", "8", "--max-concurrency", "1,4", "--json",
         "--goodput", "ttft:60000", "e2el:0.001"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    levels = json.loads(out.stdout)
    assert [lv["max_concurrency"] for lv in levels] == [1, 4]
    for lv in levels:
        assert lv["requests"] == 4 and lv["output_throughput"] > 0
        assert lv["ttft"]["median_ms"] > 0 and lv["e2e"]["p99_ms"] >= lv["e2e"]["median_ms"]
        assert lv["itl"]["median_ms"] > 0
        assert abs(lv["output_throughput"] * lv["duration_s"] - 4 * 8) < 1e-6  # every reply 8 tokens (ignore_eos)
        assert lv["goodput"] == 0  # no request ends within 1 microsecond


def test_bench_goodput_targets_are_checked():
    from atom_core.serve.bench import parse_goodput

    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2000"]) == {"ttft": 0.5, "tpot": 0.05, "e2e": 2.0}
    for bad, says in [("itl:5", "one of ttft, tpot, e2el"), ("ttft:x", "milliseconds"), ("ttft:-1", "> 0 ms")]:
        with pytest.raises(ValueError, match=says):
            parse_goodput([bad])


# -- sampling fields and grammars over HTTP ----------------------------------------------

CAT = [{"role": "user", "content": "Describe a cat as JSON with its name, colour, age and toys."}]


def test_sampled_replies_under_a_json_schema_validate_and_json_object_parses(client, model_name):
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema

    response_format = {"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT_SCHEMA}}

    # eight at a time on two cores, the torch path too (ATOM_CPU_KERNELS=0): a request may wait
    # minutes behind the others; what is checked is the replies, not their speed
    patient = client.with_options(timeout=600)

    def ask(seed: int) -> str:
        r = patient.chat.completions.create(
            model=model_name, messages=CAT, response_format=response_format, temperature=1.0, seed=seed, max_tokens=150
        )
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(ask, range(20)))
    assert len(set(replies)) > 1
    for reply in replies:
        jsonschema.validate(json.loads(reply), CAT_SCHEMA)
    short = [{"role": "user", "content": "Give a JSON object with a cat's name and age."}]
    r = client.chat.completions.create(
        model=model_name, messages=short, response_format={"type": "json_object"}, temperature=0, max_tokens=60
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_structured_outputs_choice_and_regex_stream_as_whole(client, model_name):
    r = client.completions.create(
        model=model_name, prompt="Pick a colour:", max_tokens=10, temperature=0,
        extra_body={"structured_outputs": {"choice": ["crimson", "teal"]}},
    )  # fmt: skip
    assert r.choices[0].text in ("crimson", "teal") and r.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model=model_name, prompt="A year:", max_tokens=10, temperature=0, stream=True,
        extra_body={"guided_regex": "(19|20)[0-9]{2}"},
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert len(text) == 4 and text[:2] in ("19", "20") and text.isdigit()


def test_logit_bias_and_min_tokens_act_as_defined(client, model_name, offline):
    def completion(**extra):
        r = client.completions.create(model=model_name, prompt=PROMPT, temperature=0, **extra)
        return r.choices[0]

    first = offline.tokenizer.encode(completion(max_tokens=1).text, add_special_tokens=False)[0]
    banned = completion(max_tokens=1, logit_bias={str(first): -100}, logprobs=0)
    assert banned.text != completion(max_tokens=1).text
    forced = completion(max_tokens=3, logit_bias={"1234": 100})
    assert forced.text == offline.tokenizer.decode([1234] * 3)
    short = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=200)
    assert short.choices[0].finish_reason == "stop"
    n = short.usage.completion_tokens
    longer = client.chat.completions.create(
        model=model_name, messages=QUESTION, temperature=0, max_tokens=200, extra_body={"min_tokens": n + 10}
    )
    assert longer.usage.completion_tokens >= n + 10


def test_vllms_token_and_text_fields_act_as_offline(client, server, model_name, offline):
    def completion(prompt=PROMPT, **extra):
        r = client.completions.create(model=model_name, prompt=prompt, temperature=0, max_tokens=4, extra_body=extra)
        return r

    allowed = completion(allowed_token_ids=[1234, 99]).choices[0].text
    params = SamplingParams(temperature=0, max_tokens=4, allowed_token_ids=[1234, 99])
    assert allowed == offline.generate(PROMPT, params, use_tqdm=False)[0]["text"]
    long = " ".join(["word"] * 1500)  # past max_model_len (1024) unless truncated
    cut = completion(long, truncate_prompt_tokens=100)
    want = offline.generate(
        [offline.tokenizer.encode(long)[-100:]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )[0]
    assert cut.usage.prompt_tokens == 100 and cut.choices[0].text == want["text"]
    ask = offline.apply_chat_template(QUESTION)
    for fields in ({"bad_words": ["Paris"]}, {"skip_special_tokens": False, "include_stop_str_in_output": True}):
        reply = (
            client.chat.completions.create(
                model=model_name, messages=QUESTION, temperature=0, max_tokens=40, extra_body=fields
            )
            .choices[0]
            .message.content
        )
        params = SamplingParams(temperature=0, max_tokens=40, **fields)
        assert reply == offline.generate([ask], params, use_tqdm=False)[0]["text"]
    assert reply.endswith(offline.tokenizer.eos_token)  # the last: special tokens kept, EOS's too
    for field, value, says in (
        ("truncate_prompt_tokens", 0, "truncate_prompt_tokens must be an integer >= 1"),
        ("truncate_prompt_tokens", 2000, "truncate_prompt_tokens=2000 exceeds max_model_len=1024"),
        ("allowed_token_ids", [5, 10**8], "allowed_token_ids names token 100000000, outside the vocabulary"),
        ("bad_words", "Paris", "bad_words must be list"),
        ("skip_special_tokens", "no", "skip_special_tokens must be bool"),
    ):
        r = httpx.post(f"{server}/v1/completions", json={"prompt": "x", field: value}, timeout=60)
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_tokenizer_info_serves_what_a_remote_tokenizer_needs(server, offline):
    info = httpx.get(f"{server}/tokenizer_info", timeout=10).json()
    tok = offline.tokenizer
    assert (info["eos_token"], info["bos_token"], info["chat_template"]) == (
        tok.eos_token,
        tok.bos_token,
        tok.chat_template,
    )


def lm_eval_tasks(folder) -> None:
    """A multiple-choice and a generate-until task over local JSONL files."""
    (folder / "mc.jsonl").write_text(
        "\n".join(
            json.dumps(d)
            for d in [
                {"question": "What is the capital of France?", "choices": ["Paris", "London", "Berlin"], "answer": 0},
                {
                    "question": "What colour is the sky on a clear day?",
                    "choices": ["blue", "green", "red"],
                    "answer": 0,
                },
                {"question": "How many legs does a cat have?", "choices": ["four", "two", "six"], "answer": 0},
            ]
        )  # fmt: skip
    )
    (folder / "gen.jsonl").write_text(
        "\n".join(
            json.dumps(d)
            for d in [
                {"question": "The capital of France is", "answer": " Paris."},
                {"question": "Once upon a time", "answer": " there"},
            ]
        )  # fmt: skip
    )
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "atom_mc.yaml").write_text(
        f"task: atom_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        'output_type: multiple_choice\ndoc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n'
    )
    (folder / "atom_gen.yaml").write_text(
        f"task: atom_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        'output_type: generate_until\ndoc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 12\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )


def test_lm_eval_loglikelihoods_and_generations_equal_the_engines(server, model_name, offline, tmp_path):
    lm_eval_tasks(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
         f"model={model_name},base_url={server}/v1/completions,tokenizer_backend=remote,num_concurrent=2,max_retries=1",
         "--tasks", "atom_mc,atom_gen", "--include_path", str(tmp_path), "--log_samples",
         "--output_path", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    tok = offline.tokenizer
    (mc,) = (tmp_path / "out").rglob("samples_atom_mc_*.jsonl")
    checked = 0
    for line in mc.read_text().splitlines():
        sample = json.loads(line)
        for args, resp in zip(sample["arguments"].values(), sample["resps"]):
            context, continuation = args["arg_0"], args["arg_1"]
            whole = tok.encode(context + continuation, add_special_tokens=False)
            n_context = len(tok.encode(context, add_special_tokens=False))
            ref = offline.generate(
                [whole], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False
            )[0]["prompt_logprobs"]
            want = sum(ref[i][whole[i]] for i in range(n_context, len(whole)))
            assert abs(float(resp[0][0]) - want) < 1e-4, (args, resp, want)
            checked += 1
    assert checked == 9
    (gen,) = (tmp_path / "out").rglob("samples_atom_gen_*.jsonl")
    for line in gen.read_text().splitlines():
        sample = json.loads(line)
        prompt = sample["arguments"]["gen_args_0"]["arg_0"]
        want = offline.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=12, stop_strings=["\n"]), use_tqdm=False
        )[0]["text"]
        assert sample["resps"] == [[want]]


# -- faults, cut streams and hostile frames ----------------------------------------------


@pytest.fixture(scope="module")
def faulty_server(tmp_path_factory):
    """A server on tests/fault_plugin.py's sampler, /health failing a core silent for 1 s; its
    output in a file (`url, log path`)."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    log_path = tmp_path_factory.mktemp("faulty") / "server.log"
    with open(log_path, "w") as log:
        proc, url = start_server(
            "--sampler", "faulty", "--health-timeout", "1",
            env={"ATOM_PLUGINS": "fault_plugin", "PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")])},
            log=log,
        )  # fmt: skip
    yield url, log_path
    stop_server(proc)


def test_health_stays_up_through_a_step_longer_than_its_timeout(faulty_server):
    """A long step (a long prompt's) is not a dead core: the core's heartbeat thread speaks
    through it. vLLM's /health reports the engine's state without waiting for a step."""
    import threading

    from fault_plugin import SLOW_SECONDS, SLOW_SEED

    url, _ = faulty_server
    body = {"prompt": PROMPT, "max_tokens": 1, "seed": SLOW_SEED}
    done: list = []
    worker = threading.Thread(target=lambda: done.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60)))
    start = time.time()
    worker.start()
    codes = []
    while worker.is_alive():
        codes.append(httpx.get(f"{url}/health", timeout=10).status_code)
        time.sleep(0.2)
    worker.join()
    assert time.time() - start >= SLOW_SECONDS and done[0].status_code == 200
    assert len(codes) > 5 and set(codes) == {200}


def test_a_cut_whole_response_leaves_no_traceback(faulty_server):
    url, log_path = faulty_server
    logged = len(log_path.read_text())
    body = {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{url}/v1/completions", json=body, timeout=1.0)
    deadline = time.time() + 5
    while metric_values(url)['atom:num_requests_running{engine="0"}'] and time.time() < deadline:
        time.sleep(0.2)
    assert metric_values(url)['atom:num_requests_running{engine="0"}'] == 0
    assert "Traceback" not in log_path.read_text()[logged:]


def test_an_injected_forward_pass_fault_is_a_500_and_the_server_goes_on(faulty_server):
    fault_seed = 66613  # tests/fault_plugin.py's: a step holding a request with this seed raises
    url, _ = faulty_server
    body = {"prompt": PROMPT, "max_tokens": 4, "seed": fault_seed}
    failed = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
    events = sse_events(httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=60))
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 500
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "seed": 1}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    values = metric_values(url)
    assert values['atom:num_requests_running{engine="0"}'] == 0


def test_64_streams_with_16_cut_leave_the_pool_whole(server, model_name, offline):
    import asyncio

    want = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    want_text = want[0]["text"]
    body = {
        "model": model_name,
        "prompt": PROMPT,
        "max_tokens": 24,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }

    async def one(http: httpx.AsyncClient, i: int) -> str | None:
        pieces = []
        async with http.stream("POST", f"{server}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
                if i % 4 == 0 and len(pieces) == 3:
                    return None  # cut mid-stream: leaving the block closes the connection
        return "".join(pieces)

    async def run() -> list[str | None]:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as http:
            return await asyncio.gather(*(one(http, i) for i in range(64)))

    texts = asyncio.run(run())
    assert sum(t is None for t in texts) == 16
    assert all(t == want_text for t in texts if t is not None)
    deadline = time.time() + 5
    while True:
        values = metric_values(server)
        idle = [
            values[f'atom:{n}{{engine="0"}}']
            for n in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        ]
        if idle == [0.0, 0.0, 0.0] or time.time() > deadline:
            break
        time.sleep(0.2)
    assert idle == [0.0, 0.0, 0.0]


def test_the_cores_load_while_the_api_loads_its_tokenizer_and_a_failure_there_leaves_none(monkeypatch):
    """`atom serve` starts the engine cores before it loads the tokenizer and the app (the two
    loads overlap); where the tokenizer cannot load, the server stops with that error and the
    cores it started go with it."""
    import transformers

    from atom_core.serve import server
    from atom_core.serve.client import EngineClient

    order: list[str] = []
    cores: list = []
    launch = EngineClient.launch

    def launch_and_record(self):
        launch(self)
        order.append("cores")
        cores.extend(self._processes)

    def no_tokenizer(*args, **kwargs):
        order.append("tokenizer")
        assert all(p.is_alive() for p in cores)  # loading the model meanwhile
        raise OSError("no tokenizer here")

    monkeypatch.setattr(EngineClient, "launch", launch_and_record)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_tokenizer)
    with pytest.raises(OSError, match="no tokenizer here"):
        server.serve(None, {"max_model_len": 256, "num_kvcache_blocks": 64}, port=free_port())
    assert order == ["cores", "tokenizer"] and len(cores) == 1
    assert not any(p.is_alive() for p in cores)


def test_hostile_frames_on_both_sockets_are_dropped_and_requests_complete():
    """Frames sent from a socket of the test's own to the engine core's inbox and to the API
    side's outbox: garbage, a pickle, truncated, wrong types, an unknown tag, oversized."""
    import asyncio

    import zmq

    from atom_core.serve.client import EngineClient

    good = protocol.encoder.encode(protocol.AddRequest("x", [1, 2, 3], {"max_tokens": 2}))
    frames = [
        b"garbage", b"\x80\x04\x95pickle", good[:-4],
        protocol.encoder.encode({"type": "add", "id": 1, "prompt_token_ids": "no", "params": []}),
        protocol.encoder.encode({"type": "exec", "code": "import os"}),
        protocol.encoder.encode({"type": "step", "deltas": [{"id": 5}]}),
        b"\x00" * (protocol.MAX_FRAME_BYTES + 1),
    ]  # fmt: skip

    async def run() -> list[int]:
        client = EngineClient(str(fetch_default_model(quiet=True)), {"max_model_len": 256, "num_kvcache_blocks": 64})
        await client.start()
        try:
            context = zmq.Context()
            sent = 0
            for endpoint in (f"ipc://{client._dir}/in0", f"ipc://{client._dir}/out"):
                for frame in frames:  # a socket per frame: an oversized one gets its sender cut off
                    fuzz = context.socket(zmq.PUSH)
                    fuzz.setsockopt(zmq.SNDTIMEO, 2000)
                    fuzz.connect(endpoint)
                    try:
                        fuzz.send(frame)
                        sent += 1
                    except zmq.Again:  # no peer took it within 2 s
                        pass
                    fuzz.close(linger=1000)
            context.term()
            assert sent >= 2 * (len(frames) - 1)  # an oversized frame may be cut off as it goes
            await asyncio.sleep(0.5)
            tokens: list[int] = []
            async for delta in client.generate("after-fuzz", [1, 2, 3], {"max_tokens": 5, "ignore_eos": True}):
                tokens += delta.token_ids
            assert client.dead is None
            return tokens
        finally:
            await client.close()

    assert len(asyncio.run(run())) == 5


def test_a_seeded_request_reads_the_same_alone_and_among_eight_others(client, model_name):
    from concurrent.futures import ThreadPoolExecutor

    def ask(seed: int, prompt: str = PROMPT) -> str:
        r = client.completions.create(model=model_name, prompt=prompt, max_tokens=16, temperature=1.0, seed=seed)
        return r.choices[0].text

    alone = ask(123)
    others = ["Once upon a time", "The sea is", "My favourite colour is", "Water boils at"] * 2
    with ThreadPoolExecutor(9) as pool:
        futures = [pool.submit(ask, 1000 + i, p) for i, p in enumerate(others)] + [pool.submit(ask, 123)]
        batched = futures[-1].result()
        [f.result() for f in futures]
    assert batched == alone


def test_penalties_make_fewer_repeats(client, model_name):
    def repeats(**extra) -> int:
        r = client.completions.create(
            model=model_name, prompt="List: apple, apple, apple,", max_tokens=40, temperature=0, logprobs=0, **extra
        )
        tokens = r.choices[0].logprobs.tokens
        return len(tokens) - len(set(tokens))

    plain = repeats()
    assert plain > 30  # greedy repeats ", apple" to the end
    assert repeats(frequency_penalty=1.5) < plain / 2
    assert repeats(presence_penalty=2.0) < plain / 2
    assert repeats(extra_body={"repetition_penalty": 1.8}) < plain / 2


def test_a_chat_reply_runs_to_the_context_end_with_length(client, model_name, offline):
    messages = [{"role": "user", "content": "hello " * 990}]
    prompt_tokens = len(offline.apply_chat_template(messages))
    assert 1024 - 40 < prompt_tokens < 1024
    r = client.chat.completions.create(
        model=model_name, messages=messages, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 1024


def test_a_local_chat_reply_streams_the_engines_text(offline):
    from atom_core.serve.chat import local_reply

    pieces = list(local_reply(offline, 24, 0.0)(QUESTION))
    want = offline.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]["text"]
    assert len(pieces) > 1 and "".join(pieces) == want


def test_chat_content_parts_read_as_their_text(client, model_name, server):
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}],
        }
    ]
    joined = [{"role": "user", "content": "What is the capital\nof France?"}]

    def reply(messages):
        return (
            client.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=8)
            .choices[0]
            .message.content
        )

    assert reply(parts) == reply(joined)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": image}, timeout=30)
    assert (
        r.status_code == 400 and "only text parts are supported, got a 'image_url' part" in r.json()["error"]["message"]
    )


def test_prompt_logprobs_come_whole_and_streamed(server, offline):
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    whole = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()["choices"][0]["prompt_logprobs"]
    ids = offline.tokenizer.encode(PROMPT)
    ref = offline.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    ref = ref[0]["prompt_logprobs"]
    assert whole[0] is None and len(whole) == len(ids)
    for entry, want, token in zip(whole[1:], ref[1:], ids[1:]):
        assert abs(entry[str(token)]["logprob"] - want[token]) < 1e-4
    events = sse_events(httpx.post(f"{server}/v1/completions", json={**body, "stream": True}, timeout=60))
    streamed = [c["prompt_logprobs"] for e in events[:-1] for c in e["choices"] if "prompt_logprobs" in c]
    assert streamed == [whole]
