"""Tiny random-weight checkpoints built with transformers, the numerical oracle for Atom's models."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest
import torch

from atom_core import SamplingParams

# bf16_routing_flips: top-k routing is discrete, so bf16 rounding can flip a near-tied expert
# and move the logits by up to 0.35, in transformers' own bf16 model as much as in Atom's, and
# not at the same tokens. A bf16 logits row then passes when it is close to transformers'
# float32 or bfloat16 model (`half_references`, `assert_half_close`).
DEEPSEEK_SHAPES = dict(
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)

QWEN3_5_SHAPES = dict(
    num_hidden_layers=4,
    full_attention_interval=4,  # layer_types derived: 3 linear : 1 full
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-5,
    rope_parameters=dict(
        rope_type="default",
        rope_theta=5000.0,
        partial_rotary_factor=0.5,
        mrope_section=[2, 1, 1],
        mrope_interleaved=True,
    ),
)

GLM_SHAPES = dict(
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, pad_token_id=0, eos_token_id=2
)

ARCHS = {
    "llama": dict(
        cls="LlamaForCausalLM",
        config="LlamaConfig",
        kwargs=dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    ),
    "llama_tied_rope3": dict(
        cls="LlamaForCausalLM",
        config="LlamaConfig",
        kwargs=dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=50000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "mistral": dict(  # a window shorter than the prompts: it binds, in prefill, decode and across chunks
        cls="MistralForCausalLM",
        config="MistralConfig",
        kwargs=dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=24, tie_word_embeddings=False),
    ),
    "qwen2": dict(  # q/k/v biases; layer 0 attends fully, layer 1 slides (max_window_layers=1)
        cls="Qwen2ForCausalLM",
        config="Qwen2Config",
        kwargs=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=20,
            max_window_layers=1,
            tie_word_embeddings=True,
        ),
    ),
    "gemma2": dict(  # soft-capped attention and logits; sliding and full layers alternate; GeGLU
        cls="Gemma2ForCausalLM",
        config="Gemma2Config",
        kwargs=dict(
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=24
        ),  # fmt: skip
    ),
    "gemma3": dict(  # per-head q/k norms; each layer type ropes with its own base
        cls="Gemma3ForCausalLM",
        config="Gemma3TextConfig",
        kwargs=dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=24,
            layer_types=["sliding_attention", "full_attention"],
        ),  # fmt: skip
    ),
    "phi3": dict(  # fused qkv / gate_up on disk, half the head rotated, LongRoPE within its original context
        cls="Phi3ForCausalLM",
        config="Phi3Config",
        kwargs=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=24,
            original_max_position_embeddings=256,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                partial_rotary_factor=0.5,
                short_factor=[1.0 + 0.25 * i for i in range(4)],
                long_factor=[2.0 + i for i in range(4)],
            ),
            tie_word_embeddings=False,
            pad_token_id=0,
            eos_token_id=2,
            bos_token_id=1,
        ),
    ),
    "gpt_oss": dict(  # sinks, sliding (24) and full layers, q/k/v/o biases, YaRN; biased experts, clamped SwiGLU
        cls="GptOssForCausalLM",
        config="GptOssConfig",
        kwargs=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=24,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            swiglu_limit=2.0,
            tie_word_embeddings=False,
        ),  # fmt: skip
        bf16_routing_flips=True,
    ),
    "glm": dict(  # rope over interleaved pairs on half of each head, q/k/v biases, gate/up fused on disk
        cls="GlmForCausalLM", config="GlmConfig", kwargs=GLM_SHAPES
    ),
    "glm4": dict(  # as GLM, with a norm after attention and after the MLP
        cls="Glm4ForCausalLM", config="Glm4Config", kwargs=GLM_SHAPES
    ),
    "glm4_moe": dict(  # q/k/v biases, half the head rotated, per-head q/k norms; DeepSeek-V3's router
        cls="Glm4MoeForCausalLM",
        config="Glm4MoeConfig",
        kwargs=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
            use_qk_norm=True,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.0,
            tie_word_embeddings=False,
        ),  # fmt: skip
        bf16_routing_flips=True,
    ),
    "minimax_m2": dict(  # q/k norms over the whole projection, half the head rotated, sigmoid router with a bias
        cls="MiniMaxM2ForCausalLM",
        config="MiniMaxM2Config",
        kwargs=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        ),  # fmt: skip
        bf16_routing_flips=True,
    ),
    "smollm3": dict(  # NoPE: layer 1 of 2 has no rope (no_rope_layers)
        cls="SmolLM3ForCausalLM",
        config="SmolLM3Config",
        kwargs=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            no_rope_layers=[1, 0],
            tie_word_embeddings=True,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),  # fmt: skip
    ),
    "qwen3": dict(
        cls="Qwen3ForCausalLM",
        config="Qwen3Config",
        kwargs=dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    ),
    "qwen3_moe": dict(  # layer 1 is dense through mlp_only_layers; norm_topk_prob off (its default)
        cls="Qwen3MoeForCausalLM",
        config="Qwen3MoeConfig",
        kwargs=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
        bf16_routing_flips=True,
    ),
    "qwen3_moe_step2": dict(  # decoder_sparse_step=2: only layer 1 is sparse; weights renormalised
        cls="Qwen3MoeForCausalLM",
        config="Qwen3MoeConfig",
        kwargs=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            decoder_sparse_step=2,
            norm_topk_prob=True,
            tie_word_embeddings=True,
        ),
        bf16_routing_flips=True,
    ),
    "mixtral": dict(
        cls="MixtralForCausalLM",
        config="MixtralConfig",
        kwargs=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        ),
        bf16_routing_flips=True,
    ),
    # Qwen3-Next (tests/test_qwen3_next_parity.py): layers 0-2 Gated DeltaNet ("gdn" builder), layer 3
    # gated full attention with partial rope; layer 1 dense (mlp_only_layers), the others routed + shared expert.
    "qwen3_next": dict(
        cls="Qwen3NextForCausalLM",
        config="Qwen3NextConfig",
        attention="gdn",
        kwargs=dict(
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            partial_rotary_factor=0.5,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
        bf16_routing_flips=True,
    ),
    # Qwen3.5 text models (tests/test_qwen3_5_parity.py): layers 0-2 Gated DeltaNet with flat in_proj_qkv/z/b/a,
    # layer 3 gated full attention; rope_parameters as the real configs write them (interleaved M-RoPE sections,
    # plain rope for text-only positions). Dense MLPs, or routed + shared expert on every layer.
    "qwen3_5": dict(
        cls="Qwen3_5ForCausalLM",
        config="Qwen3_5TextConfig",
        attention="gdn",
        kwargs=dict(QWEN3_5_SHAPES, intermediate_size=96, tie_word_embeddings=False),
    ),
    "qwen3_5_moe": dict(
        cls="Qwen3_5MoeForCausalLM",
        config="Qwen3_5MoeTextConfig",
        attention="gdn",
        kwargs=dict(
            QWEN3_5_SHAPES,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            tie_word_embeddings=False,
        ),
        bf16_routing_flips=True,
    ),
    # DeepSeek (attention="mla": tests/test_deepseek_parity.py runs them, on the latent pool).
    # Layer 0 dense (first_k_dense_replace=1), layers 1-2 routed + shared experts.
    "deepseek_v2_greedy": dict(
        cls="DeepseekV2ForCausalLM",
        config="DeepseekV2Config",
        attention="mla",
        kwargs=dict(DEEPSEEK_SHAPES, q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.5),
        bf16_routing_flips=True,
    ),
    "deepseek_v2_group": dict(
        cls="DeepseekV2ForCausalLM",
        config="DeepseekV2Config",
        attention="mla",
        kwargs=dict(
            DEEPSEEK_SHAPES,
            q_lora_rank=48,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            n_shared_experts=2,
            routed_scaling_factor=0.8,
            rope_parameters=dict(rope_type="default", rope_theta=5000.0),
        ),
        bf16_routing_flips=True,
    ),
    "deepseek_v3": dict(
        cls="DeepseekV3ForCausalLM",
        config="DeepseekV3Config",
        attention="mla",
        kwargs=dict(DEEPSEEK_SHAPES, q_lora_rank=48, n_group=4, topk_group=2, routed_scaling_factor=2.5),
        bf16_routing_flips=True,
    ),
    "deepseek_v3_yarn": dict(  # mscale != mscale_all_dim: cos/sin scaled and the softmax scale too
        cls="DeepseekV3ForCausalLM",
        config="DeepseekV3Config",
        attention="mla",
        kwargs=dict(
            DEEPSEEK_SHAPES,
            q_lora_rank=48,
            n_group=2,
            topk_group=1,
            norm_topk_prob=False,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=64,
                mscale=0.9,
                mscale_all_dim=0.7,
                beta_fast=32,
                beta_slow=1,
            ),
        ),
        bf16_routing_flips=True,
    ),
}


NEW_TOKENS = 24


def build_tiny_model(name: str, folder: Path, seed: int = 0, **overrides):
    """Save a 2-layer random model under `folder`; returns the transformers model (float32, eager).

    `overrides` replace config values of the arch (`num_hidden_layers=8`, say)."""
    import transformers

    spec = ARCHS[name]
    torch.manual_seed(seed)
    defaults = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        attn_implementation="eager",
    )
    # an arch may override a default, a caller the arch
    config = getattr(transformers, spec["config"])(**{**defaults, **spec["kwargs"], **overrides})
    model = getattr(transformers, spec["cls"])(config).eval()
    with torch.no_grad():  # random init leaves norms at 1: give the oracle something to check
        for p in model.parameters():
            if p.float().std() == 0 or p.numel() == 1:
                p.add_(torch.randn_like(p) * 0.1)
        saved = model.state_dict()
        for name, b in model.named_buffers():  # saved constant buffers too (DeepSeek-V3's e_score_correction_bias)
            if name in saved and b.is_floating_point() and b.float().std() == 0:
                b.add_(torch.randn_like(b) * 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return model


GDN_ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")  # the hybrids with Gated DeltaNet layers


def tiny_models(*archs: str):
    """A module-scoped fixture, parametrised over `archs`: (folder, transformers model) of
    each tiny random checkpoint, built once per test module."""

    @pytest.fixture(scope="module", params=list(archs))
    def tiny(request, tmp_path_factory):
        folder = tmp_path_factory.mktemp(request.param)
        return folder, build_tiny_model(request.param, folder)

    return tiny


def transformers_from_gguf(gguf_file: Path):
    """transformers' own GGUF loading of `gguf_file`, dequantized to float32: the real-model
    tests' oracle. That load takes half a minute on a slow host (tokenizer and tensors converted
    in Python), so its result is kept under the test cache (safetensors and config, keyed by the
    file and the versions) and later loads, in this run and the next, read that copy."""
    import transformers
    from gguf_convert import cache_dir, fill_atomically
    from safetensors.torch import save_model

    st = gguf_file.stat()
    key = f"{gguf_file.resolve()}:{st.st_size}:{st.st_mtime_ns}:{transformers.__version__}:{torch.__version__}"
    folder = cache_dir() / "transformers-from-gguf" / f"{gguf_file.stem}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    if (folder / "model.safetensors").is_file():
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()

    def save(into: Path) -> None:
        # save_pretrained refuses a model loaded from GGUF; its weights are plain float32 tensors
        into.mkdir()
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (into / "config.json").write_text(json.dumps(config, indent=1))
        save_model(model, str(into / "model.safetensors"))  # a tied LM head once

    fill_atomically(folder, save)
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),  # else a token equal to pad_token_id is masked out
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def cached_greedy(model, default_new: int):
    """`hf_greedy` for `model`, each (prompt, length) computed once: a parity test's oracle."""
    cache = {}

    def greedy(prompt, n=default_new):
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = hf_greedy(model, prompt, n)
        return cache[key]

    return greedy


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits at every position of `tokens` (teacher forcing)."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def random_prompts(lengths, seed=1, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def shared_prefix_waves(lengths) -> tuple[list[list[int]], list[list[int]]]:
    """Two waves of prompts for prefix-caching tests: `lengths` of unrelated ones plus one of
    a 160-token base, then three that share 100, 64 and all 160 of its tokens with it."""
    prompts = random_prompts(lengths, seed=4)
    base = random_prompts([160], seed=5)[0]
    tails = random_prompts([3, 30, 1], seed=6)
    shared = [base + tails[0], base[:100] + tails[1], base[:64] + tails[2]]
    return prompts + shared[:1], shared[1:] + [list(base)]


