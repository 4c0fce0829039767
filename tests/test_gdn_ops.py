"""Gated DeltaNet CPU kernels (atom_attention/gdn/ops.py) against references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from atom_attention.gdn.ops import (
    _step_gathered,
    causal_conv1d,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    expand_qk_heads,
    gated_rms_norm,
    l2norm,
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_step,
)

qn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

HK, HV, DK, DV = 2, 4, 16, 8  # grouped: each key head serves 2 consecutive value heads


def make_inputs(T: int, hk: int = HK, hv: int = HV, seed: int = 0, batch: tuple = ()):
    """Realistic magnitudes: raw (un-normalised) q/k, g = -A*softplus(a+dt) < 0, beta = sigmoid."""
    gen = torch.Generator().manual_seed(seed)
    shape = (*batch, T) if T is not None else batch
    q = torch.randn(*shape, hk, DK, generator=gen) * 2
    k = torch.randn(*shape, hk, DK, generator=gen) * 2
    v = torch.randn(*shape, hv, DV, generator=gen)
    A = torch.empty(hv).uniform_(0.01, 16, generator=gen)
    a = torch.randn(*shape, hv, generator=gen)
    g = -A * F.softplus(a + 1.0) * 0.05  # decays exp(g) mostly in (0.3, 1)
    beta = torch.sigmoid(torch.randn(*shape, hv, generator=gen))
    return q, k, v, g, beta


def rand_state(hv: int = HV, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(hv, DK, DV, generator=gen) * 0.5


def close(a, b, atol=1e-5, rtol=1e-5):
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("T", [1, 5, 64, 100, 130])
def test_chunk_equals_recurrent(T, chunk_size):
    q, k, v, g, beta = make_inputs(T, seed=T)
    s0 = rand_state(seed=T + 1)
    out_c, st_c = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=chunk_size)
    out_r, st_r = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    assert out_c.shape == (T, HV, DV) and st_c.shape == (HV, DK, DV)
    assert st_c.dtype == torch.float32
    close(out_c, out_r)
    close(st_c, st_r)
    # new request (zero state)
    out_c0, st_c0 = chunk_gated_delta_rule(q, k, v, g, beta, None, chunk_size=chunk_size)
    out_r0, st_r0 = recurrent_gated_delta_rule(q, k, v, g, beta, None)
    close(out_c0, out_r0)
    close(st_c0, st_r0)


@pytest.mark.parametrize("pieces", [(37, 1, 90), (64, 64), (1, 1, 1, 125), (100, 28)])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_split_prompt_carries_state(pieces, chunk_size):
    T = sum(pieces)
    q, k, v, g, beta = make_inputs(T, seed=7)
    s0 = rand_state(seed=8)
    s0_copy = s0.clone()
    full_out, full_st = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=chunk_size)
    assert torch.equal(s0, s0_copy)  # initial state is not modified
    outs, st, start = [], None, 0
    st = s0
    for n in pieces:
        sl = slice(start, start + n)
        o, st = chunk_gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], st, chunk_size=chunk_size)
        outs.append(o)
        start += n
    close(torch.cat(outs), full_out)
    close(st, full_st)


@pytest.mark.parametrize("T", [1, 5, 100, 130])
def test_against_transformers(T):
    q, k, v, g, beta = make_inputs(T, seed=3 * T)
    s0 = rand_state(seed=5)
    ref_c, ref_cs = qn.torch_chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        chunk_size=64,
        initial_state=s0[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    ref_r, ref_rs = qn.torch_recurrent_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        initial_state=s0[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    out_c, st_c = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=64)
    out_r, st_r = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    close(out_c, ref_c[0])
    close(st_c, ref_cs[0])
    close(out_r, ref_r[0])
    close(st_r, ref_rs[0])
    # without in-kernel l2norm the caller normalises; results agree too
    out_n, st_n = chunk_gated_delta_rule(l2norm(q), l2norm(k), v, g, beta, s0, use_qk_l2norm=False)
    close(out_n, ref_c[0])
    close(st_n, ref_cs[0])


def test_gqa_head_mapping_is_consecutive():
    x = torch.arange(2 * 3, dtype=torch.float32).view(2, 3)  # 2 key heads
    y = expand_qk_heads(x[None], 4)[0]
    assert torch.equal(y, torch.stack([x[0], x[0], x[1], x[1]]))
    # value heads 0,1 use key head 0: giving them the same v/g/beta yields equal outputs
    q, k, v, g, beta = make_inputs(9, seed=11)
    v[:, 1], g[:, 1], beta[:, 1] = v[:, 0], g[:, 0], beta[:, 0]
    out, _ = chunk_gated_delta_rule(q, k, v, g, beta, None)
    close(out[:, 0], out[:, 1])
    # ...while value heads 1 and 2 (different key heads) given the same v/g/beta do not
    v[:, 2], g[:, 2], beta[:, 2] = v[:, 0], g[:, 0], beta[:, 0]
    out, _ = chunk_gated_delta_rule(q, k, v, g, beta, None)
    assert (out[:, 1] - out[:, 2]).abs().max() > 1e-3


@pytest.mark.parametrize("path", ["public", "gathered"])
def test_decode_step_updates_only_given_slots(path):
    step = recurrent_gated_delta_rule_step if path == "public" else _step_gathered
    B, num_slots = 3, 6
    q, k, v, g, beta = make_inputs(None, batch=(B,), seed=21)
    gen = torch.Generator().manual_seed(22)
    pool = torch.randn(num_slots, HV, DK, DV, generator=gen) * 0.5
    before = pool.clone()
    slots = torch.tensor([4, 0, 2])
    out = step(q, k, v, g, beta, pool, slots)
    assert out.shape == (B, HV, DV)
    for b, s in enumerate(slots.tolist()):
        ref_o, ref_s = recurrent_gated_delta_rule(
            q[b : b + 1], k[b : b + 1], v[b : b + 1], g[b : b + 1], beta[b : b + 1], before[s]
        )
        close(out[b], ref_o[0])
        close(pool[s], ref_s)
    for s in (1, 3, 5):
        assert torch.equal(pool[s], before[s])  # bit for bit


def test_decode_steps_continue_prefill():
    """prefill (chunked) then several decode steps == one recurrence over everything."""
    T, steps = 40, 4
    q, k, v, g, beta = make_inputs(T + steps, seed=31)
    pool = torch.zeros(3, HV, DK, DV)
    _, st = chunk_gated_delta_rule(q[:T], k[:T], v[:T], g[:T], beta[:T], None)
    pool[1] = st
    slot = torch.tensor([1])
    outs = [
        recurrent_gated_delta_rule_step(
            q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], pool, slot
        )
        for t in range(T, T + steps)
    ]
    ref_o, ref_s = recurrent_gated_delta_rule(q, k, v, g, beta, None)
    close(torch.cat(outs), ref_o[T:])
    close(pool[1], ref_s)


def _conv_inputs(T: int, C: int = 12, K: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, C, generator=gen)
    w = torch.randn(C, K, generator=gen) * 0.5
    b = torch.randn(C, generator=gen) * 0.1
    return x, w, b


def _conv_reference(x, w, b):
    """Plain left-zero-padded depthwise conv + silu over the whole sequence."""
    T, C = x.shape
    K = w.shape[-1]
    y = F.conv1d(x.t()[None], w[:, None, :], b, padding=K - 1, groups=C)[0, :, :T]
    return F.silu(y).t()


@pytest.mark.parametrize("bias", [True, False])
def test_causal_conv1d_split_equals_full(bias):
    x, w, b = _conv_inputs(50, seed=1)
    b = b if bias else None
    ref = _conv_reference(x, w, b)
    y, st = causal_conv1d(x, w, b, None)
    close(y, ref)
    assert st.shape == (12, 3)
    assert torch.equal(st, x[-3:].t())
    # split at odd places, including pieces shorter than K-1
    ys, st, start = [], torch.zeros(12, 3), 0
    for n in (2, 1, 30, 17):
        yy, st = causal_conv1d(x[start : start + n], w, b, st)
        ys.append(yy)
        start += n
    close(torch.cat(ys), ref)
    assert torch.equal(st, x[-3:].t())
    # against transformers' fallback
    ref_hf = qn.causal_conv1d_fn(x.t()[None], w, b, activation="silu")
    close(y, ref_hf[0].t())


def test_causal_conv1d_update_pool():
    T, C, K = 20, 12, 4
    x, w, b = _conv_inputs(T + 2, C, K, seed=2)
    ref = _conv_reference(x, w, b)
    pool = torch.randn(5, C, K - 1)
    before = pool.clone()
    _, st = causal_conv1d(x[:T], w, b, None)
    pool[3] = st
    slots = torch.tensor([3])
    y1 = causal_conv1d_update(x[T : T + 1], w, b, pool, slots)
    y2 = causal_conv1d_update(x[T + 1 : T + 2], w, b, pool, slots)
    close(torch.cat([y1, y2]), ref[T:])
    assert torch.equal(pool[3], x[-3:].t())
    for s in (0, 1, 2, 4):
        assert torch.equal(pool[s], before[s])
    # batch of 2 vs transformers' causal_conv1d_update on the same states
    pool2 = torch.randn(4, C, K - 1)
    slots2 = torch.tensor([2, 0])
    xb = torch.randn(2, C)
    hf_state = pool2[slots2].clone()
    ref_b = qn.causal_conv1d_update(xb[:, :, None], hf_state, w, b, "silu")[:, :, 0]
    yb = causal_conv1d_update(xb, w, b, pool2, slots2)
    close(yb, ref_b)
    close(pool2[slots2], hf_state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_transformers(dtype):
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(7, HV, DV, generator=gen) * 3).to(dtype)
    z = torch.randn(7, HV, DV, generator=gen).to(dtype)
    mod = qn.Qwen3NextRMSNormGated(DV, eps=1e-6)
    with torch.no_grad():
        mod.weight.copy_(torch.randn(DV, generator=gen))
    mod = mod.to(dtype)
    with torch.no_grad():
        ref = mod(x.reshape(-1, DV), z.reshape(-1, DV)).reshape(x.shape)
    out = gated_rms_norm(x, z, mod.weight.detach(), 1e-6)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def _step_float64(q, k, v, g, beta, state):
    """One delta-rule token per (row, head) in float64: q, k prepared (expanded, normalised, q scaled)."""
    q, k, v, g, beta, state = (t.double() for t in (q, k, v, g, beta, state))
    state = state * g.exp()[..., None, None]
    delta = (v - torch.einsum("bhd,bhde->bhe", k, state)) * beta[..., None]
    state = state + torch.einsum("bhd,bhe->bhde", k, delta)
    return torch.einsum("bhd,bhde->bhe", q, state), state


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpp_decode_step_against_float64(kernel_variant, state_dtype):
    """`gdn_decode_step` (csrc/gdn_cpu.cpp) in each variant this host runs: the output and the
    new state of every (request, head) against float64 from the same stored state, only the
    given slots written, each row alone equal to its row in the batch bit for bit."""
    from conftest import require_kernel

    from atom_attention import cpu_kernels
    from atom_attention.gdn.ops import prep_qk

    ops = require_kernel(cpu_kernels.load_gdn(kernel_variant))
    tol = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[state_dtype]
    for B, dk, dv in [(1, DK, DV), (3, 128, 128), (8, 24, 40)]:
        num_slots = B + 3
        gen = torch.Generator().manual_seed(B)
        q, k = (torch.randn(B, HK, dk, generator=gen) * 2 for _ in range(2))
        v = torch.randn(B, HV, dv, generator=gen)
        g = -torch.rand(B, HV, generator=gen)
        beta = torch.rand(B, HV, generator=gen)
        q, k = prep_qk(q, k, HV, True, None)
        pool = (torch.randn(num_slots, HV, dk, dv, generator=gen) * 0.5).to(state_dtype)
        before = pool.clone()
        slots = torch.randperm(num_slots, generator=gen)[:B]
        out = ops.gdn_decode_step(q, k, v, g, beta, pool, slots)
        ref_out, ref_state = _step_float64(q, k, v, g, beta, before[slots])
        torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
        torch.testing.assert_close(pool[slots].double(), ref_state, rtol=tol, atol=tol)
        others = [s for s in range(num_slots) if s not in slots.tolist()]
        assert torch.equal(pool[others], before[others])
        for b in range(B):  # batch-invariant: a row alone computes as in the batch
            alone = before.clone()
            one = ops.gdn_decode_step(q[b : b + 1], k[b : b + 1], v[b : b + 1], g[b : b + 1], beta[b : b + 1],
                                      alone, slots[b : b + 1])  # fmt: skip
            assert torch.equal(one[0], out[b]) and torch.equal(alone[slots[b]], pool[slots[b]])
    with pytest.raises(RuntimeError, match="slot 9 is outside the pool's 4 slots"):
        ops.gdn_decode_step(q[:1], k[:1], v[:1], g[:1], beta[:1], pool[:4], torch.tensor([9]))
    with pytest.raises(RuntimeError, match="q must be contiguous float32"):
        ops.gdn_decode_step(q[:1].double(), k[:1], v[:1], g[:1], beta[:1], pool, slots[:1])
