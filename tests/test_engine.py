"""The LLMEngine API: requests, finish reasons, streaming, aborts, sampling and bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from model_utils import build_tiny_model, hf_greedy  # noqa: E402

from atom_core import RequestOutput, SamplingParams  # noqa: E402
from atom_core.engine.llm_engine import (
    COMPLETION_KEYS,  # noqa: E402
    LLMEngine,  # noqa: E402
)
from atom_core.runner.sampler import Penalties, Sampler, SamplingMetadata, apply_penalties  # noqa: E402
from atom_core.sampling_params import choice_seed  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], list(range(10, 30)), [7]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama")
    return folder, build_tiny_model("llama", folder)


@pytest.fixture
def engine(tiny):
    return LLMEngine(tiny[0], num_kvcache_blocks=32, max_model_len=128)


def run(engine: LLMEngine) -> list[dict]:
    out = []
    while engine.has_unfinished_requests():
        out += engine.step()
    return out


def test_generate_returns_one_result_per_prompt_in_order(engine, tiny):
    results = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [r["token_ids"] for r in results] == [hf_greedy(tiny[1], p, 12) for p in PROMPTS]
    for r, p in zip(results, PROMPTS):
        assert r["finish_reason"] == "max_tokens"
        assert r["num_prompt_tokens"] == len(p)
        assert r["num_cached_tokens"] == 0
        assert r["text"] is None  # no tokenizer in this folder
        assert r["ttft"] > 0 and r["tpot"] > 0
    assert engine.runner.dtype == torch.float32  # "auto" took the checkpoint's dtype


def test_a_temperature_below_1e_5_is_greedy(engine, tiny):
    """Dividing float32 logits by 1e-38 overflows them; such a request takes the argmax (vLLM's rule)."""
    expected = [hf_greedy(tiny[1], p, 12) for p in PROMPTS]
    for t in (1e-38, 1e-45, 1e-6):
        params = SamplingParams(temperature=t, max_tokens=12, ignore_eos=True)
        assert [r["token_ids"] for r in engine.generate(PROMPTS, params, use_tqdm=False)] == expected


def test_generate_keeps_the_results_of_requests_added_before_it_for_step(engine, tiny):
    rid = engine.add_request(PROMPTS[1], GREEDY)
    [result] = engine.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
    assert result["token_ids"] == hf_greedy(tiny[1], PROMPTS[0], 12)
    # the other request ran alongside and finished; its result waits for step()
    assert engine.has_unfinished_requests() and not engine.scheduler.has_unfinished_requests()
    [held] = engine.step()
    assert held["request_id"] == rid and held["token_ids"] == hf_greedy(tiny[1], PROMPTS[1], 12)
    assert not engine.has_unfinished_requests() and engine.step() == []


def test_prompts_of_every_accepted_shape_and_clear_errors_for_the_rest(engine, tiny):
    import numpy as np

    expected = hf_greedy(tiny[1], PROMPTS[0], 12)
    as_numpy_ints = [np.int64(t) for t in PROMPTS[0]]
    assert engine.generate(as_numpy_ints, GREEDY, use_tqdm=False)[0]["token_ids"] == expected
    assert engine.generate([as_numpy_ints], GREEDY, use_tqdm=False)[0]["token_ids"] == expected
    with pytest.raises(
        TypeError, match="prompts must be a string, a list of token ids or a list of those, got NoneType"
    ):
        engine.generate(None, GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="got ndarray"):
        engine.generate(np.array([[1, 2], [3, 4]]), GREEDY, use_tqdm=False)
    assert engine.scheduler.block_manager.num_free_blocks == 32


def test_one_sampling_params_per_prompt(engine, tiny):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 5, 3)]
    results = engine.generate(PROMPTS, params, use_tqdm=False)
    assert [len(r["token_ids"]) for r in results] == [2, 5, 3]
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        engine.generate(PROMPTS, params[:2], use_tqdm=False)