def second_wave_cached_tokens(policy: str) -> list[int]:
    """`num_cached_tokens` of the second wave, blocks of 16: what each skipped. spyre recomputes
    the chunk holding the cache boundary and always the last chunk, so it skips less."""
    return [96, 32, 112] if policy == "spyre" else [96, 64, 144]


def run_with_logits(engine, prompts, max_tokens: int | list[int] = NEW_TOKENS):
    """Step the engine by hand, keeping every request's logits at every step (greedy, EOS
    ignored; `max_tokens` for all prompts, or one per prompt)."""
    counts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    ids = [
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        for p, n in zip(prompts, counts)
    ]
    logits = {i: [] for i in ids}
    results = {}
    while engine.has_unfinished_requests():
        for r in engine.step():
            results[r["request_id"]] = r
        for rid, row in zip(engine.runner.last_req_ids, engine.runner.last_logits):
            logits[rid].append(row.clone())
    return [results[i] for i in ids], [torch.stack(logits[i]) for i in ids]


def half_references(name: str, model, dtype: torch.dtype = torch.bfloat16) -> list:
    """The transformers models whose logits a 16-bit Atom run may match (see `bf16_routing_flips`)."""
    if ARCHS[name].get("bf16_routing_flips"):
        return [model, copy.deepcopy(model).to(dtype)]
    return [model]


