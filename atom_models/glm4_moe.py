"""GLM-4-MoE (GLM-4.5): Llama-shaped attention with q/k/v biases (none on the output), partial
rotary (half of each head), optional per-head q/k norms (`use_qk_norm`); DeepSeek-V3's MoE
(sigmoid router with a correction bias and expert groups, shared experts) after
`first_k_dense_replace` dense layers. Its MTP layer (past `num_hidden_layers`, DeepSeek-V3's
shape) drafts for the "mtp" proposer."""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from atom_core.layers import FusedMoE
from atom_core.plugin_api import SKIP
from atom_models.deepseek_v2 import DeepseekMTP, DeepseekV3MoE
from atom_models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel


class Glm4MoeAttention(LlamaAttention):
    @classmethod
    def uses_qk_norm(cls, cfg: Any) -> bool:
        return bool(getattr(cfg, "use_qk_norm", False))

    @staticmethod
    def biases(cfg: Any) -> tuple[bool, bool]:
        return bool(getattr(cfg, "attention_bias", False)), False


class Glm4MoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = Glm4MoeAttention

    def make_mlp(self, cfg: Any, layer_id: int) -> nn.Module:
        if layer_id >= (getattr(cfg, "first_k_dense_replace", 0) or 0):
            return DeepseekV3MoE(cfg)
        return LlamaMLP(cfg.hidden_size, cfg.intermediate_size)


class Glm4MoeModel(LlamaModel):
    layer_cls = Glm4MoeDecoderLayer


class Glm4MoeForCausalLM(LlamaForCausalLM):
    model_cls = Glm4MoeModel
    _experts = FusedMoE.checkpoint_mapping()
    _layer = re.compile(r"^model\.layers\.(\d+)\.")

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        """Per-expert hub tensors -> stacked experts; the MTP layers past `num_hidden_layers` skipped."""
        m = self._layer.match(name)
        if m is not None and int(m.group(1)) >= self.config.num_hidden_layers:
            return SKIP
        return self._experts(name)

    def make_mtp_module(self) -> DeepseekMTP:
        """The checkpoint's MTP layer (index `num_hidden_layers`, DeepSeek-V3's shape) as a draft."""
        return DeepseekMTP.of(self)
