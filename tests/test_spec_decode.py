"""Speculative decoding end to end: drafts change the speed, never the greedy tokens, and the counts are right."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from conftest import (
    record_preemptions,  # noqa: E402
    require_kernel,  # noqa: E402
)
from model_utils import build_tiny_model, random_prompts  # noqa: E402

from atom_core import SamplingParams, hookimpl  # noqa: E402
from atom_core.engine.llm_engine import LLMEngine  # noqa: E402
from atom_core.runner.proposer import Drafts, Proposer  # noqa: E402

NEW = 24


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    build_tiny_model("llama", folder)
    return folder


def copy_heavy_prompts():
    """Prompts that repeat themselves, so prompt lookup finds drafts (of every length around a block)."""
    base = random_prompts((6, 9, 13, 5, 20), seed=3)
    return [p * r for p, r in zip(base, (3, 2, 3, 1, 2))] + random_prompts((1, 17), seed=4)


def generate(folder, prompts, params=None, **config):
    config.setdefault("num_kvcache_blocks", 64)
    engine = LLMEngine(folder, dtype="float32", max_model_len=256, **config)
    params = params or SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    out = engine.generate(prompts, params, use_tqdm=False)
    assert engine.scheduler.block_manager.num_free_blocks == engine.kv_plan.num_blocks
    return [r["token_ids"] for r in out], engine


@pytest.fixture(scope="module")
def plain(llama):
    return generate(llama, copy_heavy_prompts())[0]


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("policy", ["mixed", "prefill_first"])
def test_ngram_greedy_equals_plain_greedy(llama, plain, k, policy):
    spec = dict(method="ngram", num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3)
    # A small token budget chunks the longer prompts while others decode with drafts.
    tokens, engine = generate(
        llama,
        copy_heavy_prompts(),
        speculative_config=spec,
        scheduling_policy=policy,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
    )
    assert tokens == plain
    stats = engine.get_spec_stats()
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] >= stats["num_drafts"]
    assert len(stats["accepted_per_position"]) == k


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_speculation_makes_every_gemm_batch_invariant(llama, quantization):
    """Verify steps (k + 1 rows a request) must round as plain decode steps (1 row) do: with a
    speculative config every Linear's kernel serves every row count alike (float weights:
    oneDNN, the small-row fast path off; quantized groups of 32: the streaming kernel, which
    always is; float32 on AVX2 builds: the streaming kernel at every row count), so greedy
    tokens equal plain greedy under quantized weights too."""
    from atom_core.layers.gemm import gemv_ops

    require_kernel(gemv_ops())  # what it checks is the kernels' choice between row counts
    from atom_core.layers.linear import gemm_kernels

    def invariant(engine):
        return [k.batch_invariant for k in gemm_kernels(engine.runner.model) if hasattr(k, "batch_invariant")]

    prompts = copy_heavy_prompts()
    plain_tokens, plain_engine = generate(llama, prompts, quantization=quantization)
    spec = dict(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    tokens, engine = generate(llama, prompts, quantization=quantization, speculative_config=spec)
    if quantization == "none" and not gemv_ops().F32_EVERY_ROW:  # the 1-8 row fast path beside oneDNN
        assert invariant(plain_engine) and not any(invariant(plain_engine))
    assert invariant(engine) and all(invariant(engine))
    assert tokens == plain_tokens
    assert engine.get_spec_stats()["num_accepted_tokens"] > 0


def test_ngram_under_preemption(llama, plain):
    spec = dict(method="ngram", num_speculative_tokens=3, min_acceptance_rate=0)
    engine = LLMEngine(llama, dtype="float32", max_model_len=128, num_kvcache_blocks=12, speculative_config=spec)
    preempted = record_preemptions(engine.scheduler)
    out = engine.generate(
        copy_heavy_prompts(), SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False
    )
    assert preempted, "the pool was meant to be too small for every request at once"
    assert [r["token_ids"] for r in out] == plain
    assert engine.scheduler.block_manager.num_free_blocks == 12


# -- proposers that know the answer (or deny it), registered as a third party would -----


class OracleProposer(Proposer):
    """Drafts the target's own greedy continuation (or, with `wrong`, a token off by one)."""

    answers: dict[tuple[int, ...], list[int]] = {}
    wrong = False

    def propose(self, inp):
        out = []
        for seq, new, limit in zip(inp.seqs, inp.new_token_ids, inp.max_drafts):
            ref = self.answers[tuple(seq.prompt_token_ids)]
            done = seq.num_completion_tokens + len(new)
            drafts = ref[done : done + limit]
            out.append(Drafts([(t + 1) % 256 for t in drafts] if self.wrong else drafts))
        return out


