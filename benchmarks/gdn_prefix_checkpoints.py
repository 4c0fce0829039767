"""Prefix caching on a Gated DeltaNet hybrid through state checkpoints: time to first token.

A long shared system prompt (2,000 tokens) followed by 32 short questions (10-30 tokens),
sent one after another to a tiny random Qwen3-Next (3 GDN layers, 1 full-attention layer),
with prefix caching and state checkpoints on against off. With checkpoints, the first
request saves its state at its last block boundary and the second one where its prompt
parts from the first (the end of the system prompt's whole blocks); every later question
resumes there and computes only its own tokens.

    python benchmarks/gdn_prefix_checkpoints.py [--system 2000] [--questions 32] [--hidden 256] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from atom_core import SamplingParams
from atom_core.engine.llm_engine import LLMEngine
from atom_core.platform.cpu_features import cpu_features


def build_model(folder: Path, hidden: int, max_len: int) -> None:
    """A random tiny Qwen3-Next checkpoint: layers 0-2 Gated DeltaNet, layer 3 full attention."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3NextConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        partial_rotary_factor=0.5,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=hidden // 4,
        linear_value_head_dim=hidden // 8,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=hidden // 2,
        shared_expert_intermediate_size=hidden,
        mlp_only_layers=[1],
        max_position_embeddings=max_len,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    transformers.Qwen3NextForCausalLM(config).eval().save_pretrained(folder, safe_serialization=True)


def make_engine(folder: Path, on: bool, max_len: int) -> LLMEngine:
    engine = LLMEngine(
        folder,
        dtype="float32",
        enable_prefix_caching=on,
        max_model_len=max_len,
        max_num_seqs=8,
        num_kvcache_blocks=8 * max_len // 16,
    )
    engine.generate([[7] * 64], PARAMS, use_tqdm=False)  # warm-up: kernels loaded, pools mapped
    return engine


PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", type=int, default=2000, help="tokens of the shared system prompt")
    ap.add_argument("--questions", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    print(cpu_features().description(), flush=True)
    torch.set_num_threads(args.threads)
    max_len = 4096
    g = torch.Generator().manual_seed(1)
    system = torch.randint(1, 1024, (args.system,), generator=g).tolist()
    prompts = [
        system + torch.randint(1, 1024, (int(torch.randint(10, 31, (1,), generator=g)),), generator=g).tolist()
        for _ in range(args.questions)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_model(folder, args.hidden, max_len)
        engines = {False: make_engine(folder, False, max_len), True: make_engine(folder, True, max_len)}
        results = {False: [], True: []}
        spent = {False: 0.0, True: 0.0}
        for prompt in prompts:  # interleaved, so a busy neighbour slows both alike
            for on, engine in engines.items():
                t = time.perf_counter()
                results[on].append(engine.generate([prompt], PARAMS, use_tqdm=False)[0])
                spent[on] += time.perf_counter() - t
    off, on, t_off, t_on = results[False], results[True], spent[False], spent[True]
    ms = lambda rs: [1000 * r["ttft"] for r in rs]  # noqa: E731
    same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(on, off))
    hits = [r["num_cached_tokens"] for r in on]
    print(f"tiny Qwen3-Next (hidden {args.hidden}, 3 GDN + 1 attention layers), float32, {args.threads} threads")
    print(f"{args.questions} questions of 10-30 tokens after a {args.system}-token system prompt, one at a time")
    print(f"{'':16} {'TTFT mean ms':>13} {'median':>8} {'first':>8} {'3rd on':>8} {'total s':>8}")
    for name, rs, total in (("checkpoints off", off, t_off), ("checkpoints on", on, t_on)):
        v = ms(rs)
        print(
            f"{name:16} {statistics.mean(v):13.1f} {statistics.median(v):8.1f} {v[0]:8.1f} "
            f"{statistics.mean(v[2:]):8.1f} {total:8.2f}"
        )
    print(
        f"ratio off/on: mean TTFT {statistics.mean(ms(off)) / statistics.mean(ms(on)):.2f}x, "
        f"median {statistics.median(ms(off)) / statistics.median(ms(on)):.2f}x"
    )
    print(
        f"num_cached_tokens with checkpoints: first three {hits[:3]}, then {sorted(set(hits[3:]))}; "
        f"greedy tokens identical for {same}/{len(on)} requests"
    )


if __name__ == "__main__":
    main()
