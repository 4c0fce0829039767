"""What the CPU can run, and which build of Atom's C++ kernels it gets.

Each kernel is compiled in variants, one per instruction-set level (`VARIANTS`, best
first), each with explicit target flags rather than `-march=native`: a build is then right
on any CPU that has its level, so a build cache shared between hosts stays right, and an
AVX-512 host can build and test the AVX2 variant too. At run time the best variant whose
features this CPU has is chosen.

`ATOM_CPU_ISA=avx2` (or `avx2_vnni`, `avx512`, `avx512_vnni`, `avx512_bf16`, `portable`) makes
Atom choose exactly as it would on a CPU of that level: the kernel variant, and whether
oneDNN's packed bfloat16 path exists (it needs AVX-512 or AVX-NE-CONVERT). It also caps oneDNN
(`ONEDNN_MAX_CPU_ISA`), MKL (`MKL_ENABLE_INSTRUCTIONS`) and torch's own kernels
(`ATEN_CPU_CAPABILITY`) where those are not set, as early as `import atom_core`, before torch
has chosen, and gives torch.compile's Inductor a cache of that level's own. A level above what
the CPU has is refused. This module imports no torch.
"""

from __future__ import annotations

import functools
import getpass
import os
import platform
import tempfile
from pathlib import Path

import attrs

ENV_ISA = "ATOM_CPU_ISA"


@attrs.frozen
class Variant:
    """One build of every kernel: the CPU features it needs and the compiler flags that target them."""

    name: str
    requires: frozenset[str]
    cflags: tuple[str, ...]
    # what torch calls the level (ATEN_CPU_CAPABILITY), oneDNN's cap for it (ONEDNN_MAX_CPU_ISA)
    # and MKL's (MKL_ENABLE_INSTRUCTIONS: torch's float32 BLAS on x86)
    aten: str
    onednn: str
    mkl: str
    # A level whose extra features few kernels have code for: a kernel that does not list it
    # (`CppKernel(uses=...)`) runs its build of `base` there, rather than a second identical one.
    base: str | None = None

    def caps(self) -> dict[str, str]:
        """The environment variables that hold torch, oneDNN and MKL at this level."""
        return {
            "ATEN_CPU_CAPABILITY": self.aten,
            "ONEDNN_MAX_CPU_ISA": self.onednn,
            "MKL_ENABLE_INSTRUCTIONS": self.mkl,
        }


