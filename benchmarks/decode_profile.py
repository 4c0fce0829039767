"""Where a decode step's time goes (batch 1 by default): GEMMs, attention, and everything else.

The default model (SmolLM2-135M, 30 layers) decodes one request (or `--batch` of them); every Linear's GEMM and
every attention layer's kernel call is timed with `perf_counter` around it (wrappers
installed by this script only), and the rest of the step is what is left:

* gemm: the Linear layers (LM head included);
* attention: the builders' kernels (KV write and paged attention);
* other, in the model: norms, rope, activations, residual adds, views, the Python that
  dispatches them;
* outside the model: scheduling, metadata, sampling, output bookkeeping.

The timers need the model's modules to run, so that breakdown runs with decode graphs off
(`max_graph_capture_size=0`); a second engine then runs the same steps with them on (a replay
runs no module: only its whole step and model forward are timed).

    .venv/bin/python benchmarks/decode_profile.py [--dtype float32] [--quantization none] [--batch 1]
        [--kv-cache-dtype auto] [--activation-bits 16]

The timers cost about a microsecond a call (~130 a step), which lands in "other".
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np
import torch

from atom_core import SamplingParams
from atom_core.engine.fetch import fetch_default_model
from atom_core.engine.llm_engine import LLMEngine
from atom_core.layers.linear import Linear
from atom_core.platform.cpu_features import cpu_features


def timed(fn, totals: dict[str, float], key: str):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - t

    return wrapper


def instrument(engine: LLMEngine, totals: dict[str, float]) -> None:
    """Time every GEMM and attention kernel call and the model's forward (eager modules only)."""
    runner = engine.runner
    for m in runner.model.modules():
        if isinstance(m, Linear):
            m.gemm = timed(m.gemm, totals, "gemm")
    for builder in runner.attn_builders.values():
        impl = getattr(builder, "impl", None)
        if impl is not None:
            impl.forward = timed(impl.forward, totals, "attention")
    runner.model.forward = timed(runner.model.forward, totals, "model")
    runner.model.compute_logits = timed(runner.model.compute_logits, totals, "lm_head")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--activation-bits", type=int, default=16, help="what 4-bit layers round x to (8 or 16)")
    args = ap.parse_args()
    print(cpu_features().description(), flush=True)
    torch.set_num_threads(args.threads)
    plain, totals = measure(args, graphs=False)
    graphed, graph_totals = measure(args, graphs=True)
    n = args.steps
    step = float(np.mean(plain))
    gemm, attn, model, head = (totals[k] / n for k in ("gemm", "attention", "model", "lm_head"))
    print(
        f"SmolLM2, {args.dtype}, quantization={args.quantization}, batch {args.batch}, {args.threads} threads, {n} steps"
    )
    print("| part | ms per step |\n|---|---|")
    print(f"| whole step | {step * 1e3:.2f} (median {np.median(plain) * 1e3:.2f}) |")
    print(f"| GEMMs (LM head included) | {gemm * 1e3:.2f} |")
    print(f"| attention kernels | {attn * 1e3:.2f} |")
    print(f"| other, inside the model forward | {(model + head - gemm - attn) * 1e3:.2f} |")
    print(f"| outside the model (schedule, metadata, sample) | {(step - model - head) * 1e3:.2f} |")
    print(f"| **outside GEMMs and attention** | **{(step - gemm - attn) * 1e3:.2f}** |")
    replayed, head = graph_totals["model"] / n, graph_totals["lm_head"] / n
    print(
        f"| whole step, decode graphs on (the default) | {np.mean(graphed) * 1e3:.2f} (median "
        f"{np.median(graphed) * 1e3:.2f}); model forward {replayed * 1e3:.2f}, LM head {head * 1e3:.2f} |"
    )


def measure(args: argparse.Namespace, graphs: bool) -> tuple[list[float], dict[str, float]]:
    """Step times of one engine; without decode graphs every GEMM and attention call timed, with
    them (a replay runs no module) only the model forward and the LM head."""
    engine = LLMEngine(
        str(fetch_default_model(quiet=True)), dtype=args.dtype, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, activation_bits=args.activation_bits, max_model_len=1024,
        kv_cache_memory=1 << 29, **({} if graphs else dict(max_graph_capture_size=0)),
    )  # fmt: skip
    totals: dict[str, float] = defaultdict(float)
    if graphs:
        engine.runner.run_model = timed(engine.runner.run_model, totals, "model")
        engine.runner.model.compute_logits = timed(engine.runner.model.compute_logits, totals, "lm_head")
    else:
        instrument(engine, totals)
    for i in range(args.batch):  # distinct 32-token prompts (no prefix sharing)
        prompt = [100 + (7 * i + j) % 5000 for j in range(32)]
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=args.steps + 40, ignore_eos=True))
    for _ in range(20):  # the prompt and warm-up
        engine.step()
    totals.clear()
    steps = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    return steps, totals


if __name__ == "__main__":
    main()
