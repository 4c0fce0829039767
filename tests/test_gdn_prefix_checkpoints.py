"""Prefix caching on the Gated DeltaNet hybrids through state checkpoints.

A request with per-request state resumes from a cached prefix only where a checkpoint of
that state was saved (`Config.gdn_checkpoint_slots`); otherwise it takes no hit and
computes everything. Tokens and logits must match transformers either way, the hit shows
in `num_cached_tokens`, an evicted checkpoint is a miss, and the budget pays for the
slots. Pools start as NaN (`make_gdn_engine`): a checkpoint slot that was never saved, or
a group holding another request's state, would show.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from conftest import record_preemptions  # noqa: E402
from model_utils import GDN_ARCHS, cached_greedy, check_against_hf, random_prompts, run_with_logits, tiny_models  # noqa: E402
from model_utils import make_gdn_engine as make_engine  # noqa: E402

from atom_core import SamplingParams  # noqa: E402
from atom_core.engine.llm_engine import LLMEngine  # noqa: E402

NEW = 8
BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


tiny = tiny_models(*GDN_ARCHS)


@pytest.fixture(scope="module")
def oracle(tiny):
    """transformers' greedy continuation of a prompt, computed once per prompt."""
    return cached_greedy(tiny[1], NEW)


def record_state_traffic(engine) -> list[tuple[dict, dict]]:
    """(state_loads, state_saves) of every batch the runner runs."""
    seen = []
    original = engine.runner.forward

    def forward(batch, seqs):
        seen.append((dict(batch.state_loads), {r: list(p) for r, p in batch.state_saves.items()}))
        return original(batch, seqs)

    engine.runner.forward = forward
    return seen


def assert_whole(engine) -> None:
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.used_block_ids
    assert sorted(bm.per_req_cache_free_groups) == list(range(bm.num_per_req_cache_groups))
    store = bm.state_checkpoints
    slots = sorted([s for _, s in store] + list(store.free_slots))
    assert slots == list(range(store.first_slot, store.first_slot + store.num_slots))
    assert all(h in bm.hash_to_block_id for h, _ in store)


def test_repeated_long_prompt_resumes_from_a_checkpoint(tiny, oracle):
    folder, model = tiny
    engine = make_engine(folder, enable_prefix_caching=True)
    traffic = record_state_traffic(engine)
    (prompt,) = random_prompts((150,), seed=21)
    first, _ = run_with_logits(engine, [prompt], max_tokens=NEW)
    # The prompt ran in one chunk; its last full block boundary a repeat can use was saved.
    assert first[0]["num_cached_tokens"] == 0
    assert [p for _, saves in traffic for points in saves.values() for p, _ in points] == [144]
    results, logits = run_with_logits(engine, [prompt], max_tokens=NEW)
    cached = results[0]["num_cached_tokens"]
    assert cached == 144 and cached % BS == 0  # (150 - 1) // 16 whole blocks
    assert len(traffic[-NEW][0]) == 1, "the repeat did not load the checkpoint"
    assert results[0]["token_ids"] == first[0]["token_ids"] == oracle(prompt)
    check_against_hf(model, [prompt], results, logits)  # logits too, teacher-forced
    off = make_engine(folder).generate([prompt], GREEDY, use_tqdm=False)[0]
    assert off["token_ids"] == results[0]["token_ids"] and off["num_cached_tokens"] == 0
    assert_whole(engine)


def test_prompts_sharing_a_prefix_resume_where_they_part(tiny, oracle):
    folder, _ = tiny
    engine = make_engine(folder, enable_prefix_caching=True)
    system = random_prompts((72,), seed=22)[0]
    questions = random_prompts((30, 14, 25, 11), seed=23)
    cached = []
    for q in questions:  # one at a time, as a chat service sees them
        result = engine.generate([system + q], GREEDY, use_tqdm=False)[0]
        assert result["token_ids"] == oracle(system + q)
        cached.append(result["num_cached_tokens"])
    # The first request saves its state at 96 tokens, past the shared part. The second finds
    # its KV up to 64 tokens (4 whole blocks of the system prompt) but no state there, so it
    # computes everything and saves a checkpoint where the two prompts part; the others resume there.
    assert cached == [0, 0, 64, 64]
    assert_whole(engine)


