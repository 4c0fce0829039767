"""How fast a 512-token prompt could possibly go on this CPU at float32 and bfloat16.

A prompt's time is mostly its GEMMs: 512 rows through every layer's Linears. This script
measures, in one run:

* the machine's GEMM rate: 2048 x 2048 x 2048 through torch's `mm` and through oneDNN on a
  packed weight, the faster (the libraries at their best: a rate no engine's GEMMs of a
  small model's shapes beat on these cores), per dtype;
* Atom's own layer GEMMs at 512 rows: the default model's Linears (LM head aside, a prompt
  needs one row of it), each called as the engine calls it;

and prints the prompt tokens/s each allows with nothing else in the step (no attention, no
norms). A peer's prompt rate times 1.3 above the first figure is a target no engine can reach
here at that precision; `vs_peers.py` measures the peers.

    .venv/bin/python benchmarks/gemm_ceiling.py [--threads 2] [--rows 512]
"""

from __future__ import annotations

import argparse
import time

import torch

from atom_core.engine.fetch import fetch_default_model
from atom_core.engine.llm_engine import LLMEngine
from atom_core.layers.gemm import onednn_takes
from atom_core.layers.linear import Linear
from atom_core.platform.cpu_features import cpu_features


def best_seconds(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def machine_rate(dtype: torch.dtype, reps: int) -> float:
    """FLOP/s of one large square GEMM, the best of `reps` through torch's `mm` and through
    oneDNN on a packed weight (at float32 the second is the faster here). bfloat16 on a CPU
    without bfloat16 arithmetic (avx512_bf16, AMX or AVX-NE-CONVERT): the
    float32 rate, as every engine there widens the values and runs float32 FMAs."""
    if not onednn_takes(dtype):
        return machine_rate(torch.float32, reps)
    n = 2048
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(b, n)
    onednn = best_seconds(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""), reps)
    return 2 * n**3 / min(best_seconds(lambda: torch.mm(a, b), reps), onednn)


def layer_linears(dtype: str) -> list[Linear]:
    engine = LLMEngine(str(fetch_default_model(quiet=True)), dtype=dtype, quantization="none", max_model_len=1024)
    return [m for m in engine.runner.model.modules() if isinstance(m, Linear) and not m.is_lm_head]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{cpu_features().description()}, {args.threads} threads")
    print(
        "| dtype | machine GEMM (GFLOP/s) | Atom's layer GEMMs (GFLOP/s) | share | prompt tokens/s at the machine rate | at Atom's |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        linears = layer_linears(name)
        x = {k: torch.randn(args.rows, k, dtype=dtype) for k in {m.in_features for m in linears}}
        flops = sum(2 * args.rows * m.in_features * m.out_features for m in linears)
        atom = flops / best_seconds(lambda: [m(x[m.in_features]) for m in linears], args.reps)
        machine = machine_rate(dtype, args.reps)
        per_token = flops / args.rows
        print(
            f"| {name} | {machine / 1e9:.0f} | {atom / 1e9:.0f} | {atom / machine:.0%} "
            f"| {machine / per_token:.0f} | {atom / per_token:.0f} |"
        )


if __name__ == "__main__":
    main()
