"""Gemma 2 and Gemma 3 (text): Llama's attention and MLP with Gemma's differences.

- RMSNorms scale by (1 + weight), and each layer has four: before and after attention, before
  and after the MLP.
- The MLP is GeGLU (`hidden_activation`, tanh-approximated GELU).
- The embedding is scaled by sqrt(hidden_size), in the model's dtype.
- Queries are scaled by `query_pre_attn_scalar ** -0.5`.
- Sliding and full layers alternate (`layer_types`).
- Gemma 2 soft-caps attention scores and the final logits.
- Gemma 3 normalises each head's q and k, and ropes each layer type with its own parameters
  (`rope_parameters` keyed by layer type).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from gguf import MODEL_TENSOR as T
from gguf import Keys
from torch import nn

from atom_core.layers import RMSNorm, get_rope
from atom_core.layers.rotary import rope_layer_types
from atom_core.plugin_api import GGUFArchitecture, GGUFFile, Joined
from atom_models.llama import (
    LLAMA_GGUF_TENSORS,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaModel,
    SandwichNormDecoderLayer,
    sliding_window_of,
)


@functools.cache
def rounded(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype`, as transformers' `torch.tensor(value, dtype=...)` scale: a
    Python number, which a recorded decode graph keeps (a tensor made from one it refuses)."""
    return float(torch.tensor(value, dtype=dtype))


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight): the checkpoint's weight is an offset from one. Stored as
    1 + weight once loaded, so the shared RMSNorm kernels (and their fused add) run it."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        with torch.no_grad():
            self.weight.zero_()  # an offset: zero is the identity, as transformers initialises it
        self._offset_applied = False

    def process_weights_after_loading(self) -> None:
        if not self._offset_applied:
            with torch.no_grad():
                self.weight.add_(1.0)
            self._offset_applied = True


class GemmaAttention(LlamaAttention):
    norm_cls = GemmaRMSNorm

    @staticmethod
    def softmax_scale(cfg: Any) -> float:
        return cfg.query_pre_attn_scalar**-0.5

    @staticmethod
    def attention_options(cfg: Any, layer_id: int) -> dict[str, Any]:
        return {
            "sliding_window": sliding_window_of(cfg, layer_id),
            "logit_softcap": getattr(cfg, "attn_logit_softcapping", None),
        }


class Gemma3Attention(GemmaAttention):
    qk_norm = True


class GemmaDecoderLayer(SandwichNormDecoderLayer):
    attention_cls: type = GemmaAttention
    norm_cls = GemmaRMSNorm

    def __init__(self, cfg: Any, layer_id: int):
        super().__init__(cfg, layer_id)
        self.layer_type = cfg.layer_types[layer_id]


class Gemma3DecoderLayer(GemmaDecoderLayer):
    attention_cls = Gemma3Attention


class GemmaModel(LlamaModel):
    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.embed_scale = cfg.hidden_size**0.5

    def make_rotary(self, cfg: Any) -> nn.Module:
        """One table per layer type: Gemma 3's sliding and full layers rope with different bases."""
        dim, max_pos = self.rope_dim(cfg), cfg.max_position_embeddings
        keyed = rope_layer_types(cfg) is not None
        return nn.ModuleDict(
            {t: get_rope(cfg, dim, max_pos, t if keyed else None) for t in sorted(set(cfg.layer_types))}
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        h = h * rounded(self.embed_scale, h.dtype)
        ropes = {t: rope(positions, h.dtype) for t, rope in self.rotary_emb.items()}
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, *ropes[layer.layer_type])
        h, _ = self.norm(h, residual)
        return h


class Gemma3Model(GemmaModel):
    layer_cls = Gemma3DecoderLayer


class Gemma2ForCausalLM(LlamaForCausalLM):
    model_cls = GemmaModel

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:  # cap * tanh(logits / cap), in float32
            logits = logits.float().div_(cap).tanh_().mul_(cap).to(logits.dtype)
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_cls = Gemma3Model


