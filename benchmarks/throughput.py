"""End-to-end generation speed on CPU: Atom against Hugging Face transformers, same model.

Model: SmolLM2-135M-Instruct (`atom_core.engine.fetch.fetch_default_model`), loaded by both
engines in the same precision and with the same torch thread count.

What is measured, per dtype:

* Offline throughput. 64 prompts of random token ids (lengths uniform in [64, 256],
  fixed seed), 128 greedy output tokens each, EOS ignored. tokens/s counts generated
  tokens only (num_prompts * output_len) over the whole wall time, prefill included.
  Atom: one `generate` call with every prompt (continuous batching).
  transformers: `model.generate` on static batches of `--hf-batch-size` prompts, left
  padded with attention masks; prompts are sorted by length first (least padding, the
  peer's best case) unless `--no-hf-sort`.
* Batch-1 decode rate. One 64-token prompt, 65 new tokens; the first token (prefill)
  is excluded: Atom reports 1/tpot, transformers is timed with a streamer between its
  first and last token. Best of `--repeats` runs.
* Atom's decode step split. The same 64 prompts through the incremental API; timings
  are cleared once every prompt is prefilled, so the means cover decode steps only.
* Both engines are loaded side by side and measured alternately; with `--rounds N` each
  throughput figure is the best of N, the least disturbed on a shared machine.
* Sanity: how many leading greedy tokens agree between the engines for the first few
  prompts (informational; float32 should agree closely, bfloat16 drifts).

    .venv/bin/python benchmarks/throughput.py [--dtype float32|bfloat16|both]
        [--num-prompts 64] [--output-len 128] [--threads 2] [--hf-batch-size 32]
        [--no-hf-sort] [--rounds 1] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from atom_core import SamplingParams
from atom_core.engine.fetch import fetch_default_model
from atom_core.engine.llm_engine import LLMEngine
from atom_core.platform.cpu_features import cpu_features

VOCAB_RANGE = (100, 40000)  # ordinary (non-special) token ids of SmolLM2's vocabulary
PHASES = ("schedule", "prepare", "forward", "sample", "postprocess")
BLOCK_SIZE = 16


@dataclass
class Result:
    dtype: str
    atom_tok_s: float = 0.0
    hf_tok_s: float = 0.0
    atom_b1: float = 0.0
    hf_b1: float = 0.0
    matches: list[tuple[int, int]] = field(default_factory=list)  # (matching prefix, length)
    atom_split_ms: dict[str, float] = field(default_factory=dict)


# -- workload -----------------------------------------------------------------------------


def make_prompts(num: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=num)
    return [rng.integers(*VOCAB_RANGE, size=int(n)).tolist() for n in lengths]


def matching_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# -- Atom ---------------------------------------------------------------------------------


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def load_atom(folder: str, dtype: str, prompts: list[list[int]], output_len: int) -> LLMEngine:
    """A KV pool just big enough for the workload (the default takes a quarter of free RAM)."""
    max_model_len = json.loads((Path(folder) / "config.json").read_text()).get("max_position_embeddings", 4096)
    needed = sum(blocks_for(len(p) + output_len + 1) for p in prompts)
    blocks = max(needed, blocks_for(max_model_len)) + 64  # Atom wants room for one max-length request
    # quantization="none": the same float weights transformers runs (benchmarks/quantization.py
    # measures the quantized formats).
    return LLMEngine(
        folder, dtype=dtype, kv_cache_block_size=BLOCK_SIZE, num_kvcache_blocks=blocks, quantization="none"
    )


def greedy(output_len: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)


def atom_throughput(eng: LLMEngine, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    results = eng.generate(prompts, greedy(output_len), use_tqdm=False)
    elapsed = time.perf_counter() - t0
    assert all(len(r["token_ids"]) == output_len for r in results), "Atom stopped early"
    return len(prompts) * output_len / elapsed, [r["token_ids"] for r in results]


def atom_batch1_decode(eng: LLMEngine, prompt: list[int], new_tokens: int, repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        (r,) = eng.generate([prompt], greedy(new_tokens), use_tqdm=False)
        rates.append(1.0 / r["tpot"])
    return max(rates)


def atom_decode_split(eng: LLMEngine, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """Mean ms per decode step of each engine phase, prefill steps left out."""
    for p in prompts:
        eng.add_request(p, greedy(output_len))
    while eng.scheduler.waiting:
        eng.step()
    eng.timings.clear()
    while eng.has_unfinished_requests():
        eng.step()
    steps = eng.timings["steps"]
    split = {k: 1e3 * eng.timings[k] / steps for k in PHASES}
    split["total"] = sum(split.values())
    split["steps"] = steps
    return split


# -- transformers -------------------------------------------------------------------------


class StepClock:
    """A generate() streamer that timestamps every new token (the first put is the prompt)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def load_hf(folder: str, dtype: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None  # ignore EOS: always max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


def hf_generate(model, batch: list[list[int]], new_tokens: int, streamer=None) -> list[list[int]]:
    width = max(map(len, batch))
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        streamer=streamer,
    )
    return out[:, width:].tolist()