class WrongProposer(OracleProposer):
    wrong = True


class OraclePlugin:
    @hookimpl
    def atom_register_proposers(self, registry):
        registry.register("oracle", OracleProposer)
        registry.register("wrong", WrongProposer)


@pytest.fixture
def oracle(plugin_manager, plain):
    plugin_manager.register(OraclePlugin(), name="oracle-proposer")
    OracleProposer.answers = {tuple(p): t for p, t in zip(copy_heavy_prompts(), plain)}


@pytest.mark.parametrize("k", [1, 3])
def test_a_draft_equal_to_the_target_is_always_accepted(llama, plain, oracle, k):
    max_tokens = 1 + 3 * (k + 1)  # the prefill's token, then three full runs of k + 1
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    spec = dict(method="oracle", num_speculative_tokens=k)
    tokens, engine = generate(llama, copy_heavy_prompts(), params, speculative_config=spec)
    assert tokens == [t[:max_tokens] for t in plain]
    stats = engine.get_spec_stats()
    n = len(plain)
    assert stats["num_drafts"] == 3 * n and stats["num_draft_tokens"] == 3 * k * n
    assert stats["acceptance_rate"] == 1.0 and stats["mean_acceptance_length"] == k + 1
    assert stats["accepted_per_position"] == [3 * n] * k
    assert engine.timings["steps"] == 4  # one prefill step, then three verify steps


def test_an_always_wrong_draft_costs_nothing_but_time(llama, plain, oracle):
    spec = dict(method="wrong", num_speculative_tokens=2, min_acceptance_rate=0)
    tokens, engine = generate(llama, copy_heavy_prompts(), speculative_config=spec)
    assert tokens == plain
    stats = engine.get_spec_stats()
    assert stats["num_drafts"] > 0 and stats["num_accepted_tokens"] == 0
    assert stats["acceptance_rate"] == 0.0 and stats["mean_acceptance_length"] == 1.0


def test_requests_whose_drafts_fail_stop_drafting(llama, plain, oracle):
    spec = dict(method="wrong", num_speculative_tokens=2, min_acceptance_rate=0.6, draft_retry_after=1000)
    tokens, engine = generate(llama, copy_heavy_prompts(), speculative_config=spec)
    assert tokens == plain
    # One failed verification each pauses every request for longer than it runs.
    assert engine.get_spec_stats()["num_drafts"] == len(plain)


@pytest.mark.parametrize("skips", [False, True])
def test_a_proposer_is_called_every_step_unless_it_skips_idle_ones(llama, plain, oracle, monkeypatch, skips):
    """A proposer with state to keep (KV of its own) sees every step, also when no request
    wants drafts; one that sets `skips_idle_steps` (prompt lookup) is spared those calls."""
    calls = []
    monkeypatch.setattr(WrongProposer, "skips_idle_steps", skips)
    original = WrongProposer.propose

    def propose(self, inp):
        calls.append(max(inp.max_drafts, default=0))
        return original(self, inp)

    monkeypatch.setattr(WrongProposer, "propose", propose)
    spec = dict(method="wrong", num_speculative_tokens=2, min_acceptance_rate=0.6, draft_retry_after=1000)
    tokens, engine = generate(llama, copy_heavy_prompts(), speculative_config=spec)
    assert tokens == plain
    assert calls and (0 in calls) != skips  # every request paused after its first miss: idle steps follow
    if not skips:
        assert len(calls) == engine.timings["steps"]


class CountingSampler:
    """A plugin's sampler: the argmax, counting the rows it was given."""

    rows = 0

    def __init__(self, config):
        pass

    def __call__(self, logits, meta):
        CountingSampler.rows += logits.shape[0]
        return logits.argmax(dim=-1)


class SamplerPlugin:
    @hookimpl
    def atom_register_samplers(self, registry):
        registry.register("counting", CountingSampler)


