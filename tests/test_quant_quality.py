"""Quantization quality on the default model, measured with Atom's own prompt log probabilities.

The passage is the GPL-3 text (tests/fixtures/gpl-3.0.txt, copied verbatim as its licence
allows): a few thousand tokens of ordinary English prose. Perplexity is exp of the mean
negative log probability of every passage token after the first.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from atom_core import SamplingParams  # noqa: E402
from atom_core.engine.fetch import fetch_default_model  # noqa: E402
from atom_core.engine.llm_engine import LLMEngine  # noqa: E402

PASSAGE = (Path(__file__).parent / "fixtures" / "gpl-3.0.txt").read_text()[:8000]


def perplexity(**config) -> float:
    engine = LLMEngine(fetch_default_model(quiet=True), max_model_len=4096, kv_cache_memory=256 << 20, **config)
    ids = engine.tokenizer(PASSAGE)["input_ids"]
    assert len(ids) > 1000
    [r] = engine.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    logprobs = [next(iter(e.values())) for e in r["prompt_logprobs"][1:]]
    assert len(logprobs) == len(ids) - 1
    return math.exp(-sum(logprobs) / len(logprobs))


@pytest.fixture(scope="module")
def bf16():
    return perplexity(dtype="bfloat16", quantization="none")


def test_int8_perplexity_within_one_percent_of_bfloat16(bf16):
    assert 1 < bf16 < 100  # a sane model on English prose
    assert perplexity(dtype="bfloat16", quantization="int8") == pytest.approx(bf16, rel=0.01)


def test_int4_perplexity_within_five_percent_of_bfloat16(bf16):
    assert perplexity(dtype="bfloat16", quantization="int4") == pytest.approx(bf16, rel=0.05)


def test_the_default_path_perplexity_matches_its_float32_self():
    """The shipped Q4_1 weights at default settings against the same file dequantized to float32."""
    ref = perplexity(dtype="float32", quantization="none")
    assert perplexity() == pytest.approx(ref, rel=0.01)
