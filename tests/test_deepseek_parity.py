"""DeepSeek-V2/V3 on the "mla" latent pool against transformers: float32 greedy tokens token for
token, the logits that produced them close; batches of mixed lengths, prefix caching,
preemption, every scheduling policy with chunked prompts.

Configs (tests/model_utils.py): V2 greedy routing without q_lora, V2 group-limited with
q_lora, V3 (noaux_tc) with the default rope and with yarn + mscale. Unwritten pool slots
hold NaN, so a kernel reading past a request's latents fails here.
"""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")

from conftest import record_preemptions  # noqa: E402
from model_utils import (  # noqa: E402
    ARCHS,
    build_tiny_model,
    hf_greedy,
    hf_logits,
    random_prompts,
    run_with_logits,
    second_wave_cached_tokens,
    shared_prefix_waves,
)

from atom_core import SamplingParams  # noqa: E402
from atom_core.engine.llm_engine import LLMEngine  # noqa: E402

MLA_ARCHS = sorted(n for n, s in ARCHS.items() if s.get("attention") == "mla")
POLICIES = ["prefill_first", "mixed", "spyre"]


class Oracle:
    """transformers' greedy continuations, computed once per prompt (several tests ask for the same)."""

    def __init__(self, model):
        self.model = model
        self.memo: dict[tuple, list[int]] = {}

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        key = tuple(prompt)
        if len(self.memo.get(key, ())) < n:
            self.memo[key] = hf_greedy(self.model, prompt, n)
        return self.memo[key][:n]

    def check(self, prompts, results, logits=None):
        for i, (prompt, result) in enumerate(zip(prompts, results)):
            expected = self.greedy(prompt, len(result["token_ids"]))
            assert result["token_ids"] == expected, f"prompt of {len(prompt)} tokens"
            if logits is not None:  # teacher-forced: the logits that produced each token
                ref = hf_logits(self.model, prompt + result["token_ids"][:-1])[len(prompt) - 1 :]
                torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=0)


@pytest.fixture(scope="module", params=MLA_ARCHS)
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = build_tiny_model(request.param, folder)
    return folder, model, Oracle(model)


def make_engine(folder, num_blocks: int, **config) -> LLMEngine:
    engine = LLMEngine(folder, dtype=config.pop("dtype", "float32"), num_kvcache_blocks=num_blocks, **config)
    # Every block the scheduler may hand out starts as NaN (the block past them is the kernel's own null block).
    engine.runner.kv_cache_tensors["mla_kv_cache"][:, :num_blocks].fill_(float("nan"))
    return engine


def test_batch_of_mixed_lengths_matches_transformers(tiny):
    folder, _, oracle = tiny
    engine = make_engine(folder, 64, max_model_len=256)
    prompts = random_prompts((1, 15, 16, 17, 40))
    results, logits = run_with_logits(engine, prompts, max_tokens=16)
    oracle.check(prompts, results, logits)
    assert engine.scheduler.block_manager.num_free_blocks == 64


def test_portable_torch_path_matches_transformers(tiny, monkeypatch):
    """Every C++ and oneDNN kernel off (the path other devices take); more than four decode
    rows, so decode runs chunked over the latent blocks."""
    from atom_attention.mla.builder import MLAMetadataBuilder
    from atom_attention.mla.paged import TorchMLAAttention
    from atom_core.layers import ops

    monkeypatch.setattr(MLAMetadataBuilder, "impl_cls", TorchMLAAttention)
    monkeypatch.setattr(ops, "_native", lambda x: None)
    monkeypatch.setenv("ATOM_DISABLE_ONEDNN", "1")
    folder, _, oracle = tiny
    engine = make_engine(folder, 64, max_model_len=256)
    assert all(type(m.impl) is TorchMLAAttention for m in engine.runner.attn_layers)
    prompts = random_prompts((1, 15, 16, 17, 40, 3, 60, 33))
    results, logits = run_with_logits(engine, prompts, max_tokens=12)
    oracle.check(prompts, results, logits)


def test_preemption_mid_generation_matches_transformers(tiny):
    folder, _, oracle = tiny
    engine = make_engine(folder, 8, max_model_len=128)
    preempted = record_preemptions(engine.scheduler)
    prompts = random_prompts((1, 15, 16, 17, 40))
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), False)
    assert len(preempted) >= 2
    oracle.check(prompts, results)
    assert engine.scheduler.block_manager.num_free_blocks == 8


