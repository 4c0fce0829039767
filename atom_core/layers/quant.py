"""Weight-only quantization behind `Linear`: integer weights, float activations.

Why: a decode step at small batch streams every weight from memory once, so on CPU the
bytes per weight set the pace. A `QuantizedWeight` keeps integer values with affine
parameters in groups along the input dimension K:

- 4 bits: w = (q - 8) * scale + zero, q in 0..15 (torch's int4 layout, zero = the value at
  q = 8). GGUF Q4_0 is exactly this with zero = 0, Q4_1 with zero = min + 8 * scale.
- 8 bits: w = q * scale, q in -128..127, in groups (GGUF Q8_0 is groups of 32), or one
  scale per output channel.

`pick_quantized_gemm` chooses the kernel, as `pick_gemm` does for float weights: on CPU
torch's `_weight_int4pack_mm_for_cpu` for 4-bit groups and for 8-bit groups (run exactly
as two 4-bit halves; at batch 1 faster than the per-channel kernel, and groups of 32 cost
no perplexity where per channel cost 0.6% on SmolLM2), `_weight_int8pack_mm` for 8 bits
per channel. Both take bfloat16 activations (with float32 ones they measured 10-100x
slower); the model's own dtype runs between GEMMs. Elsewhere the weight is dequantized
once and runs as a float weight. `quantize_model` (called by the runner between loading
and `process_weights_after_loading`) decides what each `Linear` gets from
`Config.quantization`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from atom_core.layers.cpp import compiled_op
from atom_core.layers.embedding import LookupEmbedding, replace_embedding, tied_embeddings
from atom_core.layers.ops import near_max
from atom_core.platform.memory import resident

logger = logging.getLogger("atom")

# Activations the torch CPU kernels take (and the precision their scales are held in).
KERNEL_DTYPE = torch.bfloat16
# Group sizes `_weight_int4pack_mm_for_cpu` accepts.
INT4_GROUP_SIZES = (32, 64, 128, 256)


@dataclass
class QuantizedWeight:
    """An [N, K] weight as integers plus per-group scales (and zeros, 4 bits); see the module doc."""

    bits: int  # 4 or 8
    group_size: int  # along K; K itself for one group per output channel
    qweight: torch.Tensor  # [N, K]: uint8 values 0..15 (4 bits) or int8 (8 bits)
    scales: torch.Tensor  # [N, K // group_size], float32
    zeros: torch.Tensor | None = None  # [N, K // group_size], float32, 4 bits only
    origin: str = ""  # what it came from, for log lines: "int4", "Q4_1", ...

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    @property
    def format(self) -> str:
        """'4-bit groups of 32', '8-bit per channel', ...: for log lines and errors."""
        n, k = self.shape
        groups = "per channel" if self.group_size == k else f"groups of {self.group_size}"
        return f"{self.bits}-bit {groups}"

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float weight (or only `rows` of it, for an embedding lookup), computed in float32."""
        q, scales, zeros = self.qweight, self.scales, self.zeros
        if rows is not None:
            q, scales = q[rows], scales[rows]
            zeros = None if zeros is None else zeros[rows]
        grouped = q.reshape(*q.shape[:-1], -1, self.group_size).to(torch.float32)
        if self.bits == 4:
            w = (grouped - 8).mul_(scales.unsqueeze(-1)).add_(zeros.unsqueeze(-1))
        else:
            w = grouped.mul_(scales.unsqueeze(-1))
        return w.reshape(q.shape).to(dtype)

    def widened(self) -> QuantizedWeight | None:
        """The same weight in 8 bits, exactly, where it has no zero offsets ((q - 8) * scale, as
        GGUF's Q4_0); None where it has (8-bit weights are symmetric)."""
        if self.bits == 8:
            return self
        if self.zeros is None or torch.count_nonzero(self.zeros):
            return None
        return QuantizedWeight(8, self.group_size, self.qweight.to(torch.int8) - 8, self.scales, None, self.origin)

    def scale_magnitudes(self) -> torch.Tensor:
        """Per element, |(q - 8) * scale| + |zero| (4 bits) or |q * scale| (8 bits): a kernel that
        rounds scales and zeros to a precision of unit roundoff u moves each weight by at most
        u times this."""
        if self.bits == 8:
            return self.dequantize().abs_()
        q = self.qweight.reshape(*self.shape[:-1], -1, self.group_size).to(torch.float32) - 8
        return (q.abs() * self.scales.unsqueeze(-1) + self.zeros.abs().unsqueeze(-1)).reshape(self.shape)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
        """The same weight with its rows rearranged by `fn` (GGUF's Q/K row permutation)."""
        zeros = None if self.zeros is None else fn(self.zeros)
        return QuantizedWeight(self.bits, self.group_size, fn(self.qweight), fn(self.scales), zeros, self.origin)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Row blocks stacked (the shards of a `MergedLinear`); they must share one format."""
        first = parts[0]
        if any((p.bits, p.group_size, p.shape[1]) != (first.bits, first.group_size, first.shape[1]) for p in parts):
            raise ValueError(f"cannot stack {', '.join(p.format for p in parts)} into one weight")
        zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])
        origin = "+".join(sorted({p.origin for p in parts}))
        return QuantizedWeight(
            first.bits, first.group_size, torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]),
            zeros, origin,
        )  # fmt: skip


def quantize_int4(weight: torch.Tensor, group_size: int = 32, symmetric: bool = False) -> QuantizedWeight:
    """Asymmetric 4 bits in groups along K (min and max of each group map to 0 and 15).

    Scales and zeros stay float32 (the kernel rounds its own copy), so weights that were
    4-bit groups already (a dequantized Q4_1 file) come back exactly. `symmetric` (zero = 0)
    is there for comparison: on SmolLM2 it cost 26% perplexity where asymmetric groups of
    32 cost 0.02%.
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of quantization_group_size {group_size}")
    w = weight.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    if symmetric:  # q - 8 in -8..7: the scale that reaches both extremes
        scales = torch.maximum(-w.amin(-1) / 8, w.amax(-1) / 7).clamp_min(1e-12)
        zeros = torch.zeros_like(scales)
    else:
        lo, hi = w.amin(-1), w.amax(-1)
        scales = ((hi - lo) / 15).clamp_min(1e-12)
        zeros = lo + 8 * scales
    q = torch.round((w - zeros.unsqueeze(-1)) / scales.unsqueeze(-1) + 8).clamp_(0, 15)
    return QuantizedWeight(4, group_size, q.to(torch.uint8).reshape(n, k), scales, zeros, "int4")


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric 8 bits, one float32 scale per output channel (or per group of `group_size` along K)."""
    n, k = weight.shape
    g = k if group_size is None else group_size
    if k % g:
        raise ValueError(f"in_features {k} is not a multiple of the 8-bit group size {g}")
    w = weight.detach().to(torch.float32).reshape(n, k // g, g)
    scales = w.abs().amax(-1).div(127).clamp_min(1e-12)
    q = torch.round(w / scales.unsqueeze(-1)).clamp_(-127, 127)
    return QuantizedWeight(8, g, q.to(torch.int8).reshape(n, k), scales, None, "int8")


# --- the blocks of a converted GGUF file ----------------------------------------------------

_BLOCKS_FORMAT = "atom-gguf-blocks/1"


def save_blocks(weights: dict[str, tuple[str, QuantizedWeight | None]], path: str | Path, source: str) -> None:
    """Write `name -> (GGUF type, weight or None)` as safetensors: `{name}.qweight` (4-bit values
    two to a byte, low nibble first, or int8), `{name}.scales`, `{name}.zeros`; every name's
    type goes into the metadata, with or without a weight."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, (_, qw) in weights.items():
        if qw is None:
            continue
        q = qw.qweight
        tensors[f"{name}.qweight"] = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous() if qw.bits == 4 else q.contiguous()
        tensors[f"{name}.scales"] = qw.scales.contiguous()
        if qw.zeros is not None:
            tensors[f"{name}.zeros"] = qw.zeros.contiguous()
    types = {name: gguf_type for name, (gguf_type, _) in weights.items()}
    metadata = {"format": _BLOCKS_FORMAT, "source": source, "gguf_types": json.dumps(types)}
    save_file(tensors, str(path), metadata=metadata)


