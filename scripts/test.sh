#!/usr/bin/env bash
# Set up (once) and run the whole test suite (CPU only; GPU tests skip with a reason).
# pytest runs with -q unless the arguments set the verbosity themselves (-q, -v, ...): a second
# -q would hide the pass count.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
verbosity=-q
for arg in "$@"; do
  case "$arg" in
    -q* | -v* | --quiet | --verbose | --verbosity=*) verbosity= ;;
  esac
done
exec .venv/bin/python -m pytest ${verbosity:+"$verbosity"} -p no:cacheprovider -rs --durations=15 "$@"
