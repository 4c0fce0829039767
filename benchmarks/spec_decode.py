"""Speculative decoding with prompt lookup ("ngram") on SmolLM2: Atom with drafts against Atom without.

Two workloads through the chat template, greedy, each request ending at its own EOS
(or `--max-tokens`):

* copy-heavy: the model is asked to repeat or lightly rewrite a passage given in the
  prompt, so most of its answer is already in its context;
* free generation: open questions, whose answers share little with the prompt.

Each runs at batch 1 (requests one after another) and batch 8 (eight at once). Both
engines are loaded side by side and measured alternately, `--rounds` times: tokens/s is
each engine's best round, the ratio the median of the rounds' ratios (a round's two runs
share the machine's mood, so the pairing cancels most of the noise of a shared host).
tokens/s counts generated tokens over wall time, prefill included. "wasted rows" counts the
rejected drafts per 100 generated tokens: at batch 8 each costs about a token's compute,
and it does not depend on the machine's noise. Greedy requests do not draft in steps of
`--disable-by-batch-size` requests or more (`SpeculativeConfig.disable_by_batch_size`, vLLM's
knob): from about four rows the default model's 4-bit GEMMs are compute-bound here, and a
batch-8 draft pays only when it is nearly always right. The
greedy tokens of both engines are compared request by request ("same tokens"). A
speculative engine runs one GEMM kernel at every row count (`linear.batch_invariant_gemms`),
so drafting never changes its tokens. With quantized groups of 32 (the default model) that
kernel is the one plain decoding uses too, so the two engines agree token for token; with
float weights the plain engine's 1-8 row kernel rounds differently from oneDNN, and the two
can part at a near tie.

    .venv/bin/python benchmarks/spec_decode.py [--k 4] [--dtype float32|bfloat16]
        [--quantization auto|none|int8|int4] [--max-tokens 128] [--rounds 5] [--threads 2]
        [--disable-by-batch-size 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from atom_core import SamplingParams
from atom_core.engine.llm_engine import LLMEngine
from atom_core.platform.cpu_features import cpu_features

PASSAGES = [
    "The old lighthouse stood at the edge of the cliff for more than a century. Every night its keeper climbed "
    "the spiral stairs, trimmed the wick and watched the beam sweep across the dark water, warning ships away "
    "from the rocks below.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make glucose "
    "and oxygen. It takes place mainly in the leaves, inside small structures called chloroplasts.",
    "To make a simple bread, mix flour, water, salt and yeast into a dough. Knead it for ten minutes, let it rise "
    "for an hour, shape it into a loaf and bake it in a hot oven until the crust is golden brown.",
    "The city council met on Tuesday to discuss the new bicycle lanes. Several residents spoke in favour of the "
    "plan, while shop owners on the main street worried about losing parking spaces for their customers.",
]
COPY_TASKS = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Rewrite the following text, keeping its meaning and most of its words:\n\n{}",
]
FREE = [
    "Write a short story about a robot who learns to paint.",
    "What are the main causes of the seasons on Earth?",
    "Give me three tips for learning a new language.",
    "Explain how a refrigerator keeps food cold.",
    "Describe a walk through a forest in autumn.",
    "Why do cats purr?",
    "What should I pack for a weekend camping trip?",
    "Summarise the history of the printing press.",
]


def workloads() -> dict[str, list[str]]:
    copy = [task.format(p) for p in PASSAGES for task in COPY_TASKS]
    return {"copy-heavy": copy, "free": FREE}


def run(engine: LLMEngine, prompts: list[list[int]], batch: int, params: SamplingParams) -> tuple[float, list]:
    """Generated tokens per second over `prompts`, `batch` at a time; and the outputs."""
    outputs, tokens = [], 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        for r in engine.generate(prompts[i : i + batch], params, use_tqdm=False):
            outputs.append(r["token_ids"])
            tokens += len(r["token_ids"])
    return tokens / (time.perf_counter() - start), outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-acceptance-rate", type=float, default=None, help="the draft gate (default: Config's)")
    ap.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=4,
        help="greedy requests stop drafting in steps of this many requests (0: never); 4 where the 4-bit GEMMs "
        "turn compute-bound on this 2-core CPU",
    )
    ap.add_argument("--quantization", default="auto", help="auto (the default model's Q4_1 weights), none, int8, int4")
    args = ap.parse_args()
    print(cpu_features().description(), flush=True)
    torch.set_num_threads(args.threads)

    spec = dict(method="ngram", num_speculative_tokens=args.k, prompt_lookup_min=2, prompt_lookup_max=4)
    if args.min_acceptance_rate is not None:
        spec["min_acceptance_rate"] = args.min_acceptance_rate
    if args.disable_by_batch_size:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    common = dict(dtype=args.dtype, quantization=args.quantization, max_model_len=1024, kv_cache_memory=512 << 20)
    plain = LLMEngine(**common)
    drafting = LLMEngine(speculative_config=spec, **common)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    def chat(text: str) -> list[int]:
        return plain.apply_chat_template([{"role": "user", "content": text}])

    print(
        f"SmolLM2-135M-Instruct, {args.dtype}, quantization={args.quantization}, {args.threads} threads, "
        f"ngram k={args.k}, disable_by_batch_size={args.disable_by_batch_size or None}, greedy, <= {args.max_tokens} tokens"
    )
    print(
        "| workload | batch | without (tok/s) | with ngram (tok/s) | ratio | acceptance rate | mean acceptance length "
        "| wasted rows | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, texts in workloads().items():
        prompts = [chat(t) for t in texts]
        for batch in (1, 8):
            best_plain = best_spec = 0.0
            ratios, stats, same = [], None, 0
            for _ in range(args.rounds):
                plain_rate, ref = run(plain, prompts, batch, params)
                best_plain = max(best_plain, plain_rate)
                before = drafting.get_spec_stats()
                rate, out = run(drafting, prompts, batch, params)
                best_spec = max(best_spec, rate)
                ratios.append(rate / plain_rate)
                same = sum(a == b for a, b in zip(out, ref))
                after = drafting.get_spec_stats()
                drafts = after["num_drafts"] - before["num_drafts"]
                draft_tokens = after["num_draft_tokens"] - before["num_draft_tokens"]
                accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
                wasted = 100 * (draft_tokens - accepted) / sum(len(t) for t in out)
                stats = (accepted / draft_tokens if draft_tokens else 0.0, 1 + accepted / drafts if drafts else 1.0)
            print(
                f"| {name} | {batch} | {best_plain:.1f} | {best_spec:.1f} | {statistics.median(ratios):.2f}x "
                f"| {stats[0]:.2f} | {stats[1]:.2f} | {wasted:.1f} | {same}/{len(prompts)} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