def test_eos_and_stop_token_ids_end_requests_unless_ignore_eos(tiny):
    expected = hf_greedy(tiny[1], PROMPTS[0], 12)
    eos = expected[4]
    first = expected.index(eos)
    engine = LLMEngine(tiny[0], num_kvcache_blocks=32, max_model_len=128, eos_token_id=eos)
    r_eos, r_ignore = engine.generate(
        [PROMPTS[0]] * 2,
        [SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)],
        use_tqdm=False,
    )
    assert (r_eos["finish_reason"], r_eos["token_ids"]) == ("eos", expected[: first + 1])
    assert (r_ignore["finish_reason"], r_ignore["token_ids"]) == ("max_tokens", expected)
    engine = LLMEngine(tiny[0], num_kvcache_blocks=32, max_model_len=128, stop_token_ids=[eos])
    r = engine.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert (r["finish_reason"], r["token_ids"]) == (f"stop_{eos}", expected[: first + 1])


def test_per_request_stop_token_ids_end_only_that_request_even_with_ignore_eos(tiny):
    expected = hf_greedy(tiny[1], PROMPTS[0], 12)
    stop = expected[5]
    first = expected.index(stop)
    engine = LLMEngine(tiny[0], num_kvcache_blocks=32, max_model_len=128)
    stopped, other = engine.generate(
        [PROMPTS[0]] * 2,
        [
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop]),
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        ],
        use_tqdm=False,
    )
    assert (stopped["finish_reason"], stopped["token_ids"]) == (f"stop_{stop}", expected[: first + 1])
    assert (other["finish_reason"], other["token_ids"]) == ("max_tokens", expected)
    assert engine.scheduler.block_manager.num_free_blocks == 32
    with pytest.raises(ValueError, match=f"stop_token_ids names token {engine.vocab_size}, outside the vocabulary"):
        engine.add_request(PROMPTS[0], SamplingParams(stop_token_ids=[1, engine.vocab_size]))
    with pytest.raises(ValueError, match="stop_token_ids must hold token ids"):
        SamplingParams(stop_token_ids=[-1])
    assert not engine.has_unfinished_requests()


def test_max_model_len_ends_a_request(engine):
    prompt = list(range(1, 121))
    r = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert (r["finish_reason"], len(r["token_ids"])) == ("max_model_len", 8)
    # max_tokens=None (vLLM's): no limit of its own, the context limit ends it
    r = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert (r["finish_reason"], len(r["token_ids"])) == ("max_model_len", 8)


def test_streaming_callback_sees_every_token_once(engine):
    seen: list[RequestOutput] = []
    rid = engine.add_request(PROMPTS[1], GREEDY, stream_callback=seen.append)
    results = run(engine)
    assert [r["request_id"] for r in results] == [rid]
    assert [t for o in seen for t in o.output_tokens] == results[0]["token_ids"]
    assert [o.finished for o in seen] == [False] * 11 + [True]
    assert seen[-1].finish_reason == "max_tokens"


def test_a_step_loop_gets_the_result_of_the_last_request_aborted(engine):
    rid = engine.add_request(PROMPTS[1], GREEDY)
    engine.step()
    assert engine.abort(rid)
    results = run(engine)  # step() while has_unfinished_requests()
    assert [(r["request_id"], r["finish_reason"]) for r in results] == [(rid, "abort")]
    assert not engine.has_unfinished_requests()


def test_abort_frees_blocks_and_leaves_others_untouched(engine):
    pool = engine.scheduler.block_manager
    alone = engine.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0]["token_ids"]
    seen: list[RequestOutput] = []
    keep = engine.add_request(PROMPTS[1], GREEDY)
    drop = engine.add_request(list(range(40, 80)), GREEDY, stream_callback=seen.append)
    engine.step()
    engine.step()
    assert pool.num_free_blocks < 32
    assert engine.abort(drop) is True
    assert engine.abort(drop) is False  # already gone
    assert seen[-1].finished and seen[-1].finish_reason == "abort"
    results = {r["request_id"]: r for r in run(engine)}
    assert results[drop]["finish_reason"] == "abort"
    assert results[keep]["token_ids"] == alone
    assert pool.num_free_blocks == 32


