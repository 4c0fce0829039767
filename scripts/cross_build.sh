#!/usr/bin/env bash
# Compile every declared C++ kernel's portable variant for another CPU architecture (aarch64 by
# default) with a cross compiler, Debian's g++-<arch>-linux-gnu, installed if missing: the
# portable variant promises to build where no x86 variant applies, and this checks it from an
# x86-64 host. Objects only (nothing links or runs); each kernel's flags are its build's own
# (`CppKernel.compile_command`).
#   bash scripts/cross_build.sh [aarch64]
set -euo pipefail
cd "$(dirname "$0")/.."
arch=${1:-aarch64}
cxx=$arch-linux-gnu-g++
if ! command -v "$cxx" >/dev/null; then
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "g++-$arch-linux-gnu" >/dev/null
fi
.venv/bin/python - "$cxx" <<'PY'
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from atom_core.layers.cpp import declared_kernels

cxx = sys.argv[1]
with tempfile.TemporaryDirectory() as out:
    def compile_one(kernel):
        cmd = kernel.compile_command("portable", cxx, Path(out) / f"{kernel.name}.o")
        done = subprocess.run(cmd, capture_output=True, text=True)
        return kernel.name, done.returncode, done.stderr

    with ThreadPoolExecutor() as pool:
        results = list(pool.map(compile_one, declared_kernels().values()))
for name, code, err in results:
    print(f"cross_build.sh: {name} (portable, {cxx}): {'ok' if code == 0 else 'FAILED'}")
    if code:
        print(err[-4000:], file=sys.stderr)
sys.exit(any(code for _, code, _ in results))
PY
