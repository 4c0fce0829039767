#!/usr/bin/env bash
# Set everything up (scripts/setup.sh), then answer a few questions with the default model.
# Extra arguments go to `atom generate`, e.g. `bash scripts/demo.sh "Why is the sky blue?"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/atom fetch >/dev/null
exec .venv/bin/atom generate "$@"