def test_a_failed_step_ends_its_requests_and_leaves_the_engine_whole(tiny):
    """A forward pass that raises ends the step's requests ("error"); requests outside the
    step run on, the pool is whole, and the blocks the step never wrote are not cached."""
    engine = LLMEngine(tiny[0], num_kvcache_blocks=32, max_model_len=128, enable_prefix_caching=True, max_num_seqs=1)
    pool = engine.scheduler.block_manager
    long_prompt = list(range(40, 80))  # two full blocks, published when scheduled
    bad = engine.add_request(long_prompt, GREEDY)
    later = engine.add_request(PROMPTS[1], GREEDY)  # waits: one request at a time
    forward = engine.runner.forward

    def broken(batch, seqs):
        raise RuntimeError("kernel failure")

    engine.runner.forward = broken
    with pytest.raises(RuntimeError, match="kernel failure"):
        engine.step()
    engine.runner.forward = forward
    results = {r["request_id"]: r for r in run(engine)}
    assert results[bad]["finish_reason"] == "error" and results[bad]["token_ids"] == []
    assert results[later]["token_ids"] == hf_greedy(tiny[1], PROMPTS[1], 12)
    assert pool.num_free_blocks == 32
    [again] = engine.generate([long_prompt], GREEDY, use_tqdm=False)
    assert again["num_cached_tokens"] == 0  # the unwritten blocks were taken back
    assert again["token_ids"] == hf_greedy(tiny[1], long_prompt, 12)


def test_a_failed_step_keeps_the_cached_blocks_its_requests_shared(tiny):
    """spyre recomputes part of a hit (its writes go to the padding block): a failed step of
    such a request takes back only the blocks it would have written, not the shared prefix."""
    engine = LLMEngine(tiny[0], scheduling_policy="spyre", enable_prefix_caching=True, num_kvcache_blocks=32,
                       max_model_len=128, max_num_batched_tokens=64)  # fmt: skip
    base = list(range(1, 101))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.generate([base], params, use_tqdm=False)
    cached = dict(engine.scheduler.block_manager.hash_to_block_id)
    engine.add_request(base + [1, 2, 3], params)
    forward = engine.runner.forward

    def broken(batch, seqs):
        assert batch.num_computed_tokens[0] < 96  # it recomputes inside the cached prefix
        raise RuntimeError("kernel failure")

    engine.runner.forward = broken
    with pytest.raises(RuntimeError, match="kernel failure"):
        engine.step()
    engine.runner.forward = forward
    assert [r["finish_reason"] for r in run(engine)] == ["error"]
    assert engine.scheduler.block_manager.hash_to_block_id == cached


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "empty"),
        ([1, 2, 256], "prompt token 2 is 256, outside the vocabulary"),
        ([1, -3], "prompt token 1 is -3"),
        (list(range(1, 130)), "129 tokens, more than max_model_len=128"),
        ("hello", "no tokenizer"),
        ([1, 2.5], "not a token id"),
    ],
)
def test_bad_prompts_are_refused_without_disturbing_requests_in_flight(engine, prompt, message):
    rid = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, GREEDY)
    with pytest.raises(ValueError, match=message):
        engine.generate([PROMPTS[2], prompt], GREEDY, use_tqdm=False)
    results = run(engine)
    assert [r["request_id"] for r in results] == [rid]
    assert len(results[0]["token_ids"]) == 12
    assert engine.scheduler.block_manager.num_free_blocks == 32


def test_an_explicit_pool_needs_no_free_memory_reading(tiny, monkeypatch):
    """Where free memory cannot be read (no /proc/meminfo), a pool of given size is taken as given."""

    def unreadable(device):
        raise RuntimeError("cannot read free memory; set kv_cache_memory or num_kvcache_blocks")

    monkeypatch.setattr("atom_core.runner.kv_pool.free_memory_bytes", unreadable)
    engine = LLMEngine(tiny[0], num_kvcache_blocks=16, max_model_len=128)
    assert engine.scheduler.block_manager.num_free_blocks == 16