def test_a_plugin_sampler_picks_the_tokens_of_rows_without_drafts(llama, plain, oracle, plugin_manager):
    """Rows with drafts go to the verifier; every other row, in the same steps too, to Config.sampler."""
    plugin_manager.register(SamplerPlugin(), name="counting-sampler")
    CountingSampler.rows = 0
    spec = dict(method="wrong", num_speculative_tokens=2, min_acceptance_rate=0.6, draft_retry_after=1000)
    tokens, engine = generate(llama, copy_heavy_prompts(), speculative_config=spec, sampler="counting")
    assert tokens == plain
    # Each request drafts once (the first verify step), then pauses: every other token is the sampler's.
    assert engine.get_spec_stats()["num_drafts"] == len(plain)
    assert CountingSampler.rows == sum(len(t) for t in plain) - len(plain)


class ShortProposer(OracleProposer):
    def propose(self, inp):
        return super().propose(inp)[:-1]


class OutOfVocabProposer(OracleProposer):
    def propose(self, inp):
        return [Drafts([10**6]) for _ in inp.seqs]


class BadProposers:
    @hookimpl
    def atom_register_proposers(self, registry):
        registry.register("short", ShortProposer)
        registry.register("oov", OutOfVocabProposer)


@pytest.mark.parametrize(
    "method, error", [("short", "returned 0 entries for 1 drafting rows"), ("oov", r"drafted \[1000000\]")]
)
def test_a_proposer_breaking_its_contract_is_named(llama, oracle, plugin_manager, method, error):
    plugin_manager.register(BadProposers(), name="bad-proposers")
    engine = LLMEngine(
        llama, dtype="float32", max_model_len=256, num_kvcache_blocks=64, speculative_config=dict(method=method)
    )
    with pytest.raises(Exception, match=f"proposer '{method}' {error}"):
        engine.generate([copy_heavy_prompts()[0]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert engine.scheduler.block_manager.num_free_blocks == 64


def test_a_stop_inside_an_accepted_run_ends_the_request_there(llama, plain, oracle):
    prompt, ref = copy_heavy_prompts()[0], plain[0]
    j = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i])  # a token first seen at j
    spec = dict(method="oracle", num_speculative_tokens=4)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, stop_token_ids=[ref[j]])
    engine = LLMEngine(llama, dtype="float32", max_model_len=256, num_kvcache_blocks=64, speculative_config=spec)
    [out] = engine.generate([prompt], params, use_tqdm=False)
    assert out["token_ids"] == ref[: j + 1] and out["finish_reason"] == f"stop_{ref[j]}"
    # Each verify step emits 4 accepted drafts and the target's token; the step holding the
    # stop commits only up to it, and nothing past the stop is counted.
    steps = -(-j // 5)
    last = j - 5 * (steps - 1)  # tokens the last step committed
    full_steps = steps - 1 + (last == 5)  # steps whose target token was committed too
    stats = engine.get_spec_stats()
    assert stats["num_drafts"] == steps
    assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] == j - full_steps
    assert engine.scheduler.block_manager.num_free_blocks == 64


def test_a_seeded_sampled_request_is_the_same_alone_or_batched(llama):
    spec = dict(method="ngram", num_speculative_tokens=3, min_acceptance_rate=0)
    prompts = copy_heavy_prompts()
    seeded = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=7, max_tokens=NEW, ignore_eos=True)
    others = SamplingParams(temperature=1.0, max_tokens=NEW, ignore_eos=True)
    alone, _ = generate(llama, [prompts[0]], seeded, speculative_config=spec)
    engine = LLMEngine(llama, dtype="float32", max_model_len=256, num_kvcache_blocks=64, speculative_config=spec)
    out = engine.generate(prompts, [seeded] + [others] * (len(prompts) - 1), use_tqdm=False)
    assert out[0]["token_ids"] == alone[0]
    assert engine.get_spec_stats()["num_drafts"] > 0


def test_greedy_requests_do_not_draft_in_steps_of_disable_by_batch_size_requests(llama, plain, oracle):
    """vLLM's `disable_by_batch_size`, for greedy requests: their tokens are the same either
    way. A sampled request keeps its own gate, so a seeded one is the same alone or batched."""
    prompts = copy_heavy_prompts()
    spec = dict(method="oracle", num_speculative_tokens=2, disable_by_batch_size=2)
    # All requests run together to the end (ignore_eos, same max_tokens): no step holds fewer than two.
    tokens, engine = generate(llama, prompts, speculative_config=spec)
    assert tokens == plain and engine.get_spec_stats()["num_drafts"] == 0
    tokens, engine = generate(llama, prompts[:1], speculative_config=spec)  # alone: it drafts
    assert tokens == plain[:1] and engine.get_spec_stats()["num_drafts"] > 0

    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=NEW, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    alone, engine = generate(llama, prompts[:1], seeded, speculative_config=spec)
    drafts_alone = engine.get_spec_stats()["num_drafts"]
    assert drafts_alone > 0
    engine = LLMEngine(llama, dtype="float32", max_model_len=256, num_kvcache_blocks=64, speculative_config=spec)
    out = engine.generate(prompts, [seeded] + [greedy] * (len(prompts) - 1), use_tqdm=False)
    assert out[0]["token_ids"] == alone[0]
    assert [r["token_ids"] for r in out[1:]] == plain[1:]
    assert engine.get_spec_stats()["num_drafts"] == drafts_alone  # the sampled request's, and no other's
    assert engine.scheduler.block_manager.num_free_blocks == 64


