"""The C++ CPU kernels in `csrc/`, compiled on first use and cached by torch.

Built with the machine's C++ compiler through `torch.utils.cpp_extension` (ninja), for
the CPU it runs on (-march=native), into torch's extension cache (TORCH_EXTENSIONS_DIR,
by default ~/.cache/torch_extensions). When no compiler is there, or ATOM_CPU_KERNELS=0,
`load()` returns None and attention stays on the pure-torch path, with a warning.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"


@functools.cache
def load() -> ModuleType | None:
    if os.environ.get("ATOM_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils import cpp_extension

        return cpp_extension.load(
            name="atom_paged_attention_cpu",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, a build error: the torch path still works
        logger.warning("Atom's C++ CPU attention kernel is unavailable (%s); using the slower torch path", e)
        return None
