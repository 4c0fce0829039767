"""Decode speed and weight memory of the default model under each `Config.quantization` (Atom only).

SmolLM2-135M-Instruct, one engine at a time, same thread count:

* none, bfloat16 / none, float32: the file dequantized (what the parity tests run);
* int8: every Linear (the LM head too) 8-bit in groups of 32 (Atom's `qgemm`), float32 between GEMMs;
* int4: every Linear 4-bit in groups of 32 with zeros, the LM head 8-bit in groups of 32;
* auto: the GGUF's own Q4_1 layers and Q8_0 LM head as shipped (the default), float32
  between GEMMs; and auto with bfloat16 everywhere.

Groups of 32 run through Atom's `qgemm` at every row count (x rounded per group to int16);
the dtype is what runs between GEMMs (norms, attention, the residual stream).

What is measured:

* batch-1 decode: one 64-token prompt, 64 new tokens, 1 / tpot (first token excluded), best
  of `--repeats`;
* batch-8 decode: 8 prompts of 64 tokens admitted together, 64 new tokens each, 8 / mean
  tpot, best of `--repeats`;
* prefill: one 512-token prompt, prompt tokens / time to first token, best of `--repeats`;
* weight bytes: parameters, packed weights and quantized kernels' tensors;
* the greedy answer to "What is the capital of France?" and by how much its first token
  ("The") leads the runner-up ("L") in the logits.

    .venv/bin/python benchmarks/quantization.py [--threads 2] [--repeats 3] [--configs auto,int4,...]
    .venv/bin/python benchmarks/quantization.py --kernels [--kernel-rows 1,8]   # the GEMMs alone, per weight format
    .venv/bin/python benchmarks/quantization.py --kernels --against FILE [--kernel-rows 1,8,32,512]

`--against FILE` builds FILE (another version of `gemv_cpu.cpp`, e.g. `git show
HEAD~3:atom_core/layers/csrc/gemv_cpu.cpp`) as a kernel of its own and times its `qgemm`
(4- and 8-bit weights) and `gemv` (float32, bfloat16 and float16 weights) beside this tree's
on the same packed weights (all 120 layer GEMMs, the engines alternating,
best of `--repeats` rounds but at least 5), checks that both give the same bits, and prints the ratio.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path

import numpy as np
import torch

from atom_core import SamplingParams
from atom_core.engine.fetch import fetch_default_model
from atom_core.engine.llm_engine import LLMEngine
from atom_core.platform.cpu_features import cpu_features

CONFIGS = {
    "none-bf16": dict(quantization="none", dtype="bfloat16"),
    "none-f32": dict(quantization="none", dtype="float32"),
    "int8": dict(quantization="int8"),
    "int4": dict(quantization="int4"),
    "auto": dict(),
    "auto-bf16": dict(dtype="bfloat16"),
}
VOCAB_RANGE = (100, 40000)


def tensor_bytes(obj: object, seen: set[int]) -> int:
    """Bytes of the tensors an object holds (a tensor, a kernel object, a quantized weight)."""
    if isinstance(obj, torch.Tensor):
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        return obj.numel() * obj.element_size()
    if hasattr(obj, "__dict__"):
        return sum(tensor_bytes(v, seen) for v in vars(obj).values() if not isinstance(v, torch.nn.Module))
    return 0


def weight_bytes(model: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = sum(tensor_bytes(p, seen) for p in model.parameters())
    for module in model.modules():
        for attr in ("packed_weight", "qw", "packed"):
            total += tensor_bytes(getattr(module, attr, None), seen)
    return total


def decode_rate(engine: LLMEngine, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    best = 0.0
    for _ in range(repeats):
        results = engine.generate(prompts, params, use_tqdm=False)
        best = max(best, len(prompts) / float(np.mean([r["tpot"] for r in results])))
    return best


def prefill_rate(engine: LLMEngine, prompt: list[int], repeats: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=1)
    return max(len(prompt) / engine.generate([prompt], params, use_tqdm=False)[0]["ttft"] for _ in range(repeats))


def answer(engine: LLMEngine) -> tuple[str, float, str, str]:
    prompt = engine.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    top = engine.runner.last_logits[0].double().topk(2)
    lead = float(top.values[0] - top.values[1])
    first, runner_up = (engine.tokenizer.decode([int(i)]) for i in top.indices)
    r = engine.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]  # fmt: skip
    return r["text"], lead, first, runner_up


def kernel_times(rows: tuple[int, ...] = (1, 8)) -> None:
    """ms for all of SmolLM2's layer GEMMs (30 layers, distinct weights: streamed from memory)
    and for its LM head, per weight format, random weights of the model's shapes."""
    from gemv_bandwidth import SHAPES as shapes  # benchmarks/: SmolLM2's layer GEMMs

    from atom_core.layers.gemm import PACK_ROWS, _onednn_linear, gemv_ops, onednn_takes
    from atom_core.layers.quantized_gemm import Int4PackGemm, Int8PackGemm, StreamingGroupGemm
    from atom_core.layers.quantized_weight import quantize_int4, quantize_int8

    # where oneDNN has no bfloat16 kernels (no AVX-512), its float32 GEMM is the reference
    dense = torch.bfloat16 if onednn_takes(torch.bfloat16) else torch.float32

    def onednn(w: torch.Tensor):
        packed = torch.ops.mkldnn._reorder_linear_weight(w.to(dense), PACK_ROWS)
        return lambda x: _onednn_linear(x.to(dense), packed, None)

    formats = {
        f"{str(dense).removeprefix('torch.')} (oneDNN)": onednn,
        "int8 per channel": lambda w: Int8PackGemm(quantize_int8(w)),
        "int8 groups of 32": lambda w: Int4PackGemm(quantize_int8(w, 32)),
        "int4 groups of 32": lambda w: Int4PackGemm(quantize_int4(w, 32)),
    }
    if (ops := gemv_ops()) is not None:  # Atom's own kernel, as Linear runs it (the head: 8 bits, int16 x)
        formats |= {
            "int8 groups of 32, Atom's qgemm": lambda w: StreamingGroupGemm(quantize_int8(w, 32), ops),
            "int4 groups of 32, Atom's qgemm, int16 x (default)": lambda w: StreamingGroupGemm(
                quantize_int4(w, 32), ops, 16
            ),
            "int4 groups of 32, Atom's qgemm, int8 x": lambda w: StreamingGroupGemm(quantize_int4(w, 32), ops, 8),
        }
    gen = torch.Generator().manual_seed(0)
    print("\n| format | " + " | ".join(f"layers, {m} rows (ms) | LM head, {m} rows (ms)" for m in rows) + " |")
    print("|---|" + "---:|---:|" * len(rows))
    for name, make in formats.items():
        layers = [make(torch.randn(n, k, generator=gen) * 0.05) for n, k in shapes]
        head = make(torch.randn(49152, 576, generator=gen) * 0.05)
        cells = []
        for m in rows:
            xs = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}

            def all_layers() -> None:
                for g, (_, k) in zip(layers, shapes):
                    g(xs[k])

            for fn, calls in ((all_layers, 5), (lambda: head(xs[576]), 20)):
                fn()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                cells.append(f"{1e3 * (time.perf_counter() - t0) / calls:.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def kernels_against(source: Path, rows: tuple[int, ...], rounds: int) -> None:
    """This tree's `qgemm` and `gemv` against `source`'s, alternating on the same packed weights."""
    from gemv_bandwidth import SHAPES as shapes  # benchmarks/: SmolLM2's layer GEMMs

    from atom_core.layers.cpp import CppKernel
    from atom_core.layers.gemm import GEMV_KERNEL, gemv_ops, gemv_weight
    from atom_core.layers.quantized_gemm import StreamingGroupGemm
    from atom_core.layers.quantized_weight import quantize_int4, quantize_int8

    ours = gemv_ops()
    other = CppKernel("atom_gemv_against", source.resolve(), uses=tuple(GEMV_KERNEL.uses)).load()
    if ours is None or other is None:
        raise SystemExit("a kernel did not build here (see the log line above)")

    def grouped(quantize, bits):  # a layer's call of `qgemm` in `ops`, on x [m, k]
        def make(w):
            g = StreamingGroupGemm(quantize(w), ours, bits)
            return lambda ops, x: ops.qgemm(x, g.qweight, g.scales, g.mins, w.shape[0], None, bits)

        return make

    def tiled(dtype, xdtype):  # ... of `gemv`, 16-bit or float32 weights in its tiled layout
        def make(w):
            t = gemv_weight(w.to(dtype), int(ours.TILE))
            return lambda ops, x: ops.gemv(x.to(xdtype), t, w.shape[0], None, None)

        return make

    formats = {"int4, int16 x (default)": grouped(quantize_int4, 16), "int4, int8 x": grouped(quantize_int4, 8),
               "int8, int16 x (the LM head's)": grouped(lambda w: quantize_int8(w, 32), 16),
               "gemv float32": tiled(torch.float32, torch.float32),
               "gemv bfloat16": tiled(torch.bfloat16, torch.bfloat16),
               "gemv bfloat16 w, float32 x": tiled(torch.bfloat16, torch.float32),
               "gemv float16": tiled(torch.float16, torch.float16)}  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    print(f"\n| format | rows | this tree (ms) | {source.name} (ms) | this tree over it | same bits |")
    print("|---|---:|---:|---:|---:|---|")
    for name, make in formats.items():
        layers = [make(torch.randn(n, k, generator=gen) * 0.05) for n, k in shapes]
        for m in rows:
            xs = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}
            inputs = [xs[k] for _, k in shapes]
            same = all(torch.equal(call(ours, x), call(other, x)) for call, x in zip(layers, inputs))
            best = {ours: float("inf"), other: float("inf")}
            for r in range(rounds):
                for ops in (ours, other) if r % 2 == 0 else (other, ours):
                    t0 = time.perf_counter()
                    for call, x in zip(layers, inputs):
                        call(ops, x)
                    best[ops] = min(best[ops], time.perf_counter() - t0)
            print(f"| {name} | {m} | {1e3 * best[ours]:.2f} | {1e3 * best[other]:.2f} | "
                  f"{best[other] / best[ours]:.2f}x | {'yes' if same else 'NO'} |", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {', '.join(CONFIGS)}")
    ap.add_argument("--kernels", action="store_true", help="time the GEMMs alone per weight format, then stop")
    ap.add_argument("--kernel-rows", default="1,8", help="--kernels: rows of x, e.g. 1,8,32,512")
    ap.add_argument(
        "--against", type=Path, help="--kernels: another gemv_cpu.cpp whose qgemm and gemv to time beside this one"
    )
    args = ap.parse_args()
    print(cpu_features().description(), flush=True)
    torch.set_num_threads(args.threads)
    if args.against and not args.kernels:
        ap.error("--against times kernels: give --kernels too")
    if args.kernels:
        rows = tuple(int(r) for r in args.kernel_rows.split(","))
        if args.against:
            kernels_against(args.against, rows, max(args.repeats, 5))
        else:
            kernel_times(rows)
        return
    folder = fetch_default_model(quiet=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(*VOCAB_RANGE, size=args.prompt_len).tolist() for _ in range(8)]
    long_prompt = rng.integers(*VOCAB_RANGE, size=512).tolist()
    print(f"model {folder}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    rows = []
    for name in args.configs.split(","):
        t0 = time.perf_counter()
        engine = LLMEngine(folder, max_model_len=1024, num_kvcache_blocks=8 * 10 + 80, **CONFIGS[name])
        load = time.perf_counter() - t0
        b1 = decode_rate(engine, prompts[:1], args.new_tokens, args.repeats)
        b8 = decode_rate(engine, prompts, args.new_tokens, args.repeats)
        pre = prefill_rate(engine, long_prompt, args.repeats)
        text, lead, first, runner_up = answer(engine)
        mib = weight_bytes(engine.runner.model) / 2**20
        rows.append((name, b1, b8, pre, mib, load, f"{first!r} by {lead:.3f} over {runner_up!r}", text))
        print(f"{name:>10}: batch-1 {b1:6.1f} tok/s, batch-8 {b8:6.1f} tok/s, prefill {pre:6.0f} tok/s, "
              f"weights {mib:6.1f} MiB, "
              f"load {load:4.1f} s, first token {rows[-1][6]}: {text!r}", flush=True)  # fmt: skip
        del engine
        gc.collect()
    print("\n| config | batch-1 decode tok/s | batch-8 decode tok/s | prefill tok/s | weights (MiB) "
          "| first answer token | answer |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---|---|")
    for name, b1, b8, pre, mib, _, lead, text in rows:
        print(f"| {name} | {b1:.1f} | {b8:.1f} | {pre:.0f} | {mib:.0f} | {lead} | {text[:40]} |")
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} (above {os.cpu_count()}: noisy figures)")


if __name__ == "__main__":
    main()
