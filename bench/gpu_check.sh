#!/usr/bin/env bash
# On a GPU machine (CuPy, cuDNN, PyTorch, pytest, pytest-timeout and hypothesis present, no network): run the
# GPU tests, the rest of the suite and the GPU benchmarks (among them a PyTorch ResNet-50 training step against
# the same model converted by wsarena.torch) from this checkout, then the `wsarena tune` curves
# (ResNet-50 and VGG-16, batch 32 float32 and batch 64 float16) and the search cache's start-up saving. Results:
# bench/results/gpu-check-<date>.json, tune-*-gpu.json/.png, search-cache-startup-resnet50-gpu.json and
# gpu-check.log (under $OUT when set), written as each phase ends.
#
# What such a machine lacks (pycparser, for the header checks; platformdirs, else the cache folder follows the
# XDG rule; pytest-xdist, which runs the tests that need no GPU in parallel; RAPIDS RMM, for the test of RMM under
# CuPy's allocator, which is skipped without it) comes as wheels in the folder WSARENA_WHEELS names, prepared where
# pip works:
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl pycparser platformdirs pytest-xdist execnet \
#       rmm-cu13 librmm-cu13 rapids-logger
# The image's cuda-core may predate what wsarena uses (Device, Stream.from_handle and DeviceMemoryResource at the
# top level of cuda.core): then it is replaced from the same folder, given wheels for that machine's Python
# (3.12 when last seen), with the versions of pyproject's cuda-python:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 -d .whl cuda-core cuda-bindings cuda-pathfinder
# Installing is best effort: the checks run from the checkout (PYTHONPATH) whether or not the install worked.
# Arguments go to bench/gpu_check.py: where one command may not hold it all, run `gpu_check.sh --no-bench` (the
# tests), then `gpu_check.sh --no-tests --quick` (the benchmarks and one tune curve, fewer repeats), each with
# `--deadline S`, S the command's limit less a minute, so that the run ends, and says what it left, within it.
# A copy without its .git folder, or with a stale one (a lent machine's copy kept naming the first commit it was sent),
# names its commit in WSARENA_COMMIT, for the JSON: WSARENA_COMMIT=<git rev-parse HEAD, run where the work is>.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -n "${WSARENA_WHEELS:-}" ]; then
  "$PY" -m pip install --quiet --no-index --no-deps --find-links "$WSARENA_WHEELS" pycparser platformdirs \
    || echo "gpu_check: could not install pycparser and platformdirs from $WSARENA_WHEELS" >&2
  "$PY" -m pip install --quiet --no-index --no-deps --find-links "$WSARENA_WHEELS" pytest-xdist execnet \
    || echo "gpu_check: no pytest-xdist from $WSARENA_WHEELS; the tests that need no GPU run in one process" >&2
  "$PY" -m pip install --quiet --no-index --no-deps --find-links "$WSARENA_WHEELS" rmm-cu13 librmm-cu13 rapids-logger \
    || echo "gpu_check: no RAPIDS RMM from $WSARENA_WHEELS; its test will be skipped" >&2
fi
if [ -n "${WSARENA_WHEELS:-}" ] && ! "$PY" -c \
    "from cuda.core import Device, DeviceMemoryResource, Stream; Stream.from_handle; import cuda.pathfinder" 2>/dev/null
then
  "$PY" -m pip install --quiet --no-index --no-deps --find-links "$WSARENA_WHEELS" --upgrade \
    cuda-core cuda-bindings cuda-pathfinder \
    || echo "gpu_check: this image's cuda-core lacks what wsarena uses, and no wheels replaced it" >&2
fi
# --no-build-isolation: build with the machine's own setuptools rather than fetch one
"$PY" -m pip install --quiet --no-deps --no-build-isolation -e . \
  || echo "gpu_check: could not install this checkout; running it from PYTHONPATH" >&2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -m pip list 2>/dev/null | grep -iE '^(nvidia-cudnn|cupy|cuda-|numpy |torch |rmm|pytest|hypothesis|pycparser|platformdirs)' || true
out=${OUT:-bench/results}
mkdir -p "$out"
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 "$PY" bench/gpu_check.py --out "$out" "$@" 2>&1 \
  | tee "$out/gpu-check.log"
