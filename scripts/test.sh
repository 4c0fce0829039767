#!/usr/bin/env bash
# Set everything up (scripts/setup.sh), then run the tests. Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -k scheduler`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
