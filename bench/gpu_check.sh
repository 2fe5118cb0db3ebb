#!/usr/bin/env bash
# On a GPU machine (CuPy, cuDNN and PyTorch present, no network): install wsarena without fetching anything
# it cannot find locally, then run the tests with the GPU tests enabled and the GPU benchmark.
# Wheels for what the machine lacks (cuda-python, cuda-pathfinder, onnx, pycparser, hypothesis, pytest) can be
# brought in a folder named by WSARENA_WHEELS:  pip download -d wheels cuda-python cuda-pathfinder onnx ...
# Results: bench/results/gpu-check-<date>.json (or under $OUT when set).
set -uo pipefail
cd "$(dirname "$0")/.."
find_links=()
[ -n "${WSARENA_WHEELS:-}" ] && find_links=(--no-index --find-links "$WSARENA_WHEELS")
python -m pip install --quiet --no-deps -e . \
  && python -m pip install --quiet "${find_links[@]}" cuda-pathfinder cuda-python onnx pycparser hypothesis pytest 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python bench/gpu_check.py --out "${OUT:-bench/results}" "$@"
