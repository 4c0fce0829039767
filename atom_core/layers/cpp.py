"""C++ CPU kernels, built per instruction-set variant and loaded for the one this CPU runs.

A `CppKernel` is a C++ source compiled with `torch.utils.cpp_extension` once per variant
(`atom_core.platform.cpu_features.VARIANTS`: explicit target flags, never -march=native), into
torch's extension cache (TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions).
`load()` gives the build for this CPU's best variant (`ATOM_CPU_ISA` caps it); tests ask
for each variant the CPU can run. The source sees `ATOM_VARIANT` and `ATOM_OPS_NS` (a
torch-op namespace unique to the kernel and variant, so two variants live in one process).

Where a build fails, one log line names the kernel, the variant and the compiler's first
error, and the full output goes to a file in the build folder; the failure is remembered
there and not retried until the sources, flags, torch or compiler change. Callers then
keep their torch path. `ATOM_CPU_KERNELS=0` turns every kernel off.

Kernels are declared to the plugin manager (`atom_register_cpp_kernels`), so `atom env`
and `atom kernels` find a plugin's kernels as well as the core's.

A process's first kernel load builds every declared kernel of the CPU's variant, one per
core, and waits (a minute or two the first time on 2 cores; `scripts/setup.sh` does it at
install). With `ATOM_KERNEL_BUILD=background` (what `atom generate` and `atom chat` set), a
process that finds them unbuilt starts `atom kernels --idle` as a detached process at idle
priority instead (one at a time: a lock in the build root), runs the torch path itself on the
cores the compilers leave (`leave_cores_to_compilers`; `give_cores_back` returns them once the
build is over), and later processes load the kernels: a first question on a fresh install is
answered in seconds, not after the compiler. Whether a kernel is built is a marker its build leaves (`OK_FILE`), keyed as failures are.
A build's folder is named by its sources, flags and torch, not by the checkout's path: a new
clone or environment with the same sources loads the library another one built, directly
(torch's builder would compile it again for a source at another path).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import IO

from atom_core.platform.cpu_features import VARIANT_NAMES, cpu_features, variant

logger = logging.getLogger(__name__)

# Headers every kernel may include (float_convert.h, simd.h), wherever its own source lives.
INCLUDE_DIR = Path(__file__).parent / "csrc"
# no fused multiply-add contraction (float32 results round as torch's do); no FP exception or
# errno semantics, which keep floor and sqrt from vectorising
COMMON_CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno", "-Wno-psabi")
FAILED_FILE = "atom-build-failed.json"
OK_FILE = "atom-build-ok.json"
LOG_FILE = "atom-build.log"
BUILDING_FILE = "atom-building.lock"  # `_building`'s lock, in each build folder
TORCH_BATON = "lock"  # the lock file torch's builder keeps in a build folder while it builds
BUILD_ENV = "ATOM_KERNEL_BUILD"  # "wait" (the default) or "background": see the module's docstring
BUILD_MODES = ("wait", "background")
BACKGROUND_LOG = "atom-background-build.log"  # in the build root, beside the lock
BUILD_LOCK = "atom-build.lock"


def kernels_enabled() -> bool:
    return os.environ.get("ATOM_CPU_KERNELS", "1") != "0"


def compiler() -> str | None:
    """The C++ compiler torch's builder runs (CXX, else c++), if it is on PATH."""
    return shutil.which(os.environ.get("CXX", "c++"))


@functools.cache
def _compiler_version(cxx: str, mtime_ns: int) -> bytes:
    """`cxx --version`, run once a process for every kernel (keyed by the compiler's mtime, so a
    reinstalled compiler is asked again): each run forks, and a fork from a process with many
    threads is slow under emulation."""
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return b""


