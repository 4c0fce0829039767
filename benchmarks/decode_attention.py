"""Decode attention: Atom's C++ paged kernel against torch's own CPU attention, same rows.

One decode row per request (`--batch` of them) over `--contexts` keys each, every layer's
K/V in a pool of its own (`--layers` of them, so a step reads K/V from memory as an engine's
does) whose blocks are shuffled. Shapes: SmolLM2's (9 heads on 3 KV heads of 64), MLA's (16
heads on DeepSeek's one latent head of 576, read as K and V) and an 8B Llama's (32 heads on 8
of 128). torch gets each layer's K/V gathered from the pool per step (the copy a gather-based
path pays) and runs `F.scaled_dot_product_attention(enable_gqa=True)`. Each result is checked
against torch's first. `--against FILE` also builds FILE (another version of
`paged_attention_cpu.cpp`, e.g. `git show HEAD~3:atom_attention/csrc/paged_attention_cpu.cpp`)
as a kernel of its own and times it in the same rounds. Prints microseconds a layer (best of
`--rounds`, the engines alternating) and Atom over torch (and over FILE).

    .venv/bin/python benchmarks/decode_attention.py [--shapes smollm2,mla,llama8b] [--batch 1,2,8]
        [--contexts 100,1000,4000] [--dtype float32] [--threads 2] [--against FILE]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from atom_attention import cpu_kernels
from atom_core.layers.cpp import CppKernel
from atom_core.platform.cpu_features import cpu_features

SHAPES = {"smollm2": (9, 3, 64), "mla": (16, 1, 576), "llama8b": (32, 8, 128)}  # heads, KV heads, head dim
BLOCK = 16
POOL_BYTES = 256 << 20  # past the caches: layers enough to fill this, at least 2


def pools(kv_heads: int, dim: int, batch: int, ctx: int, dtype: torch.dtype, layers: int):
    """`layers` (K, V) pools of a request's blocks in shuffled order, and the block tables."""
    blocks = -(-ctx // BLOCK)
    tables = (torch.randperm(batch * blocks) + 1).reshape(batch, blocks)  # block 0 unused
    shape = (kv_heads, batch * blocks + 1, BLOCK, dim)
    return [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(layers)], tables


def torch_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, ctx: int) -> torch.Tensor:
    """Gather each request's blocks, then torch's attention: [batch, heads, dim]."""
    kv_heads, dim = k.shape[0], k.shape[-1]
    keys = k[:, tables].reshape(kv_heads, tables.shape[0], -1, dim)[:, :, :ctx].transpose(0, 1)
    values = v[:, tables].reshape(kv_heads, tables.shape[0], -1, dim)[:, :, :ctx].transpose(0, 1)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, scale=dim**-0.5, enable_gqa=True)
    return out.squeeze(2)


def against_kernel(source: Path) -> Callable:
    """`paged_attention` of another `paged_attention_cpu.cpp`, built as a kernel of its own."""
    other = CppKernel("atom_paged_attention_against", source.resolve()).load()
    if other is None:
        raise SystemExit(f"{source} did not build (see the log line above)")
    return other.paged_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2,mla,llama8b", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--batch", default="1,2,8", help="requests decoding together")
    ap.add_argument("--contexts", default="100,1000,4000", help="keys each request sees")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=0, help="K/V pools (default: enough to fill 256 MiB)")
    ap.add_argument("--against", type=Path, help="another paged_attention_cpu.cpp to time beside this one")
    args = ap.parse_args()
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape {unknown[0]!r}; the shapes are {', '.join(SHAPES)}")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    ops = cpu_kernels.load()
    if ops is None:
        raise SystemExit("Atom's C++ attention kernel is not built here (ATOM_CPU_KERNELS=0, or no compiler)")
    engines: dict[str, Callable] = {"atom": ops.paged_attention}
    if args.against:
        engines["against"] = against_kernel(args.against)
    print(f"{cpu_features().description()}; {args.threads} threads, {args.dtype}, blocks of {BLOCK}")
    columns = " | ".join(
        ["atom us", "torch us", "Atom over torch"] + (["against us", "Atom over against"] if args.against else [])
    )
    print(f"| shape | batch | keys | {columns} |")
    print("|---|---:|---:|" + "---:|" * (5 if args.against else 3))
    for name in args.shapes.split(","):
        heads, kv_heads, dim = SHAPES[name]
        for batch in map(int, args.batch.split(",")):
            for ctx in map(int, args.contexts.split(",")):
                layer_bytes = 2 * kv_heads * batch * -(-ctx // BLOCK) * BLOCK * dim * dtype.itemsize
                layers = args.layers or max(2, POOL_BYTES // layer_bytes)
                caches, tables = pools(kv_heads, dim, batch, ctx, dtype, layers)
                q = torch.randn(batch, heads, dim).to(dtype)
                lens, starts = torch.full((batch,), ctx), torch.arange(batch + 1)
                calls = {e: (lambda k, v, f=f: f(q, k, v, tables, lens, starts, dim**-0.5)) for e, f in engines.items()}
                calls["torch"] = lambda k, v: torch_decode(q, k, v, tables, ctx)
                want = calls["torch"](*caches[0]).float()
                for e in engines:
                    torch.testing.assert_close(calls[e](*caches[0]).float(), want, atol=2e-2, rtol=2e-2)
                best = dict.fromkeys(calls, float("inf"))
                for r in range(args.rounds):
                    order = list(calls) if r % 2 == 0 else list(reversed(calls))
                    for e in order:
                        t = time.perf_counter()
                        for k, v in caches:
                            calls[e](k, v)
                        best[e] = min(best[e], (time.perf_counter() - t) / layers * 1e6)
                cells = [f"{best['atom']:.1f}", f"{best['torch']:.1f}", f"{best['torch'] / best['atom']:.2f}x"]
                if args.against:
                    cells += [f"{best['against']:.1f}", f"{best['against'] / best['atom']:.2f}x"]
                print(f"| {name} | {batch} | {ctx} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
