"""The "mha" builder's paged-attention kernel against a plain softmax(QK^T)V reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from conftest import require_kernel  # noqa: E402

from atom_attention import cpu_kernels  # noqa: E402
from atom_attention.mha.builder import MHAMetadataBuilder, default_impl_cls  # noqa: E402
from atom_attention.mha.cpu_paged import CpuPagedAttention  # noqa: E402
from atom_attention.mha.torch_paged import TorchPagedAttention, chunk_size  # noqa: E402
from atom_core.kv.layout import KVPoolPlan  # noqa: E402
from atom_core.layers import Attention  # noqa: E402
from atom_core.platform.cpu_features import cpu_features  # noqa: E402
from atom_core.runner.attention_builder import BuilderContext  # noqa: E402

IMPLS = [TorchPagedAttention, CpuPagedAttention]

BS, KV_HEADS, HEADS, DIM, NUM_BLOCKS = 16, 2, 6, 8, 256


def make_builder(dtype, impl_cls=TorchPagedAttention):
    if impl_cls is CpuPagedAttention:
        require_kernel(cpu_kernels.load())
    context = BuilderContext.without_engine(dtype=dtype, block_size=BS)
    layer = Attention(HEADS, DIM, DIM**-0.5, KV_HEADS, layer_id=0)
    builder = type("Builder", (MHAMetadataBuilder,), {"impl_cls": impl_cls})(context, [layer])
    builder.bind_pool(KVPoolPlan(num_blocks=NUM_BLOCKS, block_size=BS))
    builder.allocate_kv_cache_tensors(KV_HEADS, 0)
    assert builder.build_kv_cache_tensor(0, layer) is not None
    assert builder.compute_block_bytes() == 2 * BS * KV_HEADS * DIM * torch.tensor([], dtype=dtype).element_size()
    return builder, layer


def batch(context_lens, tables, num_new, **padding):
    return SimpleNamespace(
        req_ids=list(range(len(context_lens))),
        num_scheduled_tokens=list(num_new),
        scheduled_spec_decode_tokens={},
        context_lens=list(context_lens),
        num_cached_tokens=[0] * len(context_lens),
        block_tables=tables,
        pad_block=padding.get("pad_block"),
        left_pad_blocks=padding.get("left_pad_blocks"),
        tkvs=padding.get("tkvs"),
    )


def random_tables(context_lens, gen, num_blocks=NUM_BLOCKS):
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for L in context_lens:
        n = -(-L // BS)
        tables.append(perm[:n])
        perm = perm[n:]
    return tables


def run_step(builder, layer, context_lens, tables, num_new, gen, **padding):
    """Write `num_new` tokens per request through the kernel; returns (meta, q, output)."""
    meta = builder.build(batch(context_lens, tables, num_new, **padding))
    total = sum(num_new)
    q = torch.randn(total, HEADS, DIM, generator=gen).to(builder.dtype)
    k = torch.randn(total, KV_HEADS, DIM, generator=gen).to(builder.dtype)
    v = torch.randn(total, KV_HEADS, DIM, generator=gen).to(builder.dtype)
    return meta, q, layer.impl.forward(layer, q, k, v, meta)


def reference(k_cache, v_cache, scale, q, tables, context_lens):
    """softmax(q K^T) V per request, over the first L slots of its blocks, in the inputs' dtype."""
    out = []
    group = q.shape[1] // k_cache.shape[0]
    for i, (table, L) in enumerate(zip(tables, context_lens)):
        k = k_cache[:, table].flatten(1, 2)[:, :L].repeat_interleave(group, 0)  # [heads, L, dim]
        v = v_cache[:, table].flatten(1, 2)[:, :L].repeat_interleave(group, 0)
        w = torch.softmax((q[i].unsqueeze(1) @ k.transpose(1, 2)).float() * scale, dim=-1)
        out.append((w.to(v.dtype) @ v).squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize("impl_cls", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("context_lens", [[2, 17, 300, 16, 33, 5, 128, 129, 2], [40, 2, 250], [16] * 6])
def test_prefill_then_decode_matches_reference(context_lens, dtype, impl_cls):
    gen = torch.Generator().manual_seed(len(context_lens))
    builder, layer = make_builder(dtype, impl_cls)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    # Unwritten slots may hold anything, NaN included (the null block alone starts zeroed).
    builder.kv_cache[:, :, :, :NUM_BLOCKS].fill_(float("nan"))
    tables = random_tables(context_lens, gen)
    prompt_lens = [L - 1 for L in context_lens]
    meta, q, out = run_step(builder, layer, prompt_lens, tables, prompt_lens, gen)
    assert "chunk_req" not in meta.extra
    for i, L in enumerate(prompt_lens):  # each prompt token: causal attention over the prompt so far
        s = sum(prompt_lens[:i])
        for j in (0, L - 1):
            ref = reference(layer.k_cache, layer.v_cache, layer.scale, q[s + j : s + j + 1], [tables[i]], [j + 1])
            torch.testing.assert_close(out[s + j : s + j + 1], ref, atol=tol, rtol=tol)
    meta, q, out = run_step(builder, layer, context_lens, tables, [1] * len(context_lens), gen)
    if impl_cls is TorchPagedAttention:  # chunks serve batches above a few requests; small ones go one by one
        assert ("chunk_req" in meta.extra) == (len(context_lens) > 4)
    torch.testing.assert_close(
        out, reference(layer.k_cache, layer.v_cache, layer.scale, q, tables, context_lens), atol=tol, rtol=tol
    )


def test_chunk_size_trades_padding_against_chunk_count():
    import numpy as np

    assert chunk_size(np.array([11] * 64)) == 11  # equal lengths: one chunk each, no padding
    assert chunk_size(np.array([1, 2, 3])) == 3
    assert 1 <= chunk_size(np.array([1, 100, 7, 64])) <= 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_serves_a_few_new_tokens_per_request_causally(dtype):
    """Steps with a few new tokens a request (speculative verification) take the kernel's
    per-token path: token j of n sees the cached prefix and new tokens up to j."""
    gen = torch.Generator().manual_seed(7)
    builder, layer = make_builder(dtype, CpuPagedAttention)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    context_lens, num_new = [37, 9, 64, 80], [3, 5, 1, 8]
    tables = random_tables(context_lens, gen)
    run_step(
        builder,
        layer,
        [L - n for L, n in zip(context_lens, num_new)],
        tables,
        [L - n for L, n in zip(context_lens, num_new)],
        gen,
    )  # the cached part
    _, q, out = run_step(builder, layer, context_lens, tables, num_new, gen)
    s = 0
    for table, L, n in zip(tables, context_lens, num_new):
        for j in range(n):
            ref = reference(layer.k_cache, layer.v_cache, layer.scale, q[s + j : s + j + 1], [table], [L - n + j + 1])
            torch.testing.assert_close(out[s + j : s + j + 1], ref, atol=tol, rtol=tol)
        s += n


def test_cpu_kernel_builds_where_a_compiler_is():
    """CI has g++: a broken build must fail here, not fall back to the slow path unnoticed."""
    require_kernel(cpu_kernels.load())
    import shutil

    assert shutil.which("c++") or shutil.which("g++"), "no C++ compiler on this machine"
    assert cpu_kernels.load() is not None
    assert default_impl_cls(torch.device("cpu")) is CpuPagedAttention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim,kv_heads,group", [(64, 3, 3), (64, 2, 5), (128, 2, 3), (128, 1, 4), (96, 2, 2)])
def test_cpu_kernel_vector_paths_match_reference(dtype, dim, kv_heads, group, kernel_variant):
    """Head dims 64 and 128 take the vector paths (several query heads per pass over a row;
    groups above a pass's capacity take two; AVX2's 16 registers hold fewer), in float32,
    bfloat16 and float16 (widened as loaded); others the generic loop, in each variant this host runs."""
    ops = require_kernel(cpu_kernels.load(kernel_variant))
    gen = torch.Generator().manual_seed(dim + group)
    bs, nblocks = 16, 64
    context_lens = [1, 15, 16, 17, 100, 203]
    tables = random_tables(context_lens, gen, nblocks)
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    k_cache = torch.randn(kv_heads, nblocks, bs, dim, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, nblocks, bs, dim, generator=gen).to(dtype)
    q = torch.randn(len(context_lens), kv_heads * group, dim, generator=gen).to(dtype)
    out = ops.paged_attention(
        q, k_cache, v_cache, padded, torch.tensor(context_lens), torch.arange(len(context_lens) + 1), dim**-0.5
    )
    ref = reference(k_cache.float(), v_cache.float(), dim**-0.5, q.float(), tables, context_lens)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def filled_caches(context_lens, kv_heads, dim, dtype, gen, bs, nblocks):
    """Random block tables (and their padded tensor) and K/V caches holding each request's
    positions there; every other slot NaN, so a kernel that reads one fails."""
    tables = random_tables(context_lens, gen, nblocks)
    padded = torch.tensor([t + [0] * (max(map(len, tables)) - len(t)) for t in tables])
    k_cache = torch.full((kv_heads, nblocks, bs, dim), float("nan"), dtype=dtype)
    v_cache = torch.full((kv_heads, nblocks, bs, dim), float("nan"), dtype=dtype)
    for table, L in zip(tables, context_lens):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(L)])
        for cache in (k_cache, v_cache):
            cache.view(kv_heads, -1, dim)[:, slots] = torch.randn(kv_heads, L, dim, generator=gen).to(dtype)
    return tables, padded, k_cache, v_cache


