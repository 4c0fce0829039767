"""Greedy tokens and logits match transformers' own Llama and Qwen3, float32, eager attention."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from conftest import record_preemptions  # noqa: E402
from model_utils import (  # noqa: E402
    ARCHS,
    NEW_TOKENS,
    assert_half_close,
    check_against_hf,
    half_references,
    hf_greedy,
    random_prompts,
    run_with_logits,
    tiny_models,
)

from atom_core import SamplingParams  # noqa: E402
from atom_core.engine.llm_engine import LLMEngine  # noqa: E402
from atom_core.layers.gemm import StreamingGemm, gemv_ops  # noqa: E402
from atom_core.layers.linear import Linear  # noqa: E402

PROMPT_LENS = (1, 15, 16, 17, 40)  # around the 16-token block edges


tiny = tiny_models(*sorted(n for n, s in ARCHS.items() if s.get("attention", "mha") == "mha"))


def test_batch_of_mixed_lengths_matches_transformers(tiny):
    folder, model = tiny
    engine = LLMEngine(folder, dtype="float32", num_kvcache_blocks=64, max_model_len=256)
    # Unwritten slots may hold anything: a kernel that reads past a request's length fails
    # here. (The null block past the pool is the kernel's own, zero by construction.)
    engine.runner.kv_cache_tensors["kv_cache"][:, :, :, :64].fill_(float("nan"))
    prompts = random_prompts(PROMPT_LENS)
    results, logits = run_with_logits(engine, prompts)
    check_against_hf(model, prompts, results, logits)
    assert [r["finish_reason"] for r in results] == ["max_tokens"] * len(prompts)
    assert engine.scheduler.block_manager.num_free_blocks == 64


def test_portable_torch_path_matches_transformers(tiny, monkeypatch):
    """The same batch with every C++ and oneDNN kernel off: the path other devices take."""
    from atom_attention.mha.builder import MHAMetadataBuilder
    from atom_attention.mha.torch_paged import TorchPagedAttention
    from atom_core.layers import ops

    monkeypatch.setattr(MHAMetadataBuilder, "impl_cls", TorchPagedAttention)
    monkeypatch.setattr(ops, "_native", lambda x: None)
    monkeypatch.setenv("ATOM_DISABLE_ONEDNN", "1")
    monkeypatch.setenv("ATOM_DISABLE_GEMV", "1")
    folder, model = tiny
    engine = LLMEngine(folder, dtype="float32", num_kvcache_blocks=64, max_model_len=256)
    assert all(type(m.impl) is TorchPagedAttention for m in engine.runner.attn_layers)
    assert all(m.gemm is torch.nn.functional.linear for m in engine.runner.model.modules() if hasattr(m, "gemm"))
    engine.runner.kv_cache_tensors["kv_cache"][:, :, :, :64].fill_(float("nan"))
    prompts = random_prompts(PROMPT_LENS + (3, 60, 33))  # more than 4 requests: chunked decode
    results, logits = run_with_logits(engine, prompts)
    check_against_hf(model, prompts, results, logits)


def test_prefix_caching_matches_transformers(tiny):
    folder, model = tiny
    engine = LLMEngine(folder, dtype="float32", num_kvcache_blocks=64, max_model_len=256, enable_prefix_caching=True)
    base = random_prompts([48], seed=2)[0]
    tails = random_prompts([1, 3, 9, 20], seed=3)
    first = [base[:33] + tails[0], base + tails[1]]
    # The second wave shares 16..48 tokens with the first; two of its prompts also share with each other.
    second = [base[:16] + tails[2], base[:40] + tails[3], base[:40] + tails[3][:5], list(base)]
    r1, l1 = run_with_logits(engine, first)
    r2, l2 = run_with_logits(engine, second)
    check_against_hf(model, first + second, r1 + r2, l1 + l2)
    assert [r["num_cached_tokens"] for r in r2] == [16, 32, 32, 32]
    assert engine.scheduler.block_manager.num_free_blocks == 64


def test_preemption_mid_generation_matches_transformers(tiny):
    folder, model = tiny
    # 8 blocks of 16 tokens: five requests growing to 209 tokens in all cannot all stay.
    engine = LLMEngine(folder, dtype="float32", num_kvcache_blocks=8, max_model_len=128)
    preempted = record_preemptions(engine.scheduler)
    prompts = random_prompts(PROMPT_LENS)
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), False)
    assert len(preempted) >= 2
    for prompt, result in zip(prompts, results):
        assert result["token_ids"] == hf_greedy(model, prompt, NEW_TOKENS)
    assert engine.scheduler.block_manager.num_free_blocks == 8


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_logits_stay_close(tiny, dtype, request):
    """bfloat16 and float16 weights and activations, on whichever path this CPU gives them
    (float16 and AVX2's bfloat16: the streaming kernel widening the weights at every row
    count), against transformers' float32 model."""
    folder, model = tiny
    references = half_references(request.node.callspec.params["tiny"], model, getattr(torch, dtype))
    engine = LLMEngine(folder, dtype=dtype, num_kvcache_blocks=64, max_model_len=256)
    assert engine.runner.model.model.embed_tokens(torch.tensor([0])).dtype == getattr(torch, dtype)
    if dtype == "float16" and gemv_ops() is not None:  # not torch's float16 GEMM (a twentieth of the rate)
        linears = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
        assert linears and all(isinstance(m.gemm, StreamingGemm) and m.gemm.every_row for m in linears)
    prompts = random_prompts(PROMPT_LENS + (70,))  # a prompt past the streaming kernel's 64-row chunks
    results, logits = run_with_logits(engine, prompts, max_tokens=4)
    for prompt, result, steps in zip(prompts, results, logits):
        assert_half_close(steps, prompt + result["token_ids"][:-1], len(prompt) - 1, references)


def test_chunked_prefill_prefix_caching_and_preemption_match_transformers(tiny):
    """Prompts longer than the windowed families' windows, in chunks of at most 16 tokens (a chunk
    crosses the window's edge), two waves sharing prefixes, a pool small enough that a request
    is preempted: 24 greedy tokens each, as transformers gives them."""
    folder, model = tiny
    engine = LLMEngine(
        folder, dtype="float32", num_kvcache_blocks=8, max_model_len=128, enable_prefix_caching=True,
        max_num_batched_tokens=32, long_prefill_token_threshold=16,
    )  # fmt: skip
    preempted = record_preemptions(engine.scheduler)
    base = random_prompts([50], seed=8)[0]
    waves = [
        [base + [5, 6], *random_prompts([30, 31, 29], seed=9)],  # 16 blocks at their longest, in a pool of 8
        [base[:40] + [7], base[:33], random_prompts([70], seed=10)[0]],
    ]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    cached = []
    for wave in waves:
        results = engine.generate(wave, params, use_tqdm=False)
        for prompt, result in zip(wave, results):
            assert result["token_ids"] == hf_greedy(model, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
        cached += [r["num_cached_tokens"] for r in results]
    assert preempted, "the pool was meant to preempt a request"
    assert any(cached[2:]), cached
    assert engine.scheduler.block_manager.num_free_blocks == 8


def test_a_padding_policy_refuses_windowed_attention_by_name(tmp_path):
    from model_utils import build_tiny_model

    folder = tmp_path / "mistral"
    build_tiny_model("mistral", folder)
    with pytest.raises(ValueError, match=r"scheduling_policy='spyre' pads batches.*sliding windows.*layers \[0, 1\]"):
        LLMEngine(folder, dtype="float32", num_kvcache_blocks=64, max_model_len=256, scheduling_policy="spyre")