def assert_half_close(steps: torch.Tensor, tokens: list[int], first: int, references: list) -> None:
    """Each row of `steps` (logits at positions first.. of `tokens`) close to some reference's row."""
    refs = [hf_logits(m, tokens)[first:] for m in references]
    assert all(steps.shape == r.shape for r in refs)
    for i, row in enumerate(steps):
        errors = []
        for ref in refs:
            try:
                torch.testing.assert_close(row, ref[i], atol=0.1, rtol=0.05)
                break
            except AssertionError as e:
                errors.append(f"row {i}: {e}")
        else:
            raise AssertionError("\n".join(errors))


def check_against_hf(model, prompts, results, logits):
    for prompt, result, steps in zip(prompts, results, logits):
        expected = hf_greedy(model, prompt, len(result["token_ids"]))
        assert result["token_ids"] == expected, f"prompt of {len(prompt)} tokens"
        # Teacher-forced: the logits that produced each generated token.
        ref = hf_logits(model, prompt + result["token_ids"][:-1])[len(prompt) - 1 :]
        assert steps.shape == ref.shape
        torch.testing.assert_close(steps, ref, atol=1e-4, rtol=0)


def make_gdn_engine(folder, **config):
    """An engine on a GDN hybrid whose state pools and KV slots start as NaN: stale state is
    what a reused group holds, and nothing may rely on a clean pool."""
    from atom_core.engine.llm_engine import LLMEngine

    config.setdefault("num_kvcache_blocks", 96)
    config.setdefault("max_model_len", 512)
    config.setdefault("dtype", "float32")
    engine = LLMEngine(folder, **config)
    for t in engine.runner.per_req_cache_tensors.values():
        t.fill_(float("nan"))
    # The null block past the pool stays zero.
    engine.runner.kv_cache_tensors["kv_cache"][:, :, :, : config["num_kvcache_blocks"]].fill_(float("nan"))
    return engine


