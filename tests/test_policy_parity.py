"""Every scheduling policy against transformers: chunked prompts, prefix caching, preemption.

A small token budget (48) chunks almost every prompt; under `mixed` the chunks share steps
with decode rows, under `spyre` every step runs on padded rectangular block tables.
Float32 greedy tokens must match transformers' token for token, and the logits that
produced them must agree closely.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from atom_core import SamplingParams  # noqa: E402
from atom_core.llm_engine import LLMEngine  # noqa: E402
from model_utils import check_against_hf, hf_greedy, random_prompts, run_with_logits, tiny_models  # noqa: E402
from conftest import record_preemptions  # noqa: E402

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
    lengths = (1, 15, 16, 17, 47, 48, 49, 100, 300)
    prompts = random_prompts(lengths, seed=4)
    base = random_prompts([160], seed=5)[0]
    tails = random_prompts([3, 30, 1], seed=6)
    shared = [base + tails[0], base[:100] + tails[1], base[:64] + tails[2]]
    r1, l1 = run_with_logits(engine, prompts + shared[:1], max_tokens=NEW)
    r2, l2 = run_with_logits(engine, shared[1:] + [list(base)], max_tokens=NEW)  # hits on the first wave
    check_against_hf(model, prompts + shared, r1 + r2, l1 + l2)
    # What each request skipped: spyre recomputes the chunk holding the cache boundary and
    # the last chunk always, so it skips less of the same hits (sendnn-inference's adjusted hit).
    assert [r["num_cached_tokens"] for r in r2] == ([96, 32, 112] if policy == "spyre" else [96, 64, 144])
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
