"""The C++ CPU attention kernel in `csrc/`, compiled on first use (see `atom_core.layers.cpp`)."""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

from atom_core.layers.cpp import load_extension

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"


@functools.cache
def load() -> ModuleType | None:
    return load_extension("atom_paged_attention_cpu", SOURCE)
