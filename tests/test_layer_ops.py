"""The fused CPU kernels behind RMSNorm and rotary embedding against the torch path."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from atom_core.layers import ops  # noqa: E402


@pytest.fixture(scope="module")
def native():
    m = ops.cpu_ops()
    assert m is not None, "the C++ CPU ops did not build (is a C++ compiler installed?)"
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
    torch.testing.assert_close(native.rms_norm(xh.reshape(-1, 64), w[:64], 1e-6).view(37, 8, 64),
                               ops.rms_norm(xh, w[:64], 1e-6), **tolerance(dtype))


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
