#!/usr/bin/env bash
# Set up (once) and run the whole test suite (CPU only; GPU tests skip with a reason).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
exec .venv/bin/python -m pytest -q -p no:cacheprovider -rs --durations=15 "$@"
