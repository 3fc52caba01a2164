#!/usr/bin/env bash
# Download the wheels the GPU machine's image lacks (bench/gpu_models/wheels.txt) into the ignored
# folder .whl/ at the repo's root, for CPython 3.12 on manylinux x86-64, and print their total:
#
#   bash bench/gpu_wheels.sh                 # .whl/, CPython 3.12 (the GPU machine's)
#   bash bench/gpu_wheels.sh DIR [X.Y]       # DIR, CPython X.Y (the dry run: this Python's)
#
# One pip download per wheel, --no-deps (wheels.txt names each one), binary only. bench/gpu_check.sh
# installs them offline (--no-index --no-deps --target) when it finds the folder. Fails when a
# wheel cannot be fetched, or when the total passes GPU_WHEELS_MAX_MIB (default 40): a call
# carries 64 MiB, the working tree included.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PYVER=${2:-3.12}
MAX_MIB=${GPU_WHEELS_MAX_MIB:-40}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
LIST=bench/gpu_models/wheels.txt
mkdir -p "$DEST"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
grep -v '^\s*\(#\|$\)' "$LIST" | while read -r spec; do
  echo "fetching $spec (CPython $PYVER)"
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PYVER" --implementation cp "${platforms[@]}" -d "$DEST" "$spec" \
    || { echo "gpu_wheels: could not fetch $spec for CPython $PYVER" >&2; exit 1; }
done
# One version of each: two would stop the whole install there.
dups=$(ls "$DEST"/*.whl | xargs -n1 basename | cut -d- -f1 | sort | uniq -d)
[ -z "$dups" ] || { echo "gpu_wheels: more than one version in $DEST of: $dups" >&2; exit 1; }
ls -l "$DEST"/*.whl | awk '{print $5, $NF}'
bytes=$(cat "$DEST"/*.whl | wc -c)
mib=$(awk -v b="$bytes" 'BEGIN {printf "%.2f", b / 1048576}')
echo "total: $(ls "$DEST"/*.whl | wc -l) wheels, $mib MiB in $DEST (limit $MAX_MIB MiB)"
awk -v b="$bytes" -v m="$MAX_MIB" 'BEGIN {exit !(b <= m * 1048576)}' \
  || { echo "gpu_wheels: $mib MiB is over the $MAX_MIB MiB budget" >&2; exit 1; }
