"""Structured output (llguidance through the `structured_output_backends` registry), logit_bias
and min_tokens, on the default model through the Python API."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from conftest import CAT_SCHEMA, make_seq

from atom_core import SamplingParams
from atom_core.engine.fetch import fetch_default_model
from atom_core.engine.llm_engine import LLMEngine
from atom_core.plugin_api import Grammar, StructuredOutputBackend, hookimpl
from atom_core.runner.sampler import SamplingMetadata, process_logits
from atom_core.sched.speculative import wanted_drafts
from atom_core.structured_output.backend import allocate_bitmask, apply_bitmask

ASK = [{"role": "user", "content": "Describe a cat as JSON with its name, colour, age and toys."}]


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(fetch_default_model(quiet=True), max_model_len=512)


@pytest.fixture(scope="module")
def ask(engine):
    return engine.apply_chat_template(ASK)


def test_sampled_requests_under_a_bounded_schema_parse_and_validate(engine, ask):
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured_output={"json": CAT_SCHEMA})
        for i in range(20)
    ]
    results = engine.generate([ask] * 20, params, use_tqdm=False)
    texts = {r["text"] for r in results}
    assert len(texts) > 1  # sampled, not one answer
    for r in results:
        assert r["finish_reason"] == "grammar", r
        value = json.loads(r["text"])
        jsonschema.validate(value, CAT_SCHEMA)
        assert r["text"] == json.dumps(value, separators=(",", ":"), ensure_ascii=False)  # compact: no padding


def test_json_object_regex_choice_and_lark_constrain_greedy_output(engine, ask):
    def run(spec, max_tokens=40):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_output=spec)
        return engine.generate([ask], params, use_tqdm=False)[0]

    short = engine.apply_chat_template([{"role": "user", "content": "Give a JSON object with a cat's name and age."}])
    params = SamplingParams(temperature=0, max_tokens=60, structured_output={"json_object": True})
    assert isinstance(json.loads(engine.generate([short], params, use_tqdm=False)[0]["text"]), dict)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", run({"regex": r"[0-9]{3}-[a-z]{2}"})["text"])
    assert run({"choice": ["tabby", "siamese"]})["text"] in ("tabby", "siamese")
    lark = run({"grammar": 'start: "cat" ("," "cat")*'}, 12)
    # cut by max_tokens: a prefix of the language
    assert re.fullmatch(r"cat(,cat)*,?", lark["text"]) and lark["finish_reason"] == "max_tokens"
    unconstrained = engine.generate([ask], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    assert not unconstrained["text"].startswith("{")  # the constraint, not the model, made the JSON


@pytest.mark.parametrize(
    "spec, says",
    [
        ({"regex": "[0-9"}, "structured_output.regex does not compile"),
        ({"grammar": "start: undefined_rule"}, "structured_output.grammar does not compile"),
        ({"json": "{not json"}, "structured_output.json is not valid JSON"),
        ({"json": CAT_SCHEMA, "backend": "no-such"}, "unknown structured-output backend 'no-such'"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of"),
        ({"choice": []}, "non-empty list"),
        ({"regexp": "a"}, "structured_output has unknown field(s) regexp; known: backend, choice, grammar, json"),
    ],
)
def test_a_bad_grammar_is_a_value_error_at_add_request_and_queues_nothing(engine, ask, spec, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        engine.add_request(ask, SamplingParams(structured_output=spec))
    assert not engine.has_unfinished_requests()


def test_a_constrained_or_biased_request_drafts_nothing_and_reads_whole_logits():
    plain = make_seq(8, temperature=0)
    plain.block_table = [0]  # room for drafts
    assert wanted_drafts(plain, 0, 3, None) == 3
    for extra in ({"structured_output": {"regex": "a+"}}, {"logit_bias": {5: 1.0}}, {"min_tokens": 2}):
        seq = make_seq(8, temperature=0, **extra)
        seq.block_table = [0]
        assert seq.sampling_params.modifies_logits
        assert wanted_drafts(seq, 0, 3, None) == 0


def test_logit_bias_removes_or_forces_a_token(engine, ask):
    greedy = engine.generate([ask], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]["token_ids"]
    banned = engine.generate(
        [ask], SamplingParams(temperature=0, max_tokens=4, logit_bias={greedy[0]: -100}), use_tqdm=False
    )[0]["token_ids"]
    assert banned[0] != greedy[0]
    forced = engine.generate(
        [ask], SamplingParams(temperature=0, max_tokens=4, logit_bias={"1234": 100}), use_tqdm=False
    )[0]["token_ids"]
    assert forced == [1234] * 4  # JSON's string keys are token ids too


def test_min_tokens_delays_eos_and_stop_strings(engine):
    ask = engine.apply_chat_template([{"role": "user", "content": "Say hi."}])
    free = engine.generate([ask], SamplingParams(temperature=0, max_tokens=200), use_tqdm=False)[0]
    assert free["finish_reason"] == "eos"
    n = len(free["token_ids"])
    longer = engine.generate([ask], SamplingParams(temperature=0, max_tokens=200, min_tokens=n + 5), use_tqdm=False)[0]
    assert len(longer["token_ids"]) >= n + 5
    assert longer["token_ids"][: n - 1] == free["token_ids"][: n - 1]  # the same text up to where EOS was
    # a stop string inside the first min_tokens tokens does not end it
    word = free["text"].split()[1]
    early = engine.generate(
        [ask], SamplingParams(temperature=0, max_tokens=40, stop_strings=[word], min_tokens=30), use_tqdm=False
    )[0]
    assert len(early["token_ids"]) >= 30
    # the stop string that ends it is the one a token past min_tokens completes, and the text
    # keeps everything before that one, not only what comes before the first occurrence
    for include in (False, True):
        r = engine.generate(
            ["Count: 1, 2, 3,"],
            SamplingParams(
                temperature=0, max_tokens=30, min_tokens=10, stop_strings=[","], include_stop_str_in_output=include
            ),
            use_tqdm=False,
        )[0]
        whole = engine.tokenizer.decode(r["token_ids"])
        assert r["finish_reason"] == "stop" and len(r["token_ids"]) > 10 and whole.endswith(",")
        assert r["text"] == (whole if include else whole[:-1]) and whole.count(",") > 1


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"logit_bias": {5: 101}}, "logit_bias[5] must be a number in [-100, 100], got 101"),
        ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": [1, 2]}, "logit_bias must be a mapping"),
        ({"min_tokens": -1}, "min_tokens must be an integer >= 0, got -1"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens=9 exceeds max_tokens=8"),
    ],
)
def test_bad_sampling_fields_name_the_field_limit_and_value(fields, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        SamplingParams(**fields)


def test_logit_bias_outside_the_vocabulary_is_refused(engine, ask):
    with pytest.raises(ValueError, match=r"logit_bias names token 99999999, outside the vocabulary \[0, 49152\)"):
        engine.add_request(ask, SamplingParams(logit_bias={99999999: 1}))


def test_process_logits_applies_mask_ban_and_bias_in_place_of_nothing_else():
    logits = torch.zeros(3, 70)
    bitmask = allocate_bitmask(3, 70)
    bitmask[0] = 0
    bitmask[0, 2] = 1 << 3  # row 0: only token 67
    meta = SamplingMetadata(
        temperatures=[0.0] * 3, top_ks=[-1] * 3, top_ps=[1.0] * 3, seeds=[None] * 3, steps=[0] * 3,
        logit_biases=[None, {4: 2.5}, None], banned_token_ids=[None, None, [1, 2]], allowed_bitmask=bitmask,
    )  # fmt: skip
    out = process_logits(logits, meta)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [67]
    assert out[1, 4] == 2.5 and out[1].sum() == 2.5
    assert torch.isinf(out[2, [1, 2]]).all() and torch.isfinite(out[2]).sum() == 68
    assert torch.equal(apply_bitmask(logits, allocate_bitmask(3, 70)), logits)


class _OnlyToken(Grammar):
    def __init__(self, token: int):
        self.token, self.seen = token, 0

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0
        bitmask[row, self.token // 32] = 1 << (self.token % 32)

    def accept_token(self, token_id):
        self.seen += 1
        return token_id == self.token

    def is_terminated(self):
        return self.seen == 3


class _RepeatBackend(StructuredOutputBackend):
    """A third party's backend: the grammar text is a token id, repeated three times."""

    def compile(self, params):
        return _OnlyToken(int(params.grammar))


class _RepeatPlugin:
    @hookimpl
    def atom_register_structured_output_backends(self, registry):
        registry.register("repeat", _RepeatBackend)


def test_a_plugin_backend_is_found_through_the_registry(engine, ask, plugin_manager):
    plugin_manager.register(_RepeatPlugin())
    params = SamplingParams(temperature=0, max_tokens=10, structured_output={"grammar": "77", "backend": "repeat"})
    result = engine.generate([ask], params, use_tqdm=False)[0]
    assert result["token_ids"] == [77, 77, 77] and result["finish_reason"] == "grammar"
