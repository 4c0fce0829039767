"""The fused CPU kernels (RMSNorm, add + RMSNorm, rotary embedding, SiLU-and-mul) against the torch path."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from conftest import require_kernel  # noqa: E402

from atom_core.layers import ops  # noqa: E402


@pytest.fixture
def native(kernel_variant, monkeypatch):
    """Each variant of the C++ ops this host runs, as the one `ops` calls."""
    m = require_kernel(ops.cpu_ops(kernel_variant))
    monkeypatch.setattr(ops, "cpu_ops", lambda variant=None: m)
    return m


def torch_path(monkeypatch):
    monkeypatch.setattr(ops, "_native", lambda x: None)


def tolerance(dtype):
    # bfloat16: one unit in the last place where a sum order differs; float32: a few ulp
    return dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_torch(native, monkeypatch, dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 2 * 576, generator=gen) * 3)[:, :576].to(dtype)  # strided rows
    w = torch.randn(576, generator=gen).to(dtype)
    fused = ops.rms_norm(x, w, 1e-5)
    torch_path(monkeypatch)
    torch.testing.assert_close(fused, ops.rms_norm(x, w, 1e-5), **tolerance(dtype))
    # per-head norm on a [tokens, heads, dim] view (Qwen3's q/k norm)
    xh = x[:, :512].reshape(37, 8, 64)
    torch.testing.assert_close(
        native.rms_norm(xh.reshape(-1, 64), w[:64], 1e-6).view(37, 8, 64),
        ops.rms_norm(xh, w[:64], 1e-6),
        **tolerance(dtype),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_torch_on_a_strided_view(native, monkeypatch, dtype):
    from atom_core.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(2)
    rope = RotaryEmbedding(64, 512, 10000.0)
    positions = torch.randint(0, 512, (23,), generator=gen)
    cos, sin = rope(positions, dtype)
    qkv = torch.randn(23, 15 * 64, generator=gen).to(dtype)
    expected = qkv.clone()
    fused = ops.apply_rotary(qkv[:, : 12 * 64].view(23, 12, 64), cos, sin)
    torch_path(monkeypatch)
    ref = ops.apply_rotary(expected[:, : 12 * 64].view(23, 12, 64), cos, sin)
    torch.testing.assert_close(fused, ref, **tolerance(dtype))
    torch.testing.assert_close(qkv[:, 12 * 64 :], expected[:, 12 * 64 :], rtol=0, atol=0)  # v untouched


def bits(t):
    """The tensor's raw bits: exact equality that also tells -0.0 from 0.0."""
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


