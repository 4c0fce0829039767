"""Perplexity of the default model under each weight format, through Atom's own quantized kernels.

Two tables over the same text in windows of `--window` tokens (default: the GPL-3 text of
/usr/share/common-licenses, else README.md):

* Atom end to end: an `LLMEngine` per `Config` setting (dtype, quantization), perplexity from
  its own `prompt_logprobs`;
* formats `Config` does not offer (other group sizes, symmetric groups, other LM-head
  formats): transformers' LlamaForCausalLM on the converted SmolLM2 folder with every
  nn.Linear swapped for the kernel `atom_core.layers.quantized_gemm` picks for the format, the LM
  head through `ExactTopLogits` as in Atom.

Each relative to the same model in bfloat16 and in float32 (the file dequantized).

    .venv/bin/python benchmarks/quant_quality.py [--text FILE] [--window 512] [--threads 2]
        [--only 2,5] [--engine-only]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import transformers
from torch import nn

from atom_core.engine.fetch import fetch_default_model
from atom_core.layers.quantized_gemm import pick_quantized_gemm
from atom_core.layers.quantized_weight import QuantizedWeight, quantize_int4, quantize_int8
from atom_core.loading.checkpoint import GGUF_BLOCKS_FILE
from atom_core.loading.gguf.blocks import load_blocks

DEFAULT_TEXTS = (Path("/usr/share/common-licenses/GPL-3"), Path(__file__).parent.parent / "docs" / "performance.md")


class QuantizedLinear(nn.Module):
    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype, lm_head: bool):
        super().__init__()
        self.gemm, self.kernel = pick_quantized_gemm(qw, torch.device("cpu"), dtype, exact_top=lm_head)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.kernel, self.bias)


def build(folder: Path, dtype: torch.dtype, fmt: str | None, head: str | None) -> nn.Module:
    """The HF model with its Linears in `fmt` ("gguf", "int8", "int4-g32", "int4sym-g32", ...)
    and its LM head in `head` (a format, "same" or None for float)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    blocks = load_blocks(folder / GGUF_BLOCKS_FILE)[1] if fmt == "gguf" else {}

    def quantized(name: str, weight: torch.Tensor, kind: str) -> QuantizedWeight:
        if kind == "gguf":
            tied = name == "lm_head" and model.config.tie_word_embeddings
            return blocks["model.embed_tokens.weight" if tied else f"{name}.weight"][1]
        base, _, group = kind.partition("-g")
        if base == "int8":
            return quantize_int8(weight, int(group) if group else None)
        return quantize_int4(weight, int(group), symmetric=base == "int4sym")

    if fmt is not None:
        for name, module in list(model.named_modules()):
            if not isinstance(module, nn.Linear):
                continue
            is_head = name == "lm_head"
            kind = (fmt if head == "same" else head) if is_head else fmt
            if kind is None:
                continue
            qw = quantized(name, module.weight.detach(), kind)
            model.set_submodule(name, QuantizedLinear(qw, module.bias, dtype, is_head))
    return model.to(dtype)


def windows(ids, window: int) -> list:
    """`ids` in windows of `window` + 1 tokens, overlapping by one: every token after the first
    is scored once, from the tokens before it in its window."""
    return [ids[start : start + window + 1] for start in range(0, len(ids) - 1, window)]


@torch.inference_mode()
def perplexity(model: nn.Module, ids: torch.Tensor, window: int) -> float:
    nll, count = 0.0, 0
    for chunk in windows(ids, window):
        chunk = chunk.unsqueeze(0)
        logits = model(chunk[:, :-1]).logits.float()
        nll += torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
        count += chunk.shape[1] - 1
    return math.exp(nll / count)


ENGINE_SETTINGS = [  # name, LLMEngine settings
    ("float32, quantization='none'", dict(dtype="float32", quantization="none")),
    ("bfloat16, quantization='none'", dict(dtype="bfloat16", quantization="none")),
    ("default: float32, quantization='auto' (the Q4_1 file)", dict()),
    ("float32, quantization='auto', activation_bits=8", dict(activation_bits=8)),
    (  # llama.cpp's precision on this file: int8 activations, a 16-bit KV cache
        "float32, quantization='auto', activation_bits=8, kv_cache_dtype='bfloat16'",
        dict(activation_bits=8, kv_cache_dtype="bfloat16"),
    ),
    ("bfloat16, quantization='auto'", dict(dtype="bfloat16")),
    # OpenVINO's CPU default on int4 weights: bfloat16 between ops, int8 activations
    ("bfloat16, quantization='auto', activation_bits=8", dict(dtype="bfloat16", activation_bits=8)),
    ("float32, quantization='int8'", dict(dtype="float32", quantization="int8")),
    ("float32, quantization='int4'", dict(dtype="float32", quantization="int4")),
    (
        "float32, quantization='int4', activation_bits=8",
        dict(dtype="float32", quantization="int4", activation_bits=8),
    ),
]