def test_configuration_errors_name_the_problem(tiny):
    with pytest.raises(TypeError, match="'max_batch'"):
        LLMEngine(tiny[0], max_batch=4)
    with pytest.raises(ValueError, match="fewer than the 8 blocks one request of max_model_len=128"):
        LLMEngine(tiny[0], num_kvcache_blocks=4, max_model_len=128)
    # a pool past the memory there is: named, not an OSError from mmap (or the OOM killer)
    with pytest.raises(
        ValueError, match=r"num_kvcache_blocks=10000000000 takes .* bytes .* more than the \d+ bytes of cpu"
    ):
        LLMEngine(tiny[0], num_kvcache_blocks=10**10, max_model_len=128)
    # spyre keeps block 0 for padding: 8 blocks hold 7 for requests
    with pytest.raises(ValueError, match="fewer than the 8 blocks .* beside the 1 the 'spyre' policy reserves"):
        LLMEngine(tiny[0], num_kvcache_blocks=8, max_model_len=128, scheduling_policy="spyre")
    LLMEngine(tiny[0], num_kvcache_blocks=9, max_model_len=128, scheduling_policy="spyre")
    # drafts stay inside the blocks of max_model_len tokens: 8 blocks serve k=4 drafts too
    LLMEngine(
        tiny[0],
        num_kvcache_blocks=8,
        max_model_len=128,
        speculative_config=dict(method="ngram", num_speculative_tokens=4),
    )
    with pytest.raises(ValueError, match="max_model_len=1024 exceeds the model's max_position_embeddings=512"):
        LLMEngine(tiny[0], max_model_len=1024)
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLMEngine(tiny[0], dtype="fp8")
    with pytest.raises(FileNotFoundError, match="neither a folder with config.json"):
        LLMEngine(tiny[0] / "nope")
    # ids outside the vocabulary (the model would never stop on them), refused before loading
    vocab = tiny[1].config.vocab_size
    with pytest.raises(ValueError, match=f"eos_token_id names token {vocab}, outside the model's vocabulary"):
        LLMEngine(tiny[0], eos_token_id=vocab)
    with pytest.raises(ValueError, match=f"stop_token_ids names token {10**9}, outside"):
        LLMEngine(tiny[0], stop_token_ids=[1, 10**9])
    # a name no plugin registers, before the model loads
    from atom_core.plugins.registry import RegistryError

    for option in ({"sampler": "nope"}, {"scheduling_policy": "nope"}, {"distributed_executor": "nope"}):
        with pytest.raises(RegistryError, match="'nope'"):
            LLMEngine(tiny[0], **option)


def test_a_setting_of_another_policy_is_said_to_go_unread(tiny, caplog):
    from atom_core.engine.model_source import load_model_source

    with caplog.at_level("WARNING", logger="atom"):
        load_model_source(tiny[0], scheduling_policy="mixed", prefill_chunk_size=64)
    assert "prefill_chunk_size is a setting of other scheduling policies: scheduling_policy='mixed'" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="atom"):
        load_model_source(tiny[0], scheduling_policy="spyre", prefill_chunk_size=64)
    assert "prefill_chunk_size" not in caplog.text


def test_a_cut_or_garbled_checkpoint_is_named(tiny, tmp_path):
    import shutil

    for name in ("model.safetensors", "config.json"):
        folder = tmp_path / name.split(".")[0]
        shutil.copytree(tiny[0], folder)
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: len(data) // 3])
        with pytest.raises(
            ValueError, match=f"{folder / name}: .*(safetensors|JSON)|{folder / name} is not valid JSON"
        ):
            LLMEngine(folder, num_kvcache_blocks=16, max_model_len=64)


def test_bytes_are_no_prompt_and_numpy_ids_are_ids(engine):
    import numpy as np

    with pytest.raises(TypeError, match="got bytes"):
        engine.generate(b"hello", GREEDY, use_tqdm=False)
    params = SamplingParams(
        temperature=0, max_tokens=4, stop_token_ids=[np.int64(3)], logit_bias={np.int64(5): np.float32(1.0)}
    )
    assert params.stop_token_ids == [3] and params.logit_bias == {5: 1.0}


def test_sampling_params_take_vllms_stop_and_name_fields_they_lack():
    import attrs

    params = SamplingParams(stop=["\n"], temperature=0)
    assert params.stop_strings == params.stop == ["\n"] and attrs.evolve(params, max_tokens=3).stop == ["\n"]
    with pytest.raises(TypeError, match="not both"):
        SamplingParams(stop=["a"], stop_strings=["b"])
    for bad in (0, 65, 1.5, True):
        with pytest.raises(ValueError, match=f"n must be an integer between 1 and 64, got {bad!r}"):
            SamplingParams(n=bad)
    with pytest.raises(TypeError, match="no field 'best_of'"):
        SamplingParams(best_of=2)


def test_kv_pool_sized_from_memory_budget(tiny):
    # 2 layers x K and V x 16 tokens x 2 kv heads x 16 dims x 4 bytes = 8192 bytes a block
    engine = LLMEngine(tiny[0], kv_cache_memory=8192 * 20, max_model_len=64)
    assert engine.kv_plan.block_bytes == 8192
    assert engine.kv_plan.num_blocks == 20
    assert engine.runner.kv_cache_tensors["kv_cache"].shape == (2, 2, 2, 21, 16, 16)  # + the null block


