"""Qwen3.5 text models: Qwen3-Next's layers with flat Gated DeltaNet projections.

`Qwen3_5ForCausalLM` (dense MLPs) and `Qwen3_5MoeForCausalLM` (every layer routed experts plus a
sigmoid-gated shared expert; top-k weights always renormalised) reuse Qwen3-Next's gated full
attention, zero-centred norms, partial rope and the "gdn" builder's conv + delta-rule kernel.
Only the GDN projections differ: the checkpoint has `in_proj_qkv` ([all q | all k | all v]),
`in_proj_z`, `in_proj_b`, `in_proj_a`, which load into one fused GEMM here. `layer_types` (or
`full_attention_interval`) decides which layer is which.

Rope: transformers' Qwen3.5 text rotary is interleaved M-RoPE over (t, h, w) position rows; for
text-only positions the three rows are equal, so it is plain rope on the partial rotary dims.

Checkpoints of the multimodal releases keep the text model under `model.language_model.*`
(mapped onto `model.*`) next to a vision tower `model.visual.*`, which is skipped with one log
line; the multi-token-prediction head `mtp.*` is not loaded either.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from atom_core.layers import MergedColumnParallelLinear, get_tp_group
from atom_core.plugin_api import SKIP, packed_target
from atom_models.llama import LlamaForCausalLM, LlamaMLP
from atom_models.qwen3_next import (
    Qwen3NextDecoderLayer,
    Qwen3NextForCausalLM,
    Qwen3NextGatedDeltaNet,
    Qwen3NextModel,
    Qwen3NextSparseMoeBlock,
)

logger = logging.getLogger("atom")

TEXT_PREFIX = "model.language_model."  # multimodal checkpoints: the text model's weights
VISION_PREFIXES = ("model.visual.", "visual.")


class Qwen3_5GatedDeltaNet(Qwen3NextGatedDeltaNet):
    """Qwen3-Next's GDN with flat projections: q, k, v, z, b, a each contiguous over heads."""

    def __init__(self, cfg: Any, layer_id: int):
        super().__init__(cfg, layer_id)
        del self.in_proj_qkvz, self.in_proj_ba
        local = {"qkv": self.conv_dim, "z": self.value_dim, "b": self.num_v_heads, "a": self.num_v_heads}
        ranks = get_tp_group().world_size
        self.in_proj_qkvzba = MergedColumnParallelLinear(
            cfg.hidden_size,
            {name: size * ranks for name, size in local.items()},  # the whole layer's, as on disk
            sections={"qkv": self.qkv_sections},  # q, k and v in one tensor: this rank's heads of each
        )

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        mixed_qkv, z, b, a = self.in_proj_qkvzba.split(self.in_proj_qkvzba(h))
        return mixed_qkv.contiguous(), z, b.contiguous(), a.contiguous()


class Qwen3_5DecoderLayer(Qwen3NextDecoderLayer):
    gdn_cls = Qwen3_5GatedDeltaNet

    def make_mlp(self, cfg: Any, layer_id: int) -> nn.Module:
        return LlamaMLP(cfg.hidden_size, cfg.intermediate_size)


class Qwen3_5MoeSparseMoeBlock(Qwen3NextSparseMoeBlock):
    """Qwen3-Next's block; Qwen3.5's router always renormalises the top-k weights
    (its config has no `norm_topk_prob`: saved configs carry it as null)."""

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.renormalize = True


class Qwen3_5MoeDecoderLayer(Qwen3_5DecoderLayer):
    def make_mlp(self, cfg: Any, layer_id: int) -> nn.Module:
        return Qwen3_5MoeSparseMoeBlock(cfg)  # every layer: no mlp_only_layers / decoder_sparse_step


class Qwen3_5Model(Qwen3NextModel):
    layer_cls = Qwen3_5DecoderLayer


class Qwen3_5MoeModel(Qwen3NextModel):
    layer_cls = Qwen3_5MoeDecoderLayer


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    model_cls = Qwen3_5Model
    packed_modules_mapping = {
        **LlamaForCausalLM.packed_modules_mapping,
        "in_proj_qkv": ("in_proj_qkvzba", "qkv"),
        "in_proj_z": ("in_proj_qkvzba", "z"),
        "in_proj_b": ("in_proj_qkvzba", "b"),
        "in_proj_a": ("in_proj_qkvzba", "a"),
    }

    def __init__(self, hf_config: Any, atom_config: Any = None):
        super().__init__(hf_config, atom_config)
        self.skipped_vision_tensors = 0

    def map_checkpoint_name(self, name: str):
        """`model.language_model.*` -> `model.*`; vision tower and `mtp.*` skipped (counted, logged once
        after loading); per-expert tensors -> stacked experts; split GDN projections -> one GEMM."""
        if name.startswith(VISION_PREFIXES):
            self.skipped_vision_tensors += 1
            return SKIP
        if name.startswith("mtp."):
            return SKIP
        if not name.startswith(TEXT_PREFIX):
            return self._experts(name)  # None: the loader applies packed_modules_mapping itself
        name = "model." + name[len(TEXT_PREFIX) :]
        return self._experts(name) or packed_target(name, self.packed_modules_mapping)

    def process_weights_after_loading(self) -> None:
        if self.skipped_vision_tensors:
            logger.info(
                "Qwen3.5: skipped %d vision-tower checkpoint tensors (text model only)", self.skipped_vision_tensors
            )
            self.skipped_vision_tensors = 0


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    model_cls = Qwen3_5MoeModel
