"""GPT-OSS: Llama-shaped layers with these differences.

- Attention: q/k/v/o biases, attention sinks (a learned logit per head that joins the
  softmax), sliding (128) and full layers alternating (`layer_types`), YaRN rope.
- Router: a linear layer with a bias; the top k of its logits, then a softmax over those k.
- Experts: biases on both projections, and the clamped SwiGLU, (up + 1) * gate *
  sigmoid(1.702 gate). On disk gate and up are interleaved in one 3-D tensor per layer
  (`experts.gate_up_proj` [experts, hidden, 2 x intermediate], input-major).

Released checkpoints store the experts in MXFP4: 4-bit E2M1 values in blocks of 32 with an
E8M0 scale each (`*_blocks`, `*_scales`). Twice an E2M1 value is an integer (0, 1, 2, 3, 4, 6,
8, 12 and their negatives) and half an E8M0 scale a power of two, so each block is exactly an
8-bit group of 32: under quantization="auto" (the default) the experts run from those,
`FusedMoE.checkpoint_quant`; "none" dequantizes them, "int8" / "int4" requantize them from
the dequantized weights. An MXFP4 kernel of its own (4 bits a weight) is later work.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from atom_core.layers import FusedMoE
from atom_core.layers.checkpoint_slice import materialize
from atom_core.layers.quantized_weight import QuantizedWeight
from atom_models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, sliding_window_of

logger = logging.getLogger("atom")

# E2M1's sixteen values, by their 4-bit code
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_as_int8_groups(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, groups, 16] uint8 (two codes a byte, low nibble first) and [..., rows, groups]
    uint8 exponents (E8M0, bias 127) -> int8 [..., rows, groups * 32] and float32 scales
    [..., rows, groups] whose products are the MXFP4 values exactly: codes doubled into
    integers, exponents halved."""
    lut = torch.tensor([int(2 * v) for v in FP4_VALUES], dtype=torch.int8)
    q = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1).flatten(-3)
    return q, torch.exp2(scales.to(torch.float32) - 128)