def causal_reference(q, k_cache, v_cache, tables, context_lens, num_new, scale):
    """float64 softmax(q K^T) V for each request's last `n` of `L` positions, token j seeing keys up to L - n + j."""
    return options_reference(q, k_cache, v_cache, tables, context_lens, num_new, scale, None, None, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim,kv_heads,group", [(64, 3, 3), (128, 2, 4), (64, 1, 1), (576, 1, 5), (96, 2, 2)])
def test_cpu_kernel_tiles_long_query_runs(dtype, dim, kv_heads, group, kernel_variant):
    """Prompt chunks (more than a few new tokens) take the tiled path, over a cached prefix or
    none, with a decode row and a short run in the same call; unwritten slots hold NaN.
    Head dims 64, 128 and 576 (MLA's latent) tile in float32, bfloat16 and float16; 96 takes
    the per-token loop, in each variant this host runs."""
    ops = require_kernel(cpu_kernels.load(kernel_variant))
    gen = torch.Generator().manual_seed(dim * group)
    bs, nblocks = 16, 96
    context_lens, num_new = [300, 9, 40, 100, 1, 17, 70], [300, 9, 33, 20, 1, 17, 3]
    tables, padded, k_cache, v_cache = filled_caches(context_lens, kv_heads, dim, dtype, gen, bs, nblocks)
    q = torch.randn(sum(num_new), kv_heads * group, dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(num_new).cumsum(0).tolist()])
    out = ops.paged_attention(q, k_cache, v_cache, padded, torch.tensor(context_lens), starts, dim**-0.5)
    ref = causal_reference(q, k_cache, v_cache, tables, context_lens, num_new, dim**-0.5)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("impl_cls", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_step_of_decode_rows_and_prompt_chunks_matches_reference(dtype, impl_cls):
    """Decode rows first, then prompt chunks over a cached prefix, in one forward (the `mixed` policy)."""
    gen = torch.Generator().manual_seed(11)
    builder, layer = make_builder(dtype, impl_cls)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    builder.kv_cache[:, :, :, :NUM_BLOCKS].fill_(float("nan"))
    context_lens = [9, 30, 17, 64, 5, 100, 70, 130]
    num_new = [1, 1, 1, 1, 1, 1, 38, 50]  # six decodes, then two chunks (the second one ends mid-block)
    tables = random_tables(context_lens, gen)
    cached = [L - n for L, n in zip(context_lens, num_new)]
    run_step(builder, layer, cached, tables, cached, gen)
    meta, q, out = run_step(builder, layer, context_lens, tables, num_new, gen)
    if impl_cls is TorchPagedAttention:
        assert meta.extra["decode_reqs"] == 6  # the decode rows run chunked, the chunks varlen
    else:  # head_dim 8 is not tiled: the kernel takes the decode rows, torch the chunks
        assert meta.extra["kernel_reqs"] == 6 and not layer.impl.tiles(layer, q)
    s = 0
    for table, L, n in zip(tables, context_lens, num_new):
        for j in sorted({0, n // 2, n - 1}):
            ref = reference(layer.k_cache, layer.v_cache, layer.scale, q[s + j : s + j + 1], [table], [L - n + j + 1])
            torch.testing.assert_close(out[s + j : s + j + 1], ref, atol=tol, rtol=tol)
        s += n


@pytest.mark.parametrize("impl_cls", IMPLS)
def test_rectangular_padded_layout_gives_the_unpadded_output(impl_cls):
    """spyre's layout: rows left-padded with whole padding blocks to one width, masked;
    the output must equal the plain layout's for decode rows and for a prompt chunk."""
    gen = torch.Generator().manual_seed(12)
    builder, layer = make_builder(torch.float32, impl_cls)
    builder.kv_cache[:, :, :, :NUM_BLOCKS].fill_(float("nan"))  # the padding block (0) too
    context_lens = [5, 33, 20, 48]
    tables = random_tables(context_lens, gen, NUM_BLOCKS - 1)
    tables = [[b + 1 for b in t] for t in tables]  # block 0 is the padding block
    run_step(builder, layer, [L - 1 for L in context_lens], tables, [L - 1 for L in context_lens], gen)
    q = torch.randn(4, HEADS, DIM, generator=gen)
    k = torch.randn(4, KV_HEADS, DIM, generator=gen)
    v = torch.randn(4, KV_HEADS, DIM, generator=gen)
    plain = layer.impl.forward(layer, q, k, v, builder.build(batch(context_lens, tables, [1] * 4)))
    width = max(-(-L // BS) for L in context_lens)
    pads = [width - -(-L // BS) for L in context_lens]
    tkvs = [p * BS + L for p, L in zip(pads, context_lens)]
    meta = builder.build(batch(context_lens, tables, [1] * 4, pad_block=0, left_pad_blocks=pads, tkvs=tkvs))
    assert meta.padded_block_tables.shape == (4, width)
    assert meta.padded_block_tables[0, : pads[0]].tolist() == [0] * pads[0]
    padded = layer.impl.forward(layer, q, k, v, meta)
    torch.testing.assert_close(padded, plain, atol=1e-5, rtol=1e-5)
    # A prompt chunk, left-padded by 3 blocks: 20 new tokens after 28 computed ones.
    table = tables[3]
    chunk = builder.build(batch([48], [table], [20]))
    qc = torch.randn(20, HEADS, DIM, generator=gen)
    kc = torch.randn(20, KV_HEADS, DIM, generator=gen)
    vc = torch.randn(20, KV_HEADS, DIM, generator=gen)
    plain = layer.impl.forward(layer, qc, kc, vc, chunk)
    meta = builder.build(batch([48], [table], [20], pad_block=0, left_pad_blocks=[3], tkvs=[3 * BS + 48]))
    torch.testing.assert_close(layer.impl.forward(layer, qc, kc, vc, meta), plain, atol=1e-5, rtol=1e-5)


def options_reference(q, k_cache, v_cache, tables, context_lens, num_new, scale, window, softcap, sinks):
    """`causal_reference` with a sliding window (token at p sees keys p - window + 1 .. p), soft-capped
    scores and a sink logit per head joining the softmax, in float64."""
    out, s = torch.empty(q.shape, dtype=torch.float64), 0
    group = q.shape[1] // k_cache.shape[0]
    for table, L, n in zip(tables, context_lens, num_new):
        k = k_cache[:, table].flatten(1, 2)[:, :L].double().repeat_interleave(group, 0)  # [heads, L, dim]
        v = v_cache[:, table].flatten(1, 2)[:, :L].double().repeat_interleave(group, 0)
        scores = q[s : s + n].double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [heads, n, L]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        keys, pos = torch.arange(L)[None, :], torch.arange(L - n, L)[:, None]
        hidden = (keys > pos) | ((keys <= pos - window) if window else torch.zeros_like(keys > pos))
        scores.masked_fill_(hidden, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None, None].expand(-1, n, 1)], dim=-1)
        p = scores.softmax(-1)
        if sinks is not None:
            p = p[..., :-1]
        out[s : s + n] = (p @ v).transpose(0, 1)
        s += n
    return out


def check_kernel_options(variant, dtype, dim, kv_heads, group, window, softcap, sinks, context_lens, num_new, nblocks):
    """The kernel's output for requests of `context_lens` keys, the last `num_new` of them new
    (random caches, tables and queries; a sink logit per head if `sinks`), against the float64
    reference with the window and soft cap; what it ran on, for further checks."""
    ops = require_kernel(cpu_kernels.load(variant))
    gen = torch.Generator().manual_seed(dim + group + (window or 0))
    tables, padded, k_cache, v_cache = filled_caches(context_lens, kv_heads, dim, dtype, gen, 16, nblocks)
    heads = kv_heads * group
    sink = torch.randn(heads, generator=gen) * 2 if sinks else None
    q = (torch.randn(sum(num_new), heads, dim, generator=gen) * 2).to(dtype)
    starts = torch.tensor([0, *torch.tensor(num_new).cumsum(0).tolist()])
    out = ops.paged_attention(
        q, k_cache, v_cache, padded, torch.tensor(context_lens), starts, dim**-0.5, window or 0, softcap or 0.0, sink
    )
    ref = options_reference(q, k_cache, v_cache, tables, context_lens, num_new, dim**-0.5, window, softcap, sink)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    return q, k_cache, v_cache, tables, starts, ref, tol, sink


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim,kv_heads,group", [(64, 2, 3), (128, 1, 4), (96, 2, 2)])
@pytest.mark.parametrize("window,softcap,sinks", [(24, None, False), (None, 20.0, False), (None, None, True),
                                                  (5, 30.0, True), (128, None, True)])  # fmt: skip
def test_cpu_kernel_windows_sinks_and_softcaps(dtype, dim, kv_heads, group, window, softcap, sinks, kernel_variant):
    """Every kernel path (decode, short runs, tiles over a cached prefix) with a sliding window
    that binds or not, and crosses block and chunk edges; soft-capped scores; sinks. Against a
    float64 reference, and the torch path (`attend`) against the same."""
    from atom_attention.mha.torch_paged import attend

    context_lens, num_new = [300, 9, 40, 100, 1, 17, 70, 33], [300, 9, 33, 20, 1, 17, 3, 1]
    q, k_cache, v_cache, tables, starts, ref, tol, sink = check_kernel_options(
        kernel_variant, dtype, dim, kv_heads, group, window, softcap, sinks, context_lens, num_new, nblocks=96
    )
    for i, (table, L, n) in enumerate(zip(tables, context_lens, num_new)):
        k = k_cache[:, table].flatten(1, 2)[:, :L]
        v = v_cache[:, table].flatten(1, 2)[:, :L]
        got = attend(q[starts[i] : starts[i + 1]], k, v, L - n, dim**-0.5, window, softcap, sink)
        torch.testing.assert_close(got.double(), ref[starts[i] : starts[i + 1]], atol=tol, rtol=tol)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("window,softcap,sinks", [(24, None, False), (5, 30.0, True), (None, None, True)])
def test_float32_queries_over_a_16_bit_cache_keep_windows_sinks_and_softcaps(
    cache_dtype, dim, window, softcap, sinks, kernel_variant
):
    """`kv_cache_dtype="bfloat16"` or `"float16"` under a float32 model: prompt chunks
    (bfloat16 pairs on avx512_bf16, queries rounded; float16 widened) and decode rows (the
    cache widened) honour a sliding window, soft-capped scores and sinks as float32 queries
    over a float32 cache do."""
    ops = require_kernel(cpu_kernels.load(kernel_variant))
    gen = torch.Generator().manual_seed(dim + (window or 0))
    kv_heads, group, bs, nblocks = 2, 3, 16, 96
    context_lens, num_new = [300, 40, 100, 1, 70], [300, 33, 20, 1, 3]
    tables, padded, k_cache, v_cache = filled_caches(context_lens, kv_heads, dim, cache_dtype, gen, bs, nblocks)
    heads = kv_heads * group
    sink = torch.randn(heads, generator=gen) * 2 if sinks else None
    q = torch.randn(sum(num_new), heads, dim, generator=gen) * 2
    starts = torch.tensor([0, *torch.tensor(num_new).cumsum(0).tolist()])
    args = (padded, torch.tensor(context_lens), starts, dim**-0.5, window or 0, softcap or 0.0, sink)
    out = ops.paged_attention(q, k_cache, v_cache, *args)
    assert out.dtype == torch.float32
    ref = options_reference(q, k_cache, v_cache, tables, context_lens, num_new, dim**-0.5, window, softcap, sink)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    # the decode rows (one new token) read the cache widened: the float32 cache's sums
    wide = ops.paged_attention(q, k_cache.float(), v_cache.float(), *args)
    decode = starts[3]  # request 3's single row
    assert torch.equal(out[decode], wide[decode])
    if cache_dtype == torch.bfloat16 and kernel_variant == "avx512_bf16":  # the chunks' pairs: bfloat16 queries' sums
        chunks = slice(0, int(starts[3]))
        narrow = ops.paged_attention(q.bfloat16(), k_cache, v_cache, *args)
        assert torch.equal(out[chunks].bfloat16(), narrow[chunks])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim,kv_heads,group", [(64, 3, 3), (576, 1, 5), (96, 2, 2)])
@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (700, 30.0, True), (1100, None, True)])
def test_cpu_kernel_splits_long_decode_queries_into_parts(dtype, dim, kv_heads, group, window, softcap, sinks,
                                                          kernel_variant):  # fmt: skip
    """A decode or verification row over more than a part's keys (512) takes a softmax per
    part and merges them: against a float64 reference at contexts on and across part edges,
    with windows that start inside a later part, sinks (which join at the merge) and soft caps;
    head dims 64, MLA's 576 and 96 (the generic loop)."""
    context_lens, num_new = [1500, 1025, 513, 512, 40, 1030], [1, 3, 1, 1, 1, 8]
    check_kernel_options(
        kernel_variant, dtype, dim, kv_heads, group, window, softcap, sinks, context_lens, num_new, nblocks=320
    )


@pytest.mark.parametrize("dim,kv_heads,group", [(64, 3, 3), (576, 1, 5)])
def test_a_split_decode_row_gives_the_same_bits_alone_and_in_any_batch(dim, kv_heads, group, kernel_variant):
    """Alone, a long decode row's parts run as tasks of their own (few tasks: threads would
    idle); in a batch one task takes them in turn. Either way the same parts merge alike, and
    a verification row's token j is the decode row at its length: speculative decoding's
    verify rows round as plain decode rows do."""
    ops = require_kernel(cpu_kernels.load(kernel_variant))
    gen = torch.Generator().manual_seed(dim)
    bs, nblocks = 16, 400
    context_lens = [1300, 700, 90, 2000, 1030, 515]
    tables, padded, k_cache, v_cache = filled_caches(context_lens, kv_heads, dim, torch.float32, gen, bs, nblocks)
    q = torch.randn(len(context_lens), kv_heads * group, dim, generator=gen)
    lens = torch.tensor(context_lens)
    together = ops.paged_attention(q, k_cache, v_cache, padded, lens, torch.arange(len(context_lens) + 1), dim**-0.5)
    for i in range(len(context_lens)):
        alone = ops.paged_attention(q[i : i + 1], k_cache, v_cache, padded[i : i + 1], lens[i : i + 1],
                                    torch.tensor([0, 1]), dim**-0.5)  # fmt: skip
        assert torch.equal(alone, together[i : i + 1]), i
    # request 3 verifying 3 tokens at 1028..1030 keys: each token as a decode row of that length
    n, L = 3, 1030
    qv = torch.randn(n, kv_heads * group, dim, generator=gen)
    table, lens_v = padded[4:5], torch.tensor([L])
    verify = ops.paged_attention(qv, k_cache, v_cache, table, lens_v, torch.tensor([0, n]), dim**-0.5)
    for j in range(n):
        decode = ops.paged_attention(qv[j : j + 1], k_cache, v_cache, table, torch.tensor([L - n + j + 1]),
                                     torch.tensor([0, 1]), dim**-0.5)  # fmt: skip
        assert torch.equal(decode, verify[j : j + 1]), j


@pytest.fixture
def amx_tiles(request):
    """The paged kernel with its prompt tiles in AMX tiles (True) or in vdpbf16ps (False), then
    as `cpu_kernels.load` leaves it. `set_amx(True)` holds exactly where the CPU has AMX."""
    ops = require_kernel(cpu_kernels.load())
    assert ops.set_amx(True) is cpu_features().amx_bf16
    on = ops.set_amx(request.param)
    assert on is (request.param and cpu_features().amx_bf16)
    yield ops
    cpu_kernels.load()


@pytest.mark.parametrize("amx_tiles", [True, False], indirect=True)
@pytest.mark.parametrize("qdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim,kv_heads,group", [(64, 3, 3), (128, 2, 4), (576, 1, 5), (64, 1, 7)])
@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (40, 30.0, True)])
def test_prompt_tiles_over_a_bfloat16_cache_match_reference_in_amx_tiles_or_not(
    amx_tiles, qdtype, dim, kv_heads, group, window, softcap, sinks
):
    """Prompt runs over a bfloat16 cache, whole and over a cached prefix, beside a decode row and
    a short run, bfloat16 or float32 queries, with and without a window, soft cap and sinks: the
    tiles (AMX's, which take rows in blocks of 16, and vdpbf16ps's) against float64. A run's
    rows are the same bits alone as beside others."""
    ops = amx_tiles
    gen = torch.Generator().manual_seed(dim * group)
    bs, nblocks = 16, 128
    context_lens, num_new = [300, 1, 9, 100, 53, 700], [300, 1, 9, 20, 53, 211]
    tables, padded, k_cache, v_cache = filled_caches(context_lens, kv_heads, dim, torch.bfloat16, gen, bs, nblocks)
    heads = kv_heads * group
    sink = torch.randn(heads, generator=gen) * 2 if sinks else None
    q = (torch.randn(sum(num_new), heads, dim, generator=gen) * 2).to(qdtype)
    starts = torch.tensor([0, *torch.tensor(num_new).cumsum(0).tolist()])
    lens = torch.tensor(context_lens)
    scale, extra = dim**-0.5, (window or 0, softcap or 0.0, sink)
    out = ops.paged_attention(q, k_cache, v_cache, padded, lens, starts, scale, *extra)
    ref = options_reference(q, k_cache, v_cache, tables, context_lens, num_new, scale, window, softcap, sink)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    last = slice(int(starts[-2]), int(starts[-1]))  # the last request alone
    alone = ops.paged_attention(
        q[last], k_cache, v_cache, padded[-1:], lens[-1:], starts[-2:] - starts[-2], scale, *extra
    )
    assert torch.equal(alone, out[last])
