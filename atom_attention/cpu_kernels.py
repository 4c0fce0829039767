"""The C++ CPU attention kernels in `csrc/`, built per CPU variant on first use (see `atom_core.layers.cpp`)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from atom_core.layers.cpp import CppKernel

PAGED_ATTENTION_KERNEL = CppKernel(
    "atom_paged_attention_cpu", Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
)


GDN_KERNEL = CppKernel("atom_gdn_cpu", Path(__file__).parent / "csrc" / "gdn_cpu.cpp")


def load(variant: str | None = None) -> ModuleType | None:
    return PAGED_ATTENTION_KERNEL.load(variant)


def load_gdn(variant: str | None = None) -> ModuleType | None:
    return GDN_KERNEL.load(variant)
