#!/usr/bin/env bash
# The architecture and style checks CI runs before the tests (after scripts/setup.sh):
# the import contracts in pyproject.toml ([tool.importlinter]), ruff's lint and format, mypy on the core.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/lint-imports
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
