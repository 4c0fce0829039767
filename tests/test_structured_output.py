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
from atom_core.engine.engine_core import bad_words_token_ids
from atom_core.engine.fetch import fetch_default_model
from atom_core.engine.llm_engine import LLMEngine
from atom_core.plugin_api import Grammar, StructuredOutputBackend, hookimpl
from atom_core.runner.sampler import SamplingMetadata, banned_now, process_logits
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


def test_allowed_token_ids_bad_words_and_special_tokens_as_vllm_defines_them(engine):
    ask = engine.apply_chat_template([{"role": "user", "content": "Say hi."}])

    def greedy(**fields):
        params = SamplingParams(temperature=0, max_tokens=fields.pop("max_tokens", 40), **fields)
        return engine.generate([ask], params, use_tqdm=False)[0]

    free = greedy()
    assert free["finish_reason"] == "eos"
    # only the allowed ids are sampled, whatever the model prefers
    allowed = greedy(max_tokens=8, allowed_token_ids=[100, 200, 300])["token_ids"]
    assert set(allowed) <= {100, 200, 300} and free["token_ids"][0] not in allowed

    # a bad word's tokens never appear in a row (as written, or after a space in mid-text);
    # a word of two tokens gets its last banned only after the first
    def occurs(word: list[int], ids: list[int]) -> bool:
        return any(ids[i : i + len(word)] == word for i in range(len(ids)))

    words = free["text"].replace("!", "").replace(".", "").replace("?", "").split()
    two = next(w for w in words if len(engine.tokenizer.encode(" " + w, add_special_tokens=False)) == 2)
    for word in (words[0], words[3], two):
        sequences = bad_words_token_ids(engine.tokenizer, [word])
        assert any(occurs(ids, free["token_ids"]) for ids in sequences), word
        out = greedy(bad_words=[word])["token_ids"]
        assert out and not any(occurs(ids, out) for ids in sequences), (word, sequences, out)
    # special tokens: left out of the text by default, kept when asked; the ids are the same
    start = engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    forced = {"max_tokens": 3, "ignore_eos": True, "logit_bias": {start: 100}}
    assert greedy(**forced)["text"] == "" and greedy(**forced, skip_special_tokens=False)["text"] == "<|im_start|>" * 3
    # the stop token's own text (EOS here) only with include_stop_str_in_output, as in vLLM
    kept = greedy(skip_special_tokens=False)
    assert kept["token_ids"] == free["token_ids"] and kept["text"] == free["text"]
    with_eos = greedy(skip_special_tokens=False, include_stop_str_in_output=True)
    assert with_eos["text"] == free["text"] + engine.tokenizer.eos_token
    # a stop string made of a special token is found only in the text that keeps them
    stopped = greedy(skip_special_tokens=False, stop_strings=["<|im_end|>"], include_stop_str_in_output=True)
    assert stopped["finish_reason"] == "stop" and stopped["text"].endswith("<|im_end|>")


def test_a_stop_token_ids_text_is_left_out_unless_include_stop_str_in_output(engine):
    ask = engine.apply_chat_template([{"role": "user", "content": "Say hi."}])
    free = engine.generate([ask], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    stop = free["token_ids"][2]  # "!" of "Hello there!"
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop], include_stop_str_in_output=include)
        r = engine.generate([ask], params, use_tqdm=False)[0]
        assert r["token_ids"] == free["token_ids"][:3] and r["finish_reason"] == f"stop_{stop}"
        assert r["text"] == engine.tokenizer.decode(free["token_ids"][: 3 if include else 2])


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(engine):
    long = list(range(1000, 1700))  # longer than max_model_len (512)
    params = SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=100)
    cut = engine.generate([long], params, use_tqdm=False)[0]
    same = engine.generate([long[-100:]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert cut["num_prompt_tokens"] == 100 and cut["token_ids"] == same["token_ids"]
    whole = SamplingParams(temperature=0, max_tokens=1, truncate_prompt_tokens=-1)
    assert engine.generate([long], whole, use_tqdm=False)[0]["num_prompt_tokens"] == 512
    with pytest.raises(ValueError, match=re.escape("truncate_prompt_tokens=600 exceeds max_model_len=512")):
        engine.add_request(long, SamplingParams(truncate_prompt_tokens=600))
    with pytest.raises(ValueError, match="allowed_token_ids names token 49152, outside the vocabulary"):
        engine.add_request(long[:10], SamplingParams(allowed_token_ids=[5, 49152]))
    assert not engine.has_unfinished_requests()


def test_banned_now_follows_vllms_bad_word_rule():
    seq = make_seq(4, temperature=0, bad_words=["x"])
    seq.bad_words_token_ids = [[7], [8, 9], [1, 2, 3]]
    assert banned_now(seq) == [7]  # one token: always; two: only after the first
    seq.append_token(8)
    assert banned_now(seq) == [7, 9]
    seq.append_token(1)
    assert banned_now(seq) == [7]
    seq.append_token(2)
    assert banned_now(seq) == [3, 7]
    logits = process_logits(torch.zeros(1, 12), SamplingMetadata.from_seqs([seq]))
    assert torch.isinf(logits[0, [3, 7]]).all() and torch.isfinite(logits[0, [0, 1, 2, 4, 5, 6, 8, 9]]).all()
    allowed = make_seq(4, temperature=0, allowed_token_ids=[2, 5])
    logits = process_logits(torch.arange(12.0).view(1, 12), SamplingMetadata.from_seqs([allowed]))
    assert logits[0, 2] == 2 and logits[0, 5] == 5 and torch.isinf(logits[0]).sum() == 10
    assert allowed.sampling_params.modifies_logits and seq.sampling_params.modifies_logits


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"logit_bias": {5: 101}}, "logit_bias[5] must be a number in [-100, 100], got 101"),
        ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": [1, 2]}, "logit_bias must be a mapping"),
        ({"min_tokens": -1}, "min_tokens must be an integer >= 0, got -1"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens=9 exceeds max_tokens=8"),
        ({"allowed_token_ids": []}, "allowed_token_ids must name at least one token id"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids must hold token ids (integers >= 0), got -2"),
        ({"bad_words": "word"}, "bad_words must be a list of strings, got 'word'"),
        ({"bad_words": [" "]}, "bad_words must hold words (non-blank strings), got ' '"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be an integer >= 1"),
        ({"truncate_prompt_tokens": -2}, "or None, got -2"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens must be True or False, got 'no'"),
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