class CppKernel:
    """One C++ source (and the shared headers), built and loaded per variant on first use."""

    def __init__(self, name: str, source: Path, uses: Sequence[str] = ()):
        """`uses`: the variants with a `base` (cpu_features.VARIANTS) this source has code of
        its own for; at the others it runs its build of the base."""
        for v in map(variant, uses):  # an unknown name: ValueError naming the known ones
            if v.base is None:
                raise ValueError(f"{name}: uses={v.name!r} has no base build; a kernel always has code for it")
        self.name, self.source, self.uses = name, source, frozenset(uses)
        self._modules: dict[str, ModuleType | None] = {}
        self._why: dict[str, str] = {}
        self._default: ModuleType | None = None  # this CPU's build, once loaded
        self._contents: dict[str, str] = {}  # variant -> `_content`, once a process
        self._keys: dict[tuple[str, str], str] = {}  # (variant, compiler) -> `_key`, once a process
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"CppKernel({self.name!r})"

    def load(self, variant_name: str | None = None) -> ModuleType | None:
        """The build for `variant_name` (default: this CPU's), or None where kernels are off or it
        cannot build. `ATOM_CPU_KERNELS` is read until the default build has loaded: layers
        call this per op, and the environment read was half of that call's cost."""
        if variant_name is None and self._default is not None:
            return self._default
        if not kernels_enabled():
            return None
        default = variant_name is None
        cpu_variant = cpu_features().variant.name
        wanted = variant_name or cpu_variant
        build = self.build_of(wanted)
        if build not in self._modules and wanted == cpu_variant:
            _build_declared_once(wanted)
        if default and wanted in _deferred and build not in self._modules:
            self._why[build] = _deferred[wanted]
            return None
        with self._lock:
            if build not in self._modules:
                self._modules[build] = self._build(build)
            if default:
                self._default = self._modules[build]
            return self._modules[build]

    def build_of(self, variant_name: str) -> str:
        """The build this kernel runs at `variant_name`: its own, or its base's where this
        source has no code for what the variant adds."""
        v = variant(variant_name)
        while v.base is not None and v.name not in self.uses:
            v = variant(v.base)
        return v.name

    def status(self, variant_name: str | None = None) -> str:
        """What `load` gave: the build it runs, or why there is none (after `load`)."""
        build = self.build_of(variant_name or cpu_features().variant.name)
        if not kernels_enabled():
            return "off (ATOM_CPU_KERNELS=0)"
        if self._modules.get(build) is not None:
            return build
        return f"torch path ({self._why.get(build, 'not loaded yet')})"

    def module_name(self, variant_name: str) -> str:
        """Named by what the build is made of (`_content`), not by where the checkout lies: a new
        clone or environment with the same sources loads the build another one made, and two
        checkouts whose sources differ never build over each other's folder."""
        return f"{self.name}_{variant_name}_{self._content(variant_name)[:8]}"

    def cflags(self, variant_name: str) -> list[str]:
        ns = f"{self.name}_{variant_name}"
        return [*COMMON_CFLAGS, *variant(variant_name).cflags, f"-DATOM_VARIANT={variant_name}", f"-DATOM_OPS_NS={ns}"]

    def compile_command(self, variant_name: str, cxx: str, output: Path) -> list[str]:
        """The command that compiles this kernel's `variant_name` build to an object file with
        `cxx`, flags as torch's builder passes them: how a cross compiler checks that the
        portable variant builds on other CPUs (scripts/cross_build.sh)."""
        import sysconfig

        from torch.utils import cpp_extension

        includes = [f"-I{INCLUDE_DIR}", *(f"-isystem{p}" for p in cpp_extension.include_paths())]
        includes.append(f"-isystem{sysconfig.get_paths()['include']}")
        defines = [f"-DTORCH_EXTENSION_NAME={self.module_name(variant_name)}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
        return [cxx, *defines, *includes, "-fPIC", "-std=c++20", *self.cflags(variant_name), "-c", str(self.source),
                "-o", str(output)]  # fmt: skip

    def build_dir(self, variant_name: str) -> Path:
        path = build_root() / self.module_name(variant_name)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def built(self, variant_name: str) -> bool:
        """Whether loading `variant_name` needs no compiler run: it built (or failed to build)
        from these sources, flags, torch and compiler before, or there is no compiler at all."""
        cxx = compiler()
        if cxx is None:
            return True
        variant_name = self.build_of(variant_name)
        try:
            build_dir = self.build_dir(variant_name)
        except OSError:
            return True  # load() says why, at once
        key = self._key(variant_name, cxx)
        return any(_marker_key(build_dir / marker) == key for marker in (OK_FILE, FAILED_FILE))

    def _content(self, variant_name: str) -> str:
        """The sources, headers, flags and torch a build is made of (hashed once a process)."""
        if variant_name not in self._contents:
            import torch

            h = hashlib.sha1()
            for path in [self.source, *sorted(INCLUDE_DIR.glob("*.h"))]:
                h.update(path.read_bytes())
            h.update(" ".join(self.cflags(variant_name)).encode())
            h.update(torch.__version__.encode())
            self._contents[variant_name] = h.hexdigest()
        return self._contents[variant_name]

    def _key(self, variant_name: str, cxx: str) -> str:
        """What a build depended on: `_content` and the compiler (computed once a process: it
        runs the compiler, and a first load asks for it up to three times)."""
        if (variant_name, cxx) in self._keys:
            return self._keys[variant_name, cxx]
        h = hashlib.sha1(self._content(variant_name).encode())
        with contextlib.suppress(OSError):
            h.update(_compiler_version(cxx, os.stat(cxx).st_mtime_ns))
        key = self._keys[variant_name, cxx] = h.hexdigest()
        return key

    def _build(self, variant_name: str) -> ModuleType | None:
        cxx = compiler()
        if cxx is None:
            return self._unavailable(variant_name, f"no C++ compiler ({os.environ.get('CXX', 'c++')} is not on PATH)")
        try:
            build_dir = self.build_dir(variant_name)
        except OSError as e:  # an unwritable cache folder
            return self._unavailable(variant_name, f"cannot create its build folder: {e}")
        key = self._key(variant_name, cxx)
        failed = build_dir / FAILED_FILE
        if failed.is_file():
            try:
                record = json.loads(failed.read_text())
            except (OSError, ValueError):
                record = {}
            if record.get("key") == key:
                return self._unavailable(
                    variant_name, f"{record.get('reason')} (an earlier build; see {build_dir / LOG_FILE})"
                )
            failed.unlink(missing_ok=True)  # something it depended on changed: try again
        module = self._load_built(variant_name, build_dir, key)
        if module is not None:
            return module
        try:
            from torch.utils import cpp_extension

            with _building(build_dir):  # (another process may have built it meanwhile)
                module = self._load_built(variant_name, build_dir, key) or cpp_extension.load(
                    name=self.module_name(variant_name),
                    sources=[str(self.source)],
                    extra_include_paths=[str(INCLUDE_DIR)],
                    extra_cflags=self.cflags(variant_name),
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(build_dir),
                    verbose=False,
                )
        except Exception as e:  # a build error, no ninja, a load error: the torch path still works
            text = str(e)
            reason = _first_error(text)
            try:
                (build_dir / LOG_FILE).write_text(text)
                failed.write_text(json.dumps({"key": key, "reason": reason}))
            except OSError:  # not remembered: tried again next time
                pass
            return self._unavailable(variant_name, f"{reason} (full output: {build_dir / LOG_FILE})")
        self._why.pop(variant_name, None)
        if _marker_key(build_dir / OK_FILE) != key:  # (a cached build's marker is already there)
            try:
                (build_dir / OK_FILE).write_text(json.dumps({"key": key}))
            except OSError:  # not remembered: a background-mode process builds it again (a no-op)
                pass
        return module

    def _load_built(self, variant_name: str, build_dir: Path, key: str) -> ModuleType | None:
        """The library in `build_dir` where its marker records `key`, imported as torch's builder
        imports it but without that builder, which compiles again wherever the source's path
        differs from the one it wrote down (another checkout's, with the same sources); None
        where it is not there or does not load."""
        from torch.utils.cpp_extension import LIB_EXT

        name = self.module_name(variant_name)
        library = build_dir / f"{name}{LIB_EXT}"
        if _marker_key(build_dir / OK_FILE) != key or not library.is_file():
            return None
        try:
            spec = importlib.util.spec_from_file_location(name, library)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except Exception:  # (a library that does not load is built again)
            return None
        return module

    def _unavailable(self, variant_name: str, why: str) -> ModuleType | None:
        self._why[variant_name] = why
        logger.warning(
            "atom: C++ kernel %s (%s) unavailable, the torch path runs instead: %s", self.name, variant_name, why
        )
        return None


@contextlib.contextmanager
def _building(build_dir: Path) -> Iterator[None]:
    """Hold the build folder's own lock (fcntl's, which the OS drops with a process however it
    ends) while torch builds there, one process at a time.

    torch's builder keeps a lock file (`TORCH_BATON`) that only the process that made it
    removes: a build killed part way (SIGTERM, a machine going down) left it, and every later
    load of that kernel waited on it for ever. Holding this lock, no other process is building
    in the folder, so a torch lock file found there is such a leftover and goes."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock file only
        yield
        return
    with open(build_dir / BUILDING_FILE, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (build_dir / TORCH_BATON).unlink(missing_ok=True)
        yield


def _marker_key(path: Path) -> str | None:
    """The key a build marker (`OK_FILE`, `FAILED_FILE`) records, if it is there and readable."""
    try:
        return json.loads(path.read_text()).get("key")
    except (OSError, ValueError, AttributeError):
        return None


_declared_built = threading.Event()
# variant -> why this process runs the torch path for it: its build runs in another process
_deferred: dict[str, str] = {}


def build_root() -> Path:
    """Torch's extension cache (TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions)."""
    from torch.utils import cpp_extension

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())