def test_a_deleted_engine_leaves_nothing_holding_its_kv_pool(tiny):
    """Nothing global (the forward context, the thread that maps the pool) keeps a deleted
    engine's KV pool: a notebook that makes engine after engine does not run out of memory."""
    import gc

    import torch

    engine = LLMEngine(tiny[0], kv_cache_memory=256 << 20, max_model_len=64)
    engine.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    pool = engine.runner.kv_cache_tensors["kv_cache"].untyped_storage().data_ptr()
    engine.close()
    del engine
    gc.collect()

    def on_pool(o: object) -> bool:
        try:  # other tests' fake tensors (torch.compile's) have no data
            return isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() == pool
        except RuntimeError:
            return False

    assert [o for o in gc.get_objects() if on_pool(o)] == []


def test_seeded_sampling_does_not_depend_on_the_batch(engine):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = engine.generate(PROMPTS[1], params, use_tqdm=False)[0]["token_ids"]
    others = SamplingParams(temperature=0.7, max_tokens=5, ignore_eos=True)
    mixed = engine.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [others, params, others], use_tqdm=False)
    assert mixed[1]["token_ids"] == alone
    reseeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=99, ignore_eos=True)
    assert engine.generate(PROMPTS[1], reseeded, use_tqdm=False)[0]["token_ids"] != alone


def test_n_completions_come_together_seeded_apart_and_leave_the_pool_whole(engine, tiny):
    """vLLM's n: a prompt's completions under "outputs", completion j seeded seed + j (the
    server's convention), greedy ones alike; add_request, which queues one, refuses n > 1."""
    free = engine.scheduler.block_manager.num_free_blocks
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=7, ignore_eos=True, n=3)
    results = engine.generate(PROMPTS[:2], params, use_tqdm=False)
    assert len(results) == 2
    for prompt, r in zip(PROMPTS[:2], results):
        outs = r["outputs"]
        assert [o["index"] for o in outs] == [0, 1, 2] and len({o["request_id"] for o in outs}) == 3
        assert r["token_ids"] == outs[0]["token_ids"] and r["request_id"] == outs[0]["request_id"]
        for j, o in enumerate(outs):
            alone = SamplingParams(temperature=1.0, max_tokens=10, seed=7 + j, ignore_eos=True)
            assert o["token_ids"] == engine.generate(prompt, alone, use_tqdm=False)[0]["token_ids"]
            assert o["finish_reason"] == "max_tokens" and len(o["token_ids"]) == 10
        assert len({tuple(o["token_ids"]) for o in outs}) > 1  # seeded apart
    greedy = engine.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, n=2), use_tqdm=False)[0]
    assert [o["token_ids"] for o in greedy["outputs"]] == [hf_greedy(tiny[1], PROMPTS[0], 12)] * 2
    single = engine.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0]
    assert single["outputs"] == [{"index": 0, **{k: single[k] for k in COMPLETION_KEYS}}]
    with pytest.raises(ValueError, match="n=2: add_request queues one completion"):
        engine.add_request(PROMPTS[0], SamplingParams(n=2))
    assert not engine.has_unfinished_requests() and engine.scheduler.block_manager.num_free_blocks == free


def test_choice_seeds_stay_in_torchs_range():
    assert choice_seed(None, 3) is None and choice_seed(-5, 0) == -5 and choice_seed(2**64 - 1, 2) == 1
    assert SamplingParams(seed=2**64 - 1, n=3).for_choice(2).seed == 1


def test_top_k_1_is_greedy(engine):
    greedy = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    top1 = engine.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True), False)
    assert [r["token_ids"] for r in top1] == [r["token_ids"] for r in greedy]


def meta(n, **kw):
    base = dict(temperatures=[1.0] * n, top_ks=[-1] * n, top_ps=[1.0] * n, seeds=[None] * n, steps=[0] * n)
    base.update(kw)
    return SamplingMetadata(**base)


def test_sampler_top_k_and_top_p_keep_only_the_allowed_tokens():
    sampler = Sampler()
    probs = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1])
    logits = probs.log().expand(2000, 5).contiguous()
    top_k = sampler(logits, meta(2000, top_ks=[2] * 2000))
    assert set(top_k.tolist()) == {1, 2}
    # Nucleus of 0.8: 0.4 + 0.3 < 0.8, so token 3 (0.15) completes it.
    top_p = sampler(logits, meta(2000, top_ps=[0.8] * 2000))
    assert set(top_p.tolist()) == {1, 2, 3}


