"""The Gated DeltaNet hybrids against transformers: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE.

Float32 greedy tokens, and the logits that produced them, for tiny random models whose
layers 0-2 are GDN ("gdn" builder: per-request conv and recurrent state) and layer 3 full
attention ("mha"). GDN state must carry across chunked-prefill cuts at any token, across
decode steps, through preemption (recompute from position 0), and must not leak from one
request to the next one that reuses its state group. The per-request pools start as NaN,
so nothing may rely on a clean pool. transformers' pure-torch GDN path ignores packed
sequences, so the oracle runs one prompt at a time (`check_against_hf`, `hf_greedy`).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from conftest import record_preemptions  # noqa: E402
from model_utils import (  # noqa: E402
    GDN_ARCHS,
    assert_half_close,
    cached_greedy,
    check_against_hf,
    half_references,
    random_prompts,
    run_with_logits,
    tiny_models,
)
from model_utils import make_gdn_engine as make_engine  # noqa: E402

from atom_core import SamplingParams  # noqa: E402

NEW = 12
POLICIES = ["prefill_first", "mixed", "spyre"]


tiny = tiny_models(*GDN_ARCHS)


@pytest.fixture(scope="module")
def oracle(tiny):
    """transformers' greedy continuation of a prompt, computed once per prompt."""
    return cached_greedy(tiny[1], NEW)


def record_gdn_rows(engine) -> list[tuple[int, int, bool]]:
    """(first position, tokens, step also has decode rows) of every prompt-chunk row the GDN builder sees."""
    rows = []
    builder = engine.runner.attn_builders["gdn"]
    original = builder.build

    def build(batch):
        meta = original(batch)
        gm = meta.extra["gdn"]
        for r in gm.prefill_rows:
            first, n = int(batch.num_computed_tokens[r]), int(batch.num_scheduled_tokens[r])
            rows.append((first, n, len(gm.decode_rows) > 0))
        return meta

    builder.build = build
    return rows


def test_model_is_what_the_parity_is_about(tiny):
    folder, hf = tiny
    engine = make_engine(folder)
    runner = engine.runner
    assert set(runner.attn_builders) == {"gdn", "mha"}
    gdn = runner.attn_builders["gdn"]
    assert gdn.compute_block_bytes() == 0 and gdn.compute_per_req_cache_bytes() > 0
    assert len(gdn.layers) == 3 and len(runner.attn_builders["mha"].layers) == 1
    assert engine.kv_plan.num_state_groups == engine.config.max_num_seqs
    assert hf.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    # Routed experts sit in the same layers as in transformers' model.
    ours = [hasattr(layer.mlp, "experts") for layer in runner.model.model.layers]
    theirs = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    assert ours == theirs


def test_float16_logits_stay_close(tiny, request):
    """GDN and attention layers in float16 (the state in float32), prompts past a 64-token
    chunk, against transformers' float32 model (or its float16 copy where routing flips,
    `half_references`). In bfloat16 these hybrids' logits move by up to 0.4-0.8 in
    transformers' own model, more than any fixed tolerance that would still catch a fault;
    bfloat16 steps are checked against the eager path bit for bit (tests/test_decode_graph.py)."""
    folder, model = tiny
    references = half_references(request.node.callspec.params["tiny"], model, torch.float16)
    engine = make_engine(folder, dtype="float16")
    prompts = random_prompts((1, 17, 70), seed=5)
    results, logits = run_with_logits(engine, prompts, max_tokens=4)
    for prompt, result, steps in zip(prompts, results, logits):
        assert_half_close(steps, prompt + result["token_ids"][:-1], len(prompt) - 1, references)


def test_batch_of_prompts_matches_transformers(tiny):
    folder, model = tiny
    engine = make_engine(folder)
    prompts = random_prompts((1, 5, 16, 17, 33, 70, 130), seed=3)
    results, logits = run_with_logits(engine, prompts, max_tokens=NEW)
    check_against_hf(model, prompts, results, logits)


@pytest.mark.parametrize(
    "policy, budget", [("prefill_first", 13), ("mixed", 13), ("prefill_first", 48), ("mixed", 48), ("spyre", 48)]
)
def test_chunked_prompts_match_transformers(tiny, policy, budget):
    folder, model = tiny
    # Chunks are floored to whole blocks unless that leaves a step empty: a budget under one
    # block (13) cuts prompts every 13 tokens, mid-block; 48 cuts on block boundaries and,
    # under `mixed`, shares steps between decode rows and prompt chunks.
    extra = dict(prefill_chunk_size=32) if policy == "spyre" else {}
    engine = make_engine(folder, scheduling_policy=policy, max_num_batched_tokens=budget, **extra)
    rows = record_gdn_rows(engine)
    prompts = random_prompts((1, 15, 16, 17, 47, 49, 100), seed=4)
    results, logits = run_with_logits(engine, prompts, max_tokens=NEW)
    check_against_hf(model, prompts, results, logits)
    continued = [(f, n) for f, n, _ in rows if f > 0]
    assert continued, "no prompt was chunked"
    if budget < 16:
        assert any(f % 16 for f, _ in continued), f"every cut fell on a block boundary: {continued}"
    if policy == "mixed" and budget >= 16:
        assert any(with_decode for f, _, with_decode in rows if f > 0), "no step mixed decode rows and prompt chunks"


