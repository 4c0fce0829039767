"""The GEMMs for float weights: packed oneDNN, and the weight-streaming C++ kernel for 1 to
`MAX_ROWS` rows (or every row count where oneDNN has no kernel for the dtype).

`pick_gemm` chooses, once the weights are loaded; `Linear` (linear.py) calls what it chose.
Why two kernels: at a few dozen rows a GEMM is a stream over its weight, which oneDNN reads
under the memory's pace; see docs/kernels.md.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
import torch.nn.functional as F

from atom_core.layers.cpp import CppKernel, compiled_op
from atom_core.layers.graph_capture import launch
from atom_core.platform.cpu_features import cpu_features
from atom_core.platform.memory import resident

Gemm = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


@torch.library.custom_op("atom::onednn_linear", mutates_args=())
def onednn_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's GEMM on a packed weight, as one opaque op for `torch.compile` (Inductor's own
    lowering of `mkldnn._linear_pointwise` rejects the inputs a traced decode step gives it)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return onednn_linear_op(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


# oneDNN lays a packed weight out for a row count; any count works. Packed for 64 rows,
# it was as fast as or faster than packed for 1 or 512 at every count from 1 to 10k.
PACK_ROWS = 64


# its 4- and 8-bit group kernels take VNNI's dot products where the CPU has them
GEMV_KERNEL = CppKernel("atom_gemv", Path(__file__).parent / "csrc" / "gemv_cpu.cpp", uses=("avx512_vnni", "avx2_vnni"))


_faked: set[str] = set()


def gemv_ops(variant: str | None = None) -> ModuleType | None:
    """The streaming GEMM and the 4/8-bit group kernel (`csrc/gemv_cpu.cpp`): this CPU's
    variant, or `variant`; None where they cannot build or are turned off (ATOM_DISABLE_GEMV)."""
    if os.environ.get("ATOM_DISABLE_GEMV"):
        return None
    ops = GEMV_KERNEL.load(variant)
    if ops is not None and ops.OPS_NAMESPACE not in _faked:  # the shapes `torch.compile` traces with
        _faked.add(ops.OPS_NAMESPACE)
        ns = ops.OPS_NAMESPACE
        ops.set_amx(cpu_features().amx_bf16)  # bfloat16 rows in AMX tiles where the CPU has them
        torch.library.register_fake(f"{ns}::gemv")(lambda x, w, n, bias: x.new_empty((x.shape[0], n)))
        torch.library.register_fake(f"{ns}::qgemm")(
            lambda x, qw, d, mn, n, bias, act_bits=16: x.new_empty((x.shape[0], n))
        )
        torch.library.register_fake(f"{ns}::qgemm_dense")(lambda x, qw, d, mn, n, bias: x.new_empty((x.shape[0], n)))
    return ops


def gemv_weight(weight: torch.Tensor, tile: int) -> torch.Tensor:
    """`weight` [N, K] in the streaming kernel's layout: tiles of `tile` output rows (the
    kernel's `TILE`, two vectors; N padded with zero rows), within a tile each k's values
    together; bfloat16 goes by pairs of k (K padded to even), so a tile is [K / 2, tile, 2].
    Why: see gemv_cpu.cpp."""
    n, k = weight.shape
    pairs = weight.dtype == torch.bfloat16
    kp = k + k % 2 if pairs else k
    if kp != k or n % tile:
        weight = F.pad(weight, (0, kp - k, 0, -n % tile))
    tiles = weight.shape[0] // tile
    if pairs:
        return weight.reshape(tiles, tile, kp // 2, 2).transpose(1, 2).contiguous()
    return weight.reshape(tiles, tile, kp).transpose(1, 2).contiguous()


def gemv_rows(tiled: torch.Tensor, rows: torch.Tensor, in_features: int) -> torch.Tensor:
    """The rows `rows` [L] of the [N, K] weight `tiled` holds (`gemv_weight`'s layout): [L, K]."""
    pairs, tile = tiled.dim() == 4, tiled.shape[2]
    if pairs:  # bfloat16 pairs as one 32-bit value each: a gather of 4-byte elements
        tiled = tiled.view(torch.int32).squeeze(-1)
    picked = tiled[rows // tile, :, rows % tile]  # [L, K] (bfloat16: [L, K / 2] pairs)
    return (picked.view(torch.bfloat16) if pairs else picked)[:, :in_features]


# Rows up to which bfloat16 weights stream beside oneDNN on CPUs with AMX whose streaming
# kernel multiplies without the tiles (`ops.amx_tiles()` false): there oneDNN's tiles outran
# vdpbf16ps from about 16 rows on (benchmarks/gemv_bandwidth.py, docs/performance.md,
# twenty-sixth session). In tiles the kernel outran oneDNN up to MAX_ROWS (thirty-second).
AMX_BF16_STREAM_ROWS = 8


def streaming_rows(dtype: torch.dtype, ops: ModuleType) -> int:
    """Up to how many rows the streaming kernel serves a weight of `dtype` beside packed oneDNN:
    the kernel's MAX_ROWS, or AMX_BF16_STREAM_ROWS for bfloat16 where the CPU has AMX and the
    kernel's own AMX tiles are off."""
    if dtype == torch.bfloat16 and cpu_features().amx_bf16 and not ops.amx_tiles():
        return min(AMX_BF16_STREAM_ROWS, int(ops.MAX_ROWS))
    return int(ops.MAX_ROWS)


class StreamingGemm:
    """The weight-streaming kernel on its own tiled copy (`gemv_weight`, in huge pages when
    loaded in a `weight_arena`): for 1 to `max_rows` rows beside packed oneDNN, or for every
    row count (`every_row`) where Atom does not give the dtype to oneDNN (bfloat16 without
    avx512_bf16 or AMX: `cpu_features().onednn_bf16`), the tiled copy then the only one."""

    def __init__(self, weight: torch.Tensor, ops: ModuleType, every_row: bool = False):
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.tiled: torch.Tensor | None = resident(gemv_weight(weight.detach(), int(ops.TILE)))
        self.ops, self.every_row = ops, every_row
        self.max_rows = sys.maxsize if every_row else streaming_rows(weight.dtype, ops)

    def __call__(self, x: torch.Tensor, packed: Any, bias: torch.Tensor | None) -> torch.Tensor:
        if self.every_row and x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1]), packed, bias).reshape(*x.shape[:-1], self.out_features)
        if x.dim() == 2 and 0 < x.shape[0] <= self.max_rows:
            if x.shape[1] != self.in_features:  # the kernel sees K only through the padded tiles
                raise ValueError(f"x has {x.shape[1]} features, the weight takes {self.in_features}")
            if torch.compiler.is_compiling():
                return compiled_op(self.ops, "gemv")(x, self.tiled, self.out_features, bias)
            return launch(self.ops.gemv, x, self.tiled, self.out_features, bias)
        if self.every_row:  # no rows
            return x.new_empty((0, self.out_features))
        return _onednn_linear(x, packed, bias)

    def rows(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of the weight as [len(index), K] (all of them when `index` is None)."""
        if index is None:
            index = torch.arange(self.out_features)
        assert self.tiled is not None  # asked of a kernel that keeps its tiled copy
        return gemv_rows(self.tiled, index, self.in_features)

    def columns(self, x: torch.Tensor, cols: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The outputs `cols` alone for 1 to `max_rows` rows of x, each equal bit for bit to that
        column of the whole product (the kernel sums each output alike in any subset)."""
        tiled = gemv_weight(self.rows(cols), int(self.ops.TILE))
        return self.ops.gemv(x, tiled, len(cols), None if bias is None else bias[cols])

    def make_batch_invariant(self) -> None:
        """One kernel at every row count: oneDNN, the tiled copy dropped (a tied embedding keeps
        its reference); a kernel that serves every row count already is."""
        if not self.every_row:
            self.max_rows, self.tiled = 0, None

    @property
    def batch_invariant(self) -> bool:
        return self.every_row or self.max_rows == 0


def onednn_takes(dtype: torch.dtype) -> bool:
    """Whether oneDNN has GEMM kernels for weights of `dtype` on this CPU: float32 always,
    bfloat16 where `cpu_features().onednn_bf16`; float16 is never given to it (its kernels
    need AVX512-FP16 or AMX-FP16, and torch's fallback runs at a twentieth of bfloat16's rate)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_features().onednn_bf16)


def onednn_enabled() -> bool:
    """Whether `pick_gemm` may hand weights to oneDNN (off with ATOM_DISABLE_ONEDNN=1)."""
    return torch.backends.mkldnn.is_available() and not os.environ.get("ATOM_DISABLE_ONEDNN")


def streams_every_row(dtype: torch.dtype, ops: ModuleType) -> bool:
    """Whether the streaming kernel `ops` alone serves CPU weights of `dtype` at every row count
    (`pick_gemm`): float32 where its build outruns oneDNN there (`F32_EVERY_ROW`), float16
    always, bfloat16 where oneDNN (enabled) has no bfloat16 kernels."""
    if dtype == torch.float32:
        return bool(ops.F32_EVERY_ROW)
    return dtype == torch.float16 or (dtype == torch.bfloat16 and onednn_enabled() and not onednn_takes(dtype))


def pick_gemm(weight: torch.Tensor, streaming: bool = True) -> tuple[Gemm, Any]:
    """The GEMM for this weight and the weight in the form that GEMM takes.

    On CPU, packed oneDNN for float32, and for bfloat16 where oneDNN has bfloat16 kernels
    (`cpu_features().onednn_bf16`; off with ATOM_DISABLE_ONEDNN=1), with the streaming
    kernel for decode-sized row counts unless `streaming` is False (MoE experts, whose rows
    per expert vary and whose plain copies would double the biggest weights). bfloat16
    without oneDNN's kernels (CPUs without AVX-512), and float16 (which oneDNN runs only on
    CPUs with AVX512-FP16 or AMX-FP16, and torch's own kernel at a twentieth of bfloat16's
    rate), keep their weights in 16 bits and run the streaming kernel at every row count,
    widening them as it goes. float32 takes the streaming kernel at every row count too
    where the kernel's build says it outruns oneDNN there (`F32_EVERY_ROW`: AVX2 builds).
    `F.linear` on the plain weight elsewhere.
    """
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return F.linear, weight
    ops = gemv_ops()
    if ops is not None and streams_every_row(weight.dtype, ops):
        gemm = StreamingGemm(weight, ops, every_row=True)
        return gemm, gemm.tiled
    if onednn_enabled() and onednn_takes(weight.dtype):
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
        if ops is None or not streaming:
            return _onednn_linear, packed
        return StreamingGemm(weight, ops), packed
    return F.linear, weight