def test_sampler_draws_from_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    tokens = Sampler()(probs.log().expand(20000, 4).contiguous(), meta(20000))
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)
    cold = Sampler()(probs.log().expand(2000, 4).contiguous(), meta(2000, temperatures=[0.05] * 2000))
    assert (cold == 3).float().mean() > 0.99  # low temperature sharpens toward the argmax


def test_sampler_min_p_drops_tokens_below_its_share_of_the_top():
    probs = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1])
    logits = probs.log().expand(2000, 5).contiguous()
    # min_p 0.3: tokens under 0.3 * 0.4 = 0.12 go (0.05 and 0.1), at temperature 1
    tokens = Sampler()(logits, meta(2000, min_ps=[0.3] * 2000))
    assert set(tokens.tolist()) == {1, 2, 3}


def test_sampler_penalties_follow_vllms_formulas():
    vocab = 6
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.9, -0.2, 0.0]]).expand(3, vocab).contiguous()
    prompt, output = [0, 4], [3, 3, 1]
    rows = [
        Penalties(1.5, 0.0, 0.0, prompt, output),  # repetition: prompt and output tokens
        Penalties(1.0, 0.25, 0.5, prompt, output),  # presence and frequency: output tokens only
        None,
    ]
    out = apply_penalties(logits, rows)
    expected = logits.clone()
    for t in (0, 4, 3, 1):  # positive logits divided, negative multiplied
        expected[0, t] = logits[0, t] / 1.5 if logits[0, t] > 0 else logits[0, t] * 1.5
    expected[1, 3] -= 0.25 + 0.5 * 2
    expected[1, 1] -= 0.25 + 0.5 * 1
    torch.testing.assert_close(out, expected)
    # Greedy rows take the penalised argmax: token 1 leads by 2, and loses it to a repetition
    # penalty of 4 on it (3 -> 0.75) or to presence plus frequency (3 - 0.5 - 2 * 1 = 0.5).
    lead = torch.tensor([[1.0, 3.0, 0.0, 0.0, 0.0, 0.0]]).expand(3, vocab).contiguous()
    rows = [Penalties(4.0, 0.0, 0.0, [1], []), Penalties(1.0, 0.5, 1.0, [], [1, 1]), None]
    assert Sampler()(lead, meta(3, temperatures=[0.0] * 3, penalties=rows)).tolist() == [0, 0, 1]


def test_repetition_penalty_gives_transformers_greedy_tokens(tiny):
    """Greedy decoding with a repetition penalty equals transformers' (its
    RepetitionPenaltyLogitsProcessor is vLLM's formula), batched with plain requests."""
    folder, model = tiny
    engine = LLMEngine(folder, dtype="float32", num_kvcache_blocks=32, max_model_len=128)
    penalised = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.8, logprobs=1)
    results = engine.generate(PROMPTS, [penalised, GREEDY, penalised], use_tqdm=False)
    for prompt, r in zip(PROMPTS[::2], results[::2]):
        ids = torch.tensor([prompt])
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                  repetition_penalty=1.8, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
        assert r["token_ids"] == expected
        assert expected != hf_greedy(model, prompt, 16)  # the penalty changed something
    assert results[1]["token_ids"] == hf_greedy(model, PROMPTS[1], 12)
    # log probabilities stay those of the raw logits (vLLM's): the chosen token need not lead
    assert any(next(iter(e.values())) < max(e.values()) for e in results[0]["logprobs"])
    # under speculative decoding a penalised request drafts nothing and keeps its tokens
    spec = LLMEngine(folder, dtype="float32", num_kvcache_blocks=32, max_model_len=128,
                     speculative_config=dict(method="ngram", num_speculative_tokens=3, min_acceptance_rate=0))  # fmt: skip
    again = spec.generate(PROMPTS[::2], penalised, use_tqdm=False)
    assert [r["token_ids"] for r in again] == [r["token_ids"] for r in results[::2]]
    assert spec.get_spec_stats()["num_drafts"] == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"repetition_penalty": 0}, r"repetition_penalty must be a finite number > 0 \(1 means none\), got 0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\] \(0 means none\), got 2.5"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be in"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
    ],
)
def test_penalty_and_min_p_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sharded_checkpoint_and_generation_config_stop_ids(tiny, tmp_path):
    import json

    folder, model = tiny
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    expected = hf_greedy(model, PROMPTS[0], 12)
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    gen["eos_token_id"] = [expected[6], expected[3]]  # a model with two end tokens
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    engine = LLMEngine(tmp_path, num_kvcache_blocks=32, max_model_len=128)
    assert (engine.config.eos_token_id, engine.config.stop_token_ids) == (expected[6], [expected[3]])
    r = engine.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    first = min(expected.index(expected[6]), expected.index(expected[3]))
    assert r["token_ids"] == expected[: first + 1]


