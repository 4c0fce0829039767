"""Gated DeltaNet kernel speed: Atom's C++ decode step and atom_attention.gdn.ops against transformers'
torch fallback.

One Qwen3-Next linear-attention layer's shapes (16 key heads, 32 value heads, head dims
128, float32 state). Decode: one token for batch 1/8/64 requests whose states live in a
pool (Atom updates pool rows in place; transformers gets a gathered [B, ...] state and we
scatter its result back, as an engine would have to). Prefill: one 4,096-token prompt,
chunk size 64. Every result is checked against transformers' first.

    python benchmarks/gdn_ops.py [--threads 2] [--prompt 4096] [--hk 16 --hv 32 --dk 128 --dv 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from atom_core.platform.cpu_features import cpu_features


def bench(fn, warmup: int = 2, reps: int = 7, min_time: float = 0.2) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    t_end = time.perf_counter() + min_time
    while len(times) < reps or (time.perf_counter() < t_end and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def inputs(T_or_B: int, hk: int, hv: int, dk: int, dv: int, dtype):
    q = torch.randn(T_or_B, hk, dk, dtype=dtype)
    k = torch.randn(T_or_B, hk, dk, dtype=dtype)
    v = torch.randn(T_or_B, hv, dv, dtype=dtype)
    A = torch.empty(hv).uniform_(0.01, 16)
    g = -A * F.softplus(torch.randn(T_or_B, hv) + 1.0) * 0.05
    beta = torch.sigmoid(torch.randn(T_or_B, hv))
    return q, k, v, g, beta


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--hk", type=int, default=16)
    ap.add_argument("--hv", type=int, default=32)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    args = ap.parse_args()
    print(cpu_features().description(), flush=True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from transformers.models.qwen3_next import modeling_qwen3_next as qn

    from atom_attention.gdn.builder import CpuGDNImpl
    from atom_attention.gdn.ops import chunk_gated_delta_rule, recurrent_gated_delta_rule_step

    cpp = CpuGDNImpl()  # the engine's decode step on CPU (csrc/gdn_cpu.cpp)

    hk, hv, dk, dv = args.hk, args.hv, args.dk, args.dv
    print(f"threads={args.threads} Hk={hk} Hv={hv} Dk={dk} Dv={dv} (float32)")

    print("decode step (one token per request, states in a pool of 2*B+8 slots):")
    for B in (1, 8, 64):
        q, k, v, g, beta = inputs(B, hk, hv, dk, dv, torch.float32)
        num_slots = 2 * B + 8
        pool = torch.randn(num_slots, hv, dk, dv) * 0.1
        slots = torch.randperm(num_slots)[:B]
        pool_hf = pool.clone()

        ref, ref_state = qn.torch_recurrent_gated_delta_rule(
            q[:, None],
            k[:, None],
            v[:, None],
            g[:, None],
            beta[:, None],
            initial_state=pool[slots],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        p = pool.clone()
        out = recurrent_gated_delta_rule_step(q, k, v, g, beta, p, slots)
        torch.testing.assert_close(out, ref[:, 0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(p[slots], ref_state, atol=1e-4, rtol=1e-4)
        p = pool.clone()
        out = cpp.decode_step(q, k, v, g, beta, p, slots)
        torch.testing.assert_close(out, ref[:, 0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(p[slots], ref_state, atol=1e-4, rtol=1e-4)

        def run_hf():
            _, st = qn.torch_recurrent_gated_delta_rule(
                q[:, None],
                k[:, None],
                v[:, None],
                g[:, None],
                beta[:, None],
                initial_state=pool_hf[slots],
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
            pool_hf.index_copy_(0, slots, st)

        t_cpp = bench(lambda: cpp.decode_step(q, k, v, g, beta, pool, slots))
        t_atom = bench(lambda: recurrent_gated_delta_rule_step(q, k, v, g, beta, pool, slots))
        t_hf = bench(run_hf)
        print(
            f"  B={B:3d}: atom C++ {t_cpp * 1e3:8.3f} ms  atom torch {t_atom * 1e3:8.3f} ms  transformers "
            f"{t_hf * 1e3:8.3f} ms  C++ over torch x{t_atom / t_cpp:.2f}, over transformers x{t_hf / t_cpp:.2f}"
        )

    T = args.prompt
    print(f"chunked prefill of one {T}-token prompt (chunk 64, zero initial state):")
    q, k, v, g, beta = inputs(T, hk, hv, dk, dv, torch.float32)
    ref, ref_state = qn.torch_chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        chunk_size=64,
        initial_state=None,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    out, st = chunk_gated_delta_rule(q, k, v, g, beta, None)
    torch.testing.assert_close(out, ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(st, ref_state[0], atol=1e-4, rtol=1e-4)
    t_atom = bench(lambda: chunk_gated_delta_rule(q, k, v, g, beta, None), warmup=1, reps=5, min_time=0)
    t_hf = bench(
        lambda: qn.torch_chunk_gated_delta_rule(
            q[None],
            k[None],
            v[None],
            g[None],
            beta[None],
            chunk_size=64,
            initial_state=None,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        ),
        warmup=1,
        reps=5,
        min_time=0,
    )
    print(f"  T={T}: atom {t_atom * 1e3:8.1f} ms  transformers {t_hf * 1e3:8.1f} ms  speedup x{t_hf / t_atom:.2f}")


if __name__ == "__main__":
    main()
