#!/usr/bin/env bash
# On a GPU machine (CuPy, cuDNN, PyTorch, pytest, pytest-timeout and hypothesis present, no network): install
# this checkout without fetching anything, run the whole test suite with the GPU tests enabled, then the GPU
# benchmark. Results: bench/results/gpu-check-<date>.json and gpu-check.log (under $OUT when set).
#
# What such a machine lacks comes as wheels in the folder WSARENA_WHEELS names, prepared where pip works:
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl pycparser 'setuptools>=77'
# Without WSARENA_WHEELS the test extras come from the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -n "${WSARENA_WHEELS:-}" ]; then
  offline=(--no-index --no-deps --find-links "$WSARENA_WHEELS")
  "$PY" -m pip install --quiet "${offline[@]}" -e .
  "$PY" -m pip install --quiet "${offline[@]}" pycparser
else
  "$PY" -m pip install --quiet -e ".[test]"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -m pip list 2>/dev/null | grep -iE '^(nvidia-cudnn|cupy|cuda-|numpy |pytest|hypothesis)' || true
out=${OUT:-bench/results}
mkdir -p "$out"
PYTHONPATH=$PWD PYTHONUNBUFFERED=1 "$PY" bench/gpu_check.py --out "$out" "$@" 2>&1 | tee "$out/gpu-check.log"
