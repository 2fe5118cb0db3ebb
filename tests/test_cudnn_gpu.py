"""The cuDNN wrappers on a real GPU: handles, workspace sizes, heuristics, timed search and the convolutions.

Every test here is marked ``gpu``; the conftest skips them, with the reason, where no GPU is usable. CuPy and
NumPy appear only in these tests (the bindings themselves use neither).
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from wsarena import cudnn
from wsarena._pass import PASSES

pytestmark = pytest.mark.gpu

F32 = cudnn.DataType.FLOAT
F64 = cudnn.DataType.DOUBLE
NCHW = cudnn.TensorFormat.NCHW


@pytest.fixture(scope="module")
def cp():
    cupy = pytest.importorskip("cupy")
    cupy.cuda.Device(0).use()
    return cupy


@pytest.fixture
def handle(cp):
    h = cudnn.get_handle(0)
    h.set_stream(cp.cuda.get_current_stream().ptr)
    return h


def reference_forward(x, w, pad, stride, dil, groups):
    """Cross-correlation in NumPy (any number of spatial dimensions), written out independently of cuDNN."""
    import numpy as np

    nd = x.ndim - 2
    xp = np.pad(x, [(0, 0), (0, 0), *((p, p) for p in pad)])
    out_size = [(x.shape[2 + j] + 2 * pad[j] - dil[j] * (w.shape[2 + j] - 1) - 1) // stride[j] + 1 for j in range(nd)]
    k_out, c_per_group = w.shape[0], w.shape[1]
    y = np.zeros((x.shape[0], k_out, *out_size), dtype=np.float64)
    k_per_group = k_out // groups
    for offset in itertools.product(*(range(k) for k in w.shape[2:])):
        index = tuple(
            slice(offset[j] * dil[j], offset[j] * dil[j] + stride[j] * (out_size[j] - 1) + 1, stride[j])
            for j in range(nd)
        )
        for g in range(groups):
            xs = xp[:, g * c_per_group : (g + 1) * c_per_group][(slice(None), slice(None), *index)]
            ws = w[g * k_per_group : (g + 1) * k_per_group][(slice(None), slice(None), *offset)]
            y[:, g * k_per_group : (g + 1) * k_per_group] += np.einsum("nc...,kc->nk...", xs, ws)
    return y


CASES = [
    # x shape, w shape, pad, stride, dilation, groups
    ((2, 4, 9, 9), (6, 4, 3, 3), (1, 1), (1, 1), (1, 1), 1),
    ((2, 4, 11, 10), (6, 2, 3, 2), (2, 1), (2, 1), (1, 2), 2),
    ((3, 5, 17), (4, 5, 4), (1,), (2,), (1,), 1),  # 1-D
    ((1, 2, 6, 7, 5), (4, 2, 3, 3, 1), (1, 1, 0), (1, 2, 1), (1, 1, 1), 1),  # 3-D
]


def _setup(cp, case, dtype):
    import numpy as np

    xs, ws, pad, stride, dil, groups = case
    # FMA_MATH keeps float32 exact enough to compare (DEFAULT_MATH may use TF32 tensor cores on Ampere+).
    math_type = cudnn.MathType.FMA_MATH if dtype == F32 else cudnn.MathType.DEFAULT_MATH
    np_dtype = np.float64 if dtype == F64 else np.float32
    rng = np.random.default_rng(0)
    x = rng.standard_normal(xs).astype(np_dtype)
    w = rng.standard_normal(ws).astype(np_dtype)
    x_desc = cudnn.TensorDescriptor(dtype, xs)
    w_desc = cudnn.FilterDescriptor(dtype, NCHW, ws)
    conv = cudnn.ConvolutionDescriptor(pad, stride, dil, groups, compute_type=dtype, math_type=math_type)
    y_shape = conv.output_shape(x_desc, w_desc)
    y_desc = cudnn.TensorDescriptor(dtype, y_shape)
    return x, w, x_desc, w_desc, conv, y_desc, y_shape


def _best(results, nbytes_limit=None):
    for perf in results:
        if perf.ok and (nbytes_limit is None or perf.memory <= nbytes_limit):
            return perf
    raise AssertionError(f"no usable algorithm in {results}")


def test_handle_is_per_thread_and_cached(cp):
    h = cudnn.get_handle(0)
    assert cudnn.get_handle(0) is h and h.device == 0 and not h.closed
    other = []
    t = threading.Thread(target=lambda: other.append(cudnn.get_handle(0)))
    t.start()
    t.join()
    assert other[0] is not h and other[0].thread_id != h.thread_id


def test_set_stream(cp):
    h = cudnn.get_handle(0)
    stream = cp.cuda.Stream(non_blocking=True)
    h.set_stream(stream.ptr)
    assert h.get_stream() == stream.ptr == h.stream
    h.set_stream(0)
    assert h.get_stream() == 0


@pytest.mark.parametrize("pass_", PASSES)
def test_workspace_size_of_every_algorithm(cp, handle, pass_):
    _, _, x_desc, w_desc, conv, y_desc, _ = _setup(cp, CASES[0], F32)
    sizes = {}
    for algo in cudnn.algorithms(pass_):
        try:
            sizes[algo] = cudnn.workspace_size(pass_, handle, x_desc, w_desc, conv, y_desc, algo)
        except (cudnn.CudnnNotSupportedError, cudnn.CudnnBadParamError):
            continue
    assert sizes, f"no {pass_} algorithm reports a workspace size"
    assert all(isinstance(v, int) and v >= 0 for v in sizes.values())


@pytest.mark.parametrize("pass_", PASSES)
def test_heuristics_rank_usable_algorithms(cp, handle, pass_):
    _, _, x_desc, w_desc, conv, y_desc, _ = _setup(cp, CASES[1], F32)
    results = cudnn.heuristic_algorithms(pass_, handle, x_desc, w_desc, conv, y_desc)
    assert results and all(isinstance(r, cudnn.AlgoPerf) for r in results)
    assert all(isinstance(r.algo, cudnn.ALGORITHMS[pass_]) for r in results)
    best = _best(results)
    # The top usable choice can be asked for its workspace without error.
    assert cudnn.workspace_size(pass_, handle, x_desc, w_desc, conv, y_desc, best.algo) >= 0
    assert all(r.memory >= 0 for r in results)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("case", CASES, ids=["2d", "2d-grouped-strided-dilated", "1d", "3d"])
def test_forward_matches_reference(cp, handle, case, dtype):
    import numpy as np

    x, w, x_desc, w_desc, conv, y_desc, y_shape = _setup(cp, case, dtype)
    perf = _best(cudnn.heuristic_algorithms("fwd", handle, x_desc, w_desc, conv, y_desc))
    nbytes = cudnn.workspace_size("fwd", handle, x_desc, w_desc, conv, y_desc, perf.algo)
    x_gpu, w_gpu = cp.asarray(x), cp.asarray(w)
    y_gpu = cp.full(y_shape, 7.0, dtype=x.dtype)  # beta=0 must ignore what was there
    workspace = cp.cuda.alloc(max(nbytes, 1))
    cudnn.convolution(
        "fwd", handle, x_desc=x_desc, x_ptr=x_gpu.data.ptr, w_desc=w_desc, w_ptr=w_gpu.data.ptr, conv_desc=conv,
        y_desc=y_desc, y_ptr=y_gpu.data.ptr, algo=perf.algo, workspace_ptr=workspace.ptr, workspace_bytes=nbytes,
    )
    expected = reference_forward(x.astype(np.float64), w.astype(np.float64), *case[2:])
    # Error relative to the output's largest value: 1e-5 for float32 holds for FMA math (Winograd and FFT
    # included) and fails for TF32, whose products keep 10 mantissa bits (errors near 1e-3).
    err = float(np.max(np.abs(cp.asnumpy(y_gpu) - expected))) / float(np.max(np.abs(expected)))
    assert err <= (1e-12 if dtype == F64 else 1e-5), (perf.algo, err)


@pytest.mark.parametrize("case", CASES[:3], ids=["2d", "2d-grouped-strided-dilated", "1d"])
def test_backward_passes_are_the_adjoints(cp, handle, case):
    """<conv(x, w), dy> == <x, bwd_data(dy, w)> == <w, bwd_filter(x, dy)>, in double precision."""
    import numpy as np

    x, w, x_desc, w_desc, conv, y_desc, y_shape = _setup(cp, case, F64)
    dy = np.random.default_rng(1).standard_normal(y_shape)
    x_gpu, w_gpu, dy_gpu = cp.asarray(x), cp.asarray(w), cp.asarray(dy)
    dx_gpu, dw_gpu = cp.zeros_like(x_gpu), cp.zeros_like(w_gpu)
    for pass_, x_ptr, w_ptr in (("bwd_data", dx_gpu.data.ptr, w_gpu.data.ptr),
                                ("bwd_filter", x_gpu.data.ptr, dw_gpu.data.ptr)):
        perf = _best(cudnn.heuristic_algorithms(pass_, handle, x_desc, w_desc, conv, y_desc))
        nbytes = cudnn.workspace_size(pass_, handle, x_desc, w_desc, conv, y_desc, perf.algo)
        workspace = cp.cuda.alloc(max(nbytes, 1))
        cudnn.convolution(
            pass_, handle, x_desc=x_desc, x_ptr=x_ptr, w_desc=w_desc, w_ptr=w_ptr, conv_desc=conv, y_desc=y_desc,
            y_ptr=dy_gpu.data.ptr, algo=perf.algo, workspace_ptr=workspace.ptr, workspace_bytes=nbytes,
        )
    y = reference_forward(x, w, *case[2:])
    forward = float(np.vdot(y, dy))
    assert float(np.vdot(x, cp.asnumpy(dx_gpu))) == pytest.approx(forward, rel=1e-9)
    assert float(np.vdot(w, cp.asnumpy(dw_gpu))) == pytest.approx(forward, rel=1e-9)


@pytest.mark.parametrize("pass_", PASSES)
def test_find_algorithms_respects_the_workspace(cp, handle, pass_):
    x, w, x_desc, w_desc, conv, y_desc, y_shape = _setup(cp, CASES[0], F32)
    x_gpu, w_gpu = cp.asarray(x), cp.asarray(w)
    y_gpu = cp.zeros(y_shape, dtype=x.dtype)
    limit = 1 << 20
    workspace = cp.cuda.alloc(limit)
    results = cudnn.find_algorithms(
        pass_, handle, x_desc, x_gpu.data.ptr, w_desc, w_gpu.data.ptr, conv, y_desc, y_gpu.data.ptr,
        workspace.ptr, limit,
    )
    usable = [r for r in results if r.ok]
    assert usable, results
    assert all(r.memory <= limit for r in usable)
    assert [r.time_ms for r in usable] == sorted(r.time_ms for r in usable)


def test_handles_are_destroyed_at_exit_quietly(cp):
    code = (
        "import cupy, wsarena.cudnn as c\n"
        "cupy.cuda.Device(0).use()\n"
        "h = c.get_handle(0)\n"
        "s = cupy.cuda.Stream(non_blocking=True)\n"  # kept alive: the handle must not name a destroyed stream
        "h.set_stream(s.ptr)\n"
    )
    repo = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=repo, check=False, timeout=120
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_close_all_handles(cp):
    h = cudnn.get_handle(0)
    cudnn.close_all_handles()
    assert h.closed
    fresh = cudnn.get_handle(0)
    assert fresh is not h and not fresh.closed