# -- draft checkpoints for speculative decoding (tests/test_draft_proposers.py) ----------


def _random(shape, g: torch.Generator, norm: bool = False) -> torch.Tensor:
    t = torch.randn(shape, generator=g) * 0.1
    return t + 1 if norm else t


def add_mtp_layer(folder: Path, name: str = "deepseek_v3", seed: int = 1):
    """Give the tiny DeepSeek checkpoint in `folder` a random MTP layer at index `num_hidden_layers`.

    transformers builds no MTP weights, and ignores them when loading. The decoder layer's
    tensors (hub names, experts one by one) come from a transformers model one layer deeper;
    enorm, hnorm, eh_proj and shared_head are random, embed_tokens a copy of the target's
    (as DeepSeek-V3 ships it). Sets `num_nextn_predict_layers=1`. Returns that deeper model's
    layer (a transformers module holding the same weights, for reference computations).
    """
    import json
    import tempfile

    from safetensors.torch import load_file, save_file

    cfg = json.loads((folder / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    prefix = f"model.layers.{n}."
    with tempfile.TemporaryDirectory() as tmp:
        deeper = build_tiny_model(name, Path(tmp), seed=seed, num_hidden_layers=n + 1)
        donor = load_file(Path(tmp) / "model.safetensors")
    tensors = load_file(folder / "model.safetensors")
    tensors.update({k: v for k, v in donor.items() if k.startswith(prefix)})
    g = torch.Generator().manual_seed(seed)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    extra = {
        "enorm.weight": _random(h, g, norm=True),
        "hnorm.weight": _random(h, g, norm=True),
        "eh_proj.weight": _random((h, 2 * h), g),
        "shared_head.norm.weight": _random(h, g, norm=True),
        "shared_head.head.weight": _random((v, h), g),
        "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
    }
    tensors.update({prefix + k: t for k, t in extra.items()})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return deeper.model.layers[n]


def add_next_mtp_layer(folder: Path, name: str = "qwen3_next", seed: int = 1) -> None:
    """Give the tiny Qwen3-Next (or Qwen3.5) checkpoint in `folder` an MTP layer, as the hub's
    checkpoints ship it (`mtp.*`, which transformers drops): one full-attention decoder layer
    taken from a transformers model one layer deeper (renamed `mtp.layers.0.*`), and random
    `fc`, `pre_fc_norm_embedding`, `pre_fc_norm_hidden` and `norm`."""
    import json
    import tempfile

    from safetensors.torch import load_file, save_file

    cfg = json.loads((folder / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ARCHS[name]["kwargs"].get("layer_types")
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_model(name, Path(tmp), seed=seed, num_hidden_layers=n + 1, layer_types=types + ["full_attention"])
        donor = load_file(Path(tmp) / "model.safetensors")
    prefix = f"model.layers.{n}."
    tensors = load_file(folder / "model.safetensors")
    tensors.update({"mtp.layers.0." + k[len(prefix) :]: v for k, v in donor.items() if k.startswith(prefix)})
    g = torch.Generator().manual_seed(seed)
    h = cfg["hidden_size"]
    extra = {
        "fc.weight": _random((h, 2 * h), g),
        "pre_fc_norm_embedding.weight": _random(h, g) * 0.1,  # zero-centred: applied as 1 + w
        "pre_fc_norm_hidden.weight": _random(h, g) * 0.1,
        "norm.weight": _random(h, g) * 0.1,
    }
    tensors.update({"mtp." + k: t for k, t in extra.items()})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def build_eagle3_head(
    folder: Path, target_folder: Path, draft_vocab: list[int], aux_layer_ids: list[int] | None = None, seed: int = 2
) -> None:
    """A random EAGLE-3 draft head for the tiny Llama in `target_folder`, in the published layout.

    `draft_vocab` lists the target ids the head predicts (d2t[i] = draft_vocab[i] - i);
    `aux_layer_ids` go to `eagle_config.eagle_aux_hidden_state_layer_ids` (None: the default).
    No `embed_tokens`: the draft shares the target's.
    """
    import json

    from safetensors.torch import save_file

    t = json.loads((target_folder / "config.json").read_text())
    h, v, inter = t["hidden_size"], t["vocab_size"], t["intermediate_size"]
    nq, nkv = t["num_attention_heads"], t["num_key_value_heads"]
    d = h // nq
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": nq,
        "num_key_value_heads": nkv,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": t["rms_norm_eps"],
        "max_position_embeddings": t["max_position_embeddings"],
        "rope_theta": 10000.0,
        "vocab_size": v,
        "draft_vocab_size": len(draft_vocab),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if aux_layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "use_aux_hidden_state": True}
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(draft_vocab, dtype=torch.int64)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    tensors = {
        "fc.weight": _random((h, 3 * h), g),
        "midlayer.input_layernorm.weight": _random(h, g, norm=True),
        "midlayer.hidden_norm.weight": _random(h, g, norm=True),
        "midlayer.self_attn.q_proj.weight": _random((nq * d, 2 * h), g),
        "midlayer.self_attn.k_proj.weight": _random((nkv * d, 2 * h), g),
        "midlayer.self_attn.v_proj.weight": _random((nkv * d, 2 * h), g),
        "midlayer.self_attn.o_proj.weight": _random((h, nq * d), g),
        "midlayer.post_attention_layernorm.weight": _random(h, g, norm=True),
        "midlayer.mlp.gate_proj.weight": _random((inter, h), g),
        "midlayer.mlp.up_proj.weight": _random((inter, h), g),
        "midlayer.mlp.down_proj.weight": _random((h, inter), g),
        "norm.weight": _random(h, g, norm=True),
        "lm_head.weight": _random((len(draft_vocab), h), g),
        "d2t": ids - torch.arange(len(draft_vocab)),
        "t2d": t2d,
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def scale_rows(path: Path, scale: dict[str, tuple[list[int], float]]) -> None:
    """Multiply rows of named tensors in a safetensors file (to make a head favour some tokens)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    for name, (rows, factor) in scale.items():
        tensors[name][rows] *= factor
    save_file(tensors, path, metadata={"format": "pt"})
