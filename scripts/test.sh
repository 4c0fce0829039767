#!/usr/bin/env bash
# Set up a virtualenv in .venv (once) with Atom and its test dependencies, then run the tests.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k scheduler`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[test]"
exec .venv/bin/python -m pytest "$@"
