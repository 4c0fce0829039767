"""Tiny random-weight checkpoints built with transformers, the numerical oracle for Atom's models."""

from __future__ import annotations

from pathlib import Path

import torch

from atom_core import SamplingParams

ARCHS = {
    "llama": dict(
        cls="LlamaForCausalLM",
        config="LlamaConfig",
        kwargs=dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    ),
    "llama_tied_rope3": dict(
        cls="LlamaForCausalLM",
        config="LlamaConfig",
        kwargs=dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=50000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "qwen3": dict(
        cls="Qwen3ForCausalLM",
        config="Qwen3Config",
        kwargs=dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    ),
}


NEW_TOKENS = 24


def build_tiny_model(name: str, folder: Path, seed: int = 0):
    """Save a 2-layer random model under `folder`; returns the transformers model (float32, eager)."""
    import transformers

    spec = ARCHS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, spec["config"])(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        attn_implementation="eager",
        **spec["kwargs"],
    )
    model = getattr(transformers, spec["cls"])(config).eval()
    with torch.no_grad():  # random init leaves norms at 1: give the oracle something to check
        for p in model.parameters():
            if p.float().std() == 0 or p.numel() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),  # else a token equal to pad_token_id is masked out
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits at every position of `tokens` (teacher forcing)."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def random_prompts(lengths, seed=1, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def run_with_logits(engine, prompts, max_tokens=NEW_TOKENS):
    """Step the engine by hand, keeping every request's logits at every step."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    logits = {i: [] for i in ids}
    results = {}
    while engine.has_unfinished_requests():
        for r in engine.step():
            results[r["request_id"]] = r
        for rid, row in zip(engine.runner.last_req_ids, engine.runner.last_logits):
            logits[rid].append(row.clone())
    return [results[i] for i in ids], [torch.stack(logits[i]) for i in ids]


def check_against_hf(model, prompts, results, logits):
    for prompt, result, steps in zip(prompts, results, logits):
        expected = hf_greedy(model, prompt, len(result["token_ids"]))
        assert result["token_ids"] == expected, f"prompt of {len(prompt)} tokens"
        # Teacher-forced: the logits that produced each generated token.
        ref = hf_logits(model, prompt + result["token_ids"][:-1])[len(prompt) - 1 :]
        assert steps.shape == ref.shape
        torch.testing.assert_close(steps, ref, atol=1e-4, rtol=0)
