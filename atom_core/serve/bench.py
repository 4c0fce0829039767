"""`atom bench serve` and `atom bench offline`: measure a server, or the engine in-process, as
vLLM's bench does.

Random token-id prompts (or a JSONL file of {"prompt": ...}), `ignore_eos`, at each
`--max-concurrency` in turn (and, for a server, an optional Poisson `--request-rate`): time to
first token, time per output token, inter-token latency and end-to-end latency (mean, median,
p99), request and token throughput, and with `--goodput` the requests per second that met every
latency target. The offline run keeps the same number of requests in flight through
`add_request` / `step`, so the two tables compare what the server costs.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from typing import Any

from atom_core.serve.sse import sse_event


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summary(values: list[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values]
    mean = statistics.fmean(ms) if ms else float("nan")
    return {"mean_ms": mean, "median_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99)}


# --goodput names: vLLM's (ttft, tpot, e2el), in milliseconds
GOODPUT_METRICS = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2e"}


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 0.5, "tpot": 0.05} (seconds, by result key)."""
    out: dict[str, float] = {}
    for item in items or ():
        name, _, value = item.partition(":")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {item!r}: the metric must be one of {', '.join(GOODPUT_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: the target must be milliseconds, e.g. ttft:500") from None
        if ms <= 0:
            raise ValueError(f"--goodput {item!r}: the target must be > 0 ms")
        out[GOODPUT_METRICS[name]] = ms / 1e3
    return out


def level_summary(
    results: list[dict[str, Any]], duration: float, concurrency: int, goodput: dict[str, float] | None = None
) -> dict[str, Any]:
    """One concurrency level's figures from its requests' timings."""
    output_tokens = sum(r["output_tokens"] for r in results)
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    level = {
        "max_concurrency": concurrency,
        "requests": len(results),
        "duration_s": duration,
        "request_throughput": len(results) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + prompt_tokens) / duration,
        "ttft": summary([r["ttft"] for r in results]),
        "tpot": summary([r["tpot"] for r in results if r["output_tokens"] > 1]),
        "itl": summary([g for r in results for g in r["itl"]]),
        "e2e": summary([r["e2e"] for r in results]),
    }
    if goodput:
        good = sum(all(r[key] <= limit for key, limit in goodput.items()) for r in results)
        level["goodput"] = good / duration
    return level


def request_timings(
    start: float, token_times: list[float], end: float, prompt_tokens: int, output_tokens: int
) -> dict[str, Any]:
    """One request's latencies from when it was sent, when each piece of output came, and its end."""
    first = token_times[0] if token_times else end
    ttft = first - start
    return {
        "ttft": ttft,
        "tpot": (end - start - ttft) / (output_tokens - 1) if output_tokens > 1 else 0.0,
        "itl": [b - a for a, b in zip(token_times, token_times[1:])],
        "e2e": end - start,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
    }


async def one_request(
    client: Any, url: str, model: str, prompt: Any, output_len: int, headers: dict[str, str]
) -> dict[str, Any]:
    body = {
        "model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    import httpx

    start = time.perf_counter()
    times: list[float] = []
    usage: dict[str, Any] = {}
    for attempt in range(2):
        try:
            async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise RuntimeError(f"the server answered {r.status_code}: {r.text}")
                async for line in r.aiter_lines():
                    event = sse_event(line)
                    if event is None:
                        continue
                    if event.get("usage"):
                        usage = event["usage"]
                    if any(c.get("text") for c in event.get("choices", [])):
                        times.append(time.perf_counter())
            break
        except httpx.RemoteProtocolError:
            # a kept-alive connection the server had closed (llama-server closes them after a
            # stream): sent again once, on a new one, if nothing had come back
            if attempt or times:
                raise
    end = time.perf_counter()
    # a server that sends no usage (some do not with stream_options): one token per piece of text
    return request_timings(start, times, end, usage.get("prompt_tokens", 0), usage.get("completion_tokens", len(times)))


async def run_level(
    url: str, model: str, prompts: list[Any], output_len: int, concurrency: int, request_rate: float, seed: int,
    headers: dict[str, str], goodput: dict[str, float] | None = None,
) -> dict[str, Any]:  # fmt: skip
    import httpx

    limit = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=concurrency + 4)) as client:

        async def limited(prompt: Any) -> dict[str, Any]:
            async with limit:
                return await one_request(client, url, model, prompt, output_len, headers)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return level_summary(results, duration, concurrency, goodput)


