"""The "mla" builder: pool size for the real DeepSeek-V3 shapes, kernels against a dense reference,
and the absorbed and expanded paths giving the same logits."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import KERNEL_VARIANTS, built_variant, require_kernel  # noqa: E402
from model_utils import build_tiny_model, random_prompts, run_with_logits  # noqa: E402
from real_shapes import DEEPSEEK_V3  # noqa: E402

from atom_core.engine.llm_engine import LLMEngine  # noqa: E402
from atom_core.layers.mla import MLAAttention  # noqa: E402
from atom_core.runner.attention_builder import AttentionMetadataBuilder, BuilderContext  # noqa: E402


def builder_context(hf_config, dtype=torch.bfloat16, block_size=16):
    return BuilderContext.without_engine(hf_config, dtype=dtype, block_size=block_size)


def test_block_bytes_of_real_deepseek_v3_are_one_latent_row_per_token_and_layer():
    from atom_attention.mla.builder import MLAMetadataBuilder
    from atom_models.deepseek_v2 import DeepseekV3ForCausalLM

    cfg = SimpleNamespace(**DEEPSEEK_V3)
    with torch.device("meta"):  # shapes only: no weights exist
        model = DeepseekV3ForCausalLM(cfg)
    layers = [m for m in model.modules() if getattr(m, "attn_type", None) == "mla"]
    assert len(layers) == 61
    builder = MLAMetadataBuilder(builder_context(cfg), layers)
    assert builder.compute_block_bytes() == 16 * 61 * (512 + 64) * 2
    assert builder.compute_block_bytes() // 16 == 70_272
    # yarn with mscale_all_dim: the softmax scale is qk_head_dim ** -0.5 times mscale ** 2
    mscale = 0.1 * 1.0 * np.log(40) + 1.0
    assert layers[0].scale == pytest.approx(192**-0.5 * mscale**2)


# -- kernels against a dense reference ---------------------------------------------------

BS = 16
# (heads, qk_nope, qk_rope, v, kv_lora_rank): tiny, and DeepSeek's real latent width (576,
# the C++ kernel's vectorised case) with 6 heads (a partial pass of its 4-head passes).
SHAPES = {"tiny": (4, 16, 8, 16, 32), "real_latent": (6, 128, 64, 128, 512)}


def make_layer(shape, dtype, seed=0):
    heads, nope, rope, v, rank = shape
    torch.manual_seed(seed)
    kv_b = torch.nn.Linear(rank, heads * (nope + v), bias=False)
    torch.nn.init.normal_(kv_b.weight, std=rank**-0.5)
    kv_b = kv_b.to(dtype)
    layer = MLAAttention(heads, nope, rope, v, rank, (nope + rope) ** -0.5, kv_b, layer_id=0)
    layer.kv_b = kv_b  # keep it alive
    return layer


def reference(layer, lat, q_nope, q_pe, n):
    """Expanded attention of the last n positions over all of `lat` (float64)."""
    h, nope, v, rank = layer.num_heads, layer.qk_nope_head_dim, layer.v_head_dim, layer.kv_lora_rank
    w = layer.kv_b_weight.double().view(h, nope + v, rank)
    c, pe = lat[:, :rank].double(), lat[:, rank:].double()
    L = lat.shape[0]
    k = torch.cat((torch.einsum("hdr,lr->lhd", w[:, :nope], c), pe[:, None].expand(L, h, -1)), -1)
    vv = torch.einsum("hdr,lr->lhd", w[:, nope:], c)
    q = torch.cat((q_nope, q_pe), -1).double()
    s = torch.einsum("nhd,lhd->hnl", q, k) * layer.scale
    s.masked_fill_(torch.arange(L)[None, :] > torch.arange(L - n, L)[:, None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), vv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("impl_name", [*(f"cpu-{v}" for v in KERNEL_VARIANTS), "torch_expand", "torch_absorb"])
def test_kernels_match_reference_on_a_mixed_batch_over_a_nan_pool(impl_name, shape, dtype, monkeypatch, request):
    from atom_attention import cpu_kernels
    from atom_attention.mla.paged import CpuMLAAttention, TorchMLAAttention

    if impl_name.startswith("cpu-"):  # the C++ kernel, in each variant this host runs
        ops = require_kernel(cpu_kernels.load(built_variant(request, impl_name.removeprefix("cpu-"))))
        monkeypatch.setattr(cpu_kernels, "load", lambda variant=None: ops)
        impl = CpuMLAAttention()
    else:
        impl = TorchMLAAttention()
        impl.prefill = impl_name.removeprefix("torch_")
    layer = make_layer(SHAPES[shape], dtype)
    heads, nope, rope, _, rank = SHAPES[shape]
    # Six decode rows (the torch path chunks them), a short chunk, a long chunk over a
    # cached prefix, a fresh prompt.
    ctx = [1, 17, 40, 5, 33, 16, 23, 50, 12]
    q_lens = [1, 1, 1, 1, 1, 1, 3, 20, 12]
    num_blocks = 40
    rng = np.random.default_rng(0)
    free = list(rng.permutation(num_blocks))
    tables = [[int(free.pop()) for _ in range(-(-c // BS))] for c in ctx]
    pool = torch.full((num_blocks + 1, BS, rank + rope), float("nan"), dtype=dtype)
    pool[num_blocks].zero_()
    layer.kv_cache, layer.impl = pool, impl
    lats, new = [], []
    for c, n, table in zip(ctx, q_lens, tables):
        lat = torch.randn(c, rank + rope).to(dtype)
        for pos in range(c - n):  # the cached prefix is in the pool already
            if pos % BS == 0 and not impl_name.startswith("cpu-"):
                pool[table[pos // BS]] = 0.0  # as the torch path clears a block on its first token
            pool[table[pos // BS], pos % BS] = lat[pos]
        lats.append(lat)
        new.append(lat[c - n :])
    new = torch.cat(new)
    total = sum(q_lens)
    q_nope, q_pe = torch.randn(total, heads, nope).to(dtype), torch.randn(total, heads, rope).to(dtype)
    batch = SimpleNamespace(
        num_scheduled_tokens=q_lens,
        context_lens=ctx,
        block_tables=tables,
        num_cached_tokens=[0] * len(ctx),
        pad_block=None,
        left_pad_blocks=None,
        tkvs=None,
    )
    meta = AttentionMetadataBuilder(builder_context(None, dtype, BS), []).build(batch)
    impl.prepare(meta, BS, num_blocks)
    with torch.no_grad():
        out = impl.forward(layer, q_nope, q_pe, new[:, :rank].contiguous(), new[:, rank:].contiguous(), meta)
    assert out.dtype == dtype and torch.isfinite(out).all()
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.02, rtol=0.02)
    start = 0
    for lat, n in zip(lats, q_lens):
        ref = reference(layer, lat, q_nope[start : start + n], q_pe[start : start + n], n)
        torch.testing.assert_close(out[start : start + n].double(), ref, **tol)
        start += n


# -- absorbed vs expanded through the whole model --------------------------------------


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek_v3")
    return folder, build_tiny_model("deepseek_v3", folder)


def _logits(folder, monkeypatch, impl_cls, prefill):
    from atom_attention.mla.builder import MLAMetadataBuilder

    monkeypatch.setattr(MLAMetadataBuilder, "impl_cls", impl_cls)
    monkeypatch.setattr(impl_cls, "prefill", prefill)
    engine = LLMEngine(folder, dtype="float32", num_kvcache_blocks=32, max_model_len=256, enable_prefix_caching=True)
    base = random_prompts([40], seed=9)[0]
    prompts = random_prompts((3, 30, 57), seed=10) + [base + [1, 2], base + [5]]  # the last one hits the prefix cache
    _, logits = run_with_logits(engine, prompts[:4], max_tokens=6)
    _, more = run_with_logits(engine, prompts[4:], max_tokens=6)
    return torch.cat(logits + more)


def test_absorbed_and_expanded_paths_give_the_same_logits(tiny_v3, monkeypatch):
    from atom_attention import cpu_kernels
    from atom_attention.mla.paged import CpuMLAAttention, TorchMLAAttention

    folder, _ = tiny_v3
    expanded = _logits(folder, monkeypatch, TorchMLAAttention, "expand")
    absorbed = _logits(folder, monkeypatch, TorchMLAAttention, "absorb")
    torch.testing.assert_close(absorbed, expanded, atol=2e-5, rtol=0)
    if cpu_kernels.load() is not None:
        kernel = _logits(folder, monkeypatch, CpuMLAAttention, "expand")
        torch.testing.assert_close(kernel, expanded, atol=2e-5, rtol=0)
