"""Online serving latency of Atom's scheduling policies: prefill_first, mixed and spyre.

Model: SmolLM2-135M-Instruct (`atom_core.engine.fetch.fetch_default_model`) on CPU, 2 torch
threads by default. Each policy gets its own engine; the engines are identical except
for `scheduling_policy` (token budget `--budget`, chunked prefill on, no prefix caching,
a KV pool large enough that nothing is preempted) and are built one after the other.

Workload (the same for every policy, fixed by `--seed`): `--requests` prompts of random
token ids, most 32-256 tokens long and `--long-share` of them 1,000-1,500 tokens, each
generating `--min-output`..`--max-output` greedy tokens with EOS ignored. Requests
arrive as a Poisson process of `--rate` requests/s (the first at time 0) and are fed
through the incremental API: every iteration adds the requests whose arrival time has
passed, then runs one `step()`, or sleeps until the next arrival when the engine is idle.

Measured per policy, from the time each streamed token reaches its callback:

* TTFT: first token time minus the request's arrival time (queueing included).
* ITL: the gaps between consecutive tokens of one request, pooled over all requests.
* output tok/s: all generated tokens over the time from the first arrival to the last finish.
* steps: engine steps the run took.

Then the issue's goal for `mixed` against `prefill_first`: p99 ITL at least 2x lower, at
no more than 10% output-throughput cost. Every request must finish with exactly its
max_tokens tokens; greedy outputs are compared across policies (float32 must agree;
bfloat16 only reports the count, reduced precision depends on the batch shape).

    .venv/bin/python benchmarks/serving_policies.py [--policies prefill_first mixed spyre]
        [--requests 40] [--rate 1.5] [--budget 256] [--dtype bfloat16|float32]
        [--max-model-len 2048] [--min-output 32] [--max-output 128] [--long-share 0.25]
        [--threads 2] [--seed 0] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from atom_core import RequestOutput, SamplingParams
from atom_core.engine.fetch import fetch_default_model
from atom_core.engine.llm_engine import LLMEngine
from atom_core.platform.cpu_features import cpu_features

POLICIES = ("prefill_first", "mixed", "spyre")
SHORT_PROMPT = (32, 256)
LONG_PROMPT = (1000, 1500)
FIRST_TOKEN_ID = 100  # ids below are special tokens in SmolLM2's vocabulary
BLOCK_SIZE = 16
ITL_GOAL = 2.0  # p99 ITL of prefill_first / mixed, at least
COST_GOAL = 0.10  # 1 - mixed tok/s / prefill_first tok/s, at most


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    arrival: float  # seconds after the start of the run


@dataclass
class Trace:
    """What one request produced in one run: its tokens and when each arrived."""

    arrival: float
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    def on_tokens(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        self.token_ids.extend(out.output_tokens)
        self.token_times.extend([now] * len(out.output_tokens))
        if out.finished:
            self.finish_reason = out.finish_reason


@dataclass
class Stats:
    policy: str
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    tok_s: float
    steps: int
    wall: float


# -- workload -----------------------------------------------------------------------------


def make_workload(args: argparse.Namespace, vocab_size: int) -> list[Request]:
    """Mixed-length random prompts with Poisson arrival times, all from one seeded generator."""
    rng = np.random.default_rng(args.seed)
    n = args.requests
    is_long = rng.random(n) < args.long_share
    short = rng.integers(SHORT_PROMPT[0], SHORT_PROMPT[1] + 1, size=n)
    long = rng.integers(LONG_PROMPT[0], LONG_PROMPT[1] + 1, size=n)
    lengths = np.where(is_long, long, short)
    outputs = rng.integers(args.min_output, args.max_output + 1, size=n)
    gaps = rng.exponential(1.0 / args.rate, size=n)
    arrivals = np.cumsum(gaps) - gaps[0]  # the first request arrives at 0
    return [
        Request(rng.integers(FIRST_TOKEN_ID, vocab_size, size=int(length)).tolist(), int(out), float(t))
        for length, out, t in zip(lengths, outputs, arrivals)
    ]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


# -- one policy ---------------------------------------------------------------------------


def engine_config(args: argparse.Namespace, workload: list[Request]) -> dict[str, object]:
    """Everything but the policy: a KV pool holding every request at once (no preemption)."""
    tokens = [len(r.prompt) + r.max_tokens + 1 for r in workload] + [args.max_model_len]
    blocks = sum(-(-t // BLOCK_SIZE) for t in tokens) + 64
    return dict(
        dtype=args.dtype,
        quantization="none",  # the float weights the README's figures were measured with
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.budget,
        enable_chunked_prefill=True,
        enable_prefix_caching=False,
        kv_cache_block_size=BLOCK_SIZE,
        num_kvcache_blocks=blocks,
    )


def warm_up(eng: LLMEngine) -> None:
    """One short request through the engine, so first-use kernel set-up is not measured."""
    eng.generate([list(range(FIRST_TOKEN_ID, FIRST_TOKEN_ID + 48))], greedy(4), use_tqdm=False)


def drive(eng: LLMEngine, workload: list[Request]) -> tuple[list[Trace], int, float]:
    """Feed the workload at its arrival times; returns the traces, the step count and t0."""
    t0 = time.perf_counter()
    traces = [Trace(arrival=t0 + r.arrival) for r in workload]
    pending, steps = 0, 0
    while pending < len(workload) or eng.has_unfinished_requests():
        elapsed = time.perf_counter() - t0
        while pending < len(workload) and workload[pending].arrival <= elapsed:
            r = workload[pending]
            eng.add_request(r.prompt, greedy(r.max_tokens), stream_callback=traces[pending].on_tokens)
            pending += 1
        if eng.has_unfinished_requests():
            eng.step()
            steps += 1
        elif pending < len(workload):
            time.sleep(max(0.0, workload[pending].arrival - (time.perf_counter() - t0)))
    return traces, steps, t0


def check_complete(policy: str, traces: list[Trace], workload: list[Request]) -> None:
    for i, (t, r) in enumerate(zip(traces, workload)):
        assert t.finish_reason == "max_tokens" and len(t.token_ids) == r.max_tokens, (
            f"{policy}: request {i} finished with {len(t.token_ids)}/{r.max_tokens} tokens ({t.finish_reason})"
        )


def summarize(policy: str, traces: list[Trace], steps: int, t0: float) -> Stats:
    ttft = [t.token_times[0] - t.arrival for t in traces]
    itl = np.concatenate([np.diff(t.token_times) for t in traces])
    tokens = sum(len(t.token_ids) for t in traces)
    wall = max(t.token_times[-1] for t in traces) - t0
    p50, p99 = np.percentile(ttft, [50, 99])
    i50, i99 = np.percentile(itl, [50, 99])
    return Stats(policy, p50, p99, i50, i99, tokens / wall, steps, wall)


def run_policy(
    args: argparse.Namespace, folder: str, policy: str, workload: list[Request]
) -> tuple[Stats, list[Trace]]:
    eng = LLMEngine(folder, scheduling_policy=policy, **engine_config(args, workload))
    warm_up(eng)
    print(f"[{policy}] running {len(workload)} requests ... ({load_average()})", flush=True)
    traces, steps, t0 = drive(eng, workload)
    del eng
    gc.collect()
    check_complete(policy, traces, workload)
    stats = summarize(policy, traces, steps, t0)
    print(f"[{policy}] done in {stats.wall:.1f} s, {steps} steps", flush=True)
    return stats, traces


# -- report -------------------------------------------------------------------------------


def print_table(results: list[Stats]) -> None:
    print("\n| policy | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) | output tok/s | steps |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for s in results:
        print(
            f"| {s.policy} | {1e3 * s.ttft_p50:.0f} | {1e3 * s.ttft_p99:.0f} | {1e3 * s.itl_p50:.1f} | "
            f"{1e3 * s.itl_p99:.1f} | {s.tok_s:.1f} | {s.steps} |"
        )


def report_goal(results: list[Stats]) -> None:
    by_name = {s.policy: s for s in results}
    if not {"prefill_first", "mixed"} <= by_name.keys():
        return
    pf, mx = by_name["prefill_first"], by_name["mixed"]
    ratio = pf.itl_p99 / mx.itl_p99
    cost = 1 - mx.tok_s / pf.tok_s
    met = ratio >= ITL_GOAL and cost <= COST_GOAL
    print(f"\np99 ITL ratio (prefill_first / mixed): {ratio:.2f}x (goal >= {ITL_GOAL:.0f}x)")
    print(
        f"throughput cost of mixed (1 - mixed tok/s / prefill_first tok/s): {100 * cost:+.1f}% "
        f"(goal <= {100 * COST_GOAL:.0f}%)"
    )
    print(f"goal {'MET' if met else 'NOT MET'}")


def compare_outputs(outputs: dict[str, list[list[int]]], dtype: str) -> bool:
    """Greedy outputs of every policy against the first one; False if float32 disagrees."""
    (ref, ref_out), *others = outputs.items()
    agree = True
    for policy, out in others:
        same = sum(a == b for a, b in zip(ref_out, out))
        print(f"greedy outputs identical to {ref}: {policy} {same}/{len(out)} requests")
        agree &= same == len(out)
    if dtype != "float32":
        print("(bfloat16: informational, reduced precision depends on the batch shape)")
        return True
    return agree


def describe(args: argparse.Namespace, workload: list[Request], config: dict[str, object]) -> None:
    lengths = np.array([len(r.prompt) for r in workload])
    outputs = np.array([r.max_tokens for r in workload])
    long = int((lengths >= LONG_PROMPT[0]).sum())
    span = workload[-1].arrival
    print(
        f"workload: {len(workload)} requests over {span:.1f} s (rate {args.rate}/s, seed {args.seed}); "
        f"prompts {lengths.min()}-{lengths.max()} tokens (mean {lengths.mean():.0f}), {long} of them "
        f">= {LONG_PROMPT[0]}; outputs {outputs.min()}-{outputs.max()} tokens ({outputs.sum()} in all)"
    )
    print("engine config (every policy): " + ", ".join(f"{k}={v}" for k, v in config.items()))


def load_average() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


# -- main ---------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rate", type=float, default=1.5, help="mean arrivals per second (Poisson)")
    ap.add_argument("--long-share", type=float, default=0.25, help="share of 1,000-1,500-token prompts")
    ap.add_argument("--min-output", type=int, default=32)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 requests, 8-16 output tokens")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.min_output, args.max_output = 8, 8, 16
    return args


def main() -> None:
    args = parse_args()
    print(cpu_features().description(), flush=True)
    torch.set_num_threads(args.threads)
    folder = str(fetch_default_model())
    vocab_size = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    workload = make_workload(args, vocab_size)
    config = engine_config(args, workload)
    print(f"model {folder}; torch {torch.__version__}, {torch.get_num_threads()} threads; {load_average()}")
    describe(args, workload, config)

    results, outputs = [], {}
    for policy in args.policies:
        stats, traces = run_policy(args, folder, policy, workload)
        results.append(stats)
        outputs[policy] = [t.token_ids for t in traces]

    print(f"\ncommand: {shlex.join([sys.executable, *sys.argv])}")
    print_table(results)
    report_goal(results)
    agree = compare_outputs(outputs, args.dtype) if len(outputs) > 1 else True
    print(f"{load_average()} (above {os.cpu_count()} means other processes shared the CPU: figures are noisy)")
    if not agree:
        sys.exit("float32 greedy outputs differ between policies")


if __name__ == "__main__":
    main()
