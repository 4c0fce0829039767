"""GLM-4 (`GlmForCausalLM`: glm-4-9b-chat-hf) and GLM-4-0414 (`Glm4ForCausalLM`): Llama's layers
with rope over interleaved pairs on half of each head (`partial_rotary_factor` 0.5), q/k/v
biases (`attention_bias`) and gate/up fused on disk (`gate_up_proj`, which the loader splits);
GLM-4-0414 adds a norm after attention and after the MLP."""

from __future__ import annotations

from typing import Any

from gguf import MODEL_TENSOR as T

from atom_core.plugin_api import GGUFArchitecture, GGUFFile
from atom_models.llama import (
    LLAMA_GGUF_TENSORS,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    SandwichNormDecoderLayer,
    gguf_attention_config,
)


class GlmAttention(LlamaAttention):
    rope_interleaved = True

    @staticmethod
    def biases(cfg: Any) -> tuple[bool, bool]:
        return bool(getattr(cfg, "attention_bias", True)), False


class GlmDecoderLayer(LlamaDecoderLayer):
    attention_cls = GlmAttention


class GlmModel(LlamaModel):
    layer_cls = GlmDecoderLayer


class GlmForCausalLM(LlamaForCausalLM):
    model_cls = GlmModel


class Glm4DecoderLayer(SandwichNormDecoderLayer):
    attention_cls = GlmAttention
    norm_names = ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")


class Glm4Model(LlamaModel):
    layer_cls = Glm4DecoderLayer


class Glm4ForCausalLM(LlamaForCausalLM):
    model_cls = Glm4Model


# --- GGUF (atom_core/loading/gguf/architecture.py): llama.cpp's "glm4" -----------------------------------------


def _gguf_glm4_config(file: GGUFFile, config: dict) -> dict:
    return gguf_attention_config(file, config, partial_rotary=True) | {
        "architectures": ["Glm4ForCausalLM"],
        "model_type": "glm4",
    }


# Q and K as the checkpoint has them (llama.cpp ropes GLM's interleaved pairs itself); gate and
# up stay fused, as on the hub; a norm after attention and after the MLP.
GGUF_GLM4 = GGUFArchitecture(
    _gguf_glm4_config,
    {k: v for k, v in LLAMA_GGUF_TENSORS.items() if k not in (T.FFN_GATE, T.FFN_UP)}
    | {
        T.FFN_UP: "model.layers.{bid}.mlp.gate_up_proj",
        T.ATTN_POST_NORM: "model.layers.{bid}.post_self_attn_layernorm",
        T.FFN_POST_NORM: "model.layers.{bid}.post_mlp_layernorm",
    },
)
