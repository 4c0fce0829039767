"""`Linear` after loading: the packed oneDNN GEMM on CPU, the plain weight released."""

from __future__ import annotations

import gc
import weakref

import pytest

torch = pytest.importorskip("torch")

from atom_core.layers.linear import Linear, MergedLinear  # noqa: E402

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def loaded(layer: Linear, dtype: torch.dtype) -> Linear:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * 0.05)
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen))
    layer.to(dtype)
    return layer


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_gemm_matches_plain_at_every_row_count(dtype, bias):
    layer = loaded(Linear(96, 80, bias=bias), dtype)
    weight = layer.weight.detach().clone()
    b = None if layer.bias is None else layer.bias.detach().clone()
    layer.process_weights_after_loading()
    assert layer.packed_weight is not None and layer.weight is None
    layer.process_weights_after_loading()  # a second call (a reload) keeps the packed weight
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for rows in (1, 3, 64, 65, 700):
        x = torch.randn(rows, 96).to(dtype)
        expected = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
        torch.testing.assert_close(layer(x).double(), expected, **tol)


@needs_onednn
def test_untied_weight_is_freed_and_tied_weight_survives():
    layer = loaded(Linear(64, 32), torch.float32)
    ref = weakref.ref(layer.weight)
    layer.process_weights_after_loading()
    gc.collect()
    assert ref() is None, "the plain weight stayed alive next to its packed copy"

    embedding = torch.nn.Embedding(32, 64)
    head = Linear(64, 32, bias=False)
    head.weight = embedding.weight  # tied, as LlamaForCausalLM does
    before = embedding.weight.detach().clone()
    head.process_weights_after_loading()
    assert torch.equal(embedding.weight, before)
    ids = torch.tensor([3, 7])
    torch.testing.assert_close(head(embedding(ids)), embedding(ids) @ before.T, atol=1e-5, rtol=1e-5)


def test_disabled_onednn_keeps_plain_weight(monkeypatch):
    monkeypatch.setenv("ATOM_DISABLE_ONEDNN", "1")
    layer = loaded(MergedLinear(16, {"a": 8, "b": 4}), torch.float32)
    layer.process_weights_after_loading()
    assert layer.packed_weight is None and layer.gemm is torch.nn.functional.linear
    x = torch.randn(5, 16)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))
