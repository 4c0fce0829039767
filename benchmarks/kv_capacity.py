"""How many tokens a 10 GiB KV budget holds for DeepSeek-V3 and DeepSeek-V2-Lite: the "mla"
builder's latent rows against the same model with expanded per-head K and V.

Shapes only: the configs are the models' config.json values (tests/real_shapes.py; no hub
access), and the models are built on the meta device (no weights). The MLA figure is the
builder's own `compute_block_bytes()`; the expanded figures are (a) the exact per-head
layout, K of qk_nope + qk_rope and V of v_head_dim, and (b) what Atom's MHA builder would
allocate, which keeps K and V at one head size (V padded to qk_head_dim).

    python benchmarks/kv_capacity.py [--budget-gib 10] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from atom_attention.mha.builder import MHAMetadataBuilder
from atom_attention.mla.builder import MLAMetadataBuilder
from atom_core.layers import Attention
from atom_core.runner.attention_builder import BuilderContext
from atom_models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from real_shapes import DEEPSEEK_V2_LITE, DEEPSEEK_V3  # noqa: E402

BLOCK_SIZE = 16
MODELS = {
    "DeepSeek-V3": (DEEPSEEK_V3, DeepseekV3ForCausalLM),
    "DeepSeek-V2-Lite": (DEEPSEEK_V2_LITE, DeepseekV2ForCausalLM),
}


def builder_context(cfg, dtype: torch.dtype) -> BuilderContext:
    """What a builder is made from, as the model runner gives it."""
    return BuilderContext.without_engine(cfg, dtype=dtype, block_size=BLOCK_SIZE)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-gib", type=float, default=10.0)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    budget = int(args.budget_gib * 2**30)
    print(f"KV budget {args.budget_gib:g} GiB, {args.dtype}, blocks of {BLOCK_SIZE} tokens")
    for name, (values, model_cls) in MODELS.items():
        cfg = SimpleNamespace(**values)
        with torch.device("meta"):
            model = model_cls(cfg)
        mla_layers = [m for m in model.modules() if getattr(m, "attn_type", None) == "mla"]
        mla = MLAMetadataBuilder(builder_context(cfg, dtype), mla_layers).compute_block_bytes()
        heads, qk = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        expanded = cfg.num_hidden_layers * BLOCK_SIZE * heads * (qk + cfg.v_head_dim) * dtype.itemsize
        mha_layers = [Attention(heads, qk, qk**-0.5, heads, i) for i in range(cfg.num_hidden_layers)]
        mha = MHAMetadataBuilder(builder_context(cfg, dtype), mha_layers).compute_block_bytes()
        tokens = {k: budget // b * BLOCK_SIZE for k, b in (("mla", mla), ("expanded", expanded), ("mha", mha))}
        latent = f"{cfg.kv_lora_rank}+{cfg.qk_rope_head_dim}"
        print(f"\n{name}: {cfg.num_hidden_layers} layers, {heads} heads, latent {latent}")
        print(f"  mla builder         {mla // BLOCK_SIZE:>10,} B/token  {tokens['mla']:>12,} tokens")
        print(
            f"  expanded K/V        {expanded // BLOCK_SIZE:>10,} B/token  {tokens['expanded']:>12,} tokens"
            f"  ratio {tokens['mla'] / tokens['expanded']:.1f}x"
        )
        print(
            f"  MHA builder (V pad) {mha // BLOCK_SIZE:>10,} B/token  {tokens['mha']:>12,} tokens"
            f"  ratio {tokens['mla'] / tokens['mha']:.1f}x"
        )


if __name__ == "__main__":
    main()