def make_prompts(num: int, input_len: int, dataset: str | None, seed: int) -> list[Any]:
    """`num` prompts: lines of a JSONL file's "prompt", or random token ids (ids 100-4999, which
    every real vocabulary has). Each concurrency level draws its own (seed + level), so no level
    finds the one before it in a prefix cache."""
    if dataset:
        with open(dataset) as f:
            rows = [json.loads(line)["prompt"] for line in f if line.strip()]
        return [rows[i % len(rows)] for i in range(num)]
    rng = random.Random(seed)
    return [[rng.randrange(100, 5000) for _ in range(input_len)] for _ in range(num)]


def bench_serve(
    url: str, model: str | None, num_prompts: int, input_len: int, output_len: int,
    concurrencies: list[int], request_rate: float, dataset: str | None, seed: int,
    api_key: str | None = None, goodput: dict[str, float] | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    import httpx

    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model = model or httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    return [
        asyncio.run(
            run_level(
                url, model, make_prompts(num_prompts, input_len, dataset, seed + i), output_len, c, request_rate,
                seed, headers, goodput,
            )
        )
        for i, c in enumerate(concurrencies)
    ]  # fmt: skip


def bench_offline(
    engine: Any, num_prompts: int, input_len: int, output_len: int, concurrencies: list[int],
    dataset: str | None, seed: int, goodput: dict[str, float] | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """The same load as `bench_serve`, through an in-process `LLMEngine`: at most `concurrency`
    requests in flight, a new one added as soon as one ends (after a warm-up request)."""
    from atom_core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    warm_up = make_prompts(1, input_len, dataset, seed - 1)
    engine.generate(warm_up, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    levels = []
    for i, concurrency in enumerate(concurrencies):
        prompts = make_prompts(num_prompts, input_len, dataset, seed + i)
        sent: dict[int, float] = {}
        times: dict[int, list[float]] = {}
        results: list[dict[str, Any]] = []
        queue = list(prompts)

        def add() -> None:
            prompt = queue.pop(0)
            holder: list[float] = []
            rid = engine.add_request(
                prompt, params, stream_callback=lambda out, h=holder: h.append(time.perf_counter())
            )
            sent[rid], times[rid] = time.perf_counter(), holder

        start = time.perf_counter()
        while queue and len(sent) < concurrency:
            add()
        while sent:
            for r in engine.step():
                rid, end = r["request_id"], time.perf_counter()
                token_times = times.pop(rid)
                results.append(
                    request_timings(sent.pop(rid), token_times, end, r["num_prompt_tokens"], len(r["token_ids"]))
                )
                if queue:
                    add()
        levels.append(level_summary(results, time.perf_counter() - start, concurrency, goodput))
    return levels


def print_table(levels: list[dict[str, Any]]) -> None:
    goodput = "goodput" in levels[0] if levels else False
    print(
        "| concurrency | req/s | output tok/s | TTFT p50/p99 (ms) | TPOT p50/p99 (ms) | ITL p50/p99 (ms) | E2E p50 (ms) |"
        + (" goodput (req/s) |" if goodput else "")
    )
    print("|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if goodput else ""))
    for lv in levels:
        t, p, i, e = lv["ttft"], lv["tpot"], lv["itl"], lv["e2e"]
        print(
            f"| {lv['max_concurrency']} | {lv['request_throughput']:.2f} | {lv['output_throughput']:.1f} "
            f"| {t['median_ms']:.0f} / {t['p99_ms']:.0f} | {p['median_ms']:.1f} / {p['p99_ms']:.1f} "
            f"| {i['median_ms']:.1f} / {i['p99_ms']:.1f} | {e['median_ms']:.0f} |"
            + (f" {lv['goodput']:.2f} |" if goodput else "")
        )
