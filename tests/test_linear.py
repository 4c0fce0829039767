"""`Linear` after loading: the packed oneDNN GEMM on CPU, and the weight-streaming kernel at 1 to MAX_ROWS (64) rows."""

from __future__ import annotations

import gc
import os
import platform
import subprocess
import sys
import weakref

import pytest

torch = pytest.importorskip("torch")

from conftest import require_kernel  # noqa: E402

import atom_core.layers.gemm as gemm_module  # noqa: E402
from atom_core.layers.gemm import AMX_BF16_STREAM_ROWS, StreamingGemm, gemv_ops, gemv_weight, streaming_rows  # noqa: E402
from atom_core.layers.linear import Linear, MergedLinear, StreamedEmbedding  # noqa: E402
from atom_core.platform.cpu_features import cpu_features  # noqa: E402
from atom_core.platform.cpu_features import detect as cpu_features_detect  # noqa: E402

# (weights, activations): each 16-bit dtype against itself and against float32 rows
DTYPE_PAIRS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16),
    (torch.float16, torch.float32),
]

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
    """oneDNN's packed weight where it has kernels for the dtype, the streaming kernel's tiles
    where only Atom's kernels serve it (bfloat16 without avx512_bf16 or AMX), and torch's GEMM on the
    plain weight where neither does (that, with the C++ kernels off)."""
    layer = loaded(Linear(96, 80, bias=bias), dtype)
    weight = layer.weight.detach().clone()
    b = None if layer.bias is None else layer.bias.detach().clone()
    layer.process_weights_after_loading()
    if dtype == torch.float32 or cpu_features().onednn_bf16 or gemv_ops() is not None:
        assert layer.packed_weight is not None and layer.weight is None
    else:
        assert layer.packed_weight is None and layer.gemm is torch.nn.functional.linear
    layer.process_weights_after_loading()  # a second call (a reload) keeps the packed weight
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for rows in (1, 3, 64, 65, 700):
        x = torch.randn(rows, 96).to(dtype)
        expected = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
        torch.testing.assert_close(layer(x).double(), expected, **tol)


@needs_onednn
def test_untied_weight_is_freed_and_tied_weight_survives(monkeypatch):
    # as with ATOM_DISABLE_GEMV=1: the streaming kernel keeps the plain weight on purpose
    monkeypatch.setattr("atom_core.layers.gemm.gemv_ops", lambda: None)
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
    """No oneDNN packing: float32 runs `F.linear` on the plain weight, or, where the kernel's
    build takes float32 at every row count (`F32_EVERY_ROW`), the streaming kernel alone."""
    monkeypatch.setenv("ATOM_DISABLE_ONEDNN", "1")
    layer = loaded(MergedLinear(16, {"a": 8, "b": 4}), torch.float32)
    weight = layer.weight.detach().clone()
    layer.process_weights_after_loading()
    x = torch.randn(5, 16)
    ops = gemv_ops()
    if ops is not None and ops.F32_EVERY_ROW:
        assert isinstance(layer.gemm, StreamingGemm) and layer.packed_weight is layer.gemm.tiled
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight), atol=1e-5, rtol=1e-5)
    else:
        assert layer.packed_weight is None and layer.gemm is torch.nn.functional.linear
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))


@pytest.mark.parametrize("wdtype,xdtype", DTYPE_PAIRS)
@pytest.mark.parametrize("bias", [False, True])
def test_streaming_gemv_against_float64(wdtype, xdtype, bias, kernel_variant):
    """Every row count of a decode step and GEMM-sized ones (64, 700: the every-row path of
    bfloat16 without oneDNN), widths with and without a vector tail, row counts that leave a
    partial tile (and runs split across threads), in each variant this host runs."""
    ops = require_kernel(gemv_ops(kernel_variant))
    gen = torch.Generator().manual_seed(1)
    # (tiles of 16 or 32 rows: N of 1, 7, 131, 1000 and 2049 leave a part tile; bfloat16 pads an odd K)
    for n, k in [(1, 16), (7, 33), (131, 576), (1000, 47), (2049, 96), (5, 80), (32, 1)]:
        w = (torch.randn(n, k, generator=gen) * 0.1).to(wdtype)
        b = torch.randn(n, generator=gen).to(xdtype) if bias else None
        gemm = StreamingGemm(w, ops, every_row=True)
        for rows in [*range(1, int(ops.MAX_ROWS) + 1), 64, 700][: None if n * k < 100_000 else 9]:
            x = torch.randn(rows, k, generator=gen).to(xdtype)
            out = gemm(x, None, b)
            assert out.dtype == xdtype and out.shape == (rows, n)
            expected = x.double() @ w.double().T + (0 if b is None else b.double())
            # float32: summation order only; 16-bit output: one rounding of the float32 sum
            # (float16 keeps 11 bits, bfloat16 8)
            rounding = {torch.float32: 1e-5, torch.bfloat16: 2**-8, torch.float16: 2**-11}[xdtype]
            tol = dict(atol=1e-5 if xdtype == torch.float32 else 1e-2, rtol=rounding)
            torch.testing.assert_close(out.double(), expected, **tol)


