"""Tensor parallel and data parallel against one rank, on one host, in one run.

Model: a random-weight Llama with SmolLM2-135M's depth and widths (30 layers, hidden 576,
MLP 1536, 49152-token vocabulary, SmolLM2's tokenizer) but heads that split in two (8 query
heads and 2 KV heads of 64; SmolLM2 itself has 9 and 3), float32, built once under
~/.cache/atom/bench/.

* Tensor parallel: one engine of 1 rank x 2 threads against 2 ranks x 1 thread ("mp" executor,
  gloo on loopback), each in a process of its own. Decode tokens/s at 1, 8 and 32 sequences
  (32-token prompts, 128 greedy tokens each, timed once every prompt is in), the time of one
  2,048-token prefill, and the model's collectives per decode step with the time rank 0 spent
  in them.
* Data parallel: `atom serve` with 2 engine cores x 1 thread against 1 core x 2 threads, loaded
  by `atom bench serve`'s client at concurrency 1, 8 and 32 (32-token prompts, 128 tokens).

Prints each figure and the ratio (parallel / one rank); --json for the raw figures.

    .venv/bin/python benchmarks/parallel.py [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_REPO / "benchmarks")]

from serve_vs_llamacpp import Server, free_port  # noqa: E402

SEQS = (1, 8, 32)
PROMPT_LEN, NEW_TOKENS, PREFILL_LEN = 32, 128, 2048


def model_folder() -> Path:
    """The random-weight model (built once) with SmolLM2's tokenizer beside it."""
    from atom_core.engine.fetch import default_cache_dir, fetch_default_model

    folder = default_cache_dir() / "bench" / "llama-smollm2-shape-8h"
    if (folder / "config.json").exists():
        return folder
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
        initializer_range=0.04,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    for f in fetch_default_model().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, folder / f.name)
    return folder


def child(ranks: int, threads: int) -> dict[str, Any]:
    """One engine's figures (runs in its own process: its threads are its own)."""
    import torch

    from atom_core import SamplingParams
    from atom_core.distributed.communication import collective_stats
    from atom_core.engine.llm_engine import LLMEngine

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {"ranks": ranks, "threads_per_rank": max(1, threads // ranks), "decode": {}}
    config = dict(dtype="float32", max_model_len=4096, kv_cache_memory=2 << 30, tensor_parallel_size=ranks)
    with LLMEngine(model_folder(), **config) as engine:
        greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm
        for n in SEQS:
            for _ in range(n):
                engine.add_request(torch.randint(100, 49000, (PROMPT_LEN,), generator=g).tolist(), greedy)
            while engine.scheduler.waiting:  # every prompt in: what follows is decode
                engine.step()
            engine.step()
            steps, calls, seconds = engine.timings["steps"], collective_stats.calls, collective_stats.seconds
            before = sum(seq.num_completion_tokens for seq in engine.scheduler.running)
            start = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            elapsed = time.perf_counter() - start
            produced = n * NEW_TOKENS - before
            decode_steps = engine.timings["steps"] - steps
            out["decode"][n] = {
                "tokens_per_s": produced / elapsed,
                "collectives_per_step": (collective_stats.calls - calls) / decode_steps,
                "collective_ms_per_step": 1e3 * (collective_stats.seconds - seconds) / decode_steps,
                "step_ms": 1e3 * elapsed / decode_steps,
            }
        prompt = torch.randint(100, 49000, (PREFILL_LEN,), generator=g).tolist()
        start = time.perf_counter()
        engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        out["prefill_2048_s"] = time.perf_counter() - start
    return out


def run_child(ranks: int, threads: int) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", str(ranks), "--threads", str(threads)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"{ranks} rank(s) failed:\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["decode"] = {int(n): d for n, d in out["decode"].items()}  # JSON keys are strings
    return out


def serve(folder: Path, dp: int, threads: int) -> dict[int, float]:
    from atom_core.serve.bench import bench_serve

    port = free_port()
    command = [sys.executable, "-m", "atom_core.cli", "serve", str(folder), "--port", str(port), "--dtype", "float32",
               "--max-model-len", "1024", "--kv-cache-memory", str(2 << 30), "--data-parallel-size", str(dp),
               "--core-threads", str(max(1, threads // dp))]  # fmt: skip
    with Server(command, port, f"atom serve dp={dp}") as server:
        levels = bench_serve(server.url, None, 32, PROMPT_LEN, NEW_TOKENS, list(SEQS), float("inf"), None, 0)
    return {level["max_concurrency"]: level["output_throughput"] for level in levels}


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure, the best of the rounds (the host's bandwidth swings between runs)."""
    out = dict(runs[0])
    out["decode"] = {n: max((r["decode"][n] for r in runs), key=lambda d: d["tokens_per_s"]) for n in SEQS}
    out["prefill_2048_s"] = min(r["prefill_2048_s"] for r in runs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="cores in all, shared by the ranks")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--skip-serve", action="store_true", help="tensor parallel only")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.threads)))
        return
    folder = model_folder()
    one, two = [], []
    dp1: dict[int, float] = {}
    dp2: dict[int, float] = {}
    for _ in range(args.rounds):  # interleaved, so a swing in bandwidth hits both
        one.append(run_child(1, args.threads))
        two.append(run_child(2, args.threads))
        if not args.skip_serve:
            for best_of, dp in ((dp1, 1), (dp2, 2)):
                for n, tps in serve(folder, dp, args.threads).items():
                    best_of[n] = max(best_of.get(n, 0.0), tps)
    tp1, tp2 = best(one), best(two)
    from atom_core.platform.cpu_features import cpu_features

    if args.json:
        print(
            json.dumps({"cpu": cpu_features().description(), "tp1": tp1, "tp2": tp2, "dp1": dp1, "dp2": dp2}, indent=1)
        )
        return
    print(f"{cpu_features().description()}, {args.threads} cores; best of {args.rounds} rounds")
    print(f"\nTensor parallel: 1 rank x {args.threads} threads vs 2 ranks x {max(1, args.threads // 2)} thread(s)")
    print(
        "| sequences | 1 rank tok/s | 2 ranks tok/s | ratio | collectives/step | ms in them/step | step ms (2 ranks) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in SEQS:
        a, b = tp1["decode"][n], tp2["decode"][n]
        print(f"| {n} | {a['tokens_per_s']:.1f} | {b['tokens_per_s']:.1f} | {b['tokens_per_s'] / a['tokens_per_s']:.2f}x "
              f"| {b['collectives_per_step']:.0f} | {b['collective_ms_per_step']:.1f} | {b['step_ms']:.1f} |")  # fmt: skip
    a, b = tp1["prefill_2048_s"], tp2["prefill_2048_s"]
    print(f"| prefill {PREFILL_LEN} tokens | {a:.2f} s | {b:.2f} s | {a / b:.2f}x | | | |")
    if dp1 and dp2:
        print(
            f"\nData parallel (atom serve): 1 engine core x {args.threads} threads vs 2 x {max(1, args.threads // 2)}"
        )
        print("| concurrency | 1 core tok/s | 2 cores tok/s | ratio |")
        print("|---:|---:|---:|---:|")
        for n in SEQS:
            print(f"| {n} | {dp1[n]:.1f} | {dp2[n]:.1f} | {dp2[n] / dp1[n]:.2f}x |")


if __name__ == "__main__":
    main()
