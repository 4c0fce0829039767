"""`atom bench serve`: load an OpenAI-compatible server and measure it as vLLM's bench does.

Random token-id prompts (or a JSONL file of {"prompt": ...}), streamed completions with
`ignore_eos`, at each `--max-concurrency` in turn (and an optional Poisson `--request-rate`):
time to first token, time per output token, inter-token latency and end-to-end latency
(mean, median, p99), request and token throughput.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from typing import Any


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summary(values: list[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values]
    mean = statistics.fmean(ms) if ms else float("nan")
    return {"mean_ms": mean, "median_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99)}


async def one_request(client: Any, url: str, model: str, prompt: Any, output_len: int) -> dict[str, Any]:
    body = {
        "model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    start = time.perf_counter()
    first: float | None = None
    last = start
    gaps: list[float] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"the server answered {r.status_code}: {r.text}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event.get("usage"):
                usage = event["usage"]
            if any(c.get("text") for c in event.get("choices", [])):
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
    end = time.perf_counter()
    out = usage.get("completion_tokens", 0)
    ttft = (first or end) - start
    return {
        "ttft": ttft,
        "tpot": (end - start - ttft) / (out - 1) if out > 1 else 0.0,
        "itl": gaps,
        "e2e": end - start,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "output_tokens": out,
    }


async def run_level(
    url: str, model: str, prompts: list[Any], output_len: int, concurrency: int, request_rate: float, seed: int
) -> dict[str, Any]:
    import httpx

    limit = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=concurrency + 4)) as client:

        async def limited(prompt: Any) -> dict[str, Any]:
            async with limit:
                return await one_request(client, url, model, prompt, output_len)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    output_tokens = sum(r["output_tokens"] for r in results)
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    return {
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


def make_prompts(num: int, input_len: int, dataset: str | None, seed: int) -> list[Any]:
    """`num` prompts: lines of a JSONL file's "prompt", or random token ids (ids 100-4999, which
    every real vocabulary has)."""
    if dataset:
        with open(dataset) as f:
            rows = [json.loads(line)["prompt"] for line in f if line.strip()]
        return [rows[i % len(rows)] for i in range(num)]
    rng = random.Random(seed)
    return [[rng.randrange(100, 5000) for _ in range(input_len)] for _ in range(num)]


def bench_serve(
    url: str, model: str | None, num_prompts: int, input_len: int, output_len: int,
    concurrencies: list[int], request_rate: float, dataset: str | None, seed: int,
) -> list[dict[str, Any]]:  # fmt: skip
    import httpx

    url = url.rstrip("/")
    model = model or httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    prompts = make_prompts(num_prompts, input_len, dataset, seed)
    return [asyncio.run(run_level(url, model, prompts, output_len, c, request_rate, seed)) for c in concurrencies]


def print_table(levels: list[dict[str, Any]]) -> None:
    print(
        "| concurrency | req/s | output tok/s | TTFT p50/p99 (ms) | TPOT p50/p99 (ms) | ITL p50/p99 (ms) | E2E p50 (ms) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for lv in levels:
        t, p, i, e = lv["ttft"], lv["tpot"], lv["itl"], lv["e2e"]
        print(
            f"| {lv['max_concurrency']} | {lv['request_throughput']:.2f} | {lv['output_throughput']:.1f} "
            f"| {t['median_ms']:.0f} / {t['p99_ms']:.0f} | {p['median_ms']:.1f} / {p['p99_ms']:.1f} "
            f"| {i['median_ms']:.1f} / {i['p99_ms']:.1f} | {e['median_ms']:.0f} |"
        )
