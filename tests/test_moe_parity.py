"""Qwen3-MoE (with dense layers) and Mixtral under every scheduling policy: chunked prompts,
prefix caching and preemption, float32 greedy tokens and logits against transformers.

Batches of mixed lengths, prefix caching, preemption, the portable torch path and bfloat16
run for these archs in test_model_parity.py (they are in model_utils.ARCHS); this file adds
the policy matrix of test_policy_parity.py and checks the models really are what the
parity is about (sparse and dense layers where transformers puts them).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import test_policy_parity as policy_parity  # noqa: E402
from model_utils import tiny_models  # noqa: E402

from atom_core.engine.llm_engine import LLMEngine  # noqa: E402

MOE_ARCHS = ["qwen3_moe", "mixtral"]


tiny = tiny_models(*MOE_ARCHS)


@pytest.mark.parametrize("policy", policy_parity.POLICIES)
def test_chunked_prompts_with_prefix_caching_match_transformers(tiny, policy):
    policy_parity.test_chunked_prompts_with_prefix_caching_match_transformers(tiny, policy)


@pytest.mark.parametrize("policy", policy_parity.POLICIES)
def test_preemption_with_chunked_prompts_matches_transformers(tiny, policy):
    policy_parity.test_preemption_with_chunked_prompts_matches_transformers(tiny, policy)


def test_sparse_and_dense_layers_sit_where_transformers_puts_them(tiny, monkeypatch):
    from atom_core.layers import FusedMoE
    from atom_models.sparse_moe import SparseMoeBlock

    # keep the stacked weights as loaded (the kernels take them in panels or one expert at a time)
    monkeypatch.setattr(FusedMoE, "process_weights_after_loading", lambda self: None)
    folder, hf = tiny
    engine = LLMEngine(folder, dtype="float32", num_kvcache_blocks=8, max_model_len=64)
    ours = [isinstance(layer.mlp, SparseMoeBlock) for layer in engine.runner.model.model.layers]
    theirs = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    assert ours == theirs and any(ours)
    assert all(ours) == (hf.config.model_type == "mixtral")  # Qwen3-MoE's layer 1 is dense (mlp_only_layers)
    for layer, hf_layer in zip(engine.runner.model.model.layers, hf.model.layers):
        if isinstance(layer.mlp, SparseMoeBlock):  # stacked weights equal transformers' fused ones
            experts: FusedMoE = layer.mlp.experts
            torch.testing.assert_close(experts.w13, hf_layer.mlp.experts.gate_up_proj, rtol=0, atol=0)
            torch.testing.assert_close(experts.w2, hf_layer.mlp.experts.down_proj, rtol=0, atol=0)


def windows(model) -> list:
    return [m.sliding_window for m in model.modules() if hasattr(m, "sliding_window")]


def test_mixtral_takes_its_sliding_window_on_every_layer():
    import transformers

    from atom_models.mixtral import MixtralForCausalLM

    shapes = dict(vocab_size=16, hidden_size=8, intermediate_size=4, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, num_local_experts=2)  # fmt: skip
    assert windows(MixtralForCausalLM(transformers.MixtralConfig(**shapes, sliding_window=64))) == [64, 64]
    assert windows(MixtralForCausalLM(transformers.MixtralConfig(**shapes, sliding_window=None))) == [None, None]


@pytest.mark.parametrize("arch", ["Qwen3", "Qwen3Moe"])
def test_qwen3_slides_the_layers_its_config_says(arch):
    """Qwen3's window applies when use_sliding_window is on, on the layers `layer_types` marks."""
    import transformers

    import atom_models.qwen3  # noqa: F401
    import atom_models.qwen3_moe  # noqa: F401
    from atom_core.plugins.manager import get_registry

    model_cls = get_registry("models").get(f"{arch}ForCausalLM")
    shapes = dict(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=4,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        sliding_window=16,
    )
    if arch == "Qwen3Moe":
        shapes.update(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=4)
    config_cls = getattr(transformers, f"{arch}Config")
    sliding = config_cls(**shapes, use_sliding_window=True, max_window_layers=0)
    types = getattr(sliding, "layer_types", None) or ["sliding_attention"] * 2  # Qwen3-MoE: every layer
    assert windows(model_cls(sliding)) == [16 if t == "sliding_attention" else None for t in types]
    assert windows(model_cls(config_cls(**shapes, use_sliding_window=False))) == [None, None]
    if arch == "Qwen3":  # layers up to max_window_layers attend fully
        full = config_cls(**shapes, use_sliding_window=True, max_window_layers=2)
        assert windows(model_cls(full)) == [None, None]


