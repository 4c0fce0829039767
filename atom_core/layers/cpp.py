"""Build-on-first-use C++ extensions for the CPU kernels (`torch.utils.cpp_extension`).

Each is compiled once with the machine's C++ compiler, for the CPU it runs on
(-march=native), into torch's extension cache (TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions), and reloaded from there afterwards. Without a compiler, or
with ATOM_CPU_KERNELS=0, `load_extension` returns None and callers keep their torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

# Headers every kernel may include (float_convert.h), wherever its own source lives.
INCLUDE_DIR = Path(__file__).parent / "csrc"


def cpu_tag() -> str:
    """Names the instruction set a -march=native build targets, so a cache shared between
    different CPUs (a network home folder) never loads a build for the wrong one."""
    flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            flags += next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def load_extension(name: str, source: Path) -> ModuleType | None:
    if os.environ.get("ATOM_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils import cpp_extension

        # The checkout's path is in the name too: two checkouts (a clone beside a working
        # tree) would otherwise rebuild over each other's cache entry on every load.
        where = hashlib.sha1(str(source.resolve().parent).encode()).hexdigest()[:6]
        return cpp_extension.load(
            name=f"{name}_{cpu_tag()}_{where}",
            sources=[str(source)],
            extra_include_paths=[str(INCLUDE_DIR)],
            # no fused multiply-add contraction (float32 results round as torch's do); no FP
            # exception or errno semantics, which keep floor and sqrt from vectorising
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, a build error: the torch path still works
        logger.warning("C++ CPU kernels %s unavailable (%s); using the slower torch path", name, e)
        return None
