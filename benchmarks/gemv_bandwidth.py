"""Decode-sized GEMMs: Atom's streaming kernels against oneDNN and torch's int4 kernel, in GB/s.

SmolLM2's 30 layers of weight shapes (qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536), random values, each GEMM run once per pass over all 120 so the weights come
from memory, not cache (as in a decode step). Reported: weight bytes read per second,
best of `--repeats` passes, and the same machine's bandwidth for reference (a copy, and a
read-only sum, of 256 MiB).

* float32 / bfloat16: `gemv_cpu.cpp`'s `gemv` on the plain weight against oneDNN's packed
  GEMM (`torch.ops.mkldnn._linear_pointwise`), the two paths `Linear` chooses between.
* 4-bit groups of 32 (GGUF Q4_1's layout): `qgemm` against `_weight_int4pack_mm_for_cpu`
  (bytes: the packed values plus a 16-bit scale and min per group, for both).

    .venv/bin/python benchmarks/gemv_bandwidth.py [--rows 1,2,3,4,8] [--threads 2] [--repeats 5]
        [--weights float32,bfloat16,4bit]
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from atom_core.layers.linear import PACK_ROWS, _onednn_linear, gemv_ops
from atom_core.layers.quant import Int4PackGemm, StreamingGroupGemm, quantize_int4

# SmolLM2's 30 layers: qkv, o, gate_up, down.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30


def best_time(calls: list[Callable[[], object]], repeats: int) -> float:
    for call in calls:
        call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for call in calls:
            call()
        best = min(best, time.perf_counter() - start)
    return best


def machine_bandwidth() -> str:
    # Random contents: a VM's host may merge pages that hold one repeated value (KSM), and
    # reading those would come from cache.
    a = torch.rand(64 << 20)
    b = torch.empty_like(a)
    copy = best_time([lambda: b.copy_(a)], 5)
    total = best_time([lambda: a.sum()], 5)
    return f"copy {2 * a.nbytes / copy / 1e9:.1f} GB/s (read + write), read-only sum {a.nbytes / total / 1e9:.1f} GB/s"


def float_rows(dtype: torch.dtype, rows: list[int], repeats: int) -> None:
    ops = gemv_ops()
    weights = [torch.randn(n, k).to(dtype) for n, k in SHAPES]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS) for w in weights]
    nbytes = sum(w.nbytes for w in weights)
    for m in (m for m in rows if m <= ops.MAX_ROWS):  # the layer's route to it
        xs = {k: torch.randn(m, k).to(dtype) for k in (576, 1536)}
        mine = best_time([lambda w=w: ops.gemv(xs[w.shape[1]], w, None) for w in weights], repeats)
        onednn = best_time([lambda w=w, p=p: _onednn_linear(xs[w.shape[1]], p, None) for w, p in zip(weights, packed)], repeats)
        print(f"| {str(dtype).removeprefix('torch.')} | {m} | {nbytes / mine / 1e9:.1f} | {nbytes / onednn / 1e9:.1f} "
              f"| {onednn / mine:.2f}x |")  # fmt: skip


def int4_rows(rows: list[int], repeats: int) -> None:
    ops = gemv_ops()
    weights = [quantize_int4(torch.randn(n, k) * 0.05, 32) for n, k in SHAPES]
    mine = [StreamingGroupGemm(w, ops) for w in weights]
    theirs = [Int4PackGemm(w) for w in weights]
    nbytes = sum(k.qweight.nbytes + k.scales.nbytes + k.mins.nbytes for k in mine)
    for m in rows:
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        a = best_time([lambda k=k: k(xs[k.in_features]) for k in mine], repeats)
        b = best_time([lambda k=k: k(xs[k.in_features]) for k in theirs], repeats)
        print(f"| 4-bit groups of 32 | {m} | {nbytes / a / 1e9:.1f} | {nbytes / b / 1e9:.1f} (torch int4) | {b / a:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,3,4,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--weights", default="float32,bfloat16,4bit", help="which of float32, bfloat16, 4bit")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    if gemv_ops() is None:
        raise SystemExit("the C++ kernels did not build (see the warning above)")
    print(f"{args.threads} threads; this machine: {machine_bandwidth()}")
    print("| weights | rows | Atom's streaming kernel (GB/s) | peer (GB/s) | Atom / peer |\n|---|---|---|---|---|")
    kinds = args.weights.split(",")
    for dtype in (torch.float32, torch.bfloat16):
        if str(dtype).removeprefix("torch.") in kinds:
            float_rows(dtype, rows, args.repeats)
    if "4bit" in kinds:
        int4_rows(rows, args.repeats)


if __name__ == "__main__":
    main()