def build_mode() -> str:
    mode = os.environ.get(BUILD_ENV) or "wait"
    if mode not in BUILD_MODES:
        raise ValueError(f"{BUILD_ENV}={mode!r}: expected one of {', '.join(BUILD_MODES)}")
    return mode


def _build_declared_once(variant_name: str) -> None:
    """At a process's first kernel load, build (or load) every declared kernel of this CPU's
    variant at once, one per core: a first run without `atom kernels` compiles them side by
    side instead of one after another as the model reaches each. In background mode, where
    any is unbuilt, hand the build to another process instead (`build_in_background`)."""
    if _declared_built.is_set():
        return
    _declared_built.set()
    try:
        kernels = list(declared_kernels().values())
    except Exception:  # a plugin that fails to load is reported by the registry, not here
        return
    unbuilt = [k.name for k in kernels if not k.built(variant_name)]
    if unbuilt and build_mode() == "background" and os.name == "posix":  # (the lock is fcntl's)
        _deferred[variant_name] = build_in_background(variant_name)
        return
    if unbuilt:  # a pause of a minute or more otherwise says nothing
        logger.warning(
            "atom: building the C++ kernels %s (%s) once, a minute or two; `atom kernels` builds them ahead",
            ", ".join(unbuilt), variant_name,
        )  # fmt: skip
    build_all([variant_name], kernels)


