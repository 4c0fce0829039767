"""Decode and prompt speed of Atom against llama.cpp: same model, same machine, same run.

Model: SmolLM2-135M-Instruct, in four precisions:

* f32, bf16, f16: the shipped Q4_1 GGUF dequantized (`atom_core.engine.fetch.fetch_default_model`).
  Atom loads that folder with `dtype=float32|bfloat16|float16, quantization="none"`; llama.cpp runs
  it converted to GGUF by llama.cpp's own `convert_hf_to_gguf.py --outtype f32|bf16|f16` (the
  converter vendored in the llama-cpp-python sdist; see tests/gguf_convert.py).
* q4_1: the shipped file itself (Q4_1 layers, Q8_0 embedding / tied LM head). llama.cpp runs it
  as is; Atom runs the same blocks with its default config (`quantization="auto"`, dtype "auto",
  the checkpoint's float32, between the quantized GEMMs).

llama.cpp is `llama-batched-bench` built from the same sdist (benchmarks/llamacpp_build.py),
run with its defaults besides the workload: KV cache f16, flash attention "auto" (which
llama.cpp turns on for the CPU; the output says what it resolved). Same thread count on both
sides.

What is measured (the workload of `llama-batched-bench -npp 32 -ntg 128 -npl 1,8,32`):

* batch N decode: N sequences, each its own 32-token prompt (random token ids), prefilled
  together, then 128 greedy decode steps of N tokens (EOS ignored). tokens/s = N * 128 / time
  of the decode steps alone. llama.cpp: its S_TG. Atom: requests added with `add_request`,
  `step()` until every prompt is prefilled (the step that samples each first token, untimed),
  then the remaining 128 steps timed.
* pp512: one 512-token prompt. llama.cpp: its S_PP (`-npp 512 -ntg 1 -npl 1`). Atom:
  512 / time to first token of a one-token request.

With `--rounds N` Atom and llama.cpp alternate N times and each cell keeps the best of each
side, the least disturbed by other processes on a shared machine.

    .venv/bin/python benchmarks/vs_llamacpp.py [--precisions f32,bf16,q4_1] [--batches 1,8,32]
        [--threads 2] [--new-tokens 128] [--prompt-tokens 32] [--rounds 1]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

_REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_REPO / "benchmarks"), str(_REPO / "tests")]
from gguf_convert import convert_many  # noqa: E402
from llamacpp_build import batched_bench, build_root, llama_cpp_commit  # noqa: E402

from atom_core import SamplingParams  # noqa: E402
from atom_core.engine.fetch import DEFAULT_MODEL_NAME, default_model_gguf, fetch_default_model  # noqa: E402
from atom_core.engine.llm_engine import LLMEngine  # noqa: E402
from atom_core.platform.cpu_features import cpu_features  # noqa: E402

PP_TOKENS = 512
VOCAB_RANGE = (100, 40000)  # ordinary (non-special) token ids of SmolLM2's vocabulary
BLOCK_SIZE = 16
# Atom's config per precision; llama.cpp's GGUF outtype (None: the shipped Q4_1 file).
ATOM_CONFIGS = {
    "f32": dict(dtype="float32", quantization="none"),
    "bf16": dict(dtype="bfloat16", quantization="none"),
    "f16": dict(dtype="float16", quantization="none"),
    "q4_1": dict(),
}
GGUF_OUTTYPES = {"f32": "f32", "bf16": "bf16", "f16": "f16", "q4_1": None}


@dataclass
class Speeds:
    """tokens/s of one engine on one precision: decode per batch size, and pp512."""

    decode: dict[int, float] = field(default_factory=dict)
    pp: float = 0.0

    def keep_best(self, other: Speeds) -> None:
        for batch, rate in other.decode.items():
            self.decode[batch] = max(self.decode.get(batch, 0.0), rate)
        self.pp = max(self.pp, other.pp)

    def summary(self) -> str:
        return ", ".join(f"batch {b} {r:.1f}" for b, r in self.decode.items()) + f", pp{PP_TOKENS} {self.pp:.0f} t/s"


# -- models -------------------------------------------------------------------------------


def gguf_files(precisions: list[str], hf_folder: Path) -> dict[str, Path]:
    """The GGUF llama.cpp runs per precision; f32 / bf16 converted once into the build cache."""
    out_dir = build_root() / "models"
    files = {p: out_dir / f"{DEFAULT_MODEL_NAME}.{t}.gguf" if t else default_model_gguf()
             for p, t in GGUF_OUTTYPES.items() if p in precisions}  # fmt: skip
    for precision, path in files.items():
        if not path.is_file():
            outtype = GGUF_OUTTYPES[precision]
            print(f"converting {hf_folder} to {path.name} with convert_hf_to_gguf.py --outtype {outtype}",
                  file=sys.stderr, flush=True)  # fmt: skip
            out_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # renamed when complete
                (written,) = convert_many([(hf_folder, Path(tmp) / path.name)], outtype)
                os.replace(written, path)
    return files


# -- llama.cpp ----------------------------------------------------------------------------


def llama_command(binary: Path, gguf: Path, args: argparse.Namespace, npp: int, ntg: int, npl: list[int]) -> list[str]:
    """A llama-batched-bench command. The context gives every sequence of the largest batch its
    npp + ntg cells, rounded up to the 256 llama.cpp pads each sequence's share to (rows that do
    not fit would be skipped silently). `-lv 4` only logs setup (its flash attention choice)."""
    ctx = max(npl) * 256 * -(-(npp + ntg) // 256)
    return [str(binary), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512",
            "-npp", str(npp), "-ntg", str(ntg), "-npl", ",".join(map(str, npl)),
            "-t", str(args.threads), "-tb", str(args.threads), "--output-format", "jsonl", "-lv", "4"]  # fmt: skip


def run_llama(cmd: list[str]) -> tuple[list[dict], str]:
    """The JSONL result rows of one llama-batched-bench run, and its attention setup from the log."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not rows:
        raise RuntimeError(f"`{shlex.join(cmd)}` failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    flash = re.search(r"resolve_fused_ops: Flash Attention (.*)", done.stderr)
    kv = re.search(r"llama_kv_cache: size = .* K \((\w+)\).* V \((\w+)\)", done.stderr)
    fa = flash[1].strip() if flash else "?"
    cache = f"K {kv[1]}, V {kv[2]}" if kv else "?"
    setup = f"flash attention {fa} (auto), KV cache {cache}"
    return rows, setup


def llama_speeds(commands: tuple[list[str], list[str]], batches: list[int]) -> tuple[Speeds, str]:
    """S_TG per batch from the decode command, S_PP from the pp512 one."""
    decode_cmd, pp_cmd = commands
    rows, setup = run_llama(decode_cmd)
    decode = {int(r["pl"]): float(r["speed_tg"]) for r in rows}
    missing = [b for b in batches if b not in decode]
    if missing:
        raise RuntimeError(f"llama-batched-bench reported no row for batch {missing}: `{shlex.join(decode_cmd)}`")
    (pp_row,), _ = run_llama(pp_cmd)
    return Speeds({b: decode[b] for b in batches}, float(pp_row["speed_pp"])), setup


# -- Atom ---------------------------------------------------------------------------------


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def load_atom(folder: Path, precision: str, args: argparse.Namespace, **overrides: Any) -> LLMEngine:
    """An engine with a KV pool just big enough for the largest batch (the default takes a
    quarter of free RAM); `overrides` go on top of the precision's settings."""
    seq_len = args.prompt_tokens + args.new_tokens + 1
    max_model_len = BLOCK_SIZE * blocks_for(max(seq_len, PP_TOKENS + 1))
    blocks = max(args.batches) * blocks_for(seq_len) + blocks_for(max_model_len) + 16
    return LLMEngine(folder, max_model_len=max_model_len, num_kvcache_blocks=blocks,
                     kv_cache_block_size=BLOCK_SIZE, **(ATOM_CONFIGS[precision] | overrides))  # fmt: skip


def atom_decode_rate(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> float:
    """N * new_tokens / time of the decode steps, as llama-batched-bench's S_TG: the prefill
    step samples each first token and is not timed, then `new_tokens` steps of N tokens are."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens + 1, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.scheduler.waiting:
        engine.step()
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - start
    if steps != new_tokens:  # a prefill left over in the timed steps would make it no decode rate
        raise RuntimeError(f"expected {new_tokens} decode steps after the prefill, ran {steps}")
    return len(prompts) * new_tokens / elapsed


def atom_pp_rate(engine: LLMEngine, prompt: list[int]) -> float:
    (result,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return len(prompt) / result["ttft"]


def workload_prompts(args: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    """The random token-id prompts: one per sequence of the largest batch, and the pp512 one."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(*VOCAB_RANGE, size=args.prompt_tokens).tolist() for _ in range(max(args.batches))]
    return prompts, rng.integers(*VOCAB_RANGE, size=PP_TOKENS).tolist()


def atom_speeds(engine: LLMEngine, args: argparse.Namespace) -> Speeds:
    prompts, long_prompt = workload_prompts(args)
    decode = {b: atom_decode_rate(engine, prompts[:b], args.new_tokens) for b in args.batches}
    return Speeds(decode, atom_pp_rate(engine, long_prompt))


def atom_config(precision: str, **overrides: Any) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in (ATOM_CONFIGS[precision] | overrides).items()) or "default config"


def atom_dtypes(engine: LLMEngine) -> str:
    """The dtype Atom runs in (between quantized GEMMs, for q4_1) and its KV cache's."""
    kv = {str(t.dtype).removeprefix("torch.") for t in engine.runner.kv_cache_tensors.values()}
    return f"runs in {str(engine.runner.dtype).removeprefix('torch.')}, KV cache {'/'.join(sorted(kv)) or '?'}"


# -- one precision ------------------------------------------------------------------------


def start_atom(folder: Path, precision: str, args: argparse.Namespace, **overrides: Any) -> tuple[LLMEngine, str]:
    """Atom's engine for one precision, warmed up, and a line saying how it runs."""
    engine = load_atom(folder, precision, args, **overrides)
    engine.generate([[100] * 16] * 2, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    return engine, f"Atom {atom_config(precision, **overrides)}, {atom_dtypes(engine)}"


def run_precision(precision: str, folder: Path, gguf: Path, binary: Path, args: argparse.Namespace) -> dict:
    """Atom and llama.cpp alternately, `--rounds` times; the best of each side."""
    commands = (llama_command(binary, gguf, args, args.prompt_tokens, args.new_tokens, args.batches),
                llama_command(binary, gguf, args, PP_TOKENS, 1, [1]))  # fmt: skip
    engine, atom_setup = start_atom(folder, precision, args)
    atom, llama, setup = Speeds(), Speeds(), "?"
    print(f"\n=== {precision}: {atom_setup}; llama.cpp {gguf.name} === {load_average()}", flush=True)
    for r in range(1, args.rounds + 1):
        speeds = atom_speeds(engine, args)
        print(f"[round {r}] Atom      {speeds.summary()}", flush=True)
        atom.keep_best(speeds)
        speeds, setup = llama_speeds(commands, args.batches)
        print(f"[round {r}] llama.cpp {speeds.summary()}", flush=True)
        llama.keep_best(speeds)
    del engine
    gc.collect()
    return dict(precision=precision, atom=atom, llama=llama, atom_setup=atom_setup, setup=setup, commands=commands)


def cell(atom: float, llama: float) -> str:
    return f"{atom:.1f} / {llama:.1f} ({atom / llama:.2f}x)"


def print_report(results: list[dict], args: argparse.Namespace) -> None:
    print(f"\n## Atom vs llama.cpp: {DEFAULT_MODEL_NAME}, {args.threads} threads, best of {args.rounds} round(s)")
    print(
        f"\ncells: Atom t/s / llama.cpp t/s (Atom/llama.cpp); batch N = decode of N sequences "
        f"({args.prompt_tokens}-token prompts, {args.new_tokens} new tokens), pp{PP_TOKENS} = prompt processing\n"
    )
    print("| precision | " + " | ".join(f"batch {b}" for b in args.batches) + f" | pp{PP_TOKENS} |")
    print("|---|" + "---:|" * (len(args.batches) + 1))
    for r in results:
        cells = [cell(r["atom"].decode[b], r["llama"].decode[b]) for b in args.batches]
        print(f"| {r['precision']} | " + " | ".join(cells) + f" | {cell(r['atom'].pp, r['llama'].pp)} |")
    print()
    for r in results:
        print(f"- {r['precision']}: {r['atom_setup']}; llama.cpp {r['setup']}")
    print(f"\nllama.cpp {llama_cpp_commit()[:12]} (llama-cpp-python sdist), commands:")
    for r in results:
        for cmd in r["commands"]:
            print(f"    {shlex.join(cmd)}")
    print(f"\n{load_average()} ({os.cpu_count()} CPUs; above that, other processes shared them: noisy figures)")


def load_average() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precisions", default="f32,bf16,q4_1", help=f"from {', '.join(ATOM_CONFIGS)}")
    ap.add_argument("--batches", type=int_list, default=[1, 8, 32], help="parallel sequences, e.g. 1,8,32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1, help="alternations of Atom and llama.cpp (best of each)")
    args = ap.parse_args()
    args.precisions = args.precisions.split(",")
    unknown = set(args.precisions) - set(ATOM_CONFIGS)
    if unknown:
        ap.error(f"unknown precision(s) {', '.join(sorted(unknown))}; choose from {', '.join(ATOM_CONFIGS)}")
    return args


def main() -> None:
    args = parse_args()
    print(cpu_features().description(), flush=True)
    torch.set_num_threads(args.threads)
    binary = batched_bench()
    folder = fetch_default_model()
    ggufs = gguf_files(args.precisions, folder)
    print(f"model {folder}; torch {torch.__version__}, {torch.get_num_threads()} threads; {binary}")
    results = [run_precision(p, folder, ggufs[p], binary, args) for p in args.precisions]
    print_report(results, args)


if __name__ == "__main__":
    main()
