"""One MLA layer's attention, timed: prompt chunks expanded vs absorbed, decode through the C++
kernel vs the torch path. Random weights at a real model's shapes (DeepSeek-V2-Lite by
default: 16 heads, latent 512 + 64, qk_nope 128, v 128); no model, no scheduler.

    python benchmarks/mla_paths.py [--heads 16] [--dtype bfloat16] [--threads 1] [--decode-only]
        [--decode 1x1024,16x1024,64x512,16x4096]
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import numpy as np
import torch

from atom_attention import cpu_kernels
from atom_attention.mla.paged import CpuMLAAttention, TorchMLAAttention
from atom_core.layers.mla import MLAAttention
from atom_core.platform.cpu_features import cpu_features
from atom_core.runner.attention_builder import AttentionMetadataBuilder, BuilderContext

BS = 16


def setup(heads, rank, rope, nope, v, dtype, ctx, q_lens, seed=0):
    torch.manual_seed(seed)
    kv_b = torch.nn.Linear(rank, heads * (nope + v), bias=False).to(dtype)
    layer = MLAAttention(heads, nope, rope, v, rank, (nope + rope) ** -0.5, kv_b, layer_id=0)
    layer.keep = kv_b
    nblocks = sum(-(-c // BS) for c in ctx)
    rng = np.random.default_rng(seed)
    free = list(rng.permutation(nblocks))
    tables = [[int(free.pop()) for _ in range(-(-c // BS))] for c in ctx]
    layer.kv_cache = torch.randn(nblocks + 1, BS, rank + rope).to(dtype)
    layer.kv_cache[nblocks].zero_()
    total = sum(q_lens)
    batch = SimpleNamespace(
        num_scheduled_tokens=q_lens,
        context_lens=ctx,
        block_tables=tables,
        num_cached_tokens=[0] * len(ctx),
        pad_block=None,
        left_pad_blocks=None,
        tkvs=None,
    )
    context = BuilderContext.without_engine(dtype=dtype, block_size=BS)
    meta = AttentionMetadataBuilder(context, []).build(batch)
    inputs = (
        torch.randn(total, heads, nope).to(dtype),
        torch.randn(total, heads, rope).to(dtype),
        torch.randn(total, rank).to(dtype),
        torch.randn(total, rope).to(dtype),
    )
    return layer, meta, nblocks, inputs


def timed(impl, layer, meta, nblocks, inputs, reps=5) -> float:
    layer.impl = impl
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps):
            meta.extra = {}
            t = time.perf_counter()
            impl.prepare(meta, BS, nblocks)
            impl.forward(layer, *inputs, meta)
            best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--decode-only", action="store_true")
    ap.add_argument("--decode", default="1x1024,16x1024,64x512,16x4096", help="decode cases, requests x context")
    args = ap.parse_args()
    print(cpu_features().description(), flush=True)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    dims = dict(heads=args.heads, rank=512, rope=64, nope=128, v=128, dtype=dtype)
    print(f"one layer, {args.heads} heads, latent 512+64, {args.dtype}, {args.threads} thread(s); best of 5, ms")
    print("prompt chunk over a cached prefix      expanded   absorbed")
    for n, cached in () if args.decode_only else ((48, 0), (256, 0), (1024, 0), (48, 1024), (256, 2048)):
        setup_args = setup(**dims, ctx=[cached + n], q_lens=[n])
        times = []
        for mode in ("expand", "absorb"):
            impl = TorchMLAAttention()
            impl.prefill = mode
            times.append(timed(impl, *setup_args))
        print(f"  {n:5d} new tokens over {cached:5d} cached   {times[0]:8.2f}   {times[1]:8.2f}")
    kernel = cpu_kernels.load() is not None  # None: ATOM_CPU_KERNELS=0, or no build
    print("decode (absorbed)                       C++ kernel   torch" + ("" if kernel else "  (C++ kernels off)"))
    for reqs, ctx in (map(int, case.split("x")) for case in args.decode.split(",")):
        setup_args = setup(**dims, ctx=[ctx] * reqs, q_lens=[1] * reqs)
        cpp = f"{timed(CpuMLAAttention(), *setup_args):8.2f}" if kernel else f"{'-':>8}"
        tor = timed(TorchMLAAttention(), *setup_args)
        print(f"  {reqs:3d} requests x {ctx:5d} tokens          {cpp}   {tor:8.2f}")


if __name__ == "__main__":
    main()
