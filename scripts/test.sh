#!/usr/bin/env bash
# Set up (once) and run the whole test suite (CPU only; GPU tests skip with a reason).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
