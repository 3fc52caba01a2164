#!/usr/bin/env bash
# The GPU check in one command, within GPU_CHECK_TOTAL_S seconds (default 470) on one GPU:
#
#   bash bench/gpu_check.sh [bench/gpu_check.py options]
#
# 1. Takes $GPU_CHECK_PYTHON as given, else the first of .venv/bin/python, python3, python whose
#    torch sees a CUDA GPU.
# 2. Offline (the GPU machine reaches no registry): when the wheel folder $GPU_CHECK_WHEELS
#    (default .whl, made by bench/gpu_wheels.sh and carried) exists, installs its wheels with
#    `pip install --no-index --no-deps --target $GPU_CHECK_SITE` (time-boxed; no network attempt),
#    and runs batchgen from this tree (PYTHONPATH), not installed. What is still missing is named
#    in the log, and the stage that needs it says why it cannot run.
#    Online (no wheel folder): installs what is missing with pip, each install time-boxed and
#    failing fast without a network (one retry, 20 s socket timeout): batchgen's dependencies,
#    cupy for torch's CUDA major (the `cuda` or `cuda13` extra), pytest, FlashInfer.
#    GPU_CHECK_NO_INSTALL=1 installs nothing.
# 3. Runs bench/gpu_check.py with the time left: stages in subprocesses, each time-boxed.
#    GPU_CHECK_DRY_RUN=1 (no GPU needed): every stage runs up to its first CUDA call and says
#    "no GPU" there; exit 0 when all of them got there.
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

DRY=${GPU_CHECK_DRY_RUN:-0}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
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
missing() { ! (has transformers && has pydantic && has gguf && has cupy && has pytest && has flashinfer); }
if [ "${GPU_CHECK_NO_INSTALL:-0}" = "1" ]; then
  :
elif [ -d "$WHEELS" ]; then
  # Offline: the carried wheels only, and nothing else is tried.
  PY=${PY:-python3}
  SITE=${GPU_CHECK_SITE:-/tmp/batchgen-gpu-site}
  shopt -s nullglob
  wheels=("$WHEELS"/*.whl)
  shopt -u nullglob
  if [ ${#wheels[@]} -eq 0 ]; then
    say "no wheels in $WHEELS: nothing to install"
  else
    say "offline: installing ${#wheels[@]} wheels from $WHEELS into $SITE (no index, no deps, up to 60s)"
    timeout 60 "$PY" -m pip install --disable-pip-version-check -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" >>"$LOG" 2>&1 \
      || say "offline install from $WHEELS failed or timed out (see $LOG); the checks run without it"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  fi
  for m in cupy pytest flashinfer; do
    has $m || say "offline: $m is not installed and not carried (the stages that need it say so)"
  done
else
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
  has pytest || pip_install 60 pytest
  has flashinfer || pip_install 90 flashinfer-python
fi
# batchgen and bench/ from this tree, whether or not batchgen is installed
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
say "python: $PY ($("$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)' 2>&1 | tail -1))"

if [ "${GPU_CHECK_SETUP_ONLY:-0}" = "1" ]; then
  say "setup only (GPU_CHECK_SETUP_ONLY=1): stopping before the checks"
  exit 0
fi
remaining=$(($(left) - 10))
[ "$remaining" -lt 60 ] && remaining=60
say "setup done; the checks get ${remaining}s"
dry=()
[ "$DRY" = "1" ] && dry=(--dry-run) && say "dry run: every stage stops at its first CUDA call"
timeout $((remaining + 8)) "$PY" bench/gpu_check.py --deadline-s "$remaining" \
  --out "$RESULTS/gpu_check.json" --setup-log "$LOG" "${dry[@]}" "$@"
rc=$?
say "finished with status $rc"
exit $rc