_AVX2 = frozenset({"avx2", "fma", "f16c"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}

VARIANTS: tuple[Variant, ...] = (
    Variant(
        "avx512_bf16",
        _AVX512 | {"avx512_bf16", "avx512_vnni"},
        (
            "-mavx2",
            "-mfma",
            "-mf16c",
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512dq",
            "-mavx512bf16",
            "-mavx512vnni",
        ),
        "avx512",
        "AVX512_CORE_BF16",
        "AVX512",
    ),  # fmt: skip
    # AVX-512 with VNNI, no bfloat16 (Cascade Lake, Ice Lake, Tiger Lake): the group kernels'
    # dot products, as avx2_vnni adds them to avx2
    Variant(
        "avx512_vnni",
        _AVX512 | {"avx512_vnni"},
        ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"),
        "avx512",
        "AVX512_CORE_VNNI",
        "AVX512_E1",
        base="avx512",
    ),
    Variant(
        "avx512",
        _AVX512,
        ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
        "avx512",
        "AVX512_CORE",
        "AVX512",
    ),
    # AVX2 with AVX-VNNI (Intel since Alder Lake and Sierra Forest): the 4-bit kernels' integer
    # dot products in one instruction each
    Variant(
        "avx2_vnni",
        _AVX2 | {"avx_vnni"},
        ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"),
        "avx2",
        "AVX2_VNNI",
        "AVX2_E1",
        base="avx2",
    ),
    Variant("avx2", _AVX2, ("-mavx2", "-mfma", "-mf16c"), "avx2", "AVX2", "AVX2"),
    # compiles anywhere (aarch64 included): generic vectors the compiler maps to what it has
    Variant("portable", frozenset(), (), "default", "SSE41", "SSE4_2"),
)
VARIANT_NAMES = tuple(v.name for v in VARIANTS)


def variant(name: str) -> Variant:
    for v in VARIANTS:
        if v.name == name:
            return v
    raise ValueError(f"unknown kernel variant {name!r}; known: {', '.join(VARIANT_NAMES)}")


def _cpuinfo(*keys: str) -> str:
    """The value of the first /proc/cpuinfo line starting with one of `keys` ("" if none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.partition(":")[2].strip() for line in f if line.startswith(keys)), "")
    except OSError:
        return ""


# The x86 flags that decide which kernels Atom and its peers run, as a report names them.
REPORTED_FLAGS = ("avx2", "avx_vnni", "avx512f", "avx512_bf16", "amx_bf16")
X86 = ("x86_64", "AMD64")


@attrs.frozen
class CpuFeatures:
    """The CPU as Atom sees it: its flags (less those above `ATOM_CPU_ISA`), and the variant it runs."""

    model: str
    machine: str
    flags: frozenset[str]  # as /proc/cpuinfo names them
    variant: Variant  # the best one these flags allow
    capped: bool  # ATOM_CPU_ISA chose a lower level than the CPU has
    cpu_flags: frozenset[str]  # all the CPU's own flags, ATOM_CPU_ISA or not

    @property
    def variants(self) -> tuple[str, ...]:
        """Every variant these flags can run, best first."""
        return tuple(v.name for v in _runnable(self.flags, self.machine))

    @property
    def onednn_bf16(self) -> bool:
        """Whether Atom hands bfloat16 weights to oneDNN (packed bfloat16 Linear): where the CPU
        multiplies bfloat16 itself (avx512_bf16, AMX) or converts it (avx_ne_convert). torch
        refuses them without avx512bw/vl/dq or avx_ne_convert, and on AVX-512 CPUs without
        avx512_bf16 (Skylake-SP to Ice Lake) oneDNN emulates them at about a quarter of the
        rate of Atom's kernels, which widen the weights as they read them."""
        avx512 = {"avx512bw", "avx512vl", "avx512dq"} <= self.flags
        return (avx512 and bool({"avx512_bf16", "amx_bf16"} & self.flags)) or "avx_ne_convert" in self.flags

    @property
    def amx_bf16(self) -> bool:
        """Whether the CPU multiplies bfloat16 tiles in hardware (AMX: Sapphire Rapids and later),
        where oneDNN's bfloat16 GEMM outruns Atom's integer kernels on a prompt's rows."""
        return "amx_bf16" in self.flags

    def description(self) -> str:
        """The machine in one line, for a benchmark's report: the CPU's model and logical CPUs,
        the x86 flags that decide the kernels as the CPU has them, and the variant Atom runs
        (less under `ATOM_CPU_ISA`). Figures from different hosts do not compare: each names its own."""
        flags = ", ".join(f"{f} {'yes' if f in self.cpu_flags else 'no'}" for f in REPORTED_FLAGS)
        capped = f" ({ENV_ISA}={self.variant.name})" if self.capped else ""
        return (f"CPU: {self.model}, {os.cpu_count()} logical CPUs"
                f"{'; ' + flags if self.machine in X86 else ''}; Atom's kernels {self.variant.name}{capped}")  # fmt: skip

    def summary(self) -> str:
        level = self.variant.name + (f" ({ENV_ISA})" if self.capped else "")
        return f"{self.model}: kernels {level}; oneDNN bfloat16 {'yes' if self.onednn_bf16 else 'no'}"


def _runnable(flags: frozenset[str], machine: str) -> list[Variant]:
    x86 = machine in X86
    return [v for v in VARIANTS if v.requires <= flags and (x86 or not v.cflags)]


def detect(flags: frozenset[str] | None = None, isa: str | None = None, machine: str | None = None) -> CpuFeatures:
    """The features of this CPU (or of `flags`), capped at `isa` (default: `ATOM_CPU_ISA`)."""
    machine = machine or platform.machine()
    flags = frozenset(_cpuinfo("flags", "Features").split()) if flags is None else flags
    isa = os.environ.get(ENV_ISA, "") if isa is None else isa
    model = _cpuinfo("model name", "Model") or platform.processor() or machine
    runnable = _runnable(flags, machine)
    best = runnable[0]
    if isa:
        try:
            wanted = variant(isa.strip().lower())
        except ValueError as e:
            raise ValueError(f"{ENV_ISA}={isa}: {e}") from None
        if wanted not in runnable:
            missing = sorted(wanted.requires - flags) or [machine]
            raise ValueError(f"{ENV_ISA}={isa}: this CPU cannot run it (it lacks {', '.join(missing)})")
        if wanted is not best:  # what a CPU of that level has: none of the better levels' features
            above = set().union(*(v.requires for v in VARIANTS))
            above |= {f for f in flags if f.startswith(("avx512", "amx")) or f == "avx_ne_convert"}
            return CpuFeatures(model, machine, flags - (above - wanted.requires), wanted, True, flags)
    return CpuFeatures(model, machine, flags, best, False, flags)


@functools.cache
def cpu_features() -> CpuFeatures:
    return detect()


def cap_torch_and_onednn() -> None:
    """Under ATOM_CPU_ISA, cap oneDNN, MKL and torch's kernels at the same level (where unset), so
    they too choose as on such a CPU. Needs to run before torch picks (at `import atom_core`)."""
    if not os.environ.get(ENV_ISA):
        return
    try:
        features = cpu_features()
    except ValueError:
        return  # a bad ATOM_CPU_ISA: said by name where the kernels are chosen, not as an import error
    if features.capped:
        for name, value in features.variant.caps().items():
            os.environ.setdefault(name, value)
        # Inductor's cache does not tell code compiled under ATEN_CPU_CAPABILITY from the CPU's
        # own: an uncapped process that found a capped compile's graph aborted in it. Each
        # level compiles into a cache of its own (beside Inductor's default one).
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir(features.variant.name)))


def inductor_cache_dir(level: str) -> Path:
    """Where Inductor caches what it compiles under `ATOM_CPU_ISA=level`."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (some containers)
        user = str(os.getuid()) if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"torchinductor_{user}" / f"atom_isa_{level}"
