"""The kernels for quantized weights (`QuantizedWeight`), and `pick_quantized_gemm`, which
chooses among them as `pick_gemm` does for float weights.

On CPU: the streaming kernel's `qgemm` for groups of 32 (4 or 8 bits); torch's
`_weight_int4pack_mm_for_cpu` for other 4-bit groups and for 8-bit groups (run exactly as
two 4-bit halves; at batch 1 faster than the per-channel kernel, and groups of 32 cost no
perplexity where per channel cost some on SmolLM2), `_weight_int8pack_mm` for 8 bits per
channel. torch's kernels take bfloat16 activations (with float32 ones they run far slower); the model's own dtype runs between GEMMs. Elsewhere the weight is dequantized once
and runs as a float weight. An LM head's kernel is wrapped in `ExactTopLogits`.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

from atom_core.layers.cpp import compiled_op
from atom_core.layers.gemm import gemv_ops, pick_gemm
from atom_core.layers.graph_capture import launch
from atom_core.layers.ops import near_max
from atom_core.layers.quantized_weight import INT4_GROUP_SIZES, KERNEL_DTYPE, QuantizedWeight
from atom_core.platform.cpu_features import cpu_features
from atom_core.platform.memory import resident

logger = logging.getLogger("atom")


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
            assert zeros is not None  # 4 bits always have zeros
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
    integer dot products against x rounded per group of 32 to `activation_bits`: int16
    (vpdpwssd; about 16 significant bits, where torch's int4 kernel takes bfloat16's 8) or,
    for 4-bit weights, int8 (vpdpbusd, twice the products an instruction; what llama.cpp's
    and OpenVINO's 4-bit GEMMs multiply). 8-bit weights always take int16. It serves every row
    count and computes each row alike whatever the count, so it is batch-invariant by
    construction (speculative decoding's verify rows round as plain decode rows do), and
    one copy of the weights serves decode and prefill.

    Except on CPUs with AMX: there 4-bit weights against 8-bit activations take `qgemm_dense`
    from `dense_rows` rows on (a prompt's), the weight widened to bfloat16 at each call
    through oneDNN's micro-kernel (`gemv_cpu.cpp`), at x and w rounded to bfloat16;
    `make_batch_invariant` (speculative decoding) or ATOM_DISABLE_DENSE_PREFILL=1 turns it off.
    """

    TILE = 16
    # From this many rows the AMX path outran qgemm at 8-bit activations (docs/performance.md).
    DENSE_ROWS = 96

    def __init__(self, qw: QuantizedWeight, ops: Any, activation_bits: int = 16, dense_rows: int | None = None):
        n, k = qw.shape
        if qw.group_size != 32 or k % 32:
            raise ValueError(f"the streaming kernel takes groups of 32, not {qw.format}")
        if activation_bits not in (8, 16):
            raise ValueError(f"activation_bits must be 8 or 16, got {activation_bits}")
        self.ops, self.bits = ops, qw.bits
        self.activation_bits = activation_bits if qw.bits == 4 else 16  # 8-bit weights: always 16
        self.out_features, self.in_features = n, k
        self.qweight, self.scales, self.mins = map(resident, self.pack(*self.codes(qw), qw.bits))
        if dense_rows is None:
            dense_rows = self.DENSE_ROWS if self.activation_bits == 8 and dense_prefill(ops) else NEVER
        elif dense_rows != NEVER and self.activation_bits != 8:
            raise ValueError(
                f"qgemm_dense stands in for 8-bit activations of 4-bit weights, not {self.activation_bits}-bit"
            )
        self.dense_rows = dense_rows

    def make_batch_invariant(self) -> None:
        """qgemm at every row count: it rounds each row alike whatever the count."""
        self.dense_rows = NEVER

    @property
    def batch_invariant(self) -> bool:
        return self.dense_rows == NEVER

    @staticmethod
    def codes(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the kernel multiplies by: unsigned q [N, K], float16 scales and mins [N, K / 32],
        w = q * scale + min."""
        scales = qw.scales.to(torch.float16)
        if qw.bits == 4:  # q in 0..15
            assert qw.zeros is not None  # 4 bits always have zeros
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
        dense = rows.shape[0] >= self.dense_rows
        if torch.compiler.is_compiling():
            if dense:
                return compiled_op(self.ops, "qgemm_dense")(
                    rows, self.qweight, self.scales, self.mins, self.out_features, bias
                )
            return compiled_op(self.ops, "qgemm")(
                rows, self.qweight, self.scales, self.mins, self.out_features, bias, self.activation_bits
            )
        if dense:
            return launch(self.ops.qgemm_dense, rows, self.qweight, self.scales, self.mins, self.out_features, bias)
        return launch(
            self.ops.qgemm, rows, self.qweight, self.scales, self.mins, self.out_features, bias, self.activation_bits
        )


NEVER = sys.maxsize  # `dense_rows` that no call reaches
_dense_usable: dict[str, bool] = {}


def dense_prefill(ops: Any) -> bool:
    """Whether `qgemm_dense` serves a prompt's rows here: on CPUs with AMX (not under an
    ATOM_CPU_ISA below it), where oneDNN's micro-kernel runs, unless ATOM_DISABLE_DENSE_PREFILL."""
    if os.environ.get("ATOM_DISABLE_DENSE_PREFILL") or not cpu_features().amx_bf16:
        return False
    if ops.OPS_NAMESPACE not in _dense_usable:
        _dense_usable[ops.OPS_NAMESPACE] = bool(ops.dense_usable())
    return _dense_usable[ops.OPS_NAMESPACE]


