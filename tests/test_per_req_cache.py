"""Per-request state groups (stateful attention such as GDN): reserved before the block pool
is sized, counted in the KV budget, and handed out by the scheduler one per request."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from model_utils import build_tiny_model, hf_greedy, random_prompts  # noqa: E402

from atom_core import SamplingParams  # noqa: E402
from atom_core.engine.llm_engine import LLMEngine  # noqa: E402

GROUP_BYTES = 4096
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 KV heads of 16, float32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    return folder, build_tiny_model("llama", folder)


@pytest.fixture
def stateful(monkeypatch):
    """The "mha" builder made to keep GROUP_BYTES of per-request state, as a GDN builder does."""
    from atom_attention.mha.builder import MHAMetadataBuilder

    allocated = []
    monkeypatch.setattr(MHAMetadataBuilder, "compute_per_req_cache_bytes", lambda self: GROUP_BYTES)
    monkeypatch.setattr(
        MHAMetadataBuilder,
        "allocate_per_req_cache",
        lambda self, slots: allocated.append(slots) or {"state": torch.zeros(slots, GROUP_BYTES // 4)},
    )
    return allocated


def test_the_budget_pays_for_the_groups_first(tiny, stateful):
    folder, _ = tiny
    budget = 4 * GROUP_BYTES + 10 * BLOCK_BYTES
    engine = LLMEngine(folder, dtype="float32", max_model_len=64, max_num_seqs=4, kv_cache_memory=budget)
    assert engine.kv_plan.num_blocks == 10
    assert engine.kv_plan.num_state_groups == 4 and stateful == [4]


@pytest.mark.parametrize("groups", [0, 3])
def test_a_budget_too_small_for_the_groups_names_the_numbers(tiny, stateful, groups):
    folder, _ = tiny
    budget = 4 * GROUP_BYTES + 3 * BLOCK_BYTES  # one request of 64 tokens needs 4 blocks
    field = "num_per_req_cache_groups=3" if groups else "max_num_seqs=4"
    fit = (budget - 4 * BLOCK_BYTES) // GROUP_BYTES
    with pytest.raises(ValueError, match=rf"groups of {GROUP_BYTES} bytes \({field}\).*at most {fit} groups fit"):
        LLMEngine(
            folder,
            dtype="float32",
            max_model_len=64,
            max_num_seqs=4,
            kv_cache_memory=budget,
            num_per_req_cache_groups=groups,
        )


def test_admission_waits_for_a_free_group_and_every_group_comes_back(tiny, stateful):
    folder, model = tiny
    engine = LLMEngine(folder, dtype="float32", max_model_len=64, num_kvcache_blocks=32, num_per_req_cache_groups=2)
    most_running = 0
    original = engine.runner.forward

    def spy(batch, seqs):
        nonlocal most_running
        most_running = max(most_running, len(engine.scheduler.running))
        assert all(s.per_req_cache_group in (0, 1) for s in seqs.values())
        return original(batch, seqs)

    engine.runner.forward = spy
    prompts = random_prompts((5, 9, 3, 12), seed=9)
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert most_running == 2  # four requests, two groups: the others waited
    for prompt, result in zip(prompts, results):
        assert result["token_ids"] == hf_greedy(model, prompt, 6)
    bm = engine.scheduler.block_manager
    assert sorted(bm.per_req_cache_free_groups) == [0, 1] and bm.num_free_blocks == 32