def load_blocks(path: str | Path) -> tuple[str, dict[str, tuple[str, QuantizedWeight | None]]]:
    """What `save_blocks` wrote: (source file name, name -> (GGUF type, weight or None))."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        if metadata.get("format") != _BLOCKS_FORMAT:
            raise ValueError(f"{path} is not a {_BLOCKS_FORMAT} file (format {metadata.get('format')!r})")
        out: dict[str, tuple[str, QuantizedWeight | None]] = {}
        keys = set(f.keys())
        for name, gguf_type in json.loads(metadata["gguf_types"]).items():
            if f"{name}.qweight" not in keys:
                out[name] = (gguf_type, None)
                continue
            # Copies, not views of the file's mapping: a weight kept as it is (a tied Q8_0
            # embedding) would otherwise keep the whole file mapped and resident (76 MiB of
            # the default model's 106 MiB file, beside the packed copies the kernels use).
            q, scales = f.get_tensor(f"{name}.qweight"), f.get_tensor(f"{name}.scales").clone()
            zeros = f.get_tensor(f"{name}.zeros").clone() if f"{name}.zeros" in keys else None
            if q.dtype == torch.uint8:  # 4 bits, two to a byte
                q = torch.stack([q & 0x0F, q >> 4], dim=-1).reshape(q.shape[0], -1)
            else:
                q = q.clone()
            group = q.shape[1] // scales.shape[1]
            out[name] = (gguf_type, QuantizedWeight(4 if zeros is not None else 8, group, q, scales, zeros, gguf_type))
    return metadata.get("source", Path(path).name), out


# --- kernels -------------------------------------------------------------------------------


class Int4PackGemm:
    """torch's `_weight_int4pack_mm_for_cpu` on a 4-bit weight, or on an 8-bit grouped one split exactly.

    q = 16 * hi + lo with hi = q >> 4 in -8..7 and lo = q & 15: the hi half is a 4-bit group
    with scale 16 * s and zero 0, the lo half one with scale s and zero 8 * s, and one GEMM
    over [x, x] (2K wide) sums them. Rows are padded to the kernel's multiple of 16.
    """

    def __init__(self, qw: QuantizedWeight):
        n, k = qw.shape
        if qw.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"torch's int4 kernel takes groups of {INT4_GROUP_SIZES}, not {qw.group_size}")
        if qw.bits == 4:
            scales, zeros = qw.scales, qw.zeros
        else:
            scales = torch.cat([qw.scales * 16, qw.scales], dim=1)
            zeros = torch.cat([torch.zeros_like(qw.scales), qw.scales * 8], dim=1)
        self.doubled = qw.bits == 8
        self.out_features, self.in_features, self.group_size = n, k, qw.group_size
        pad = -n % 16
        if pad:  # padded rows are (8 - 8) * 0 + 0 = 0
            scales, zeros = F.pad(scales, (0, 0, 0, pad)), F.pad(zeros, (0, 0, 0, pad))
        # Packed by row blocks (the layout is per row): int32 nibbles of a whole vocabulary are big.
        self.packed = resident(torch.cat([
            torch._convert_weight_to_int4pack_for_cpu(self._nibbles(qw.qweight[i : i + self.PACK_ROWS], pad), 1)
            for i in range(0, n, self.PACK_ROWS)
        ]))  # fmt: skip
        self.scales_and_zeros = torch.stack([scales, zeros], -1).transpose(0, 1).contiguous().to(KERNEL_DTYPE)

    PACK_ROWS = 4096  # a multiple of 16

    def _nibbles(self, q: torch.Tensor, pad: int) -> torch.Tensor:
        """int32 values 0..15 the packing takes; the last block gets the padding rows."""
        q = q.to(torch.int32)
        if self.doubled:
            q = torch.cat([(q >> 4) + 8, q & 15], dim=1)
        if q.shape[0] % 16:
            q = F.pad(q, (0, 0, 0, pad), value=8)
        return q.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        a = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        if self.doubled:
            a = torch.cat([a, a], dim=1)
        out = torch._weight_int4pack_mm_for_cpu(a.contiguous(), self.packed, self.group_size, self.scales_and_zeros)
        if out.shape[1] != self.out_features:
            out = out[:, : self.out_features]
        return out.reshape(*x.shape[:-1], self.out_features)


class StreamingGroupGemm:
    """4- or 8-bit groups of 32 through Atom's own kernel (`gemv_cpu.cpp`'s `qgemm`).

    The weight is repacked in tiles of 16 output columns (see the kernel's comment) with
    float16 scale and min per group, exact for GGUF Q4_0/Q4_1/Q5_0/Q8_0 (Q4_K: rounded), and multiplied with
    integer dot products (vpdpwssd) against x rounded per group of 32 to int16: about 16
    significant bits, where torch's int4 kernel takes bfloat16 (8). It serves every row
    count and computes each row alike whatever the count, so it is batch-invariant by
    construction (speculative decoding's verify rows round as plain decode rows do), and
    one copy of the weights serves decode and prefill.
    """

    batch_invariant = True
    TILE = 16

    def __init__(self, qw: QuantizedWeight, ops: Any):
        n, k = qw.shape
        if qw.group_size != 32 or k % 32:
            raise ValueError(f"the streaming kernel takes groups of 32, not {qw.format}")
        self.ops, self.bits = ops, qw.bits
        self.out_features, self.in_features = n, k
        self.qweight, self.scales, self.mins = map(resident, self.pack(*self.codes(qw), qw.bits))

    @staticmethod
    def codes(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the kernel multiplies by: unsigned q [N, K], float16 scales and mins [N, K / 32],
        w = q * scale + min."""
        scales = qw.scales.to(torch.float16)
        if qw.bits == 4:  # q in 0..15
            return qw.qweight.to(torch.uint8), scales, (qw.zeros - 8 * qw.scales).to(torch.float16)
        # q + 128 in 0..255, min -128 scale
        return (qw.qweight.to(torch.int16) + 128).to(torch.uint8), scales, (-128 * scales.float()).to(torch.float16)

    @classmethod
    def pack(cls, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int) -> tuple[torch.Tensor, ...]:
        """q [N, K] (unsigned), scales and mins [N, K / 32] -> the kernel's tiles of 16 columns.

        Per tile and group, lane c of vector p holds column c's values at k = 2p, 2p + 1; at 4
        bits vectors 4j .. 4j + 3 share 64 bytes, their values at lane i in the nibbles of
        int16 i (vector 4j lowest).
        """
        n, k = q.shape
        g, pad = k // 32, -n % cls.TILE
        q, scales, mins = (F.pad(t, (0, 0, 0, pad)) for t in (q, scales, mins))  # zero columns
        t = (n + pad) // cls.TILE
        if bits == 4:  # k = 8 j + 2 h + i: int16 (j, 2 c + i) = sum over h of q[c][8j + 2h + i] << 4h
            v = q.reshape(t, cls.TILE, g, 4, 4, 2).permute(0, 2, 3, 1, 5, 4).to(torch.int32)
            lanes = v[..., 0] | (v[..., 1] << 4) | (v[..., 2] << 8) | (v[..., 3] << 12)
            packed = lanes.to(torch.int16).view(torch.uint8)  # little-endian bytes, wrapped past 2^15
        else:  # k = 2 p + i: byte (p, 2 c + i) = q[c][2p + i]
            packed = q.reshape(t, cls.TILE, g, 16, 2).permute(0, 2, 3, 1, 4)
        per_group = lambda x: x.reshape(t, cls.TILE, g).transpose(1, 2).contiguous()  # noqa: E731
        return packed.reshape(t, g, -1).contiguous(), per_group(scales), per_group(mins)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # a model's 2-D activations: no reshapes
        out = self.qgemm(rows, None)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)

    def qgemm(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The kernel on 2-D rows; as the torch op while `torch.compile` traces (pybind calls break its graph)."""
        if torch.compiler.is_compiling():
            return compiled_op(self.ops, "qgemm")(rows, self.qweight, self.scales, self.mins, self.out_features, bias)
        return self.ops.qgemm(rows, self.qweight, self.scales, self.mins, self.out_features, bias)


class Int8PackGemm:
    """torch's `_weight_int8pack_mm`: 8 bits, one scale per output channel.

    The kernel reads K in steps of 16: at other widths it returned garbage or crashed
    (torch 2.13, CPU), so K is padded with zero columns, and x with zeros to match.
    """

    K_STEP = 16

    def __init__(self, qw: QuantizedWeight):
        n, k = qw.shape
        if qw.bits != 8 or qw.group_size != k:
            raise ValueError(f"torch's int8 kernel takes one scale per output channel, not {qw.format}")
        self.out_features, self.in_features = n, k
        self.pad = -k % self.K_STEP
        self.qweight = resident(F.pad(qw.qweight, (0, self.pad)).contiguous())
        self.scales = qw.scales.reshape(n).to(KERNEL_DTYPE)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        a = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        a = (F.pad(a, (0, self.pad)) if self.pad else a).contiguous()
        out = torch._weight_int8pack_mm(a, self.qweight, self.scales)
        return out.reshape(*x.shape[:-1], self.out_features)


class ExactTopLogits:
    """An LM head's kernel whose logits near each row's maximum are recomputed exactly in float32.

    Why: the kernels take bfloat16 activations and round their output to bfloat16, steps of
    0.125 at logits of 16-32, and SmolLM2's first answer token to "What is the capital of
    France?" beats the runner-up by 0.08. Every logit within twice the kernel's error bound
    of the row's maximum is recomputed from the quantized rows (exact values, float32
    scales) and the float32 activations, so greedy picks what a float32 model of the same
    weights picks; the others keep the kernel's value (off by at most that bound).
    """

    # bfloat16's unit roundoff (8 significant bits: one rounding moves a value by at most
    # 2^-8 of it), with room for float32 accumulation.
    EPS = 2.0**-8 * 1.01

    def __init__(self, kernel: Callable[[torch.Tensor], torch.Tensor], qw: QuantizedWeight):
        self.kernel, self.qw = kernel, qw
        # Rounding the activations, and the scales and zeros, to bfloat16 moves logit n by at
        # most EPS * |x| * (|w_n| + |b_n|) (Cauchy-Schwarz), b = `scale_magnitudes`; taken
        # a block of rows at a time (a float32 vocabulary is big).
        w_max = b_max = 0.0
        for i in range(0, qw.shape[0], 4096):
            block = qw.map_rows(lambda t: t[i : i + 4096])
            w_max = max(w_max, float(block.dequantize().norm(dim=1).max()))
            b_max = max(b_max, float(block.scale_magnitudes().norm(dim=1).max()))
        self.row_bound = w_max + b_max

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.kernel(x)
        if x.dtype != torch.float32 or x.numel() == 0:
            return out  # bfloat16 activations: logits are no better than the kernel's anyway
        x2 = x.reshape(-1, x.shape[-1])
        out = out.reshape(x2.shape[0], -1).to(torch.float32)
        rows, cols = near_max(out, torch.linalg.vector_norm(x2, dim=1) * self.row_bound, self.EPS)
        exact = (x2[rows] * self.qw.dequantize(torch.float32, rows=cols)).sum(dim=1)
        out[rows, cols] = exact
        return out.reshape(*x.shape[:-1], -1)


def quantized_linear(
    x: torch.Tensor, kernel: Callable[[torch.Tensor], torch.Tensor], bias: torch.Tensor | None
) -> torch.Tensor:
    """`Linear`'s GEMM for a quantized weight: the kernel in its precision, the result in x's dtype."""
    out = kernel(x)
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    return out if bias is None else out.add_(bias)


def streaming_group_linear(x: torch.Tensor, kernel: StreamingGroupGemm, bias: torch.Tensor | None) -> torch.Tensor:
    """`quantized_linear` for `StreamingGroupGemm`, whose output is already in x's dtype: a
    decode step makes ~120 of these calls, and each Python frame skipped saves ~0.5 us."""
    if x.dim() == 2 and bias is None and not torch.compiler.is_compiling():
        return kernel.ops.qgemm(x, kernel.qweight, kernel.scales, kernel.mins, kernel.out_features, None)
    return quantized_linear(x, kernel, bias)


def _cpu_kernels_available() -> bool:
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_weight_int8pack_mm")


def pick_quantized_gemm(
    qw: QuantizedWeight, device: torch.device, dtype: torch.dtype, exact_top: bool = False
) -> tuple[Callable, Any]:
    """The GEMM for a quantized weight and what it takes as its weight argument.

    On CPU the torch kernels above (int8 per channel -> `_weight_int8pack_mm`, the rest ->
    `_weight_int4pack_mm_for_cpu`), wrapped in `ExactTopLogits` for an LM head
    (`exact_top`); elsewhere, or for a shape the kernels refuse, the weight is dequantized
    once to `dtype` and takes the float path (`pick_gemm`).
    """
    from atom_core.layers.linear import gemv_ops, pick_gemm

    if device.type == "cpu" and _cpu_kernels_available():
        try:
            if qw.bits == 8 and qw.group_size == qw.shape[1]:
                kernel = Int8PackGemm(qw)
            elif qw.group_size == 32 and (ops := gemv_ops()) is not None:
                kernel = StreamingGroupGemm(qw, ops)
            else:
                kernel = Int4PackGemm(qw)
            if exact_top:
                return quantized_linear, ExactTopLogits(kernel, qw)
            return (streaming_group_linear if isinstance(kernel, StreamingGroupGemm) else quantized_linear), kernel
        except (ValueError, RuntimeError) as exc:
            reason = str(exc)
    else:
        reason = f"no quantized kernel on {device.type}"
    _warn_once(f"{qw.format} weights dequantized to {str(dtype).removeprefix('torch.')}: {reason}")
    return pick_gemm(qw.dequantize(dtype).to(device))


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning("atom: %s", message)


class QuantizedEmbedding(LookupEmbedding):
    """An embedding tied to a quantized LM head: rows are dequantized as they are looked up.

    Keeps no float copy of the table; for a GGUF Q8_0 table the rows are exactly the file's.
    """

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype):
        super().__init__(*qw.shape)
        self.qw, self.dtype = qw, dtype

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qw.dequantize(self.dtype, rows=ids)


# --- which layers get what -----------------------------------------------------------------


def quantizable_linears(model: nn.Module) -> dict[str, nn.Module]:
    """Every `Linear` of the model by name, but those a model marks `quantizable = False` (routers)."""
    from atom_core.layers.linear import Linear

    return {n: m for n, m in model.named_modules() if isinstance(m, Linear) and getattr(m, "quantizable", True)}


def quantizable_experts(model: nn.Module) -> dict[str, nn.Module]:
    """Every `FusedMoE` by name: each expert's two matrices are linear layers too."""
    from atom_core.layers.moe import FusedMoE

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
    if mode == "none":
        return
    linears = quantizable_linears(model)
    experts = quantizable_experts(model)
    if mode == "auto":
        from atom_core.loading.checkpoint import GGUF_BLOCKS_FILE

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
        for name, module in experts.items():
            for param in (module.w13, module.w2):
                if param.shape[2] % group:
                    per_channel.append(f"{name} experts (in_features {param.shape[2]})")
            module.quant = tuple([_quantize(w, mode, group) for w in param] for param in (module.w13, module.w2))
        if per_channel:
            logger.warning(
                "atom: %d layers quantized to int8 per output channel, their in_features not a multiple of "
                "quantization_group_size %d: %s", len(per_channel), group, ", ".join(per_channel[:4]),
            )  # fmt: skip
    _tie_embeddings(model)


def _tie_embeddings(model: nn.Module) -> None:
    """Swap an embedding whose weight a quantized Linear shares for a lookup into the quantized weight."""
    for name, head in tied_embeddings(model):
        if getattr(head, "quant", None) is None:
            continue
        weight = model.get_submodule(name).weight
        qw = head.quant if weight.device.type == "cpu" else head.quant.map_rows(lambda t: t.to(weight.device))
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
    model: nn.Module, blocks: Path, linears: dict[str, nn.Module], experts: dict[str, nn.Module], config: Any
) -> None:
    """Each Linear's (and each expert's) blocks from the converted GGUF: stacked as they are
    where every shard has a kernel format (one for all), requantized from the loaded float
    weight otherwise."""
    from atom_core.loading.checkpoint import checkpoint_target

    params = dict(model.named_parameters(remove_duplicate=False))
    by_param: dict[int, dict[Any, tuple[str, QuantizedWeight | None]]] = {}
    source, weights = load_blocks(blocks)
    for hf_name, (gguf_type, qw) in weights.items():
        target = checkpoint_target(model, hf_name)
        if target is None or target[0] not in params:
            continue
        by_param.setdefault(id(params[target[0]]), {})[target[1]] = (gguf_type, qw)

    kept: dict[str, int] = {}
    requantized: dict[str, list[str]] = {}

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

    for name, module in linears.items():
        shards = by_param.get(id(module.weight))
        if not shards:
            continue
        if config.quantize_lm_head == "none" and module.is_lm_head:
            continue
        offsets = getattr(module, "shard_offsets", None)  # a MergedLinear: its shards in row order
        order = sorted(offsets, key=lambda s: offsets[s][0]) if offsets else [None]
        module.quant = from_blocks(name, [shards.get(s) for s in order], module.weight)
    for name, module in experts.items():
        w13, w2 = by_param.get(id(module.w13), {}), by_param.get(id(module.w2), {})
        quant = (
            [from_blocks(f"{name}.{e}.w13", [w13.get(("gate", e)), w13.get(("up", e))], module.w13[e])
             for e in range(module.num_experts)],
            [from_blocks(f"{name}.{e}.w2", [w2.get(("down", e))], module.w2[e]) for e in range(module.num_experts)],
        )  # fmt: skip
        if all(q is not None for q in quant[0] + quant[1]):  # one format for the whole layer, or float
            module.quant = quant
    if kept:
        logger.info("atom: %s: kept %s as 4/8-bit weights", source,
                    ", ".join(f"{n} {t}" for t, n in sorted(kept.items())))  # fmt: skip
    for (what, why), names in requantized.items():
        logger.warning(
            "atom: %s: %d layers requantized from their dequantized weights (%s), e.g. %s: %s",
            source, len(names), what, names[0], why,
        )  # fmt: skip