@pytest.mark.parametrize("policy", ["prefill_first", "mixed", "spyre"])
def test_chunked_prompts_checkpoint_and_resume_under_every_policy(tiny, oracle, policy):
    folder, _ = tiny
    extra = dict(prefill_chunk_size=32) if policy == "spyre" else {}
    engine = make_engine(
        folder,
        enable_prefix_caching=True,
        gdn_checkpoint_slots=4,
        scheduling_policy=policy,
        max_num_batched_tokens=48,
        num_kvcache_blocks=12,
        max_num_seqs=4,
        max_model_len=160,
        **extra,
    )
    preempted = record_preemptions(engine.scheduler)
    system = random_prompts((100,), seed=24)[0]
    tails = random_prompts((3, 20, 7, 12, 1, 30), seed=25)
    prompts = [system + t for t in tails[:3]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    first = engine.generate(prompts, params, use_tqdm=False)  # together: chunked, mixed with decode rows
    later = engine.generate([system + t for t in tails[3:]], params, use_tqdm=False)
    for prompt, result in zip(prompts + [system + t for t in tails[3:]], first + later):
        assert result["token_ids"] == oracle(prompt, 20), f"prompt of {len(prompt)} tokens"
    assert any(r["num_cached_tokens"] for r in later)
    assert all(r["num_cached_tokens"] % BS == 0 for r in first + later)
    assert policy == "spyre" or preempted, "the small pool was meant to preempt"
    assert_whole(engine)


def test_an_evicted_checkpoint_is_a_miss_not_an_error(tiny, oracle):
    folder, _ = tiny
    engine = make_engine(folder, enable_prefix_caching=True, gdn_checkpoint_slots=1)
    a, b, c = random_prompts((40, 50, 36), seed=26)
    runs = [(p, engine.generate([p], GREEDY, use_tqdm=False)[0]) for p in (a, b, c, a, a)]
    for prompt, result in runs:
        assert result["token_ids"] == oracle(prompt)
    # One slot: each prompt's checkpoint evicts the previous one. The first repeat of A
    # finds its KV blocks but no state, so it computes everything and saves it again.
    assert [r["num_cached_tokens"] for _, r in runs] == [0, 0, 0, 0, 32]
    assert len(engine.scheduler.block_manager.state_checkpoints) == 1
    assert_whole(engine)


def test_the_budget_pays_for_the_checkpoint_slots(tiny):
    folder, _ = tiny
    probe = make_engine(folder, max_num_seqs=2, max_model_len=128)
    group = probe.kv_plan.group_bytes
    block = probe.kv_plan.block_bytes
    per_request = 128 // BS
    common = dict(dtype="float32", max_num_seqs=2, max_model_len=128, enable_prefix_caching=True)
    budget = (2 + 3) * group + (per_request + 5) * block
    engine = LLMEngine(folder, kv_cache_memory=budget, gdn_checkpoint_slots=3, **common)
    assert engine.kv_plan.num_blocks == per_request + 5
    assert engine.kv_plan.num_state_checkpoints == 3
    assert {t.shape[1] for t in engine.runner.per_req_cache_tensors.values()} == {2 + 3}  # groups, then checkpoints
    with pytest.raises(ValueError, match=r"3 state checkpoints .*gdn_checkpoint_slots=3.*at most 1 groups fit"):
        LLMEngine(folder, kv_cache_memory=budget - group - 5 * block, gdn_checkpoint_slots=3, **common)
    # Without prefix caching there are no checkpoints to pay for.
    plain = LLMEngine(folder, kv_cache_memory=budget, **{**common, "enable_prefix_caching": False})
    assert plain.kv_plan.num_state_checkpoints == 0
    assert plain.kv_plan.num_blocks == min(2 * per_request, (budget - 2 * group) // block)


def test_prefix_caching_without_checkpoint_slots_is_refused(tiny):
    folder, _ = tiny
    with pytest.raises(ValueError, match="gdn_checkpoint_slots=0"):
        LLMEngine(
            folder,
            dtype="float32",
            num_kvcache_blocks=16,
            max_model_len=128,
            enable_prefix_caching=True,
            gdn_checkpoint_slots=0,
        )