@pytest.mark.parametrize("wdtype,xdtype", DTYPE_PAIRS)
def test_streaming_gemv_computes_a_row_alike_at_every_row_count(wdtype, xdtype, kernel_variant):
    """Bit for bit: a row's output does not depend on how many rows share the call (up to 70:
    rows in several passes and chunks), and a column's not on which other columns are computed
    with it (`StreamingGemm.columns`, which the LM head screen's exact logits come from).
    bfloat16 rows against bfloat16 weights in AMX tiles (from AMX_MIN_ROWS rows, on CPUs with
    AMX) sum in another order than vdpbf16ps: there a row is alike at every row count below
    AMX_MIN_ROWS and at every count from it."""
    ops = require_kernel(gemv_ops(kernel_variant))
    tiled_from = (
        int(ops.AMX_MIN_ROWS)
        if wdtype == xdtype == torch.bfloat16 and ops.set_amx(cpu_features().amx_bf16)
        else sys.maxsize
    )
    gen = torch.Generator().manual_seed(2)
    for n, k in [(131, 576), (1000, 47), (70, 120)]:
        w = (torch.randn(n, k, generator=gen) * 0.1).to(wdtype)
        b = torch.randn(n, generator=gen).to(xdtype)
        x = torch.randn(70, k, generator=gen).to(xdtype)
        gemm = StreamingGemm(w, ops, every_row=True)
        alone = torch.cat([gemm(x[i : i + 1], None, b) for i in range(len(x))])
        together = gemm(x, None, b)  # 70 rows: in tiles where they are on
        for rows in [*range(2, int(ops.MAX_ROWS) + 1), 13, 70]:
            out = gemm(x[:rows], None, b)
            expected = together if rows >= tiled_from else alone
            for i in range(rows):
                assert torch.equal(out[i], expected[i]), (rows, i)
        cols = torch.randperm(n, generator=gen)[:37]
        assert torch.equal(gemm.columns(x[:3], cols, b), gemm(x[:3], None, b)[:, cols])
        assert torch.equal(gemm.rows(cols), w[cols]) and torch.equal(gemm.rows(), w)


def test_bfloat16_rows_in_amx_tiles_match_vdpbf16ps(kernel_variant):
    """`set_amx(True)` holds exactly for the AVX-512 BF16 build on a CPU with AMX; there bfloat16
    rows from AMX_MIN_ROWS on run in tiles, the same float32 sums of exact products as
    vdpbf16ps's in another order: a part tile, an odd K and K past whole tile steps (the tail
    block), one row block and several. Elsewhere the tiles stay off and both calls agree bit for bit."""
    ops = require_kernel(gemv_ops(kernel_variant))
    on = ops.set_amx(True)
    assert on is (cpu_features().amx_bf16 and kernel_variant == "avx512_bf16")
    gen = torch.Generator().manual_seed(3)
    try:
        for n, k in [(131, 576), (40, 47), (33, 130), (64, 1536)]:
            w = (torch.randn(n, k, generator=gen) * 0.1).bfloat16()
            tiled = gemv_weight(w, int(ops.TILE))
            b = torch.randn(n, generator=gen)
            for rows in (int(ops.AMX_MIN_ROWS), 16, 17, 33, 64, 100):
                x = torch.randn(rows, k, generator=gen).bfloat16()
                ops.set_amx(True)
                tiles = ops.gemv(x, tiled, n, b)
                ops.set_amx(False)
                pairs = ops.gemv(x, tiled, n, b)
                if not on:
                    assert torch.equal(tiles, pairs)
                # float32 sums in another order, each output rounded once to bfloat16
                torch.testing.assert_close(tiles.float(), pairs.float(), atol=1e-3, rtol=2**-7)
                expected = x.double() @ w.double().T + b.double()
                torch.testing.assert_close(tiles.double(), expected, atol=1e-2, rtol=2**-8)
    finally:
        ops.set_amx(cpu_features().amx_bf16)  # as `gemv_ops` leaves it


