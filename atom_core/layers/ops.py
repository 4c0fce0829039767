"""The elementwise ops layers call: fused C++ kernels on CPU (`csrc/cpu_ops.cpp`), torch elsewhere.

The torch versions are the reference (they follow transformers op for op); the CPU
kernels do the same arithmetic in one pass. A device's kernel plugin replaces these
functions' bodies, not the models.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType
from typing import cast

import torch
import torch.nn.functional as F

from atom_core.layers.cpp import CppKernel
from atom_core.layers.graph_capture import launch, launch_inplace

CPU_OPS_KERNEL = CppKernel("atom_cpu_ops", Path(__file__).parent / "csrc" / "cpu_ops.cpp")
GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE: elements below which torch's elementwise ops use one thread


def cpu_ops(variant: str | None = None) -> ModuleType | None:
    return CPU_OPS_KERNEL.load(variant)


def _native(x: torch.Tensor) -> ModuleType | None:
    """The C++ kernels for CPU tensors; not while `torch.compile` traces (it fuses the torch versions)."""
    if torch.compiler.is_compiling() or not x.is_cpu:
        return None
    return cpu_ops()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Statistics in float32, normalised value cast back before the weight (as transformers)."""
    ops = _native(x)
    if ops is not None and weight.dtype == x.dtype:
        return launch(ops.rms_norm, x, weight, eps)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): a residual add and the norm after it in one pass.

    The sum rounds as `residual + x` does. On CPU it is written into `residual` (as vLLM's
    fused_add_rms_norm): callers pass a residual stream buffer they own.
    """
    ops = _native(x)
    if ops is not None and residual.dtype == x.dtype == weight.dtype and residual.is_contiguous():
        return launch(ops.add_rms_norm, x, residual, weight, eps), residual
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def torch_splits_whole_rows(rows: int, width: int) -> bool:
    """Whether torch's elementwise kernels hand each thread whole rows of a [rows, width]
    output: at::parallel_for cuts its n elements into min(threads, ceil(n / GRAIN_SIZE))
    chunks of ceil(n / chunks). A chunk ending mid-row moves that row's vector/scalar
    boundaries, which a kernel working in whole rows does not mirror."""
    n, threads = rows * width, torch.get_num_threads()
    if n < GRAIN_SIZE or threads == 1:
        return True
    chunks = min(threads, -(-n // GRAIN_SIZE))
    return -(-n // chunks) % width == 0


@functools.cache
def torch_vector_bytes() -> int | None:
    """The vector width of the CPU kernels torch dispatches to, where the C++ silu_and_mul mirrors them."""
    return {"AVX512": 64, "AVX2": 32}.get(torch.backends.cpu.get_cpu_capability())


# transformers' `hidden_act` names of the gated activations `act_and_mul` takes
GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu_tanh", "gelu")


def act_and_mul(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """x = [gate | up] on the last dim -> act(gate) * up: SiLU (`silu_and_mul`), or GELU exact
    ("gelu") or tanh-approximated ("gelu_pytorch_tanh", Gemma's GeGLU)."""
    if activation == "silu":
        return silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="none" if activation == "gelu" else "tanh") * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] on the last dim -> silu(gate) * up, bit for bit `F.silu(gate) * up`.

    The C++ kernel rounds each row as torch's silu does a whole row; it takes the shapes
    torch splits between threads at row boundaries only (`torch_splits_whole_rows`: one
    thread, a decode batch of 32 x 1536 or a 512-token prompt on two), since a split mid-row
    moves that row's vector/scalar boundaries in torch's exp. One pass instead of torch's
    silu and then the product: fewer dispatches at decode, one read of the gate fewer at prefill.
    """
    ops = _native(x)
    if ops is not None and x.dim() == 2 and x.stride(1) == 1:
        vector_bytes = torch_vector_bytes()
        whole_rows = torch_splits_whole_rows(x.shape[0], x.shape[1] // 2)
        if vector_bytes is not None and whole_rows and ops.EXP_LANES:
            return launch(ops.silu_and_mul, x, vector_bytes)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # in place: one fewer [tokens, intermediate] temporary


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; may rotate x in place (it is always a fresh projection).

    Equals x * cos + rotate_half(x) * sin bit for bit: rolling by half a head and
    multiplying by (-sin, sin) is rotate_half without the cat.
    """
    ops = _native(x)
    if ops is not None and x.stride(-1) == 1:
        return launch_inplace(ops.rotary_, x, cos, sin_signed)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rope over interleaved pairs (x0, x1), (x2, x3), ...

    De-interleaves to [evens | odds] and rotates halves: transformers' DeepSeek-V3 output
    layout. Queries and keys permuted alike keep every dot product (and so DeepSeek-V2's
    complex-number rope, which keeps pairs interleaved) unchanged.
    """
    d = x.shape[-1]
    x = x.unflatten(-1, (d // 2, 2)).transpose(-1, -2).reshape(*x.shape[:-1], d)
    return apply_rotary(x, cos, sin_signed)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for [rows, n] (first maximum; NaN counts as the largest); C++ on CPU,
    where torch's reads about a billion values a second and a greedy step scans [rows, vocab]."""
    ops = _native(x)
    if ops is not None and x.dim() == 2 and x.shape[1] > 0 and x.stride(1) == 1:
        return ops.argmax_rows(x)
    return x.argmax(dim=-1)


def near_max(x: torch.Tensor, base: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) of the entries of float32 `x` [rows, n] with x >= m - 2 e, where m is the
    row's maximum and e = eps * (base + |m| + 1): the logits an LM head's error bound cannot
    rule out as the maximum (`quant.ExactTopLogits`). C++ on CPU, one pass per row."""
    ops = _native(x)
    if ops is not None and x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1:
        return ops.near_max_rows(x, base.to(torch.float32).contiguous(), eps)
    top = x.max(dim=1).values
    error = eps * (base + top.abs() + 1.0)
    return cast("tuple[torch.Tensor, torch.Tensor]", (x >= (top - 2 * error).unsqueeze(1)).nonzero(as_tuple=True))