class BuildLock:
    """An exclusive lock on the build root's `BUILD_LOCK` (fcntl): held by `atom kernels` while
    it builds, so a background-mode process can tell that a build already runs."""

    def __init__(self) -> None:
        root = build_root()
        try:
            root.mkdir(parents=True, exist_ok=True)
            self.file: IO[str] | None = open(root / BUILD_LOCK, "a+")
        except OSError:  # an unwritable cache: no lock (the builds say why they fail)
            self.file = None

    def acquire(self, wait: bool = True) -> bool:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock (nor background builds)
            return True
        if self.file is None:
            return True

        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            return False
        return True

    def close(self) -> None:
        if self.file is not None:
            self.file.close()  # releases the lock

    def __enter__(self) -> BuildLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_in_background(variant_name: str) -> str:
    """Start `atom kernels --variant <variant_name> --idle` detached (unless one already runs),
    leave its compilers their cores (`leave_cores_to_compilers`); returns the status this
    process's kernels show meanwhile."""
    log = build_root() / BACKGROUND_LOG
    build: subprocess.Popen | None = None
    if build_running():
        why = f"a build runs in another process (log: {log}); later runs load them"
    else:
        build = start_background_build([variant_name])
        why = f"building in the background (log: {log}); later runs load them"
    threads = leave_cores_to_compilers(build)
    logger.warning(
        "atom: C++ kernels (%s) not built yet, the torch path runs on %d thread(s): %s", variant_name, threads, why
    )
    return why


def start_background_build(variants: Sequence[str]) -> subprocess.Popen:
    """`atom kernels --variant ... --idle` for `variants`, started detached in a session of its
    own (output: `BACKGROUND_LOG` in the build root). A second one waits for the first's lock
    (`BuildLock`), then finds its builds done."""
    build_root().mkdir(parents=True, exist_ok=True)
    # the compiler takes only what the run that started it leaves of the cores (--idle:
    # SCHED_IDLE; nice where the OS has no such class)
    nice = shutil.which("nice")
    with open(build_root() / BACKGROUND_LOG, "w") as out:
        return subprocess.Popen(
            [*([nice, "-n", "10"] if nice else []), sys.executable, "-m", "atom_core.cli", "kernels",
             *(a for v in variants for a in ("--variant", v)), "--idle"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, BUILD_ENV: "wait"},
        )  # fmt: skip


def build_running() -> bool:
    """Whether some process holds the build lock (`atom kernels` is building)."""
    probe = BuildLock()
    try:
        return not probe.acquire(wait=False)
    finally:
        probe.close()


# While torch runs on fewer threads for a build: (its threads before, the build this process
# started or None for another process's, when to look again).
_lent: list[tuple[int, subprocess.Popen | None, float]] = []
GIVE_BACK_POLL_S = 1.0  # how often `give_cores_back` looks whether the build is over


