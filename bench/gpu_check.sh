#!/usr/bin/env bash
# One command on a GPU machine: kernel tests on real cupy, end-to-end cuda-vs-torch generation,
# and the decode bandwidth benchmark. Results: bench/results/gpu_check.json.
set -euo pipefail
cd "$(dirname "$0")/.."
exec timeout 470 python bench/gpu_check.py "$@"