def test_checkpoint_problems_are_named_by_the_checkpoint_tensor(tiny, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    folder, _ = tiny

    def variant(name: str, edit) -> Path:
        out = tmp_path / name
        shutil.copytree(folder, out)
        [path] = list(out.glob("*.safetensors"))
        tensors = load_file(path)
        edit(tensors)
        save_file(tensors, path)
        return out

    def drop_q(t):
        del t["model.layers.0.self_attn.q_proj.weight"]

    with pytest.raises(ValueError, match=r"lacks tensors for: model\.layers\.0\.self_attn\.q_proj\.weight"):
        LLMEngine(variant("no_q", drop_q), num_kvcache_blocks=32, max_model_len=128)

    def widen_k(t):
        k = t["model.layers.0.self_attn.k_proj.weight"]
        t["model.layers.0.self_attn.k_proj.weight"] = torch.cat([k, k])

    with pytest.raises(ValueError, match=r"checkpoint tensor 'model\.layers\.0\.self_attn\.k_proj\.weight'.*shard 'k'"):
        LLMEngine(variant("wide_k", widen_k), num_kvcache_blocks=32, max_model_len=128)

    quantized = variant("fp8", lambda t: None)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="pre-quantized .*quant_method='fp8'"):
        LLMEngine(quantized, num_kvcache_blocks=32, max_model_len=128)

    (tmp_path / "fake.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="fake.gguf: not a GGUF file Atom can read"):
        LLMEngine(tmp_path / "fake.gguf")


def test_a_model_is_built_without_random_values_and_torch_init_is_left_as_it_was(tiny, monkeypatch):
    from atom_core.runner.model_runner import ModelRunner

    folder, _ = tiny
    before = {name: getattr(torch.nn.init, name) for name in ("normal_", "kaiming_uniform_", "uniform_")}
    built = []
    instantiate = ModelRunner.instantiate

    def spy(self, make):
        model = instantiate(self, make)
        built.append({name: p.detach().clone() for name, p in model.named_parameters()})
        return model

    monkeypatch.setattr(ModelRunner, "instantiate", spy)
    engine = LLMEngine(folder, num_kvcache_blocks=32, max_model_len=128)
    # as built, before the checkpoint: no draws (nn.Linear and nn.Embedding draw theirs), only
    # constants: zeros where torch would draw, a norm's ones
    drawn = [name for name, p in built[0].items() if p.unique().numel() > 1]
    assert built and not drawn and not built[0]["model.layers.0.self_attn.qkv_proj.weight"].any(), drawn
    # loaded: the checkpoint's values
    assert engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3))[0]["token_ids"]
    assert {name: getattr(torch.nn.init, name) for name in before} == before
    layer = torch.nn.Linear(64, 64)  # a user's module after the engine: drawn as torch draws it
    assert layer.weight.std() > 0.01


def test_a_sampler_plugin_is_picked_by_name(tiny, plugin_manager):
    from atom_core import hookimpl

    class AlwaysSeven:
        def __init__(self, config):
            pass

        def __call__(self, logits, meta):
            return torch.full((logits.shape[0],), 7, dtype=torch.long)

    class Plugin:
        @hookimpl
        def atom_register_samplers(self, registry):
            registry.register("always-seven", AlwaysSeven)

    plugin_manager.register(Plugin(), name="always-seven-plugin")
    engine = LLMEngine(tiny[0], num_kvcache_blocks=32, max_model_len=128, sampler="always-seven")
    r = engine.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0]
    assert r["token_ids"] == [7] * 12
    with pytest.raises(KeyError, match="unknown sampler 'nope'. Known samplers: always-seven, default"):
        LLMEngine(tiny[0], num_kvcache_blocks=32, max_model_len=128, sampler="nope")