def int8_groups_to_float(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., rows, groups * 32] of `mxfp4_as_int8_groups`' output."""
    return (q.float().unflatten(-1, (-1, 32)) * scales.unsqueeze(-1)).flatten(-2)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., rows, groups * 32] of MXFP4 blocks and scales (as `mxfp4_as_int8_groups` takes them)."""
    return int8_groups_to_float(*mxfp4_as_int8_groups(blocks, scales))


class GptOssAttention(LlamaAttention):
    @staticmethod
    def attention_options(cfg: Any, layer_id: int) -> dict[str, Any]:
        return {"sliding_window": sliding_window_of(cfg, layer_id), "sinks": True}


class GptOssRouter(nn.Module):
    """Top k of linear(h) + bias, softmaxed over those k (in the logits' dtype, as transformers)."""

    def __init__(self, cfg: Any):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(cfg.num_local_experts, cfg.hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(cfg.num_local_experts), requires_grad=False)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, ids = torch.topk(F.linear(h, self.weight, self.bias), self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids


class GptOssMoE(nn.Module):
    def __init__(self, cfg: Any):
        super().__init__()
        self.router = GptOssRouter(cfg)
        self.experts = FusedMoE(
            cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size, activation="swigluoai", bias=True,
            swiglu_limit=cfg.swiglu_limit, swiglu_alpha=getattr(cfg, "swiglu_alpha", 1.702),
        )  # fmt: skip
        for param in self.experts.parameters():
            param.weight_loader = self.load  # type: ignore[attr-defined]
        self._mxfp4: dict[str, Any] = {}  # a tensor's blocks waiting for its scales, or the reverse
        self._exact: dict[str, list | None] = {}  # "gate_up" / "down": this rank's experts as 8-bit groups
        self.dequantized_mxfp4 = 0
        self.kept_exact = False  # its MXFP4 experts handed over as 8-bit groups (`checkpoint_quant`)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(h)
        return self.experts(h, weights, ids)

    def load(self, param: nn.Parameter, loaded: Any, shard: tuple) -> set | None:
        """The checkpoint's stacked tensors (shard ("stacked", key)) into each expert's shards:
        gate and up de-interleaved, weights transposed to (out, in), MXFP4 parts dequantized
        once both have arrived. Returns the shards filled."""
        if shard[0] != "stacked":
            return self.experts.weight_loader(param, loaded, shard)
        which, _, part = shard[1].partition("_proj")
        loaded = materialize(loaded)
        if part in ("_blocks", "_scales"):
            self._mxfp4[which + part] = loaded
            blocks, scales = self._mxfp4.get(which + "_blocks"), self._mxfp4.get(which + "_scales")
            if blocks is None or scales is None:
                return set()
            del self._mxfp4[which + "_blocks"], self._mxfp4[which + "_scales"]
            q, s = mxfp4_as_int8_groups(blocks, scales)  # [experts, out, in], [experts, out, in / 32]
            self._keep_exact(which, q, s)
            loaded = int8_groups_to_float(q, s).transpose(1, 2)  # input-major, as the float checkpoints
            self.dequantized_mxfp4 += 1
            part = ""
        filled = set()
        for e in range(loaded.shape[0]):
            if which == "gate_up":
                t = loaded[e] if part == "_bias" else loaded[e].transpose(0, 1)  # [2I] or [2I, H]
                kinds = {"gate": t[0::2], "up": t[1::2]}
            else:
                kinds = {"down": loaded[e] if part == "_bias" else loaded[e].transpose(0, 1)}
            for kind, tensor in kinds.items():
                one = (kind + ("_bias" if part == "_bias" else ""), e)
                self.experts.weight_loader(param, tensor.contiguous(), one)
                filled.add(one)
        return filled

    def _keep_exact(self, which: str, q: torch.Tensor, s: torch.Tensor) -> None:
        """This rank's experts of one MXFP4 tensor (as `mxfp4_as_int8_groups` gives it) as 8-bit
        groups, cut as their float weights are; once both tensors of the layer are in, the
        experts' `checkpoint_quant`."""
        moe = self.experts
        parts: list | None = []
        try:
            for e in range(moe.first_expert, moe.first_expert + moe.num_local_experts):
                qw = QuantizedWeight(8, 32, q[e], s[e], None, "MXFP4")
                if which == "gate_up":  # rows interleaved: gate, up, gate, ...
                    halves = [qw.map_rows(lambda t, i=i: t[i::2].contiguous()) for i in (0, 1)]
                    parts.append(
                        QuantizedWeight.cat([moe.rank_part(h, (k, e)) for h, k in zip(halves, ("gate", "up"))])
                    )
                else:
                    parts.append(moe.rank_part(qw, ("down", e)))
        except ValueError as exc:  # a rank's cut through a group of 32: this layer runs its float weights
            logger.info("GPT-OSS: MXFP4 experts dequantized, not kept as 8-bit groups: %s", exc)
            parts = None
        self._exact[which] = parts
        if len(self._exact) == 2:
            gate_up, down = self._exact.pop("gate_up"), self._exact.pop("down")
            if gate_up is not None and down is not None:
                moe.checkpoint_quant = (gate_up, down)
                self.kept_exact = True


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_cls = GptOssAttention

    def make_mlp(self, cfg: Any, layer_id: int) -> nn.Module:
        return GptOssMoE(cfg)


class GptOssModel(LlamaModel):
    layer_cls = GptOssDecoderLayer


_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


class GptOssForCausalLM(LlamaForCausalLM):
    model_cls = GptOssModel

    def __init__(self, hf_config: Any, atom_config: Any = None):
        super().__init__(hf_config, atom_config)
        self.quantization = getattr(atom_config, "quantization", "none")

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        """Sinks into the attention layer; each layer's stacked expert tensors into the stacked
        experts, through `GptOssMoE.load` (they are whole layers, not one expert each)."""
        if name.endswith(".self_attn.sinks"):
            return name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), None
        m = _EXPERTS.match(name)
        if m is None:
            return None
        prefix, which, suffix = m.group(1), m.group(2), m.group(3) or ""
        param = {"gate_up_proj": "w13", "down_proj": "w2"}[which] + ("_bias" if suffix == "_bias" else "")
        return f"{prefix}.{param}", ("stacked", which + suffix)

    def process_weights_after_loading(self) -> None:
        moes = [m for m in self.modules() if isinstance(m, GptOssMoE)]
        # under "auto" a layer whose experts were kept as 8-bit groups runs them (quantize_model says so)
        count = sum(m.dequantized_mxfp4 for m in moes if not (m.kept_exact and self.quantization == "auto"))
        if count:
            logger.info(
                "GPT-OSS: dequantized %d MXFP4 expert tensors at load (the experts run in the model's dtype)", count
            )
        for m in moes:
            m.dequantized_mxfp4, m.kept_exact = 0, False