@pytest.mark.parametrize("policy", POLICIES)
def test_chunked_prompts_with_prefix_caching_under_every_policy(tiny, policy):
    folder, _, oracle = tiny
    engine = make_engine(
        folder,
        96,
        max_model_len=512,
        enable_prefix_caching=True,
        max_num_batched_tokens=48,
        prefill_chunk_size=48,
        scheduling_policy=policy,
    )
    first, second = shared_prefix_waves((1, 16, 17, 49, 100, 300))
    r1, l1 = run_with_logits(engine, first, max_tokens=8)
    r2, l2 = run_with_logits(engine, second, max_tokens=8)  # hits on the first wave
    oracle.check(first + second, r1 + r2, l1 + l2)
    assert [r["num_cached_tokens"] for r in r2] == second_wave_cached_tokens(policy)
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("policy", POLICIES)
def test_preemption_with_chunked_prompts_under_every_policy(tiny, policy):
    folder, _, oracle = tiny
    engine = make_engine(
        folder,
        12,
        max_num_seqs=6,
        max_model_len=160,
        max_num_batched_tokens=48,
        prefill_chunk_size=48,
        scheduling_policy=policy,
    )
    preempted = record_preemptions(engine.scheduler)
    prompts = random_prompts((20, 120, 5, 60, 33, 90), seed=7)
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert len(preempted) >= 1
    oracle.check(prompts, results)
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_logits_stay_close(tiny, dtype, tmp_path, monkeypatch):
    """The MLA path in bf16 (or float16) against transformers in the same dtype, all layers
    dense: top-k routing flips near-tied experts under bf16 rounding (0.3-0.6 logit jumps in
    transformers' own bf16 vs float32), which would measure the router's luck, not the attention."""
    folder, model, _ = tiny
    name = next(n for n in MLA_ARCHS if folder.name.startswith(n))
    spec = ARCHS[name]
    monkeypatch.setitem(ARCHS, "dense", {**spec, "kwargs": {**spec["kwargs"], "first_k_dense_replace": 3}})
    reference = build_tiny_model("dense", tmp_path).to(getattr(torch, dtype))
    engine = make_engine(tmp_path, 64, max_model_len=256, dtype=dtype)
    assert engine.runner.kv_cache_tensors["mla_kv_cache"].dtype == getattr(torch, dtype)
    prompts = random_prompts((1, 17, 40))
    results, logits = run_with_logits(engine, prompts, max_tokens=4)
    for prompt, result, steps in zip(prompts, results, logits):
        ref = hf_logits(reference, prompt + result["token_ids"][:-1])[len(prompt) - 1 :]
        torch.testing.assert_close(steps, ref, atol=0.1, rtol=0.05)


def test_mtp_layer_in_the_checkpoint_is_skipped(tiny, tmp_path):
    """A checkpoint's multi-token-prediction layer (index num_hidden_layers) is not the target's:
    its tensors are left unread, whatever their shapes (V3 checkpoints carry one; V2 loads the same way)."""
    from safetensors.torch import save_file

    folder, model, oracle = tiny
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    n = model.config.num_hidden_layers
    save_file(
        {
            f"model.layers.{n}.eh_proj.weight": torch.zeros(64, 128),
            f"model.layers.{n}.self_attn.kv_b_proj.weight": torch.zeros(8, 8),
        },
        str(tmp_path / "model-mtp.safetensors"),
    )
    engine = make_engine(tmp_path, 64, max_model_len=256)
    prompts = random_prompts((5, 33))
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    oracle.check(prompts, results)


def test_moe_layers_follow_first_k_dense_replace_and_moe_layer_freq():
    from types import SimpleNamespace

    from atom_models.deepseek_v2 import is_moe_layer

    cfg = SimpleNamespace(n_routed_experts=8, first_k_dense_replace=1, moe_layer_freq=2)
    assert [is_moe_layer(cfg, i) for i in range(6)] == [False, False, True, False, True, False]
    cfg = SimpleNamespace(n_routed_experts=8, first_k_dense_replace=3)  # V3: no moe_layer_freq
    assert [is_moe_layer(cfg, i) for i in range(5)] == [False, False, False, True, True]
    assert not is_moe_layer(SimpleNamespace(n_routed_experts=None), 5)


def test_kimi_k2_checkpoints_read_as_deepseek_v3(tmp_path):
    """Kimi-K2's config.json says `model_type: kimi_k2`, which transformers does not map: Atom
    reads it as DeepSeek-V3's config (one expert group) and matches transformers' DeepSeek-V3."""
    import json

    from transformers import AutoConfig

    folder = tmp_path / "kimi"
    model = build_tiny_model("deepseek_v3", folder, n_group=1, topk_group=1)
    config = json.loads((folder / "config.json").read_text())
    config |= {"model_type": "kimi_k2", "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError):  # what a user of transformers alone meets
        AutoConfig.from_pretrained(folder)
    engine = LLMEngine(folder, dtype="float32", num_kvcache_blocks=64, max_model_len=256)
    assert type(engine.runner.model).__name__ == "DeepseekV3ForCausalLM"
    prompts = random_prompts((5, 23, 47), seed=3)
    results, logits = run_with_logits(engine, prompts)
    for prompt, result, steps in zip(prompts, results, logits):
        assert result["token_ids"] == hf_greedy(model, prompt, len(result["token_ids"]))
        ref = hf_logits(model, prompt + result["token_ids"][:-1])[len(prompt) - 1 :]
        torch.testing.assert_close(steps, ref, atol=1e-4, rtol=0)