def streaming_error_bound(
    exact_rows: Callable[[slice], torch.Tensor], kernel: StreamingGroupGemm, qw: QuantizedWeight
) -> tuple[float, float] | None:
    """(per_norm, per_max): `kernel` (on `qw`, which it may hold with its scales rounded to
    float16) is within |x| per_norm + max|x| per_max of the product of x with the rows
    `exact_rows(block)` gives, for every output (Cauchy-Schwarz):

        |kernel - exact| <= |x| (D + c (W + Q + Z)) + Q |x - xr|

    D: the largest distance between an exact row and the kernel's; W, Q and Z: the largest
    norms of an exact row, of the kernel's `q * scale` part and of its `min` part (which
    multiplies x's own group sums); xr: x as the kernel rounds it (per group of 32 to
    `activation_bits`, at most 0.55 max|x| / levels off per value); c: float32 rounding of the
    sums ((K + 2 K / 32 + 8) units of 2^-24, 1% slack). None where a term is not finite.
    """
    codes, scales, mins = StreamingGroupGemm.codes(qw)
    n, k = codes.shape
    d = w = q = z = 0.0
    for i in range(0, n, 4096):  # a float64 vocabulary at once is big
        block = slice(i, i + 4096)
        part = codes[block].double() * scales[block].double().repeat_interleave(32, dim=1)
        zero = mins[block].double().repeat_interleave(32, dim=1)
        rows = exact_rows(block).double()
        d = max(d, float((rows - part - zero).norm(dim=1).max()))
        w = max(w, float(rows.norm(dim=1).max()))
        q = max(q, float(part.norm(dim=1).max()))
        z = max(z, float(zero.norm(dim=1).max()))
    if not all(math.isfinite(v) for v in (d, w, q, z)):  # float16 scales overflow
        return None
    c = 1.01 * (k + 2 * k // 32 + 8) * 2.0**-24
    levels = 32767 if kernel.activation_bits == 16 else 127
    return d + c * (w + q + z), q * 0.55 * math.sqrt(k) / levels


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
    # Atom's own kernel rounds x to int16 and sums in float32: `streaming_error_bound`, far
    # tighter than the bfloat16 bound, so a row recomputes only the few logits near its top.
    FLOAT32_EPS = 2.0**-22

    def __init__(self, kernel: Callable[[torch.Tensor], torch.Tensor], qw: QuantizedWeight):
        self.kernel, self.qw = kernel, qw
        self.streaming_bound: tuple[float, float] | None = None
        if isinstance(kernel, StreamingGroupGemm):
            self.streaming_bound = streaming_error_bound(
                lambda block: qw.map_rows(lambda t: t[block]).dequantize(), kernel, qw
            )
        self.row_bound = 0.0  # the bfloat16 bound's, where the streaming kernel's does not serve
        if self.streaming_bound is None:
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
        if self.streaming_bound is not None:
            per_norm, per_max = self.streaming_bound
            bound = torch.linalg.vector_norm(x2, dim=1).mul_(per_norm).add_(x2.abs().amax(dim=1), alpha=per_max)
            # near_max keeps out >= max - 2 eps (base + |max| + 1): base = bound (1 / eps + 2)
            rows, cols = near_max(out, bound.mul_(1 / self.FLOAT32_EPS + 2), self.FLOAT32_EPS)
        else:
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
    if x.dim() == 2 and bias is None and x.shape[0] < kernel.dense_rows and not torch.compiler.is_compiling():
        return launch(
            kernel.ops.qgemm, x, kernel.qweight, kernel.scales, kernel.mins, kernel.out_features, None,
            kernel.activation_bits,
        )  # fmt: skip
    return quantized_linear(x, kernel, bias)


def _cpu_kernels_available() -> bool:
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_weight_int8pack_mm")


def pick_quantized_gemm(
    qw: QuantizedWeight,
    device: torch.device,
    dtype: torch.dtype,
    exact_top: bool = False,
    activation_bits: int = 16,
) -> tuple[Callable, Any]:
    """The GEMM for a quantized weight and what it takes as its weight argument.

    On CPU the streaming kernel for groups of 32 (4-bit weights against x rounded to
    `activation_bits`), the torch kernels above for the rest (int8 per channel ->
    `_weight_int8pack_mm`, others -> `_weight_int4pack_mm_for_cpu`), wrapped in
    `ExactTopLogits` for an LM head (`exact_top`, whose x keeps 16 bits); elsewhere, or for a
    shape the kernels refuse, the weight is dequantized once to `dtype` and takes the float
    path (`pick_gemm`).
    """
    if device.type == "cpu" and _cpu_kernels_available():
        try:
            kernel: Int8PackGemm | StreamingGroupGemm | Int4PackGemm
            # groups of 32 first: a 32-wide layer (a tensor-parallel rank's slice) is also one
            # group a row, and takes the kernel its wider counterpart takes
            if qw.group_size == 32 and (ops := gemv_ops()) is not None:
                # an LM head's exact top logits rest on qgemm's error bound: qgemm at every row count
                kernel = StreamingGroupGemm(qw, ops, 16 if exact_top else activation_bits, NEVER if exact_top else None)
            elif qw.bits == 8 and qw.group_size == qw.shape[1]:
                kernel = Int8PackGemm(qw)
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
