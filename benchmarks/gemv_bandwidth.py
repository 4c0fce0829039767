"""Decode-sized GEMMs: Atom's streaming kernels against oneDNN and torch's int4 kernel, in GB/s.

SmolLM2's 30 layers of weight shapes (qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536), random values, each GEMM run once per pass over all 120 so the weights come
from memory, not cache (as in a decode step), placed as the engine places them (in huge
pages, `memory.weight_arena`). Reported: weight bytes read per second, best of `--repeats`
passes, against the machine's copy bandwidth (a 256 MiB copy, read + write, best of 3)
measured right before and after each kernel: this host's bandwidth swings 2x within
minutes, so only figures taken together compare.

* float32 / bfloat16: `gemv_cpu.cpp`'s `gemv` on its tiled copy of the weight against oneDNN's packed
  GEMM (`torch.ops.mkldnn._linear_pointwise`), the two paths `Linear` chooses between; on CPUs
  with AMX, bfloat16 both in AMX tiles (from AMX_MIN_ROWS rows) and with vdpbf16ps. Where
  the build takes float32 at every row count (`F32_EVERY_ROW`, AVX2), rows past MAX_ROWS
  (`--rows 512`: a prompt's) are measured too.
* 4-bit groups of 32 (GGUF Q4_1's layout): `qgemm` against `_weight_int4pack_mm_for_cpu`
  (bytes: the packed values plus a 16-bit scale and min per group, for both).

`--variants avx512_bf16,avx2` measures those builds of the kernels side by side (an AVX-512
host runs the AVX2 one too); the default is this CPU's.

    .venv/bin/python benchmarks/gemv_bandwidth.py [--rows 1,2,3,4,8] [--threads 2] [--repeats 5]
        [--weights float32,bfloat16,4bit] [--variants avx512_bf16,avx2]
"""

from __future__ import annotations

import argparse
import time
from typing import Callable, TypeVar

import torch

from atom_core.layers.gemm import PACK_ROWS, StreamingGemm, _onednn_linear, gemv_ops, onednn_takes
from atom_core.layers.quantized_gemm import Int4PackGemm, StreamingGroupGemm
from atom_core.layers.quantized_weight import quantize_int4
from atom_core.platform.cpu_features import cpu_features
from atom_core.platform.memory import resident, weight_arena

T = TypeVar("T")

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


class CopyBandwidth:
    """GB/s of a 256 MiB copy (read + write), on huge pages like the weights."""

    def __init__(self) -> None:
        # Random contents: a VM's host may merge pages that hold one repeated value (KSM), and
        # reading those would come from cache.
        with weight_arena():
            self.a = resident(torch.rand(64 << 20))
            self.b = resident(torch.empty_like(self.a))

    def __call__(self) -> float:
        return 2 * self.a.nbytes / best_time([lambda: self.b.copy_(self.a)], 3) / 1e9

    def around(self, measure: Callable[[], T]) -> tuple[T, float]:
        """`measure()` and the mean copy bandwidth just before and after it."""
        before = self()
        value = measure()
        return value, (before + self()) / 2


def row(weights: str, m: int, mine: float, copy: float, peer: float, peer_name: str = "") -> None:
    print(
        f"| {weights} | {m} | {mine:.1f} | {copy:.1f} | {mine / copy:.0%} | {peer:.1f}{peer_name} | {mine / peer:.2f}x |"
    )


def kernel(gemm: StreamingGemm, x: torch.Tensor) -> torch.Tensor:
    """The streaming kernel itself at any row count (past `streaming_rows`, `Linear` takes oneDNN)."""
    return gemm.ops.gemv(x, gemm.tiled, gemm.out_features, None)