def test_speculative_config_errors_name_the_problem(llama):
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        LLMEngine(llama, speculative_config=dict(method="ngram", disable_by_batch_size=0))
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        LLMEngine(llama, speculative_config=dict(method="ngram", prompt_lookup_min=5, prompt_lookup_max=2))
    with pytest.raises(Exception, match="no_such_method"):
        LLMEngine(llama, num_kvcache_blocks=16, speculative_config=dict(method="no_such_method"))
    with pytest.raises(ValueError, match="spyre"):
        LLMEngine(llama, num_kvcache_blocks=64, scheduling_policy="spyre", speculative_config=dict(method="ngram"))


class HalfRightProposer(OracleProposer):
    """The target's own next token, then wrong ones: every run is accepted only partly."""

    def propose(self, inp):
        out = super().propose(inp)
        return [Drafts(d.token_ids[:1] + [(t + 1) % 256 for t in d.token_ids[1:]]) for d in out]


class HalfRightPlugin:
    @hookimpl
    def atom_register_proposers(self, registry):
        registry.register("half_right", HalfRightProposer)


@pytest.mark.parametrize("method", ["ngram", "half_right"])
def test_a_gdn_hybrid_keeps_the_state_of_the_last_accepted_token(tmp_path, plugin_manager, method):
    """GDN state after a partly accepted run must be the state after the last accepted token,
    not after the last draft: a wrong state changes every later token."""
    from model_utils import make_gdn_engine

    plugin_manager.register(HalfRightPlugin(), name="half-right")
    build_tiny_model("qwen3_next", tmp_path)
    prompts = copy_heavy_prompts()
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    plain_engine = make_gdn_engine(tmp_path, max_num_seqs=8)
    plain_tokens = [r["token_ids"] for r in plain_engine.generate(prompts, params, use_tqdm=False)]
    OracleProposer.answers = {tuple(p): t for p, t in zip(prompts, plain_tokens)}
    spec = dict(method=method, num_speculative_tokens=3, min_acceptance_rate=0, prompt_lookup_min=1)
    engine = make_gdn_engine(tmp_path, max_num_seqs=8, speculative_config=spec, max_num_batched_tokens=48)
    tokens = [r["token_ids"] for r in engine.generate(prompts, params, use_tqdm=False)]
    assert tokens == plain_tokens
    stats = engine.get_spec_stats()
    assert stats["num_draft_tokens"] > stats["num_accepted_tokens"]  # rejected drafts: the state rolls back
    if method == "half_right":
        assert stats["num_accepted_tokens"] == stats["num_drafts"]  # exactly one of each run
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == 96 and len(bm.per_req_cache_free_groups) == 8


# -- the pieces on their own -------------------------------------------------------------


def test_ngram_lookup_takes_the_longest_suffix_at_its_earliest_occurrence():
    np = pytest.importorskip("numpy")
    from atom_spec.ngram import lookup

    t = np.array([5, 6, 7, 9, 5, 6, 8, 1, 5, 6, 7, 2, 5, 6, 7])
    assert lookup(t, 1, 3, 2) == [9, 5]  # "5 6 7" first at 0; the later match at 8 loses
    assert lookup(t, 1, 2, 3) == [9, 5, 6]  # "6 7" first at 1
    assert lookup(np.array([1, 2, 3]), 1, 3, 2) == []  # the suffix alone matches only itself
    assert lookup(np.array([4, 4]), 1, 1, 5) == [4]  # drafts stop at the end of the context
    # ids whose bytes repeat across token boundaries (a byte search must stay on whole tokens)
    t = np.array([256 * 257, 1, 1 + 256, 0, 257, 1])
    assert lookup(t, 2, 2, 1) == [] and lookup(t, 1, 1, 1) == [257]
    rng = np.random.default_rng(0)
    for _ in range(3000):  # against a plain scan
        t = rng.integers(0, int(rng.choice([3, 300, 70000])), int(rng.integers(1, 40))) * int(rng.choice([1, 257]))
        lo, hi, k = int(rng.integers(1, 4)), int(rng.integers(1, 6)), int(rng.integers(1, 5))
        ref = []
        for n in range(min(hi, len(t) - 1), lo - 1, -1):
            hits = [p for p in range(len(t) - n) if (t[p : p + n] == t[len(t) - n :]).all()]
            if hits:
                ref = t[hits[0] + n : hits[0] + n + k].tolist()
                break
        assert lookup(t, lo, hi, k) == ref