def engine_perplexity(folder: Path, settings: dict, ids: list[int], window: int) -> float:
    """Atom's own prompt log probabilities over the same `windows` as `perplexity`."""
    from atom_core import SamplingParams
    from atom_core.engine.llm_engine import LLMEngine

    engine = LLMEngine(str(folder), max_model_len=window + 8, kv_cache_memory=256 << 20, **settings)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    nll, count = 0.0, 0
    for r in engine.generate(windows(ids, window), params, use_tqdm=False):
        logprobs = [next(iter(entry.values())) for entry in r["prompt_logprobs"][1:]]
        nll -= sum(logprobs)
        count += len(logprobs)
    return math.exp(nll / count)


def print_table(results: dict[str, float], f32: float, bf16: float) -> None:
    print("\n| weights | perplexity | vs bfloat16 | vs float32 |")
    print("|---|---:|---:|---:|")
    for name, ppl in results.items():
        print(f"| {name} | {ppl:.3f} | {100 * (ppl / bf16 - 1):+.2f}% | {100 * (ppl / f32 - 1):+.2f}% |")


VARIANTS = [  # name, dtype between GEMMs, format of the layers, format of the LM head
    ("float32 (the file dequantized)", torch.float32, None, None),
    ("bfloat16", torch.bfloat16, None, None),
    ("auto: Q4_1 blocks, Q8_0 head (float32 between)", torch.float32, "gguf", "same"),
    ("auto, bfloat16 between", torch.bfloat16, "gguf", "same"),
    ("auto, Q8_0 head requantized per channel", torch.float32, "gguf", "int8"),
    ("int4 g32 + int8 g32 head", torch.float32, "int4-g32", "int8-g32"),
    ("int4 g32 + int8 per-channel head", torch.float32, "int4-g32", "int8"),
    ("int4 g32 + int4 head", torch.float32, "int4-g32", "same"),
    ("int4 g64 + int8 g32 head", torch.float32, "int4-g64", "int8-g32"),
    ("int4 symmetric g32 + int8 g32 head", torch.float32, "int4sym-g32", "int8-g32"),
    ("int8 g32", torch.float32, "int8-g32", "same"),
    ("int8 per channel", torch.float32, "int8", "same"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", type=Path, default=next((p for p in DEFAULT_TEXTS if p.is_file()), None))
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--only", default="", help="comma-separated indices into VARIANTS (0 and 1, the references, always run)"
    )
    ap.add_argument("--engine-only", action="store_true", help="only the end-to-end table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    folder = fetch_default_model(quiet=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    ids = torch.tensor(tokenizer.encode(args.text.read_text()))
    print(f"{args.text}: {ids.numel()} tokens, windows of {args.window}")
    print("\nAtom end to end (LLMEngine, prompt_logprobs):")
    results: dict[str, float] = {}
    for name, settings in ENGINE_SETTINGS:
        t0 = time.perf_counter()
        results[name] = engine_perplexity(folder, settings, ids.tolist(), args.window)
        print(f"{name:<56} ppl {results[name]:.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    print_table(results, results[ENGINE_SETTINGS[0][0]], results[ENGINE_SETTINGS[1][0]])
    if args.engine_only:
        return
    print("\nOther formats (transformers' model, Atom's kernels):")
    results = {}
    picked = {0, 1} | {int(i) for i in args.only.split(",") if i} if args.only else set(range(len(VARIANTS)))
    for name, dtype, fmt, head in [v for i, v in enumerate(VARIANTS) if i in picked]:
        t0 = time.perf_counter()
        results[name] = perplexity(build(folder, dtype, fmt, head), ids, args.window)
        print(f"{name:<48} ppl {results[name]:.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    print_table(results, results[VARIANTS[0][0]], results[VARIANTS[1][0]])


if __name__ == "__main__":
    main()
