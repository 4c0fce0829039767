"""Qwen2 (and Qwen2.5): Llama with biases on q, k and v (none on the output projection), and
sliding layers past `max_window_layers` when `use_sliding_window` is on."""

from __future__ import annotations

from typing import Any

from atom_models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def biases(cfg: Any) -> tuple[bool, bool]:
        return True, False


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


class Qwen2Model(LlamaModel):
    layer_cls = Qwen2DecoderLayer


class Qwen2ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen2Model
