"""Phi-3 (and Phi-3.5, Phi-4-mini): Llama's layers, with q/k/v and gate/up fused on disk
(`qkv_proj`, `gate_up_proj`, which the loader splits into the fused layers' shards),
partial rotary (`partial_rotary_factor`), LongRoPE, and a sliding window in some releases."""

from __future__ import annotations

import math

from gguf import MODEL_TENSOR as T
from gguf import Keys

from atom_core.plugin_api import GGUFArchitecture, GGUFFile
from atom_models.llama import LLAMA_GGUF_TENSORS, LlamaForCausalLM, gguf_attention_config


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama's classes read every difference from the config; the checkpoint's fused tensors
    load into the same fused layers (`MergedLinear.load_fused`)."""


# --- GGUF (atom_core/loading/gguf/architecture.py): llama.cpp's "phi3" -----------------------------------------


def _gguf_config(file: GGUFFile, config: dict) -> dict:
    """Partial rope from `rope.dimension_count`; LongRoPE where the file holds its factors
    (Phi-3-*-128k, Phi-3.5, Phi-4-mini), as tensors llama.cpp reads them from."""
    config = gguf_attention_config(file, config, partial_rotary=True)
    rope = config["rope_parameters"]
    long, short = file.values(T.ROPE_FACTORS_LONG), file.values(T.ROPE_FACTORS_SHORT)
    extra: dict = {}
    if long is not None and short is not None:
        original = int(file.get(Keys.Rope.SCALING_ORIG_CTX_LEN, required=True))
        rope = rope | {
            "rope_type": "longrope", "long_factor": long, "short_factor": short,
            "original_max_position_embeddings": original,
        }  # fmt: skip
        scale = config["max_position_embeddings"] / original
        default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        if (attn := file.get(Keys.Rope.SCALING_ATTN_FACTOR)) is not None and abs(attn - default) > 1e-6:
            rope["attention_factor"] = float(attn)  # else transformers' own (float64) value of it
        extra["original_max_position_embeddings"] = original
    # 0: none (Phi-4-mini); llama.cpp applies the window as transformers does
    extra["sliding_window"] = int(file.get(Keys.Attention.SLIDING_WINDOW, 0)) or None
    return config | extra | {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "rope_parameters": rope}


# q/k/v and gate/up fused, as on the hub (neither permuted: llama.cpp ropes Phi-3 by halves).
GGUF_PHI3 = GGUFArchitecture(
    _gguf_config,
    {k: v for k, v in LLAMA_GGUF_TENSORS.items() if k not in (T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.FFN_GATE, T.FFN_UP)}
    | {T.ATTN_QKV: "model.layers.{bid}.self_attn.qkv_proj", T.FFN_UP: "model.layers.{bid}.mlp.gate_up_proj"},
    config_tensors=frozenset({T.ROPE_FACTORS_LONG, T.ROPE_FACTORS_SHORT}),
)
