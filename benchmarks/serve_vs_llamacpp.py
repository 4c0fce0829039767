"""`atom serve` against `llama-server`: the same GGUF, the same load, the same machine, one run.

Both servers load the default model's Q4_1 GGUF (SmolLM2-135M-Instruct) and are measured one
at a time with `atom bench serve`'s client (atom_core/serve/bench.py): the same random
token-id prompts (`--input-len` in, `--output-len` out, `ignore_eos`, temperature 0, streamed
with usage) at each concurrency. With `--rounds N` the servers alternate N times and each cell
keeps the best round of each side. Also measured in the same run: Atom offline at the same
concurrency (`atom bench offline`: what the server costs), and `atom serve` with two data-parallel
ranks (`--dp2`).

llama-server is built from the llama-cpp-python sdist's sources (benchmarks/llamacpp_build.py)
and started as `-t T -tb T -np 32 --kv-unified -c <32 slots>`. Atom is started with its
defaults (its engine core takes every core, as llama-server does); both
see the same `--threads` cores (`taskset` when given fewer than the machine has).

    .venv/bin/python benchmarks/serve_vs_llamacpp.py [--concurrency 1,8,32] [--num-prompts 32]
        [--input-len 128] [--output-len 128] [--rounds 1] [--threads 2] [--dp2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

_REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_REPO / "benchmarks"), str(_REPO / "tests")]
from llamacpp_build import llama_cpp_commit, llama_server  # noqa: E402

from atom_core.engine.fetch import default_model_gguf  # noqa: E402
from atom_core.platform.cpu_features import cpu_features  # noqa: E402
from atom_core.serve.bench import bench_serve  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cores(threads: int) -> list[str]:
    """A `taskset` prefix giving the server `threads` cores (nothing when that is all of them)."""
    if threads >= len(os.sched_getaffinity(0)):
        return []
    return ["taskset", "-c", ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:threads])]


class Server:
    """A server process, up once /health answers 200; stopped on exit."""

    def __init__(self, command: list[str], port: int, name: str):
        self.url, self.name = f"http://127.0.0.1:{port}", name
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def __enter__(self) -> Server:
        deadline = time.time() + 900
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} was not healthy within 900 s")

    def __exit__(self, *exc: Any) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def atom_command(args: argparse.Namespace, gguf: Path, port: int, dp: int) -> list[str]:
    return [*cores(args.threads), sys.executable, "-m", "atom_core.cli", "serve", str(gguf), "--port", str(port),
            "--max-model-len", str(args.input_len + args.output_len + 64), "--data-parallel-size", str(dp)]  # fmt: skip


def llama_command(args: argparse.Namespace, gguf: Path, port: int) -> list[str]:
    slots = max(args.concurrency)
    ctx = slots * 256 * -(-(args.input_len + args.output_len) // 256)  # each slot's share, padded as llama.cpp does
    return [*cores(args.threads), str(llama_server()), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(args.threads), "-tb", str(args.threads), "-np", str(slots), "--kv-unified", "-c", str(ctx),
            "--no-webui"]  # fmt: skip


def offline(args: argparse.Namespace, gguf: Path) -> list[dict[str, Any]]:
    """`atom bench offline` in a process of its own (its threads and memory, as the server's)."""
    out = subprocess.run(
        [*cores(args.threads), sys.executable, "-m", "atom_core.cli", "bench", "offline", str(gguf),
         "--max-model-len", str(args.input_len + args.output_len + 64), "--enable-prefix-caching",
         "--num-prompts", str(args.num_prompts),
         "--input-len", str(args.input_len), "--output-len", str(args.output_len),
         "--max-concurrency", ",".join(map(str, args.concurrency)), "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def measure(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    levels = bench_serve(
        url, None, args.num_prompts, args.input_len, args.output_len, args.concurrency, float("inf"), None, args.seed
    )
    for level in levels:  # a short reply would make the throughput look better than it is
        expected = args.num_prompts * args.output_len
        got = round(level["output_throughput"] * level["duration_s"])
        if got != expected:
            raise RuntimeError(f"{url}: {got} output tokens at concurrency {level['max_concurrency']}, not {expected}")
    return levels


def keep_best(best: dict[int, dict[str, Any]], levels: list[dict[str, Any]]) -> None:
    for level in levels:
        c = level["max_concurrency"]
        if c not in best or level["output_throughput"] > best[c]["output_throughput"]:
            best[c] = level


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dp2", action="store_true", help="also atom serve --data-parallel-size 2")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    gguf = default_model_gguf()
    llama_server()  # built (once) before anything is timed
    results: dict[str, dict[int, dict[str, Any]]] = {"atom": {}, "llama": {}, "offline": {}, "atom_dp2": {}}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        port = free_port()
        with Server(atom_command(args, gguf, port, 1), port, "atom serve") as s:
            keep_best(results["atom"], measure(s.url, args))
        port = free_port()
        with Server(llama_command(args, gguf, port), port, "llama-server") as s:
            keep_best(results["llama"], measure(s.url, args))
        keep_best(results["offline"], offline(args, gguf))
        if args.dp2:
            port = free_port()
            with Server(atom_command(args, gguf, port, 2), port, "atom serve (dp=2)") as s:
                keep_best(results["atom_dp2"], measure(s.url, args))
    if args.json:
        print(json.dumps({k: list(v.values()) for k, v in results.items() if v}, indent=2))
        return
    print(f"{cpu_features().description()}, {args.threads} threads, llama.cpp {llama_cpp_commit()[:10]}, {args.rounds} round(s), "
          f"{args.num_prompts} prompts of {args.input_len} tokens, {args.output_len} out")  # fmt: skip
    print("| concurrency | engine | output tok/s | req/s | TTFT p50/p99 (ms) | TPOT p50/p99 (ms) | ITL p50/p99 (ms) |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    names = {"atom": "atom serve", "llama": "llama-server", "atom_dp2": "atom serve dp=2", "offline": "Atom offline"}
    for c in args.concurrency:
        for key, name in names.items():
            lv = results[key].get(c)
            if lv is None:
                continue
            t, p, i = lv["ttft"], lv["tpot"], lv["itl"]
            print(f"| {c} | {name} | {lv['output_throughput']:.1f} | {lv['request_throughput']:.2f} "
                  f"| {t['median_ms']:.0f} / {t['p99_ms']:.0f} | {p['median_ms']:.1f} / {p['p99_ms']:.1f} "
                  f"| {i['median_ms']:.1f} / {i['p99_ms']:.1f} |")  # fmt: skip
    print()
    for c in args.concurrency:
        a, ll, off = (results[k][c]["output_throughput"] for k in ("atom", "llama", "offline"))
        print(f"concurrency {c}: atom serve / llama-server = {a / ll:.2f}x; atom serve / Atom offline = {a / off:.2f}x")


if __name__ == "__main__":
    main()
