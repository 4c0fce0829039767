"""Qwen3.5 text models (dense and MoE) against transformers.

Float32 greedy tokens, and the logits that produced them, for tiny random models whose layers
0-2 are Gated DeltaNet with Qwen3.5's flat projections (`in_proj_qkv` / `in_proj_z` /
`in_proj_b` / `in_proj_a`) and layer 3 gated full attention. Dense MLPs (`Qwen3_5ForCausalLM`)
or routed + shared experts on every layer (`Qwen3_5MoeForCausalLM`). GDN state must carry
across chunked-prefill cuts (mid-block too) and through preemption; pools start as NaN. A copy
of the checkpoint laid out as the multimodal releases are (`model.language_model.*` plus a
`model.visual.*` tower) must load, log the skipped vision tensors once, and match too.
transformers' pure-torch GDN path ignores packed sequences, so the oracle runs one prompt at a time.
"""

from __future__ import annotations

import logging
import shutil

import pytest

torch = pytest.importorskip("torch")

from atom_core import SamplingParams  # noqa: E402
from atom_core.llm_engine import LLMEngine  # noqa: E402
from model_utils import build_tiny_model, check_against_hf, hf_greedy, random_prompts, run_with_logits  # noqa: E402

NEW = 10


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def tiny(request, tmp_path_factory):
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, build_tiny_model(request.param, folder)


def make_engine(folder, **config) -> LLMEngine:
    config.setdefault("num_kvcache_blocks", 96)
    config.setdefault("max_model_len", 512)
    engine = LLMEngine(folder, dtype="float32", **config)
    for t in engine.runner.per_req_cache_tensors.values():  # stale state is what a reused group holds
        t.fill_(float("nan"))
    engine.runner.kv_cache_tensors["kv_cache"][:, :, :, : config["num_kvcache_blocks"]].fill_(float("nan"))
    return engine


def record_prompt_chunks(engine) -> list[tuple[int, bool]]:
    """(first position, step also has decode rows) of every prompt-chunk row the GDN builder sees."""
    rows = []
    builder = engine.runner.attn_builders["gdn"]
    original = builder.build

    def build(batch):
        meta = original(batch)
        gm = meta.extra["gdn"]
        rows.extend((int(batch.num_computed_tokens[r]), len(gm.decode_rows) > 0) for r in gm.prefill_rows)
        return meta

    builder.build = build
    return rows


def test_model_is_what_the_parity_is_about(tiny):
    name, folder, hf = tiny
    engine = make_engine(folder)
    runner = engine.runner
    assert set(runner.attn_builders) == {"gdn", "mha"}
    assert len(runner.attn_builders["gdn"].layers) == 3 and len(runner.attn_builders["mha"].layers) == 1
    assert hf.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert len(hf.config.rope_parameters["mrope_section"]) == 3  # rope as the real configs write it
    from atom_models.qwen3_5 import Qwen3_5GatedDeltaNet, Qwen3_5MoeSparseMoeBlock
    from atom_models.qwen3_next import DenseMLP

    layers = runner.model.model.layers
    assert [isinstance(getattr(la, "linear_attn", None), Qwen3_5GatedDeltaNet) for la in layers] == [True] * 3 + [False]
    mlp = Qwen3_5MoeSparseMoeBlock if name == "qwen3_5_moe" else DenseMLP
    assert all(type(la.mlp) is mlp for la in layers)


def test_batch_of_prompts_matches_transformers(tiny):
    _, folder, model = tiny
    engine = make_engine(folder)
    prompts = random_prompts((1, 5, 16, 17, 33, 70, 130), seed=3)
    results, logits = run_with_logits(engine, prompts, max_tokens=NEW)
    check_against_hf(model, prompts, results, logits)


@pytest.mark.parametrize(
    "policy, budget", [("prefill_first", 13), ("mixed", 13), ("prefill_first", 48), ("mixed", 48), ("spyre", 48)]
)
def test_chunked_prompts_match_transformers(tiny, policy, budget):
    _, folder, model = tiny
    extra = dict(prefill_chunk_size=48) if policy == "spyre" else {}
    engine = make_engine(folder, scheduling_policy=policy, max_num_batched_tokens=budget, **extra)
    rows = record_prompt_chunks(engine)
    prompts = random_prompts((1, 15, 17, 47, 49, 100), seed=4)
    results, logits = run_with_logits(engine, prompts, max_tokens=NEW)
    check_against_hf(model, prompts, results, logits)
    continued = [(f, d) for f, d in rows if f > 0]
    assert continued, "no prompt was chunked"
    if budget < 16:
        assert any(f % 16 for f, _ in continued), f"every cut fell on a block boundary: {continued}"
    if policy == "mixed" and budget >= 16:
        assert any(d for _, d in continued), "no step mixed decode rows and prompt chunks"


@pytest.mark.parametrize("policy", ["prefill_first", "mixed", "spyre"])
def test_preemption_recomputes_state_from_scratch(tiny, policy):
    _, folder, model = tiny
    extra = dict(prefill_chunk_size=48) if policy == "spyre" else {}
    engine = make_engine(
        folder, scheduling_policy=policy, num_kvcache_blocks=12, max_num_seqs=6, max_model_len=160,
        max_num_batched_tokens=48, **extra,
    )
    preempted = []
    original = engine.scheduler.preempt
    engine.scheduler.preempt = lambda seq: (preempted.append(seq.id), original(seq))
    prompts = random_prompts((20, 120, 5, 60, 33, 90), seed=7)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    results = engine.generate(prompts, params, use_tqdm=False)
    assert preempted
    for prompt, result in zip(prompts, results):
        assert result["token_ids"] == hf_greedy(model, prompt, 20), f"prompt of {len(prompt)} tokens"
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert len(bm.per_req_cache_free_groups) == bm.num_per_req_cache_groups


def test_multimodal_checkpoint_layout_loads_text_model(tiny, tmp_path, caplog):
    """Text weights under `model.language_model.*` (as the multimodal releases store them), a vision
    tower in an extra file and an `mtp.*` tensor: the text model loads, one log line counts the
    skipped vision tensors, and the output still matches."""
    from safetensors.torch import load_file, save_file

    _, folder, model = tiny
    copy = tmp_path / "multimodal"
    shutil.copytree(folder, copy)
    weights = load_file(str(copy / "model.safetensors"))
    renamed = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
        for k, v in weights.items()
    }
    save_file(renamed, str(copy / "model.safetensors"), metadata={"format": "pt"})
    vision = {
        "model.visual.patch_embed.proj.weight": torch.randn(8, 3, 2, 2, 2),
        "model.visual.blocks.0.attn.qkv.weight": torch.randn(24, 8),
        "model.visual.merger.linear_fc1.weight": torch.randn(16, 32),
        "mtp.fc.weight": torch.randn(64, 128),
    }
    save_file(vision, str(copy / "model-visual.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="atom"):
        engine = make_engine(copy)
    lines = [r.getMessage() for r in caplog.records if "vision" in r.getMessage()]
    assert len(lines) == 1 and "3 " in lines[0], lines
    prompts = random_prompts((9, 40), seed=11)
    results, logits = run_with_logits(engine, prompts, max_tokens=NEW)
    check_against_hf(model, prompts, results, logits)
