"""Log probabilities equal a float64 log-softmax of transformers' logits, for prompt and generated tokens."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from conftest import record_preemptions  # noqa: E402
from model_utils import build_tiny_model, hf_logits, random_prompts  # noqa: E402

from atom_core import SamplingParams  # noqa: E402
from atom_core.engine.llm_engine import LLMEngine  # noqa: E402

TOP = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    return folder, build_tiny_model("llama", folder)


def reference(model, tokens: list[int]) -> torch.Tensor:
    """float64 log-softmax at every position of `tokens` (row p scores token p + 1)."""
    return torch.log_softmax(hf_logits(model, tokens).double(), dim=-1)


def check(entries, ref_rows, tokens, top):
    assert len(entries) == len(tokens) == len(ref_rows)
    for entry, ref, token in zip(entries, ref_rows, tokens):
        expected = {token, *ref.topk(top).indices.tolist()}
        assert set(entry) == expected and next(iter(entry)) == token  # the chosen token comes first
        for t, value in entry.items():
            assert value == pytest.approx(ref[t].item(), abs=1e-4)


@pytest.mark.parametrize(
    "config",
    [
        dict(),
        dict(enable_prefix_caching=True),
        dict(max_num_batched_tokens=16, enable_prefix_caching=True),  # chunked prompts
    ],
    ids=["plain", "prefix-cache", "chunked"],
)
def test_prompt_and_generated_logprobs_match_transformers(tiny, config):
    folder, model = tiny
    engine = LLMEngine(folder, dtype="float32", num_kvcache_blocks=64, max_model_len=256, **config)
    prompts = random_prompts((1, 17, 40, 33), seed=5)
    shared = prompts[2][:32]
    prompts.append(shared + [7, 8, 9])  # shares two cached blocks with the 40-token prompt
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=TOP, prompt_logprobs=TOP)
    engine.generate(prompts[:3], params, use_tqdm=False)  # fills the prefix cache, if on
    results = engine.generate(prompts, params, use_tqdm=False)
    for prompt, r in zip(prompts, results):
        ref = reference(model, prompt + r["token_ids"])
        n = len(prompt)
        assert r["prompt_logprobs"][0] is None
        check(r["prompt_logprobs"][1:], ref[: n - 1], prompt[1:], TOP)
        check(r["logprobs"], ref[n - 1 : n - 1 + len(r["token_ids"])], r["token_ids"], TOP)
        # Greedy: the chosen token is the most likely one.
        assert all(max(e.values()) == next(iter(e.values())) for e in r["logprobs"])
    if config.get("enable_prefix_caching"):
        # A request asking for prompt log probabilities skips the cache (every prompt position
        # must be computed); one asking only for generated ones still takes its hit.
        assert all(r["num_cached_tokens"] == 0 for r in results)
        gen_only = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=TOP)
        [r] = engine.generate([prompts[-1]], gen_only, use_tqdm=False)
        assert r["num_cached_tokens"] == 32
        ref = reference(model, prompts[-1] + r["token_ids"])
        check(r["logprobs"], ref[len(prompts[-1]) - 1 : -1], r["token_ids"], TOP)
    assert engine.scheduler.block_manager.num_free_blocks == 64


def test_sampled_tokens_get_raw_logprobs_and_none_when_not_asked(tiny):
    folder, model = tiny
    engine = LLMEngine(folder, dtype="float32", num_kvcache_blocks=64, max_model_len=256)
    [prompt] = random_prompts((12,), seed=6)
    # Temperature changes what is sampled, not the reported log probabilities.
    hot = SamplingParams(temperature=5.0, seed=3, max_tokens=5, ignore_eos=True, logprobs=0)
    plain = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    r, q = engine.generate([prompt, prompt], [hot, plain], use_tqdm=False)
    ref = reference(model, prompt + r["token_ids"])
    check(r["logprobs"], ref[len(prompt) - 1 : -1], r["token_ids"], 0)
    assert q["logprobs"] is None and q["prompt_logprobs"] is None and r["prompt_logprobs"] is None


def test_logprobs_survive_speculation_and_preemption(tiny):
    folder, model = tiny
    spec = dict(method="ngram", num_speculative_tokens=3, min_acceptance_rate=0)
    engine = LLMEngine(folder, dtype="float32", num_kvcache_blocks=12, max_model_len=128, speculative_config=spec)
    preempted = record_preemptions(engine.scheduler)
    prompts = [p * 3 for p in random_prompts((9, 11, 7, 13), seed=8)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    results = engine.generate(prompts, params, use_tqdm=False)
    for prompt, r in zip(prompts, results):
        ref = reference(model, prompt + r["token_ids"])
        n = len(prompt)
        check(r["prompt_logprobs"][1:], ref[: n - 1], prompt[1:], 1)
        check(r["logprobs"], ref[n - 1 : -1], r["token_ids"], 2)
    assert preempted and engine.get_spec_stats()["num_drafts"] > 0


def test_too_many_logprobs_is_refused_by_name(tiny):
    folder, _ = tiny
    engine = LLMEngine(folder, dtype="float32", num_kvcache_blocks=64, max_model_len=256)
    with pytest.raises(ValueError, match="prompt_logprobs=21 exceeds max_logprobs=20"):
        engine.add_request([1, 2, 3], SamplingParams(prompt_logprobs=21))
    with pytest.raises(ValueError, match=r"logprobs=-1 \(the whole vocabulary, 256 tokens\) exceeds max_logprobs=20"):
        engine.add_request([1, 2, 3], SamplingParams(logprobs=-1))
    with pytest.raises(ValueError, match="logprobs must be None, an integer >= 0 .* or -1"):
        SamplingParams(logprobs=-2)
    with pytest.raises(ValueError, match="max_logprobs must be an integer >= 0, or -1"):
        LLMEngine(folder, max_logprobs=-2)
    # Past the vocabulary: refused where it is asked, not in a later step.
    wide = LLMEngine(folder, dtype="float32", num_kvcache_blocks=64, max_model_len=256, max_logprobs=1000)
    with pytest.raises(ValueError, match="logprobs=300 exceeds the model's vocabulary of 256 tokens"):
        wide.add_request([1, 2, 3], SamplingParams(logprobs=300))
    assert not wide.has_unfinished_requests()


def test_minus_one_reports_the_whole_vocabulary(tiny):
    folder, model = tiny
    engine = LLMEngine(folder, dtype="float32", num_kvcache_blocks=64, max_model_len=256, max_logprobs=-1)
    [prompt] = random_prompts((9,), seed=9)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=-1, prompt_logprobs=-1)
    [r] = engine.generate([prompt], params, use_tqdm=False)
    ref = reference(model, prompt + r["token_ids"])
    check(r["prompt_logprobs"][1:], ref[: len(prompt) - 1], prompt[1:], 256)
    check(r["logprobs"], ref[len(prompt) - 1 : -1], r["token_ids"], 256)
    assert all(len(e) == 256 for e in r["logprobs"])


def test_a_request_keeps_the_params_it_was_added_with(tiny):
    """Reusing or changing a SamplingParams after add_request does not reach the request (as
    vLLM clones them): a later change could otherwise turn log probabilities on or off midway."""
    folder, _ = tiny
    engine = LLMEngine(folder, dtype="float32", num_kvcache_blocks=64, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    streamed = []
    rid = engine.add_request([1, 2, 3], params, stream_callback=streamed.append)
    engine.step()
    params.logprobs, params.max_tokens = None, 2
    other = engine.add_request([4, 5, 6], params)
    params.logprobs = 50  # past max_logprobs: never checked against a queued request
    results = {}
    while engine.has_unfinished_requests():
        results.update((r["request_id"], r) for r in engine.step())
    assert len(results[rid]["token_ids"]) == 6 and len(results[rid]["logprobs"]) == 6
    assert all(len(out.logprobs) == len(out.output_tokens) for out in streamed)
    assert len(results[other]["token_ids"]) == 2 and results[other]["logprobs"] is None


def test_streamed_outputs_carry_the_logprobs_of_their_tokens(tiny):
    """A stream callback gets each token's log probabilities with the token (speculative
    steps emit several at once), the prompt's with the first tokens, and nothing unasked."""
    folder, _ = tiny
    spec = dict(method="ngram", num_speculative_tokens=3, min_acceptance_rate=0)
    engine = LLMEngine(folder, dtype="float32", num_kvcache_blocks=64, max_model_len=128, speculative_config=spec)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    asked, plain = [], []
    rid = engine.add_request(
        prompt,
        SamplingParams(temperature=0, max_tokens=12, logprobs=2, prompt_logprobs=1),
        stream_callback=asked.append,
    )
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=12), stream_callback=plain.append)
    results = {}
    while engine.has_unfinished_requests():
        for r in engine.step():
            results[r["request_id"]] = r
    result = results[rid]
    assert [t for out in asked for t in out.output_tokens] == result["token_ids"]
    for out in asked:
        assert len(out.logprobs) == len(out.output_tokens)
        assert [next(iter(entry)) for entry in out.logprobs] == out.output_tokens
    assert [e for out in asked for e in out.logprobs] == result["logprobs"]
    assert any(len(out.output_tokens) > 1 for out in asked)  # a verify step emitted several
    with_prompt = [out for out in asked if out.prompt_logprobs is not None]
    assert len(with_prompt) == 1 and with_prompt[0] is next(out for out in asked if out.output_tokens)
    assert with_prompt[0].prompt_logprobs == result["prompt_logprobs"]
    assert all(out.logprobs is None and out.prompt_logprobs is None for out in plain)
