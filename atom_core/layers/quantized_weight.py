"""The quantized weight format behind `Linear`: integer weights, float activations.

Why: a decode step at small batch streams every weight from memory once, so on CPU the
bytes per weight set the pace. A `QuantizedWeight` keeps integer values with affine
parameters in groups along the input dimension K:

- 4 bits: w = (q - 8) * scale + zero, q in 0..15 (torch's int4 layout, zero = the value at
  q = 8). GGUF Q4_0 is exactly this with zero = 0, Q4_1 with zero = min + 8 * scale.
- 8 bits: w = q * scale, q in -128..127, in groups (GGUF Q8_0 is groups of 32), or one
  scale per output channel.

The kernels that multiply by one are in `quantized_gemm.py`; which layers get one is
`atom_core.loading.quantize`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, cast

import torch

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
        return cast("tuple[int, int]", tuple(self.qweight.shape))

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
            assert zeros is not None  # 4 bits always have zeros
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
        assert self.zeros is not None  # 4 bits always have zeros
        q = self.qweight.reshape(*self.shape[:-1], -1, self.group_size).to(torch.float32) - 8
        return (q.abs() * self.scales.unsqueeze(-1) + self.zeros.abs().unsqueeze(-1)).reshape(self.shape)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
        """The same weight with its rows rearranged by `fn` (GGUF's Q/K row permutation)."""
        zeros = None if self.zeros is None else fn(self.zeros)
        return QuantizedWeight(self.bits, self.group_size, fn(self.qweight), fn(self.scales), zeros, self.origin)

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight:
        """Rows [start, start + length) (dim 0), or those columns (dim 1) in whole groups: a
        tensor-parallel rank's part, as `torch.Tensor.narrow` gives a float weight's."""
        if dim == 1 and (start % self.group_size or length % self.group_size):
            raise ValueError(
                f"{self.format} ({self.origin or 'quantized'}) cannot split columns [{start}, {start + length}) of "
                f"{self.shape[1]}: a split must keep whole groups of {self.group_size}"
            )
        g = self.group_size if dim == 1 else 1
        zeros = None if self.zeros is None else self.zeros.narrow(dim, start // g, length // g)
        return QuantizedWeight(
            self.bits, self.group_size, self.qweight.narrow(dim, start, length).contiguous(),
            self.scales.narrow(dim, start // g, length // g).contiguous(),
            None if zeros is None else zeros.contiguous(), self.origin,
        )  # fmt: skip

    def pad_rows(self, rows: int) -> QuantizedWeight:
        """`rows` rows, the added ones zero (a vocabulary split whose last rank holds fewer)."""
        extra = rows - self.shape[0]
        if extra <= 0:
            return self

        def pad(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(extra, *t.shape[1:])])

        zeros = None if self.zeros is None else pad(self.zeros)
        return QuantizedWeight(self.bits, self.group_size, pad(self.qweight), pad(self.scales), zeros, self.origin)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Row blocks stacked (the shards of a `MergedLinear`); they must share one format."""
        first = parts[0]
        if any((p.bits, p.group_size, p.shape[1]) != (first.bits, first.group_size, first.shape[1]) for p in parts):
            raise ValueError(f"cannot stack {', '.join(p.format for p in parts)} into one weight")
        zeros = None if first.zeros is None else torch.cat([cast(torch.Tensor, p.zeros) for p in parts])
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


# --- kernels -------------------------------------------------------------------------------


# --- which layers get what -----------------------------------------------------------------
