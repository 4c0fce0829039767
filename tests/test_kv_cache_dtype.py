"""`Config.kv_cache_dtype`: the paged K/V caches in another dtype than the model's (vLLM's
kv_cache_dtype). A float32 model over a bfloat16 or float16 cache rounds each K/V value
once, when it is written; the C++ kernel reads the narrow values widened (a prompt chunk
over a bfloat16 cache on avx512_bf16 runs in bfloat16 pairs instead), and the torch path
(ATOM_CPU_KERNELS=0, the suite's second run) reads them back into the model's dtype."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from conftest import require_kernel  # noqa: E402
from model_utils import build_tiny_model  # noqa: E402

from atom_attention import cpu_kernels  # noqa: E402
from atom_core import Config, SamplingParams  # noqa: E402
from atom_core.engine.llm_engine import LLMEngine  # noqa: E402

PROMPTS = [[5, 17, 33, 9, 101, 250, 7], [3, 4], list(range(10, 60))]
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def attention_case(dim: int, cache_dtype: torch.dtype, seed: int):
    """Three requests over random blocks: one decode row (37 keys), three verify rows (50), a
    20-token prompt chunk (60, the tiled path): (q, k_cache, v_cache, tables, lens, starts)."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, heads, bs, blocks = 2, 4, 16, 40
    k = torch.randn(kv_heads, blocks, bs, dim, generator=gen).to(cache_dtype)
    v = torch.randn(kv_heads, blocks, bs, dim, generator=gen).to(cache_dtype)
    tables = torch.randperm(blocks, generator=gen)[:12].reshape(3, 4).long()
    q = torch.randn(24, heads, dim, generator=gen)
    return q, k, v, tables, torch.tensor([37, 50, 60]), torch.tensor([0, 1, 4, 24])


@pytest.mark.parametrize("dim", [64, 128, 576, 48])  # the vector paths' head dims, MLA's latent, another
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_float32_queries_over_a_narrow_cache_are_its_widened_values(dim, cache_dtype, kernel_variant):
    """Decode and verify rows read the narrow values widened. A prompt chunk over a bfloat16
    cache on the avx512_bf16 variant runs in bfloat16 pairs (head dims a multiple of 64): its
    queries rounded to bfloat16 (as llama.cpp rounds queries to its float16 cache's type), the
    same sums as bfloat16 queries over that cache."""
    ops = require_kernel(cpu_kernels.load(kernel_variant))
    q, k, v, tables, lens, starts = attention_case(dim, cache_dtype, seed=dim)
    scale = dim**-0.5
    out = ops.paged_attention(q, k, v, tables, lens, starts, scale)
    ref = ops.paged_attention(q, k.float(), v.float(), tables, lens, starts, scale)
    assert out.dtype == torch.float32
    pairs = cache_dtype == torch.bfloat16 and kernel_variant == "avx512_bf16" and dim % 64 == 0
    rows = slice(0, 4) if pairs else slice(None)  # the decode and verify rows; all of them without pairs
    assert torch.equal(out[rows], ref[rows])  # the same paths, widening as they read: bit for bit
    if pairs:
        chunk = slice(4, None)
        assert torch.equal(
            out[chunk].to(cache_dtype), ops.paged_attention(q.to(cache_dtype), k, v, tables, lens, starts, scale)[chunk]
        )
        torch.testing.assert_close(out[chunk], ref[chunk], atol=2e-2, rtol=2e-2)
        assert not torch.equal(out[chunk], ref[chunk])  # the pairs did run
    # queries narrower than their cache run as float32 queries, the output rounded once
    qn = q.to(cache_dtype)
    out = ops.paged_attention(qn, k.float(), v.float(), tables, lens, starts, scale)
    assert out.dtype == cache_dtype
    assert torch.equal(
        out, ops.paged_attention(qn.float(), k.float(), v.float(), tables, lens, starts, scale).to(cache_dtype)
    )


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_write_kv_rounds_new_rows_into_a_narrow_cache(cache_dtype, kernel_variant):
    ops = require_kernel(cpu_kernels.load(kernel_variant))
    kv_heads, blocks, bs, dim = 2, 8, 16, 64
    k_cache = torch.zeros(kv_heads, blocks, bs, dim, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(5, kv_heads, dim), torch.randn(5, kv_heads, dim)
    slots = torch.tensor([3, 17, 40, 41, 100])
    ops.write_kv(k, v, k_cache, v_cache, slots)
    for cache, new in ((k_cache, k), (v_cache, v)):
        assert torch.equal(cache.permute(1, 2, 0, 3).reshape(-1, kv_heads, dim)[slots], new.to(cache_dtype))


@pytest.fixture(scope="module", params=["llama", "mistral", "gpt_oss", "deepseek_v3", "qwen3_next"])
def family(request, tmp_path_factory):
    """(arch, folder, float32 logits and greedy tokens with a float32 cache): plain MHA, a
    sliding window, sinks (the layers with options), MLA's latent cache, and GDN beside MHA."""
    folder = tmp_path_factory.mktemp(request.param)
    build_tiny_model(request.param, folder)
    engine = LLMEngine(folder, **KW)
    return request.param, folder, *run(engine)


KW = dict(dtype="float32", num_kvcache_blocks=32, max_model_len=128)


def run(engine: LLMEngine) -> tuple[torch.Tensor, list[list[int]]]:
    """The prompts' last logits, then 8 greedy tokens each."""
    engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    logits = engine.runner.last_logits.double()
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    return logits, [o["token_ids"] for o in outs]


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float16"])
def test_a_float32_model_over_a_narrow_cache(family, cache_dtype):
    arch, folder, ref, ref_tokens = family
    engine = LLMEngine(folder, kv_cache_dtype=cache_dtype, **KW)
    dtype = getattr(torch, cache_dtype)
    caches = [t for name, t in engine.runner.kv_cache_tensors.items() if "state" not in name]
    assert caches and all(t.dtype == dtype for t in caches), {
        n: t.dtype for n, t in engine.runner.kv_cache_tensors.items()
    }
    assert engine.runner.dtype == torch.float32
    logits, tokens = run(engine)
    # K and V rounded once each: the logits move by a few roundoffs of their scale
    scale = ref.abs().amax(dim=1, keepdim=True)
    assert ((logits - ref).abs() <= 4 * UNIT_ROUNDOFF[dtype] * scale).all(), (logits - ref).abs().max()
    assert torch.equal(logits.argmax(1), ref.argmax(1))
    # decode steps read the narrow cache too; random tiny models have near-ties further on
    assert [t[:2] for t in tokens] == [t[:2] for t in ref_tokens] and all(len(t) == 8 for t in tokens)
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_narrow_cache_holds_twice_the_blocks_in_the_same_memory(tmp_path):
    build_tiny_model("llama", tmp_path)
    kw = dict(dtype="float32", max_model_len=128, kv_cache_memory=8 << 20)
    wide = LLMEngine(tmp_path, **kw).kv_plan.num_blocks
    narrow = LLMEngine(tmp_path, kv_cache_dtype="bfloat16", **kw).kv_plan.num_blocks
    assert narrow in (2 * wide, 2 * wide + 1), (wide, narrow)


def test_kv_cache_dtype_is_checked_by_name():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, float32, bfloat16, float16, got 'fp8'"):
        Config(kv_cache_dtype="fp8")
    assert Config().kv_cache_dtype == "auto"
