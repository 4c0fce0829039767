"""Scheduler + block-manager cost per decode step, Atom against nano-vLLM's scheduler.

512 running requests with 1,000-token contexts, no model: each step is `schedule()`
plus `postprocess()` with one fake token per request. The peer is nano-vLLM's own
scheduler and block manager (from the PyPI package `nano-vllm-npu`, a verbatim copy
of nano-vLLM's engine; installed with --no-deps into benchmarks/.peers on first run).
Its decode step does less (no batch snapshot, no streaming, fewer stop checks), so
the ratio is a ceiling on what Atom's extra bookkeeping costs.

    python benchmarks/scheduler_overhead.py [--seqs 512] [--context 1000] [--steps 200]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import random
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

from atom_core import Config, SamplingParams, ScheduledBatchOutput, Scheduler, Sequence, SequenceType
from atom_core.platform.cpu_features import cpu_features

PEERS = Path(__file__).parent / ".peers"


def prompts(num_seqs: int, context: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(32000) for _ in range(context)] for _ in range(num_seqs)]


def bench_atom(data: list[list[int]], steps: int, block_size: int, prefix_caching: bool, policy: str) -> float:
    num_blocks = len(data) * ((len(data[0]) + steps + len(data) + 2 * block_size) // block_size + 1)
    sched = Scheduler(
        Config(
            num_kvcache_blocks=num_blocks,
            kv_cache_block_size=block_size,
            max_num_seqs=len(data),
            enable_prefix_caching=prefix_caching,
            eos_token_id=2,
            scheduling_policy=policy,
        )
    )
    # Under `mixed` the first requests decode while later prompts are still prefilled.
    params = SamplingParams(max_tokens=steps + len(data), ignore_eos=True)
    for tokens in data:
        sched.add(Sequence(tokens, block_size, params))
    while sched.waiting or any(s.type != SequenceType.DECODE for s in sched.running):  # prefill everything
        batch, seqs = sched.schedule()
        sched.postprocess(list(seqs.values()), ScheduledBatchOutput({i: (7,) for i in batch.req_ids}))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        batch, seqs = sched.schedule()
        t1 = time.perf_counter()
        out = ScheduledBatchOutput({i: (7,) for i in batch.req_ids})
        t2 = time.perf_counter()
        sched.postprocess(list(seqs.values()), out)
        t3 = time.perf_counter()
        times.append((t1 - t0) + (t3 - t2))
        assert len(batch.req_ids) == len(data) and batch.total_seqs_num_prefill == 0
    return statistics.median(times)


def load_nano_vllm():
    """nano-vLLM's scheduler without its package __init__ (which imports torch and transformers)."""
    if not (PEERS / "nanovllmnpu").exists():
        print("installing the peer: pip install --no-deps nano-vllm-npu ...", flush=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--target",
                str(PEERS),
                "nano-vllm-npu==0.0.2",
            ],
            check=True,
        )
    root = PEERS / "nanovllmnpu"
    package = types.ModuleType("nanovllmnpu")
    package.__path__ = [str(root)]
    sys.modules["nanovllmnpu"] = package
    config = types.ModuleType("nanovllmnpu.config")
    config.Config = object  # only used as a type hint by the scheduler
    sys.modules["nanovllmnpu.config"] = config
    scheduler = importlib.import_module("nanovllmnpu.engine.scheduler")
    sequence = importlib.import_module("nanovllmnpu.engine.sequence")
    params = importlib.import_module("nanovllmnpu.sampling_params")
    return scheduler.Scheduler, sequence.Sequence, params.SamplingParams


def bench_nano_vllm(data: list[list[int]], steps: int, block_size: int) -> float:
    NanoScheduler, NanoSequence, NanoParams = load_nano_vllm()
    NanoSequence.block_size = block_size
    num_blocks = len(data) * ((len(data[0]) + steps + 2 * block_size) // block_size + 1)
    cfg = types.SimpleNamespace(
        max_num_seqs=len(data),
        max_num_batched_tokens=16384,
        eos=2,
        num_kvcache_blocks=num_blocks,
        kvcache_block_size=block_size,
    )
    sched = NanoScheduler(cfg)
    params = NanoParams(temperature=1.0, max_tokens=steps + 10, ignore_eos=True)
    for tokens in data:
        sched.add(NanoSequence(tokens, params))
    while sched.waiting:
        seqs, _ = sched.schedule()
        sched.postprocess(seqs, [7] * len(seqs))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        seqs, is_prefill = sched.schedule()
        t1 = time.perf_counter()
        token_ids = [7] * len(seqs)
        t2 = time.perf_counter()
        sched.postprocess(seqs, token_ids)
        t3 = time.perf_counter()
        times.append((t1 - t0) + (t3 - t2))
        assert len(seqs) == len(data) and not is_prefill
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=512)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-peer", action="store_true", help="measure Atom only")
    ap.add_argument(
        "--policies", nargs="+", default=["prefill_first", "mixed"], help="the first is compared with the peer"
    )
    args = ap.parse_args()
    print(cpu_features().description(), flush=True)
    data = prompts(args.seqs, args.context)
    print(
        f"decode step of {args.seqs} sequences with {args.context}-token contexts, block size {args.block_size}, "
        f"median of {args.steps} steps (schedule + postprocess)"
    )
    for policy in args.policies:
        off = bench_atom(data, args.steps, args.block_size, prefix_caching=False, policy=policy)
        on = bench_atom(data, args.steps, args.block_size, prefix_caching=True, policy=policy)
        print(
            f"  atom {policy:13s}, prefix caching off : {off * 1e6:8.0f} us/step  ({off * 1e6 / args.seqs:.2f} us/sequence)"
        )
        print(
            f"  atom {policy:13s}, prefix caching on  : {on * 1e6:8.0f} us/step  ({on * 1e6 / args.seqs:.2f} us/sequence)"
        )
        if policy == args.policies[0]:
            atom_on = on
    if args.no_peer:
        return
    nano = bench_nano_vllm(data, args.steps, args.block_size)
    print(f"  nano-vLLM (prefix cache) : {nano * 1e6:8.0f} us/step  ({nano * 1e6 / args.seqs:.2f} us/sequence)")
    print(f"  ratio atom {args.policies[0]}/nano-vLLM (both caching): {atom_on / nano:.2f}x the time per step")


if __name__ == "__main__":
    main()