WIDTHS = [(1, 576), (1, 37), (3, 100), (16, 1536), (5, 1), (2, 4097)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", WIDTHS)
def test_add_rms_norm_is_the_add_then_the_norm(native, monkeypatch, dtype, rows, n):
    """Bit for bit `residual + x` and rms_norm of it, on the C++ path (sum written into the
    residual's buffer) and the torch path; the C++ norm equals the plain C++ rms_norm."""
    gen = torch.Generator().manual_seed(rows * n)
    x, residual = ((torch.randn(2, rows, 2 * n, generator=gen) * 3)[..., :n]).to(dtype)  # strided x rows
    residual = residual.contiguous()
    before = residual.clone()
    w = torch.randn(n, generator=gen).to(dtype)
    expected_sum = residual + x
    expected = ops.rms_norm(expected_sum, w, 1e-5)
    buffer = residual.clone()
    normed, summed = ops.add_rms_norm(x, buffer, w, 1e-5)
    assert summed is buffer and torch.equal(bits(summed), bits(expected_sum))
    assert torch.equal(bits(normed), bits(expected))
    torch_path(monkeypatch)
    normed, summed = ops.add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(bits(summed), bits(expected_sum)) and torch.equal(bits(residual), bits(before))
    assert torch.equal(bits(normed), bits(ops.rms_norm(expected_sum, w, 1e-5)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", WIDTHS + [(1, 11008), (7, 33)])
def test_silu_and_mul_is_torchs_bit_for_bit(native, dtype, rows, n):
    """Equal to F.silu(gate) * up in every bit, a row's tail (past torch's whole vector pairs)
    included, where torch's exp is std::exp and differs from the vector one in some last bits."""
    gen = torch.Generator().manual_seed(rows + n)
    x = (torch.randn(rows, 2 * n, generator=gen) * 6).to(dtype)
    x.view(-1)[:4] = torch.tensor([0.0, -0.0, 88.0, -104.0])  # signed zeros; exp overflow and underflow
    gate, up = x.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    assert ops.torch_vector_bytes() is not None
    got = ops.silu_and_mul(x)
    assert got.shape == expected.shape and torch.equal(bits(got), bits(expected))
    if native.EXP_LANES:  # a portable build has no vector exp to mirror torch's with: torch's silu runs
        assert torch.equal(bits(native.silu_and_mul(x, ops.torch_vector_bytes())), bits(expected))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_takes_what_torch_splits_between_threads_at_row_boundaries(native, dtype):
    """Past GRAIN_SIZE elements torch's silu runs on several threads; where every thread's
    chunk is whole rows (32 x 1536 on 2 threads: 16 rows each; a 512-token prompt) the C++
    kernel is taken and still equal in every bit, where a chunk ends mid-row (25 or 511 x
    1536) it is not."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert ops.torch_splits_whole_rows(32, 1536) and ops.torch_splits_whole_rows(64, 1536)
        assert not ops.torch_splits_whole_rows(25, 1536) and ops.torch_splits_whole_rows(21, 1536)  # 21: < GRAIN
        assert ops.torch_splits_whole_rows(512, 1536) and not ops.torch_splits_whole_rows(511, 1536)
        for rows in (25, 32, 64, 511, 512, 1000):
            x = (torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 6).to(dtype)
            gate, up = x.chunk(2, dim=-1)
            expected = torch.nn.functional.silu(gate) * up
            assert torch.equal(bits(ops.silu_and_mul(x)), bits(expected)), rows
            if native.EXP_LANES and ops.torch_splits_whole_rows(rows, 1536):
                assert torch.equal(bits(native.silu_and_mul(x, ops.torch_vector_bytes())), bits(expected)), rows
    finally:
        torch.set_num_threads(threads)


def test_silu_and_mul_matches_torch_where_its_two_exps_disagree(native):
    """torch's silu takes a row's whole vector pairs through Sleef's exp and the rest through
    std::exp, which round a few float32 inputs in 1000 differently: put such inputs both in
    the vector part and in the tail (d = 208: 192 + 16 on AVX-512, all 208 in pairs on AVX2)."""
    g = torch.randn(4096, generator=torch.Generator().manual_seed(7)) * 8
    vector = torch.nn.functional.silu(g)  # contiguous, 4096 elements: all in whole vectors
    scalar = torch.nn.functional.silu(torch.stack([g, g], dim=1)[:, 0])  # strided: all std::exp
    odd = g[vector != scalar]
    assert len(odd) >= 8
    gate = odd[torch.arange(208) % len(odd)][None].repeat(3, 1)
    x = torch.cat([gate, torch.randn(3, 208, generator=torch.Generator().manual_seed(8))], dim=1)
    expected = torch.nn.functional.silu(x[:, :208]) * x[:, 208:]
    assert torch.equal(bits(ops.silu_and_mul(x)), bits(expected))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_matches_torch_first_maximum_and_nan(native, dtype):
    from atom_core.layers.ops import argmax

    gen = torch.Generator().manual_seed(0)
    for rows, n in [(1, 1), (1, 15), (3, 16), (2, 17), (32, 49152), (5, 1000)]:
        x = torch.randn(rows, n, generator=gen).to(dtype)
        assert torch.equal(argmax(x), x.argmax(dim=-1))
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0], [-0.0, 0.0, -1.0, -0.0], [-float("inf")] * 4], dtype=dtype)
    x = torch.cat([x, torch.full((3, 30), -5.0, dtype=dtype)], dim=1)  # ties across the vector part
    x[0, 20] = 3.0
    assert argmax(x).tolist() == x.argmax(dim=-1).tolist() == [1, 0, 4]
    assert argmax(torch.full((1, 40), -float("inf"), dtype=dtype)).tolist() == [0]
    for at in (0, 7, 16, 33):  # a NaN anywhere wins, the first of them
        y = torch.randn(2, 34, generator=gen).to(dtype)
        y[1, at] = float("nan")
        y[1, 33] = float("nan")
        y[0, 5] = float("inf")
        assert argmax(y).tolist() == y.argmax(dim=-1).tolist() == [5, at]
    strided = torch.randn(4, 64, generator=gen).to(dtype)[:, 3:40]  # rows apart in memory
    assert torch.equal(argmax(strided), strided.argmax(dim=-1))


def test_near_max_matches_its_torch_definition(native):
    """The logits ExactTopLogits recomputes: the C++ pass against the torch ops it replaced,
    with margins from none to most of a row, ties at the threshold, NaN and infinite rows."""
    from atom_core.layers.ops import near_max

    def reference(x, base, eps):
        top = x.max(dim=1).values
        error = eps * (base + top.abs() + 1.0)
        return (x >= (top - 2 * error).unsqueeze(1)).nonzero(as_tuple=True)

    gen = torch.Generator().manual_seed(3)
    for rows, n in [(1, 49152), (3, 17), (8, 1000), (2, 16), (1, 1)]:
        x = torch.randn(rows, n, generator=gen) * 4
        for base, eps in [
            (torch.zeros(rows), 0.0),
            (torch.rand(rows, generator=gen) * 15, 2.0**-8),
            (torch.full((rows,), 1e3), 0.01),
        ]:
            got, want = near_max(x, base, eps), reference(x, base, eps)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (rows, n, eps)
    x = torch.full((4, 40), -5.0)
    x[0, [3, 20, 33]] = 2.0  # ties at the maximum, in the vector part and the tail
    x[1, 7] = float("nan")
    x[2, :] = -float("inf")
    x[3, 39] = float("inf")  # an infinite maximum makes the margin NaN: no entries, as in torch
    rows, cols = near_max(x, torch.zeros(4), 0.0)
    assert (rows.tolist(), cols.tolist()) == ([0, 0, 0], [3, 20, 33])
    want = reference(x, torch.zeros(4), 0.0)
    assert rows.tolist() == want[0].tolist() and cols.tolist() == want[1].tolist()


def test_longrope_takes_the_long_factors_past_the_original_context():
    """Phi-3's LongRoPE: positions within `original_max_position_embeddings` rotate with the short
    factors, later ones with the long; both tables scaled by sqrt(1 + ln(factor) / ln(original))."""
    import math

    import transformers

    from atom_core.layers.rotary import get_rope

    short, long = [1.0, 1.5, 2.0, 4.0], [3.0, 5.0, 7.0, 9.0]
    cfg = transformers.Phi3Config(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=64, original_max_position_embeddings=16,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                             short_factor=short, long_factor=long),
    )  # fmt: skip
    rope = get_rope(cfg, 8, 64)
    scale = math.sqrt(1 + math.log(64 / 16) / math.log(16))
    base = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    for p, factors in ((3, short), (15, short), (16, long), (40, long)):
        freqs = p * base / torch.tensor(factors)
        want = torch.cat((freqs, freqs)).cos() * scale
        torch.testing.assert_close(rope.cos[p], want, rtol=1e-5, atol=1e-6)