def test_gpt_oss_mxfp4_experts_dequantize_as_transformers_does(tmp_path):
    """Released GPT-OSS checkpoints store experts as MXFP4 blocks and E8M0 scales: Atom
    dequantizes them at load to exactly what transformers' own conversion gives, then
    de-interleaves gate and up into its stacked experts."""
    from model_utils import build_tiny_model
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from atom_core import SamplingParams
    from atom_core.engine.llm_engine import LLMEngine
    from atom_models.gpt_oss import dequantize_mxfp4

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 130, (3, 8, 2), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [experts, in, out]
    assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(1, 2), want)

    folder = tmp_path / "gpt_oss"
    build_tiny_model("gpt_oss", folder, hidden_size=64, intermediate_size=32, num_local_experts=4)
    [path] = list(folder.glob("*.safetensors"))
    tensors = load_file(path)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    e, h, two_i = tensors[name].shape
    packed_blocks = torch.randint(0, 256, (e, two_i, h // 32, 16), generator=g, dtype=torch.uint8)
    packed_scales = torch.randint(122, 128, (e, two_i, h // 32), generator=g, dtype=torch.uint8)
    del tensors[name]
    tensors[name + "_blocks"], tensors[name + "_scales"] = packed_blocks, packed_scales
    save_file(tensors, str(path), metadata={"format": "pt"})
    engine = LLMEngine(folder, dtype="float32", num_kvcache_blocks=16, max_model_len=64)
    w13 = engine.runner.model.model.layers[0].mlp.experts.w13  # biased experts keep their stacks
    dense = convert_moe_packed_tensors(packed_blocks, packed_scales, dtype=torch.float32)  # [e, H, 2I], interleaved
    for x in range(e):
        assert torch.equal(w13[x, : two_i // 2], dense[x][:, 0::2].T)
        assert torch.equal(w13[x, two_i // 2 :], dense[x][:, 1::2].T)
    out = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0]["token_ids"]) == 4


def mxfp4_gpt_oss(folder, seed: int = 0, **overrides) -> None:
    """A tiny GPT-OSS whose every expert tensor is stored as MXFP4 blocks and E8M0 scales, as
    released checkpoints are."""
    from model_utils import build_tiny_model
    from safetensors.torch import load_file, save_file

    build_tiny_model("gpt_oss", folder, hidden_size=64, num_local_experts=4, **overrides)
    [path] = list(folder.glob("*.safetensors"))
    tensors = load_file(path)
    g = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, n = tensors.pop(name).shape  # input-major: [experts, in, out]
        tensors[name + "_blocks"] = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.uint8)
        tensors[name + "_scales"] = torch.randint(122, 128, (e, n, k // 32), generator=g, dtype=torch.uint8)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_gpt_oss_mxfp4_experts_run_exactly_as_8_bit_groups(tmp_path, caplog):
    """Under quantization="auto" the MXFP4 experts are kept, exactly, as 8-bit groups of 32 (the
    codes doubled, the scales halved) and give the logits of the dequantized experts ("none")."""
    from conftest import require_kernel
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from atom_core import SamplingParams
    from atom_core.engine.llm_engine import LLMEngine
    from atom_core.layers import FusedMoE
    from atom_core.layers.gemm import gemv_ops
    from atom_core.layers.quantized_gemm import StreamingGroupGemm
    from atom_models.gpt_oss import mxfp4_as_int8_groups

    require_kernel(gemv_ops())
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (2, 5, 3, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 140, (2, 5, 3), generator=g, dtype=torch.uint8)
    q, s = mxfp4_as_int8_groups(blocks, scales)
    assert q.dtype == torch.int8 and q.shape == (2, 5, 96) and s.shape == (2, 5, 3)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # transformers' own: [experts, in, out]
    assert torch.equal((q.float().unflatten(-1, (3, 32)) * s.unsqueeze(-1)).flatten(-2).transpose(1, 2), want)

    mxfp4_gpt_oss(tmp_path, intermediate_size=64)
    kw = dict(dtype="float32", num_kvcache_blocks=16, max_model_len=64)
    prompts, params = [[1, 2, 3, 4, 5], list(range(7, 40))], SamplingParams(temperature=0, max_tokens=1)
    logits = {}
    for mode in ("auto", "none"):
        caplog.clear()
        with caplog.at_level("INFO", logger="atom"):
            engine = LLMEngine(tmp_path, quantization=mode, **kw)
        moes = [m for m in engine.runner.model.modules() if isinstance(m, FusedMoE)]
        if mode == "auto":
            kernels = [k for m in moes for pair in m.expert_gemms for _, k in pair]
            assert len(kernels) == 2 * 4 * 2 and all(isinstance(k, StreamingGroupGemm) and k.bits == 8 for k in kernels)
            assert "as the checkpoint quantized them (MXFP4), exactly" in caplog.text
            assert "dequantized" not in caplog.text
        else:
            assert all(m.expert_gemms is None and m.w13 is not None for m in moes)
            assert "dequantized 4 MXFP4 expert tensors" in caplog.text
        engine.generate(prompts, params, use_tqdm=False)
        logits[mode] = engine.runner.last_logits.clone()
    # The same weights; the kernel rounds activations per group of 32 to int16 (StreamingGroupGemm),
    # which moved these logits by up to 0.1% of their scale: the bound GGUF's Q8_0 files are held to.
    out, ref = logits["auto"], logits["none"]
    scale = ref.abs().amax(dim=1, keepdim=True)
    assert ((out - ref).abs() <= 4 * 2.0**-8 * scale).all(), ((out - ref).abs() / scale).max()
    assert torch.equal(out.argmax(1), ref.argmax(1))
