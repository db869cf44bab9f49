#!/usr/bin/env bash
# The GPU check from any directory, with whatever python has the CUDA torch:
#   bash benchmarks/gpu_check.sh [OUT_DIR] [--budget S] [--sections ...] [--dry-run]
# OUT_DIR defaults to $OUT, else ./gpu_check_out. PYTHON=... picks the interpreter, which must
# have this package installed (pip install -e .; see benchmarks/gpu_check.py).
set -u
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-}"
if [ -z "$py" ]; then
  for c in python3 python; do
    if command -v "$c" >/dev/null 2>&1; then py="$c"; break; fi
  done
fi
if [ -z "$py" ]; then echo "gpu_check.sh: no python found (set PYTHON=...)" >&2; exit 2; fi
exec "$py" "$root/benchmarks/gpu_check.py" "$@"
