"""Qwen3: Llama with RMSNorm on each head's q and k before rope, and an explicit head_dim."""

from __future__ import annotations

from gguf import MODEL_TENSOR as T

from atom_core.plugin_api import GGUFArchitecture, GGUFFile
from atom_models.llama import (
    LLAMA_GGUF_TENSORS,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    gguf_attention_config,
)


class Qwen3Attention(LlamaAttention):
    qk_norm = True


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model


# --- GGUF (atom_core/loading/gguf/architecture.py): Llama's names plus the q/k norms, no rope permutation ---------

QWEN3_GGUF_TENSORS = LLAMA_GGUF_TENSORS | {
    T.ATTN_Q_NORM: "model.layers.{bid}.self_attn.q_norm",
    T.ATTN_K_NORM: "model.layers.{bid}.self_attn.k_norm",
}


def qwen3_gguf_config(file: GGUFFile, config: dict) -> dict:
    return gguf_attention_config(file, config) | {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "use_sliding_window": False,
        "sliding_window": None,
    }


def _qwen2_gguf_config(file: GGUFFile, config: dict) -> dict:
    return gguf_attention_config(file, config) | {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}


GGUF_QWEN3 = GGUFArchitecture(qwen3_gguf_config, QWEN3_GGUF_TENSORS)
# Qwen2: q/k/v biases, no q/k norms (atom_models/qwen2.py)
GGUF_QWEN2 = GGUFArchitecture(_qwen2_gguf_config, LLAMA_GGUF_TENSORS)
