"""The elementwise ops layers call: fused C++ kernels on CPU (`csrc/cpu_ops.cpp`), torch elsewhere.

The torch versions are the reference (they follow transformers op for op); the CPU
kernels do the same arithmetic in one pass. A device's kernel plugin replaces these
functions' bodies, not the models.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from atom_core.layers.cpp import load_extension

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"


@functools.cache
def cpu_ops() -> ModuleType | None:
    return load_extension("atom_cpu_ops", SOURCE)


def _native(x: torch.Tensor) -> ModuleType | None:
    """The C++ kernels for CPU tensors; not while `torch.compile` traces (it fuses the torch versions)."""
    if torch.compiler.is_compiling():
        return None
    return cpu_ops() if x.device.type == "cpu" else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Statistics in float32, normalised value cast back before the weight (as transformers)."""
    ops = _native(x)
    if ops is not None and weight.dtype == x.dtype:
        return ops.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] on the last dim -> silu(gate) * up (torch's own kernels beat a fused one here)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # in place: one fewer [tokens, intermediate] temporary


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; may rotate x in place (it is always a fresh projection).

    Equals x * cos + rotate_half(x) * sin bit for bit: rolling by half a head and
    multiplying by (-sin, sin) is rotate_half without the cat.
    """
    ops = _native(x)
    if ops is not None and x.stride(-1) == 1:
        return ops.rotary_(x, cos, sin_signed)
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
