"""Which layers of a loaded model run quantized, and with which weights (`Config.quantization`).

Called by the runner between loading and `process_weights_after_loading`: it gives each
quantizable `Linear` (and `FusedMoE`) its `quant` weight, from a GGUF file's blocks as they
are ("auto") or quantized from the loaded float weight ("int8" / "int4").
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from atom_core.distributed.parallel_state import get_tp_group
from atom_core.layers.embedding import (
    QuantizedEmbedding,
    replace_embedding,
    tied_embeddings,
)
from atom_core.layers.linear import Linear
from atom_core.layers.moe import FusedMoE
from atom_core.layers.quantized_weight import (
    QuantizedWeight,
    quantize_int4,
    quantize_int8,
)
from atom_core.loading.checkpoint import checkpoint_target
from atom_core.loading.gguf import GGUF_BLOCKS_FILE
from atom_core.loading.gguf.blocks import load_blocks

logger = logging.getLogger("atom")


def quantizable_linears(model: nn.Module) -> dict[str, Linear]:
    """Every `Linear` of the model by name, but those a model marks `quantizable = False` (routers)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear) and getattr(m, "quantizable", True)}


def quantizable_experts(model: nn.Module) -> dict[str, FusedMoE]:
    """Every `FusedMoE` by name: each expert's two matrices are linear layers too."""
    return {n: m for n, m in model.named_modules() if isinstance(m, FusedMoE) and getattr(m, "quantizable", True)}


def _quantize(weight: torch.Tensor, mode: str, group: int) -> QuantizedWeight:
    """`mode` ("int8" / "int4") in groups of `group`, or 8 bits per output channel where `group` does not divide K."""
    if weight.shape[1] % group:
        return quantize_int8(weight)
    return quantize_int8(weight, group) if mode == "int8" else quantize_int4(weight, group)


def quantize_model(model: nn.Module, config: Any) -> None:
    """Give each quantizable `Linear` its `quant` weight as `config.quantization` says (LM heads
    flagged by `linear.mark_lm_heads` first).

    "none": nothing. "auto": a model converted from GGUF (its folder holds the file's blocks,
    `loader.GGUF_BLOCKS_FILE`) takes the Q4_0/Q4_1/Q4_K/Q5_0/Q8_0 blocks as they are and requantizes
    other quantized types to the nearest format; any other checkpoint stays as loaded.
    "int8" / "int4": every layer is quantized from its loaded weight in groups of
    `quantization_group_size` (8 bits symmetric, 4 bits with zeros), the LM head as
    `quantize_lm_head` says. Per output channel instead where the group does not divide K.
    MoE experts (`FusedMoE.quant`) are quantized expert by expert like any other layer.
    An embedding tied to a quantized LM head then looks its rows up in the quantized weight.
    """
    mode = config.quantization
    shipped = _take_checkpoint_quant(model)
    if mode == "none":
        return
    linears = quantizable_linears(model)
    experts = quantizable_experts(model)
    for module in (*linears.values(), *experts.values()):
        module.activation_bits = config.activation_bits  # read where the kernels are picked
    if mode == "auto":
        for name, quant in shipped.items():
            experts[name].quant = quant
        if shipped:
            origins = sorted({q.origin for pair in shipped.values() for qs in pair for q in qs})
            logger.info(
                "atom: kept the experts of %d MoE layers as the checkpoint quantized them (%s), exactly",
                len(shipped), ", ".join(origins),
            )  # fmt: skip
        blocks = Path(config.model) / GGUF_BLOCKS_FILE if config.model else None
        if blocks is None or not blocks.is_file():
            return  # not converted from GGUF: the checkpoint's weights as they are
        _from_gguf(model, blocks, linears, experts, config)
    else:
        head_mode = config.quantize_lm_head
        group = config.quantization_group_size
        per_channel: list[str] = []
        for name, module in linears.items():
            as_head = mode if head_mode == "same" else head_mode
            layer_mode = as_head if module.is_lm_head else mode
            if layer_mode == "none":
                continue
            if module.in_features % group:
                per_channel.append(f"{name} (in_features {module.in_features})")
            module.quant = _quantize(module.weight, layer_mode, group)
        for name, moe in experts.items():
            for param in (moe.w13, moe.w2):
                if param.shape[2] % group:
                    per_channel.append(f"{name} experts (in_features {param.shape[2]})")
            moe.quant = cast(
                "tuple[list, list]", tuple([_quantize(w, mode, group) for w in param] for param in (moe.w13, moe.w2))
            )
        if per_channel:
            logger.warning(
                "atom: %d layers quantized to int8 per output channel, their in_features not a multiple of "
                "quantization_group_size %d: %s", len(per_channel), group, ", ".join(per_channel[:4]),
            )  # fmt: skip
    _tie_embeddings(model)


