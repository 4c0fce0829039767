#!/usr/bin/env bash
# Set everything up (scripts/setup.sh), then run the tests. Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -k scheduler`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# llama.cpp's HF -> GGUF converter for tests/test_gguf_families.py, taken once from the
# llama-cpp-python sdist on PyPI into ~/.cache/atom (or $ATOM_CACHE_DIR); stops here if it cannot.
.venv/bin/python tests/gguf_convert.py >/dev/null
exec .venv/bin/python -m pytest "$@"
