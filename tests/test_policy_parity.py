"""Every scheduling policy against transformers: chunked prompts, prefix caching, preemption.

A small token budget (48) chunks almost every prompt; under `mixed` the chunks share steps
with decode rows, under `spyre` every step runs on padded rectangular block tables.
Float32 greedy tokens must match transformers' token for token, and the logits that
produced them must agree closely.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from conftest import record_preemptions  # noqa: E402
from model_utils import (  # noqa: E402
    check_against_hf,
    hf_greedy,
    random_prompts,
    run_with_logits,
    second_wave_cached_tokens,
    shared_prefix_waves,
    tiny_models,
)

from atom_core import SamplingParams  # noqa: E402
from atom_core.engine.llm_engine import LLMEngine  # noqa: E402

POLICIES = ["prefill_first", "mixed", "spyre"]
NEW = 12


tiny = tiny_models("llama", "qwen3")


def engine_for(folder, policy: str, **config) -> LLMEngine:
    config.setdefault("num_kvcache_blocks", 96)
    config.setdefault("max_model_len", 512)
    engine = LLMEngine(
        folder,
        dtype="float32",
        max_num_batched_tokens=48,
        prefill_chunk_size=48,
        scheduling_policy=policy,
        **config,
    )
    # Unwritten slots may hold anything: a kernel that reads past a request's keys, or
    # lets padding through, fails here.
    engine.runner.kv_cache_tensors["kv_cache"][:, :, :, : config["num_kvcache_blocks"]].fill_(float("nan"))
    return engine


@pytest.mark.parametrize("policy", POLICIES)
def test_chunked_prompts_with_prefix_caching_match_transformers(tiny, policy):
    folder, model = tiny
    engine = engine_for(folder, policy, enable_prefix_caching=True)
    first, second = shared_prefix_waves((1, 15, 16, 17, 47, 48, 49, 100, 300))
    r1, l1 = run_with_logits(engine, first, max_tokens=NEW)
    r2, l2 = run_with_logits(engine, second, max_tokens=NEW)  # hits on the first wave
    check_against_hf(model, first + second, r1 + r2, l1 + l2)
    assert [r["num_cached_tokens"] for r in r2] == second_wave_cached_tokens(policy)
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks == 96 - (policy == "spyre")


@pytest.mark.parametrize("policy", POLICIES)
def test_preemption_with_chunked_prompts_matches_transformers(tiny, policy):
    folder, model = tiny
    # 12 blocks of 16 tokens for prompts of up to 120 tokens that grow by 24: requests are
    # preempted, some of them partway through their prompt.
    engine = engine_for(folder, policy, num_kvcache_blocks=12, max_num_seqs=6, max_model_len=160)
    preempted = record_preemptions(engine.scheduler)
    prompts = random_prompts((20, 120, 5, 60, 33, 90), seed=7)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = engine.generate(prompts, params, use_tqdm=False)
    assert len(preempted) >= 1
    for prompt, result in zip(prompts, results):
        assert result["token_ids"] == hf_greedy(model, prompt, 24), f"prompt of {len(prompt)} tokens"
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_mixed_steps_really_mix(tiny):
    """The parity above means something for `mixed` only if steps carried both kinds of rows."""
    folder, model = tiny
    engine = engine_for(folder, "mixed")
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    short, long = random_prompts((5, 200), seed=8)
    engine.add_request(short, params)
    engine.step()
    engine.add_request(long, params)
    mixed_steps = 0
    original = engine.runner.forward

    def spy(batch, seqs):
        nonlocal mixed_steps
        mixed_steps += batch.total_seqs_num_decode > 0 and batch.total_seqs_num_prefill > 0
        return original(batch, seqs)

    engine.runner.forward = spy
    results = []
    while engine.has_unfinished_requests():
        results += engine.step()
    assert mixed_steps >= 4
    by_len = {r["num_prompt_tokens"]: r["token_ids"] for r in results}
    assert by_len[200] == hf_greedy(model, long, NEW)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_newer_prompt_does_not_take_turns_with_an_older_decoding_request(tiny, policy):
    """A prompt chunk that would need a decoding request's blocks waits while decodes run; it
    used to preempt the older request, whose prefill again then preempted it, in turns."""
    folder, model = tiny
    engine = LLMEngine(folder, dtype="float32", scheduling_policy=policy, max_model_len=128, num_kvcache_blocks=10,
                       max_num_batched_tokens=32, max_num_seqs=2, max_batch_tkv_limit=1 << 20)  # fmt: skip
    preempted = record_preemptions(engine.scheduler)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    older, newer = list(range(1, 91)), list(range(101, 191))
    rids = [engine.add_request(older, params)]
    results = {}
    for step in range(1000):
        if step == 5:
            rids.append(engine.add_request(newer, params))
        results.update((r["request_id"], r) for r in engine.step())
        if step > 5 and not engine.has_unfinished_requests():
            break
    assert len(preempted) <= 7  # was 54 under prefill_first and 15 under spyre
    assert [results[r]["token_ids"] for r in rids] == [hf_greedy(model, p, 30) for p in (older, newer)]
    assert engine.scheduler.block_manager.num_free_blocks == 10 - (policy == "spyre")


def test_spyre_finishes_a_decoding_request_a_later_prompt_would_have_preempted(tiny):
    """Its prefill again (prompt and 90 generated tokens, in whole chunks) would pass the
    volume limit, so preempting it for another prompt's chunk used to end it unschedulable."""
    folder, _ = tiny
    engine = LLMEngine(folder, dtype="float32", scheduling_policy="spyre", max_model_len=128, num_kvcache_blocks=9,
                       max_num_batched_tokens=32, max_batch_tkv_limit=120)  # fmt: skip
    rid = engine.add_request(list(range(1, 9)), SamplingParams(temperature=0, max_tokens=112, ignore_eos=True))
    results = {}
    for step in range(1000):
        if step == 92:
            late = engine.add_request(
                list(range(20, 100)), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
            )
        results.update((r["request_id"], r) for r in engine.step())
        if step > 92 and not engine.has_unfinished_requests():
            break
    assert (results[rid]["finish_reason"], len(results[rid]["token_ids"])) == ("max_tokens", 112)
    assert (results[late]["finish_reason"], len(results[late]["token_ids"])) == ("max_tokens", 10)