def hf_throughput(model, prompts: list[list[int]], output_len: int, batch_size: int, sort: bool):
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i])) if sort else list(range(len(prompts)))
    outputs: list[list[int]] = [[] for _ in prompts]
    t0 = time.perf_counter()
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        for i, toks in zip(chunk, hf_generate(model, [prompts[i] for i in chunk], output_len)):
            outputs[i] = toks
    elapsed = time.perf_counter() - t0
    assert all(len(o) == output_len for o in outputs), "transformers stopped early"
    return len(prompts) * output_len / elapsed, outputs


def hf_batch1_decode(model, prompt: list[int], new_tokens: int, repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        clock = StepClock()
        hf_generate(model, [prompt], new_tokens, streamer=clock)
        tokens = clock.times[1:]  # drop the prompt's put
        rates.append((len(tokens) - 1) / (tokens[-1] - tokens[0]))
    return max(rates)


# -- one dtype ----------------------------------------------------------------------------


def run_dtype(args, folder: str, dtype: str, prompts: list[list[int]]) -> Result:
    """Both engines loaded side by side; measurements alternate between them, best of `--rounds`."""
    res = Result(dtype)
    b1_prompt = make_prompts(1, args.b1_prompt_len, args.b1_prompt_len, seed=1)[0]
    b1_tokens = args.b1_decode_tokens + 1  # the first token is prefill, not timed
    print(f"\n=== {dtype} === {load_average()}", flush=True)
    eng = load_atom(folder, dtype, prompts, args.output_len)
    model = load_hf(folder, dtype)
    eng.generate(prompts[:2], greedy(4), use_tqdm=False)  # warm-ups
    hf_generate(model, prompts[:2], 4)

    for r in range(args.rounds):
        rate, atom_out = atom_throughput(eng, prompts, args.output_len)
        res.atom_tok_s = max(res.atom_tok_s, rate)
        print(f"[round {r + 1}] atom         throughput: {rate:8.1f} tok/s", flush=True)
        rate, hf_out = hf_throughput(model, prompts, args.output_len, args.hf_batch_size, args.hf_sort)
        res.hf_tok_s = max(res.hf_tok_s, rate)
        print(f"[round {r + 1}] transformers throughput: {rate:8.1f} tok/s", flush=True)
    res.matches = [(matching_prefix(a, h), len(a)) for a, h in zip(atom_out[: args.check], hf_out)]

    res.atom_b1 = atom_batch1_decode(eng, b1_prompt, b1_tokens, args.repeats)
    print(f"atom         batch-1 decode: {res.atom_b1:8.1f} tok/s", flush=True)
    res.hf_b1 = hf_batch1_decode(model, b1_prompt, b1_tokens, args.repeats)
    print(f"transformers batch-1 decode: {res.hf_b1:8.1f} tok/s", flush=True)
    del model
    gc.collect()

    res.atom_split_ms = atom_decode_split(eng, prompts, args.output_len)
    del eng
    gc.collect()
    report_dtype(res)
    return res


def report_dtype(res: Result) -> None:
    print(
        f"ratio atom/transformers: throughput {res.atom_tok_s / res.hf_tok_s:.2f}x, "
        f"batch-1 decode {res.atom_b1 / res.hf_b1:.2f}x"
    )
    s = res.atom_split_ms
    print(
        f"atom decode step ({int(s['steps'])} steps after prefill), mean ms/step: "
        + ", ".join(f"{k} {s[k]:.2f}" for k in (*PHASES, "total"))
    )
    note = "" if res.dtype == "float32" else " (informational: reduced precision drifts)"
    print(
        f"greedy agreement, first {len(res.matches)} prompts, matching prefix{note}: "
        + ", ".join(f"{m}/{n}" for m, n in res.matches)
    )


def print_summary(results: list[Result], args) -> None:
    sort = "sorted by length" if args.hf_sort else "unsorted"
    print(
        f"\n=== summary: {args.num_prompts} prompts x {args.output_len} tokens, {args.threads} threads, "
        f"transformers batch {args.hf_batch_size} ({sort}) ==="
    )
    head = (
        f"{'dtype':<9} {'atom tok/s':>10} {'hf tok/s':>9} {'ratio':>6} | {'atom b1':>8} {'hf b1':>7} {'ratio':>6} | "
        f"{'fwd ms':>7} {'other ms':>8} | agree"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        s = r.atom_split_ms
        agree = f"{sum(m == n for m, n in r.matches)}/{len(r.matches)} full"
        print(
            f"{r.dtype:<9} {r.atom_tok_s:>10.1f} {r.hf_tok_s:>9.1f} {r.atom_tok_s / r.hf_tok_s:>5.2f}x | "
            f"{r.atom_b1:>8.1f} {r.hf_b1:>7.1f} {r.atom_b1 / r.hf_b1:>5.2f}x | "
            f"{s['forward']:>7.2f} {s['total'] - s['forward']:>8.2f} | {agree}"
        )
    print("(b1 = batch-1 decode tok/s; fwd/other = Atom's mean ms per decode step in the model / elsewhere)")


def load_average() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


# -- main ---------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "both"), default="float32")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument(
        "--hf-sort",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="sort prompts by length before batching them for transformers",
    )
    ap.add_argument("--b1-prompt-len", type=int, default=64)
    ap.add_argument("--b1-decode-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="throughput runs per engine, alternating (best)")
    ap.add_argument("--repeats", type=int, default=3, help="batch-1 runs per engine (best)")
    ap.add_argument("--check", type=int, default=4, help="prompts whose greedy outputs are compared")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 prompts, 16 output tokens")
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.output_len, args.b1_decode_tokens, args.repeats = 8, 16, 16, 1
    args.hf_batch_size = min(args.hf_batch_size, args.num_prompts)
    return args


def main() -> None:
    args = parse_args()
    print(cpu_features().description(), flush=True)
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    folder = str(fetch_default_model())
    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, args.seed)
    lengths = [len(p) for p in prompts]
    print(f"model {folder}; torch {torch.__version__}, {torch.get_num_threads()} threads; {load_average()}")
    print(
        f"{len(prompts)} prompts, lengths {min(lengths)}-{max(lengths)} (mean {np.mean(lengths):.0f}), "
        f"{args.output_len} greedy tokens each, ignore EOS; transformers batch {args.hf_batch_size}, "
        f"{'sorted by length' if args.hf_sort else 'unsorted'}"
    )
    dtypes = ("float32", "bfloat16") if args.dtype == "both" else (args.dtype,)
    results = [run_dtype(args, folder, d, prompts) for d in dtypes]
    print_summary(results, args)
    print(f"{load_average()} (above {os.cpu_count()} means other processes shared the CPU: figures are noisy)")


if __name__ == "__main__":
    main()
