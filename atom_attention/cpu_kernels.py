"""The C++ CPU attention kernels in `csrc/`, built per CPU variant on first use (see `atom_core.layers.cpp`)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from atom_core.layers.cpp import CppKernel
from atom_core.plugin_api import cpu_features

PAGED_ATTENTION_KERNEL = CppKernel(
    "atom_paged_attention_cpu", Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
)


GDN_KERNEL = CppKernel("atom_gdn_cpu", Path(__file__).parent / "csrc" / "gdn_cpu.cpp")


def load(variant: str | None = None) -> ModuleType | None:
    """The paged attention kernel, its prompt tiles multiplied in AMX tiles where the CPU has
    them (`set_amx`; `cpu_features().amx_bf16`, which ATOM_CPU_ISA below AVX-512 bfloat16 turns off)."""
    ops = PAGED_ATTENTION_KERNEL.load(variant)
    if ops is not None:
        ops.set_amx(cpu_features().amx_bf16)
    return ops


def load_gdn(variant: str | None = None) -> ModuleType | None:
    return GDN_KERNEL.load(variant)