def test_draft_gate_opens_positions_as_they_pay_and_backs_off_when_they_do_not():
    from atom_core.sched.speculative import DraftGate

    gate, done = DraftGate(min_rate=0.5, retry_after=4), 0
    assert gate.drafts(3, done) == 3  # a new request drafts all k
    gate.record(3, 1, done)  # positions past the first start on probation: one miss closes them
    assert gate.accept == [1.0, 0.25, 0.25] and gate.drafts(3, done) == 1
    gate.record(1, 1, done)  # every draft taken: the closed positions open on probation
    assert gate.drafts(3, done) == 3
    gate.record(3, 2, done)  # the third rejected: closed again
    assert gate.drafts(3, done) == 2
    gate.record(2, 2, done)  # both taken: the third back on probation
    assert gate.drafts(3, done) == 3
    gate.record(3, 1, done)  # the second rejected: its average 0.875 -> 0.44, closed
    assert gate.accept[1] < 0.5 and gate.drafts(3, done) == 1
    gate.record(1, 0, done)  # the first position was trusted: one miss leaves it open
    assert gate.drafts(3, done) == 1
    pauses = []
    for _ in range(4):  # the first position fails: paused, then one probe, the pause doubling
        gate.record(1, 0, done)
        pauses.append(gate.paused_until - done)
        assert gate.drafts(3, done) == 0 and gate.drafts(3, gate.paused_until - 1) == 0
        done = gate.paused_until
        assert gate.drafts(3, done) == 1  # probation
    assert pauses == [4, 8, 16, 32]
    gate.record(1, 0, done)
    assert gate.paused_until - done == 64 == 16 * gate.retry_after  # capped
    done = gate.paused_until
    gate.record(gate.drafts(3, done), 1, done)  # the probe pays: pauses start over, every position reopens
    assert gate.pause == 0 and gate.drafts(3, done) == 3
    assert DraftGate(min_rate=0, retry_after=4).drafts(3, 0) == 3  # no gate


def test_a_free_text_request_pays_one_round_of_k_drafts_then_one_at_a_time():
    """What the gate costs a request whose drafts miss: k rows once, then single probes."""
    from atom_core.sched.speculative import DraftGate

    gate, done, rows = DraftGate(min_rate=0.5, retry_after=64), 0, []
    while done < 200:
        n = gate.drafts(4, done)
        if n:
            gate.record(n, 0, done + 1)
            rows.append(n)
        done += 1
    assert rows == [4, 1, 1, 1]  # trusted start, one more miss pauses 64 tokens, probes pause 128


def test_a_seeded_request_keeps_its_tokens_when_the_budget_is_short(llama):
    """Requests ahead of a seeded sampled one spend the step's token budget: it then waits a
    step rather than verify fewer drafts (a verified draft draws unlike a plain sample), so
    its tokens are the same alone and batched."""
    folder = llama
    spec = dict(
        method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3, min_acceptance_rate=0
    )
    target = random_prompts((40,), seed=11)[0]
    seeded = SamplingParams(temperature=1.0, seed=123, max_tokens=60, ignore_eos=True)

    def run(others: int) -> list[int]:
        engine = LLMEngine(folder, dtype="float32", max_model_len=160, num_kvcache_blocks=80,
                           max_num_batched_tokens=21, speculative_config=spec)  # fmt: skip
        for i in range(others):  # short greedy prompts whose outputs repeat: 4 drafts a step
            engine.add_request(
                [1, 2, 3, 4, 5][: 2 + i % 4], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
            )
        rid = engine.add_request(target, seeded)
        results = {}
        while engine.has_unfinished_requests():
            results.update((r["request_id"], r) for r in engine.step())
        assert engine.get_spec_stats()["num_drafts"] > 0
        return results[rid]["token_ids"]

    assert run(5) == run(0)