def test_streaming_gemv_refuses_what_it_cannot_take(kernel_variant):
    ops = require_kernel(gemv_ops(kernel_variant))
    w = gemv_weight(torch.randn(4, 16), int(ops.TILE))
    with pytest.raises(RuntimeError, match=r"takes x \[M, K\]"):
        ops.gemv(torch.randn(2, 9, 16), w, 4, None)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16, not Double"):
        ops.gemv(torch.randn(1, 16), w.double(), 4, None)
    with pytest.raises(RuntimeError, match="activations are float32, bfloat16 or float16, not Int"):
        ops.gemv(torch.ones(1, 16, dtype=torch.int32), w, 4, None)
    with pytest.raises(RuntimeError, match="tiled layout"):  # a plain [N, K] weight
        ops.gemv(torch.randn(1, 16), torch.randn(4, 16), 4, None)
    with pytest.raises(RuntimeError, match="tiled layout"):  # N past the tiles
        ops.gemv(torch.randn(1, 16), w, 33, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_streamed_embedding_reads_the_tiled_table_and_checks_ids(dtype, kernel_variant):
    """Rows as `nn.Embedding` gives them (odd K: bfloat16 pads its pairs; N past a tile);
    an id outside the table fails by name instead of reading padding or wrapping around."""
    table = torch.randn(40, 15).to(dtype)
    gemm = StreamingGemm(table, require_kernel(gemv_ops(kernel_variant)))
    emb = StreamedEmbedding(gemm.tiled, 40, 15)
    ids = torch.tensor([[0, 39, 7], [31, 32, 5]])
    assert torch.equal(emb(ids), torch.nn.functional.embedding(ids, table))
    for bad in (-1, 40, 63):
        with pytest.raises(IndexError, match=f"token id {bad} is outside the embedding table's 40 rows"):
            emb(torch.tensor([3, bad]))
    with pytest.raises(ValueError, match="x has 16 features, the weight takes 15"):
        gemm(torch.randn(1, 16).to(dtype), None, None)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_streams_decode_rows_and_packs_the_rest(dtype, monkeypatch):
    """Up to MAX_ROWS rows go to the streaming kernel, more to packed oneDNN; both agree.
    bfloat16 where oneDNN has no bfloat16 kernels, and float16 (oneDNN's float16 GEMM needs
    AVX512-FP16), and float32 where the kernel's build outruns oneDNN there (`F32_EVERY_ROW`,
    AVX2 builds): the streaming kernel at every row count, with no packed copy."""
    ops = require_kernel(gemv_ops())
    every_row = (
        dtype == torch.float16
        or (dtype == torch.bfloat16 and not cpu_features().onednn_bf16)
        or (dtype == torch.float32 and ops.F32_EVERY_ROW)
    )
    layer = loaded(Linear(96, 80, bias=True), dtype)
    weight, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.process_weights_after_loading()
    assert isinstance(layer.gemm, StreamingGemm) and layer.packed_weight is not None
    assert (layer.packed_weight is layer.gemm.tiled) == every_row  # no second copy of the weight
    calls = []
    ops = layer.gemm.ops

    class Spy:
        MAX_ROWS = ops.MAX_ROWS

        def gemv(self, *args):
            calls.append(args[0].shape[0])
            return ops.gemv(*args)

    layer.gemm.ops = Spy()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for rows in (1, 8, 64, 65, 200):
        x = torch.randn(rows, 96).to(dtype)
        torch.testing.assert_close(layer(x).double(), x.double() @ weight.double().T + b.double(), **tol)
    streamed = [r for r in (1, 8, 64, 65, 200) if every_row or r <= streaming_rows(dtype, ops)]
    assert calls == streamed and layer.gemm.max_rows == (sys.maxsize if every_row else streaming_rows(dtype, ops))


@pytest.mark.parametrize("amx", [False, True])
def test_bfloat16_streams_fewer_rows_where_amx_multiplies_them(amx, monkeypatch):
    """On CPUs with AMX, oneDNN's bfloat16 tiles take bfloat16 from AMX_BF16_STREAM_ROWS rows on
    unless the streaming kernel multiplies in AMX tiles itself (`amx_tiles()`, which `gemv_ops`
    turns on where the CPU has them); float32 (no tiles) and every dtype elsewhere stream up to
    the kernel's MAX_ROWS."""
    ops = require_kernel(gemv_ops())
    flags = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}
    features = cpu_features_detect(
        flags=frozenset(flags | ({"amx_bf16", "amx_tile", "amx_int8"} if amx else set())), isa=""
    )
    assert ops.amx_tiles() is cpu_features().amx_bf16
    monkeypatch.setattr(gemm_module, "cpu_features", lambda: features)
    try:
        ops.set_amx(False)
        assert streaming_rows(torch.bfloat16, ops) == (AMX_BF16_STREAM_ROWS if amx else ops.MAX_ROWS)
        if ops.set_amx(True):  # this CPU has the tiles
            assert streaming_rows(torch.bfloat16, ops) == ops.MAX_ROWS
        assert streaming_rows(torch.float32, ops) == ops.MAX_ROWS
        assert AMX_BF16_STREAM_ROWS < ops.MAX_ROWS
    finally:
        ops.set_amx(cpu_features().amx_bf16)


@pytest.mark.parametrize("hint", ["", "nta", "t2"])
def test_weight_streams_prefetch_as_the_cpu_or_the_environment_says(hint):
    """Weight streams are prefetched non-temporally on AMD's cores and T2 elsewhere (Intel's read
    an NTA stream at a third of the bandwidth); ATOM_STREAM_PREFETCH chooses either."""
    require_kernel(gemv_ops())
    code = "from atom_core.layers.gemm import gemv_ops; print(gemv_ops().STREAM_PREFETCH)"
    env = {**os.environ, "ATOM_STREAM_PREFETCH": hint}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    amd = "AuthenticAMD" in open("/proc/cpuinfo").read() or platform.machine() not in ("x86_64", "AMD64")
    assert out.stdout.split()[-1] == (hint or ("nta" if amd else "t2"))
