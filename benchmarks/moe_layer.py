"""MoE layer speed: Atom's router + grouped FusedMoE against transformers' own Qwen3-MoE block.

A tiny-but-wide MoE (64 experts, top-6, hidden 1024) on the same weights, at 1, 8, 64 and
512 tokens per call. transformers is timed with the experts implementation
`from_pretrained` picks on this machine (`grouped_mm`, torch's grouped GEMM) and with its
`eager` loop over experts. Every call's output is checked against transformers' first.

    python benchmarks/moe_layer.py [--dtype float32|bfloat16] [--threads 2] [--intermediate 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from atom_core.platform.cpu_features import cpu_features

TOKENS = (1, 8, 64, 512)


def median_ms(fns: list, x: torch.Tensor, min_time: float = 1.0, min_rounds: int = 7) -> list[float]:
    """Median ms per call of each fn, calls interleaved round by round so that load from
    other processes on a shared machine hits every contender alike."""
    times: list[list[float]] = [[] for _ in fns]
    with torch.no_grad():
        for fn in fns:
            for _ in range(3):
                fn(x)
        start = time.perf_counter()
        while len(times[0]) < min_rounds or time.perf_counter() - start < min_time:
            for fn, ts in zip(fns, times):
                t0 = time.perf_counter()
                fn(x)
                ts.append(time.perf_counter() - t0)
    return [1e3 * statistics.median(ts) for ts in times]


def build(args: argparse.Namespace, dtype: torch.dtype):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from atom_models.sparse_moe import SparseMoeBlock

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        hidden_size=args.hidden,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.intermediate,
        norm_topk_prob=True,
    )
    hf = Qwen3MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    hf = hf.to(dtype)
    ours = SparseMoeBlock(args.hidden, args.experts, args.top_k, args.intermediate, renormalize=True).to(dtype)
    with torch.no_grad():  # the same weights: transformers keeps experts stacked as we do
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.w13.copy_(hf.experts.gate_up_proj)
        ours.experts.w2.copy_(hf.experts.down_proj)
    for m in ours.modules():
        if hasattr(m, "process_weights_after_loading"):
            m.process_weights_after_loading()
    return config, hf, ours


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=256)
    args = ap.parse_args()
    print(cpu_features().description(), flush=True)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    config, hf, ours = build(args, dtype)
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)

    def hf_fn(impl: str):
        def run(x: torch.Tensor) -> torch.Tensor:
            config._experts_implementation = impl
            return hf(x.unsqueeze(0))[0]

        return run

    print(
        f"MoE layer, {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, expert intermediate "
        f"{args.intermediate}, {args.dtype}, {args.threads} threads (ms per call, median)"
    )
    print(f"{'tokens':>6} {'atom':>9} {'hf grouped_mm':>14} {'hf eager':>9} {'vs grouped':>10} {'vs eager':>9}")
    for n in TOKENS:
        x = torch.randn(n, args.hidden, dtype=dtype)
        with torch.no_grad():
            ref = hf_fn("grouped_mm")(x)
            torch.testing.assert_close(ours(x), ref, **tol)
            torch.testing.assert_close(hf_fn("eager")(x), ref, **tol)
        atom, grouped, eager = median_ms([ours, hf_fn("grouped_mm"), hf_fn("eager")], x)
        print(f"{n:>6} {atom:>9.3f} {grouped:>14.3f} {eager:>9.3f} {grouped / atom:>9.2f}x {eager / atom:>8.2f}x")


if __name__ == "__main__":
    main()