@pytest.mark.parametrize("policy", POLICIES)
def test_preemption_recomputes_state_from_scratch(tiny, oracle, policy):
    folder, _ = tiny
    extra = dict(prefill_chunk_size=48) if policy == "spyre" else {}
    engine = make_engine(
        folder,
        scheduling_policy=policy,
        num_kvcache_blocks=12,
        max_num_seqs=6,
        max_model_len=160,
        max_num_batched_tokens=48,
        **extra,
    )
    preempted = record_preemptions(engine.scheduler)
    prompts = random_prompts((20, 120, 5, 60, 33, 90), seed=7)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = engine.generate(prompts, params, use_tqdm=False)
    assert preempted
    for prompt, result in zip(prompts, results):
        assert result["token_ids"] == oracle(prompt, 24), f"prompt of {len(prompt)} tokens"
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert len(bm.per_req_cache_free_groups) == bm.num_per_req_cache_groups


def test_reused_state_group_leaks_nothing(tiny, oracle):
    folder, _ = tiny
    a, b = random_prompts((40, 23), seed=9)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    alone = make_engine(folder, max_num_seqs=1).generate([b], params, use_tqdm=False)[0]["token_ids"]
    engine = make_engine(folder, max_num_seqs=1, max_num_batched_tokens=16)  # B's prompt in two chunks
    groups = []
    original = engine.scheduler.block_manager.allocate

    def allocate(seq, *args, **kwargs):
        out = original(seq, *args, **kwargs)
        groups.append(seq.per_req_cache_group)
        return out

    engine.scheduler.block_manager.allocate = allocate
    first = engine.generate([a], params, use_tqdm=False)[0]["token_ids"]
    second = engine.generate([b], params, use_tqdm=False)[0]["token_ids"]
    assert set(groups) == {0}  # one group, A's then B's
    assert first == oracle(a)
    assert second == alone == oracle(b)


def test_block_and_state_bytes_of_the_real_qwen3_next_80b_a3b():
    """Shapes only (meta device): 12 full-attention layers take paged blocks, 36 GDN layers
    one conv state [8192, 3] and one recurrent state [32, 128, 128] each per request."""
    from transformers import Qwen3NextConfig

    from atom_attention.gdn.builder import GDNMetadataBuilder
    from atom_attention.mha.builder import MHAMetadataBuilder
    from atom_core.runner.attention_builder import BuilderContext
    from atom_models.qwen3_next import Qwen3NextForCausalLM

    cfg = Qwen3NextConfig()  # transformers' defaults are Qwen3-Next-80B-A3B's shapes
    assert (cfg.num_hidden_layers, cfg.linear_num_value_heads, cfg.head_dim) == (48, 32, 256)
    with torch.device("meta"):
        model = Qwen3NextForCausalLM(cfg)
    layers = {kind: [m for m in model.modules() if getattr(m, "attn_type", None) == kind] for kind in ("mha", "gdn")}
    assert (len(layers["mha"]), len(layers["gdn"])) == (12, 36)

    def runner(state_dtype):
        return BuilderContext.without_engine(
            cfg, dtype=torch.bfloat16, additional_config={"gdn_state_dtype": state_dtype}
        )

    mha = MHAMetadataBuilder(runner("float32"), layers["mha"])
    assert mha.compute_block_bytes() == 2 * 12 * 16 * 2 * 256 * 2  # K and V, 2 KV heads of 256, bf16
    conv_dim = 2 * 16 * 128 + 32 * 128
    per_layer = conv_dim * (4 - 1) + 32 * 128 * 128
    assert GDNMetadataBuilder(runner("float32"), layers["gdn"]).compute_per_req_cache_bytes() == 36 * per_layer * 4
    assert GDNMetadataBuilder(runner("bfloat16"), layers["gdn"]).compute_per_req_cache_bytes() == 36 * per_layer * 2
    assert 36 * per_layer * 4 == 79_036_416  # about 75 MiB of state per request, whatever its length


def test_bfloat16_state_halves_the_groups_and_still_generates(tiny, oracle):
    folder, _ = tiny
    with pytest.raises(ValueError, match="gdn_state_dtype"):
        make_engine(folder, gdn_state_dtype="float16")
    engine = make_engine(folder, gdn_state_dtype="bfloat16")
    assert {t.dtype for t in engine.runner.per_req_cache_tensors.values()} == {torch.bfloat16}
    full = make_engine(folder).runner.attn_builders["gdn"].compute_per_req_cache_bytes()
    assert engine.runner.attn_builders["gdn"].compute_per_req_cache_bytes() * 2 == full
    prompt = random_prompts((30,), seed=11)[0]
    result = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)[
        0
    ]
    # Rounded state drifts from the float32 oracle eventually; the first tokens agree.
    assert result["finish_reason"] == "max_tokens" and result["token_ids"][:2] == oracle(prompt)[:2]
