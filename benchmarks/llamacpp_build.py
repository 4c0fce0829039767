"""llama.cpp's `llama-batched-bench` and `llama-server`, built once from the sources the
`llama-cpp-python` sdist vendors.

PyPI is the only network the benchmark machines have, so llama.cpp comes from the same pinned
sdist `tests/gguf_convert.py` takes its converter from (`vendor/llama.cpp/`). Sources and build
are kept under `<cache>/llama-cpp-build/<version>/` (`$ATOM_CACHE_DIR` or `~/.cache/atom`):
Release, CPU only, `-march=native` (GGML_NATIVE), static, only the one target; the server in a
build directory of its own (its options differ). The first build takes about 6 minutes on 2
cores (the server longer); a `built` stamp written after success marks it reusable.

    .venv/bin/python benchmarks/llamacpp_build.py            # build llama-batched-bench if needed, print its path
    .venv/bin/python benchmarks/llamacpp_build.py --server   # the same for llama-server
    .venv/bin/python benchmarks/llamacpp_build.py --isa=avx2 # llama-batched-bench at AVX2, not -march=native
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gguf_convert import LLAMA_CPP_PYTHON_VERSION, cache_dir, unpack_sdist  # noqa: E402

TARGET = "llama-batched-bench"
# Unneeded by the build and the bulk of the tree (vocabulary GGUFs, docs, images).
_SKIPPED = ("models/", "docs/", "media/", ".git")
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_OPENSSL=OFF",  # no HTTPS model downloads (this llama.cpp has no LLAMA_CURL any more)
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
)
# What an AVX2-only x86-64 CPU (AMD before Zen 4, Intel client cores since Alder Lake) gets
# from llama.cpp: its x86 build at that level instead of -march=native, so an AVX-512 host can
# measure the AVX2 paths of llama.cpp beside Atom's (`ATOM_CPU_ISA=avx2`).
ISA_OPTIONS = {
    "avx2": (
        "-DGGML_NATIVE=OFF",
        "-DGGML_SSE42=ON",
        "-DGGML_AVX=ON",
        "-DGGML_AVX2=ON",
        "-DGGML_BMI2=ON",
        "-DGGML_FMA=ON",
        "-DGGML_F16C=ON",
        "-DGGML_AVX_VNNI=OFF",
        "-DGGML_AVX512=OFF",
    ),  # fmt: skip
}
# Intel's AVX2 cores since Alder Lake add AVX-VNNI, which llama.cpp's quantized dot products take
ISA_OPTIONS["avx2_vnni"] = tuple(o.replace("GGML_AVX_VNNI=OFF", "GGML_AVX_VNNI=ON") for o in ISA_OPTIONS["avx2"])
SERVER_TARGET = "llama-server"
SERVER_OPTIONS = (
    *(o for o in CMAKE_OPTIONS if o != "-DLLAMA_BUILD_SERVER=OFF"),
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",  # no web UI (it would need npm)
)


def build_root(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return cache_dir() / "llama-cpp-build" / version


def llama_cpp_commit(version: str = LLAMA_CPP_PYTHON_VERSION) -> str:
    """The llama.cpp commit the sdist vendors (its submodule HEAD), or "unknown"."""
    path = build_root(version) / "src" / "COMMIT"
    return path.read_text().strip() if path.is_file() else "unknown"


def batched_bench(version: str = LLAMA_CPP_PYTHON_VERSION, isa: str | None = None) -> Path:
    """Path of the `llama-batched-bench` binary, fetching and building it on first use; with
    `isa` (a key of ISA_OPTIONS), a build of its own capped at that instruction set."""
    if isa is None:
        return _build(TARGET, "build", CMAKE_OPTIONS, version)
    if isa not in ISA_OPTIONS:
        raise ValueError(f"isa must be one of {', '.join(ISA_OPTIONS)} (or None for -march=native), got {isa!r}")
    options = (*(o for o in CMAKE_OPTIONS if o != "-DGGML_NATIVE=ON"), *ISA_OPTIONS[isa])
    return _build(TARGET, f"build-{isa}", options, version)


def llama_server(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """Path of the `llama-server` binary, fetching and building it on first use."""
    return _build(SERVER_TARGET, "build-server", SERVER_OPTIONS, version)


def _build(target: str, build_name: str, options: tuple[str, ...], version: str) -> Path:
    root = build_root(version)
    build = root / build_name
    binary, stamp = build / "bin" / target, build / "built"
    if binary.is_file() and stamp.is_file():
        return binary
    src = _sources(root, version)
    started = time.perf_counter()
    if not (build / "CMakeCache.txt").is_file():
        _log(f"configuring llama.cpp ({llama_cpp_commit(version)[:10]}) in {build}")
        _run(["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", *options], stream=False)
    _log(f"building {target} with {os.cpu_count()} jobs (several minutes on 2 cores, once)")
    _run(["cmake", "--build", str(build), "--target", target, "-j", str(os.cpu_count() or 1)], stream=True)
    if not binary.is_file():
        raise RuntimeError(f"the build finished but {binary} does not exist")
    stamp.write_text(f"{' '.join(options)}\n")
    _log(f"built {binary} in {time.perf_counter() - started:.0f} s")
    return binary


def _sources(root: Path, version: str) -> Path:
    """`<root>/src`: the sdist's vendor/llama.cpp tree, downloaded and extracted on first use."""
    src = root / "src"
    if (src / "CMakeLists.txt").is_file():
        return src
    _log(f"downloading the llama-cpp-python {version} sdist from PyPI")
    return unpack_sdist(src, _extract_llama_cpp, version)


def _extract_llama_cpp(sdist: Path, dest: Path) -> None:
    """vendor/llama.cpp/ (less _SKIPPED) into dest, and its submodule commit into dest/COMMIT."""
    with tarfile.open(sdist) as tar:
        members, commit = [], "unknown"
        for m in tar.getmembers():
            rest = m.name.partition("/")[2]
            if rest == ".git/modules/vendor/llama.cpp/HEAD":
                commit = tar.extractfile(m).read().decode().strip()
            rel = rest.removeprefix("vendor/llama.cpp/")
            if rel != rest and rel and (m.isfile() or m.isdir()) and not rel.startswith(_SKIPPED):
                m.name = rel
                members.append(m)
        if not any(m.name == "CMakeLists.txt" for m in members):
            raise RuntimeError(f"{sdist.name} has no vendor/llama.cpp/CMakeLists.txt")
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.11.4
        tar.extractall(dest, members=members, **safe)
    (dest / "COMMIT").write_text(commit + "\n")


def _run(cmd: list[str], stream: bool) -> None:
    """Run a build command; with `stream`, echo ninja's `[n/m]` lines as progress."""
    tail: deque[str] = deque(maxlen=60)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            tail.append(line)
            if stream and line.startswith("["):
                _log(line.rstrip()[:120])
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{''.join(tail)}")


def _log(message: str) -> None:
    print(f"llama.cpp: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    import argparse

    _ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _ap.add_argument("--server", action="store_true", help="build llama-server instead of llama-batched-bench")
    _ap.add_argument("--isa", choices=sorted(ISA_OPTIONS), help="build at this level, not -march=native")
    _args = _ap.parse_args()
    print(llama_server() if _args.server else batched_bench(isa=_args.isa))
