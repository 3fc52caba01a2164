#!/usr/bin/env bash
# Set up (once) and run the quickstart on the embedded SmolLM2-135M-Instruct model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/batchgen run configs/quickstart.yaml --overwrite "$@"