def float_rows(dtype: torch.dtype, rows: list[int], repeats: int, copy: CopyBandwidth, variant: str) -> None:
    ops = gemv_ops(variant)
    weights = [torch.randn(n, k).to(dtype) for n, k in SHAPES]
    every = dtype == torch.float32 and bool(ops.F32_EVERY_ROW)  # the kernel `Linear` gives prompts too
    with weight_arena():
        streamed = [StreamingGemm(w, ops, every_row=every) for w in weights]  # its tiled copy, in huge pages
    # where oneDNN has no kernels for the dtype (bfloat16 without AVX-512), the peer is torch's own linear
    packs = onednn_takes(dtype)
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS) if packs else w for w in weights]
    peer, peer_name = (_onednn_linear, "") if packs else (torch.nn.functional.linear, " (torch linear)")
    nbytes = sum(w.nbytes for w in weights)
    # bfloat16 where the build and CPU multiply in AMX tiles: with them and without (vdpbf16ps)
    tiles = [True, False] if dtype == torch.bfloat16 and ops.set_amx(True) else [None]
    for m in (m for m in rows if m <= ops.MAX_ROWS or every):  # the layer's route to it (past it, oneDNN)
        xs = {k: torch.randn(m, k).to(dtype) for k in (576, 1536)}
        calls = [lambda w=w, p=p: peer(xs[w.shape[1]], p, None) for w, p in zip(weights, packed)]
        onednn = nbytes / best_time(calls, repeats) / 1e9
        for amx in tiles:
            if amx is not None:
                ops.set_amx(amx)
            mine, machine = copy.around(
                lambda: nbytes / best_time([lambda g=g: kernel(g, xs[g.in_features]) for g in streamed], repeats) / 1e9
            )
            how = "" if amx is None else ", AMX tiles" if amx and m >= ops.AMX_MIN_ROWS else ", vdpbf16ps"
            row(f"{str(dtype).removeprefix('torch.')} ({variant}{how})", m, mine, machine, onednn, peer_name)
    ops.set_amx(cpu_features().amx_bf16)  # as `gemv_ops` leaves it


def int4_rows(rows: list[int], repeats: int, copy: CopyBandwidth, variant: str) -> None:
    ops = gemv_ops(variant)
    weights = [quantize_int4(torch.randn(n, k) * 0.05, 32) for n, k in SHAPES]
    with weight_arena():
        mine = [StreamingGroupGemm(w, ops) for w in weights]
        theirs = [Int4PackGemm(w) for w in weights]
    nbytes = sum(k.qweight.nbytes + k.scales.nbytes + k.mins.nbytes for k in mine)
    for m in rows:
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        for bits in (8, 16):
            for k in mine:
                k.activation_bits = bits
            a, machine = copy.around(
                lambda: nbytes / best_time([lambda k=k: k(xs[k.in_features]) for k in mine], repeats) / 1e9
            )
            b = nbytes / best_time([lambda k=k: k(xs[k.in_features]) for k in theirs], repeats) / 1e9
            row(f"4-bit groups of 32, int{bits} x ({variant})", m, a, machine, b, " (torch int4)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,3,4,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--weights", default="float32,bfloat16,4bit", help="which of float32, bfloat16, 4bit")
    ap.add_argument("--variants", default=None, help="kernel builds to measure (default: this CPU's)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    variants = args.variants.split(",") if args.variants else [cpu_features().variant.name]
    for variant in variants:
        if gemv_ops(variant) is None:
            raise SystemExit(f"the {variant} build of the C++ kernels is unavailable (see the log line above)")
    copy = CopyBandwidth()
    print(f"{cpu_features().description()}, {args.threads} threads")
    print(
        "| weights | rows | Atom's streaming kernel (GB/s) | copy around it (GB/s) | of copy | peer (GB/s) | Atom / peer |"
    )
    print("|---|---|---|---|---|---|---|")
    kinds = args.weights.split(",")
    for dtype in (torch.float32, torch.bfloat16):
        if str(dtype).removeprefix("torch.") in kinds:
            for variant in variants:
                float_rows(dtype, rows, args.repeats, copy, variant)
    if "4bit" in kinds:
        for variant in variants:
            int4_rows(rows, args.repeats, copy, variant)


if __name__ == "__main__":
    main()