# --- GGUF (atom_core/loading/gguf/architecture.py): llama.cpp's "gemma2" and "gemma3" ---------------------------

_NORMS = {  # llama.cpp stores every Gemma norm as 1 + weight; transformers' weight is the offset
    T.OUTPUT_NORM: "model.norm.weight",
    T.ATTN_NORM: "model.layers.{bid}.input_layernorm.weight",
    T.ATTN_POST_NORM: "model.layers.{bid}.post_attention_layernorm.weight",
    T.FFN_NORM: "model.layers.{bid}.pre_feedforward_layernorm.weight",
    T.FFN_POST_NORM: "model.layers.{bid}.post_feedforward_layernorm.weight",
    T.ATTN_Q_NORM: "model.layers.{bid}.self_attn.q_norm.weight",  # Gemma 3
    T.ATTN_K_NORM: "model.layers.{bid}.self_attn.k_norm.weight",
}
GEMMA_GGUF_TENSORS = {kind: name for kind, name in LLAMA_GGUF_TENSORS.items() if kind not in _NORMS}
# Gemma 3's sliding layers rope with base 10000 where the file does not say (llama.cpp's default).
GEMMA3_SLIDING_ROPE_THETA = 10000.0


def _minus_one(config: dict, weight: Any) -> Any:
    return weight - 1


def _gguf_gemma_config(file: GGUFFile, config: dict, swa_pattern: int, layers_27b: int) -> dict:
    """What Gemma 2 and 3 files share. Every `swa_pattern`-th layer attends fully (llama.cpp's
    `set_swa_pattern`, or the file's `sliding_window_pattern`); queries are scaled by
    head_dim ** -0.5, or hidden / heads for the 27B (told apart by its layer count, as
    llama.cpp does)."""
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    head_dim = int(file.get(Keys.Attention.KEY_LENGTH, config["hidden_size"] // heads))
    pattern = int(file.get(Keys.Attention.SLIDING_WINDOW_PATTERN, swa_pattern))
    return config | {
        "num_key_value_heads": int(file.get(Keys.Attention.HEAD_COUNT_KV, heads)),
        "head_dim": head_dim,
        "query_pre_attn_scalar": config["hidden_size"] // heads if layers == layers_27b else head_dim,
        "intermediate_size": int(file.get(Keys.LLM.FEED_FORWARD_LENGTH, required=True)),
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)],
        "final_logit_softcapping": file.get(Keys.LLM.FINAL_LOGIT_SOFTCAPPING),
        "attn_logit_softcapping": file.get(Keys.LLM.ATTN_LOGIT_SOFTCAPPING),
        "attention_bias": False,
    }


def _gguf_gemma2_config(file: GGUFFile, config: dict) -> dict:
    return _gguf_gemma_config(file, config, swa_pattern=2, layers_27b=46) | {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "sliding_window": int(file.get(Keys.Attention.SLIDING_WINDOW, 4096)),  # llama.cpp's default for Gemma 2
    }


def _gguf_gemma3_config(file: GGUFFile, config: dict) -> dict:
    sliding_theta = float(file.get(Keys.Rope.FREQ_BASE_SWA, GEMMA3_SLIDING_ROPE_THETA))
    return _gguf_gemma_config(file, config, swa_pattern=6, layers_27b=62) | {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "sliding_window": int(file.get(Keys.Attention.SLIDING_WINDOW, required=True)),
        "rope_parameters": {
            "full_attention": config["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": sliding_theta},
        },
    }


_GEMMA_JOINED = {name: Joined((kind,), _minus_one) for kind, name in _NORMS.items()}
GGUF_GEMMA2 = GGUFArchitecture(_gguf_gemma2_config, GEMMA_GGUF_TENSORS, joined=_GEMMA_JOINED)
GGUF_GEMMA3 = GGUFArchitecture(_gguf_gemma3_config, GEMMA_GGUF_TENSORS, joined=_GEMMA_JOINED)