def _take_checkpoint_quant(model: nn.Module) -> dict[str, tuple[list, list]]:
    """Each quantizable `FusedMoE`'s `checkpoint_quant` by name; every one is cleared (its
    copies freed whatever the setting)."""
    shipped = {}
    for name, m in model.named_modules():
        if isinstance(m, FusedMoE) and m.checkpoint_quant is not None:
            if getattr(m, "quantizable", True):
                shipped[name] = m.checkpoint_quant
            m.checkpoint_quant = None
    return shipped


def _tie_embeddings(model: nn.Module) -> None:
    """Swap an embedding whose weight a quantized Linear shares for a lookup into the quantized weight."""
    for name, head in tied_embeddings(model):
        quant: QuantizedWeight | None = getattr(head, "quant", None)
        if quant is None:
            continue
        weight = cast(torch.Tensor, model.get_submodule(name).weight)  # an nn.Embedding's
        qw = quant if weight.device.type == "cpu" else quant.map_rows(lambda t: t.to(weight.device))
        replace_embedding(model, name, QuantizedEmbedding(qw, weight.dtype))


_FLOAT_GGUF = ("F32", "F16", "BF16", "F64")


# Bits per weight of the other types (llama.cpp's block sizes): <= 4.5 requantizes to 4 bits.
_GGUF_BITS = {
    "Q2_K": 2.6, "Q3_K": 3.4, "Q4_K": 4.5, "IQ1_S": 1.6, "IQ1_M": 1.8, "IQ2_XXS": 2.1, "IQ2_XS": 2.3,
    "IQ2_S": 2.5, "IQ3_XXS": 3.1, "IQ3_S": 3.4, "IQ4_NL": 4.5, "IQ4_XS": 4.3, "TQ1_0": 1.7, "TQ2_0": 2.1,
}  # fmt: skip


def _gguf_bits(gguf_type: str) -> float:
    return 4.5 if gguf_type in ("Q4_0", "Q4_1", "Q4_K") else _GGUF_BITS.get(gguf_type, 8.0)


def _requantized(weight: torch.Tensor, gguf_type: str) -> QuantizedWeight:
    """The nearest kernel format for a GGUF type that has none of its own."""
    bits = _gguf_bits(gguf_type)
    k = weight.shape[1]
    if bits <= 4.5 and k % 32 == 0:
        qw = quantize_int4(weight, 32)
    elif k % 32 == 0:
        qw = quantize_int8(weight, 32)  # Q8_0's own layout
    else:
        qw = quantize_int8(weight)
    qw.origin = f"{gguf_type} requantized"
    return qw