def leave_cores_to_compilers(build: subprocess.Popen | None = None) -> int:
    """Take torch's threads down by the compilers a build runs (at most a core each, one at
    least left) until `give_cores_back` finds the build over; returns the threads left.
    `build`: the build's process, if this one started it (else the build lock tells).

    torch's threads wait for one another after every op, and with a compiler on one of their
    cores, even at idle priority, the torch path of a first `atom generate` (2 cores) took
    12-25 s where it takes 4-6 on one thread beside the build."""
    import torch

    before = torch.get_num_threads()
    compilers = min(len(declared_kernels()) or 1, os.cpu_count() or 1)
    threads = max(1, before - compilers)
    if threads < before:
        torch.set_num_threads(threads)
        if not _lent:
            # a process that started it looks no earlier than the child can take the lock
            _lent.append((before, build, time.monotonic() + GIVE_BACK_POLL_S))
    return torch.get_num_threads()


def give_cores_back() -> None:
    """Give torch back the threads `leave_cores_to_compilers` took, once the build is over.

    Called before every model step (in the thread that steps: torch's thread count is per
    thread); it looks at most once a `GIVE_BACK_POLL_S`. The process keeps its torch path
    (its layers chose their kernels at load), now on all its threads: a first `atom chat`
    no longer runs on one core after the compilers are done."""
    if not _lent:
        return
    before, build, next_look = _lent[0]
    now = time.monotonic()
    if now < next_look:
        return
    if build.poll() is None if build is not None else build_running():
        _lent[0] = (before, build, now + GIVE_BACK_POLL_S)
        return
    import torch

    _lent.clear()
    torch.set_num_threads(before)
    logger.warning("atom: the C++ kernels' build is over: the torch path runs on %d threads again", before)


def _first_error(text: str) -> str:
    for line in text.splitlines():
        if re.search(r"\berror\b", line) and "Error building extension" not in line:
            return line.strip()[:300]
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else "unknown error"


def compiled_op(ops: ModuleType, name: str):
    """The torch op a traced graph calls for `ops.<name>`: a kernel that registers torch ops
    does so under its build's namespace (`ops.OPS_NAMESPACE`), one per variant."""
    import torch

    return getattr(getattr(torch.ops, ops.OPS_NAMESPACE), name)


def declared_kernels() -> dict[str, CppKernel]:
    """Every kernel the installed plugins declare (`atom_register_cpp_kernels`), by name."""
    from atom_core.plugins.manager import get_registry

    registry = get_registry("cpp_kernels")
    return {name: registry.get(name) for name in registry.names()}


def build_all(
    variants: Sequence[str | None] = (None,), kernels: list[CppKernel] | None = None
) -> dict[str, dict[str, str]]:
    """Build (or load from the cache) every declared kernel in each of `variants` (None: this
    CPU's), one build per core at a time; returns each variant's kernels' status."""
    kernels = list(declared_kernels().values()) if kernels is None else kernels
    names = [v or cpu_features().variant.name for v in variants]
    jobs = [(k, v) for v in names for k in kernels]
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        list(pool.map(lambda job: job[0].load(job[1]), jobs))
    return {v: {k.name: k.status(v) for k in kernels} for v in names}


def summary() -> str:
    """One line: the CPU, the variant its kernels run, torch's and oneDNN's levels, and each
    declared kernel's status (those loaded so far)."""
    import torch

    features = cpu_features()
    kernels = [k for k in declared_kernels().values() if k._modules or k._why]
    parts = ", ".join(f"{k.name.removeprefix('atom_')} {k.status()}" for k in kernels)
    return (
        f"{features.summary()}; torch {torch.backends.cpu.get_cpu_capability()}"
        + (
            f" (ATEN_CPU_CAPABILITY={os.environ['ATEN_CPU_CAPABILITY']})"
            if os.environ.get("ATEN_CPU_CAPABILITY")
            else ""
        )
        + (f"; oneDNN capped at {os.environ['ONEDNN_MAX_CPU_ISA']}" if os.environ.get("ONEDNN_MAX_CPU_ISA") else "")
        + (f"; {parts}" if parts else "")
    )


__all__ = [
    "BuildLock",
    "CppKernel",
    "VARIANT_NAMES",
    "build_in_background",
    "start_background_build",
    "build_mode",
    "build_root",
    "build_all",
    "compiled_op",
    "compiler",
    "declared_kernels",
    "kernels_enabled",
    "summary",
]
