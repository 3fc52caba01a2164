#!/usr/bin/env bash
# Set up (once) and run the whole test suite (CPU only; GPU tests skip with a reason), one
# worker process per core.
# pytest runs with -q unless the arguments set the verbosity themselves (-q, -v, ...): a second
# -q would hide the pass count.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
verbosity=-q
# One pytest-xdist worker per core (BATCHGEN_TEST_WORKERS overrides; 0 runs in this process),
# each test file on one worker, so that a file's module fixtures are built once; arguments
# that choose the workers themselves (-n, --numprocesses, -p no:xdist) turn this off.
workers=(-n "${BATCHGEN_TEST_WORKERS:-auto}" --dist loadfile)
for arg in "$@"; do
  case "$arg" in
    -q* | -v* | --quiet | --verbose | --verbosity=*) verbosity= ;;
    -n* | --numprocesses* | no:xdist) workers=() ;;
  esac
done
exec .venv/bin/python -m pytest ${verbosity:+"$verbosity"} -p no:cacheprovider -rs --durations=15 "${workers[@]}" "$@"