def _from_gguf(
    model: nn.Module, blocks: Path, linears: dict[str, Linear], experts: dict[str, FusedMoE], config: Any
) -> None:
    """Each Linear's (and each expert's) blocks from the converted GGUF: stacked as they are
    where every shard has a kernel format (one for all), requantized from the loaded float
    weight otherwise."""
    params = dict(model.named_parameters(remove_duplicate=False))
    by_param: dict[int, dict[Any, tuple[str, QuantizedWeight | None]]] = {}
    source, weights = load_blocks(blocks)
    for hf_name, (gguf_type, qw) in weights.items():
        target = checkpoint_target(model, hf_name)
        if target is None or target[0] not in params:
            continue
        by_param.setdefault(id(params[target[0]]), {})[target[1]] = (gguf_type, qw)

    kept: dict[str, int] = {}
    requantized: dict[tuple[str, str], list[str]] = {}

    def from_blocks(name: str, parts: list, weight: torch.Tensor) -> QuantizedWeight | None:
        """One weight from its shards' blocks (in row order); None where the file holds it in float."""
        types = {p[0] for p in parts if p is not None}
        if types & set(_FLOAT_GGUF) or any(p is None for p in parts):
            return None  # float in the file: loaded as it is
        exact = [p[1] for p in parts]
        mapped = all(q is not None for q in exact)
        if mapped and len({(q.bits, q.group_size) for q in exact}) > 1:
            # a fused layer of 4- and 8-bit shards (Q4_0 q/k beside a Q8_0 v): all 8 bits, exactly, if it can be
            wide = [q.widened() for q in exact]
            if all(q is not None for q in wide):
                exact = wide
        if mapped and len({(q.bits, q.group_size) for q in exact}) == 1:
            for t in [p[0] for p in parts]:
                kept[t] = kept.get(t, 0) + 1
            return QuantizedWeight.cat(exact) if len(exact) > 1 else exact[0]
        # a type no kernel takes as it is, or shards whose formats differ: requantize the whole
        qw = _requantized(weight, max(types, key=_gguf_bits))
        why = (
            "their shards' formats differ (4 bits with zero offsets beside 8)"
            if mapped
            else "no kernel takes their blocks as they are"
        )
        requantized.setdefault((f"{'/'.join(sorted(types))} -> {qw.format}", why), []).append(name)
        return qw

    split = get_tp_group().world_size > 1

    def rank_part(name: str, module: nn.Module, shard: Any, part: tuple[str, Any] | None) -> tuple[str, Any] | None:
        """A tensor-parallel rank's part of a shard's blocks, cut as the layer cuts its float weight."""
        if part is None or part[1] is None or not split or not hasattr(module, "rank_part"):
            return part
        try:
            return part[0], module.rank_part(part[1], shard)  # type: ignore[operator]
        except ValueError as e:
            raise ValueError(f"{name}, shard {shard!r} ({part[0]}) at {get_tp_group().world_size} ranks: {e}") from None

    for name, module in linears.items():
        shards = by_param.get(id(module.weight))
        if not shards:
            continue
        if config.quantize_lm_head == "none" and module.is_lm_head:
            continue
        offsets = getattr(module, "shard_offsets", None)  # a MergedLinear: its shards in row order
        order = sorted(offsets, key=lambda s: offsets[s][0]) if offsets else [None]
        if offsets and None in shards:  # fused on disk (GLM-4's gate_up): cut into the layer's shards
            gguf_type, qw = shards[None]
            cut = module.split_fused(qw) if qw is not None else dict.fromkeys(order)  # type: ignore[operator]
            shards = {s: (gguf_type, part) for s, part in cut.items()}
        parts = [rank_part(name, module, s, shards.get(s)) for s in order]
        module.quant = from_blocks(name, parts, module.weight)
    for name, moe in experts.items():
        w13, w2 = by_param.get(id(moe.w13), {}), by_param.get(id(moe.w2), {})
        local = range(moe.first_expert, moe.first_expert + moe.num_local_experts)  # this rank's experts
        quant = (
            [from_blocks(f"{name}.{e}.w13", [rank_part(name, moe, s, w13.get(s)) for s in (("gate", e), ("up", e))],
                         moe.w13[e - moe.first_expert]) for e in local],
            [from_blocks(f"{name}.{e}.w2", [rank_part(name, moe, ("down", e), w2.get(("down", e)))],
                         moe.w2[e - moe.first_expert]) for e in local],
        )  # fmt: skip
        if all(q is not None for q in quant[0] + quant[1]):  # one format for the whole layer, or float
            moe.quant = quant
    if kept:
        logger.info("atom: %s: kept %s as 4/8-bit weights", source,
                    ", ".join(f"{n} {t}" for t, n in sorted(kept.items())))  # fmt: skip
    for (what, why), names in requantized.items():
        logger.warning(
            "atom: %s: %d layers requantized from their dequantized weights (%s), e.g. %s: %s",
            source, len(names), what, names[0], why,
        )  # fmt: skip
