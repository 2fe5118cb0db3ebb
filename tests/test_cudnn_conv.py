"""The convolution wrappers without a GPU: argument order against the header, marshalling through ctypes."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from wsarena import cudnn
from wsarena._gpu import gpu_unusable_reason
from wsarena._pass import PASSES
from wsarena.cudnn import conv as conv_mod

from .cudnn_probe import driver, probe

_info = cudnn.library_info()
needs_cudnn = pytest.mark.skipif(not _info["found"], reason=f"libcudnn not loadable: {_info['error']}")

F32 = cudnn.DataType.FLOAT
X_PTR, W_PTR, Y_PTR, WS_PTR, WS_BYTES = 0x1000, 0x2000, 0x3000, 0x4000, 12345


class _NullHandle:
    """Stands in for a Handle: a null cudnnHandle_t, which cuDNN rejects with BAD_PARAM (no GPU needed)."""

    _as_parameter_ = ctypes.c_void_p(None)
    device = 0


@pytest.fixture(scope="module")
def descs():
    if not _info["found"]:
        pytest.skip(f"libcudnn not loadable: {_info['error']}")
    x = cudnn.TensorDescriptor(F32, (2, 4, 9, 9))
    w = cudnn.FilterDescriptor(F32, cudnn.TensorFormat.NCHW, (6, 4, 3, 3))
    conv = cudnn.ConvolutionDescriptor((1, 1), (1, 1), (1, 1))
    y = cudnn.TensorDescriptor(F32, conv.output_shape(x, w))
    return x, w, conv, y


def _roles(pass_: str, handle, x, w, conv, y, algo) -> dict[str, object]:
    """Header parameter name -> the object the wrapper must pass there."""
    roles = {
        "handle": handle, "convDesc": conv, "algo": algo,
        "xDesc": x, "srcDesc": x, "dxDesc": x, "x": X_PTR, "dx": X_PTR,
        "wDesc": w, "filterDesc": w, "dwDesc": w, "w": W_PTR, "dw": W_PTR,
        "yDesc": y, "destDesc": y, "dyDesc": y, "diffDesc": y, "y": Y_PTR, "dy": Y_PTR,
        "workSpace": WS_PTR, "workSpaceSizeInBytes": WS_BYTES,
    }
    roles["gradDesc"] = x if pass_ == "bwd_data" else w  # the header reuses this name for dx and for dw
    return roles


@pytest.mark.skipif(probe.compiler() is None, reason="no C compiler (cc/gcc/clang or $CC) found")
@pytest.mark.parametrize("pass_", PASSES)
def test_arguments_follow_the_header_order(monkeypatch, descs, pass_):
    x, w, conv, y = descs
    handle = _NullHandle()
    algo = cudnn.ALGORITHMS[pass_](1)
    seen: list[tuple[str, tuple]] = []

    def recorder(name, *args, context=""):
        seen.append((name, args))

    monkeypatch.setattr(conv_mod, "call", recorder)
    cudnn.workspace_size(pass_, handle, x, w, conv, y, algo)
    cudnn.heuristic_algorithms(pass_, handle, x, w, conv, y)
    cudnn.find_algorithms(pass_, handle, x, X_PTR, w, W_PTR, conv, y, Y_PTR, WS_PTR, WS_BYTES)
    cudnn.convolution(
        pass_, handle, x_desc=x, x_ptr=X_PTR, w_desc=w, w_ptr=W_PTR, conv_desc=conv, y_desc=y, y_ptr=Y_PTR,
        algo=algo, workspace_ptr=WS_PTR, workspace_bytes=WS_BYTES,
    )
    roles = _roles(pass_, handle, x, w, conv, y, algo)
    functions = probe.parsed()["functions"]
    checked = 0
    for name, args in seen:
        params = [p.name for p in functions[name].args.params]
        assert len(args) == len(params), name
        for param, arg in zip(params, args):
            if param in roles:
                assert arg is roles[param] or arg == roles[param], f"{name}: {param} got {arg!r}"
                checked += 1
    called = {name for name, _ in seen}
    assert len(called) == 5  # workspace size, max count, _v7, FindEx, the convolution
    assert checked >= 30


@needs_cudnn
@pytest.mark.parametrize("pass_", PASSES)
def test_size_queries_reach_cudnn(descs, pass_):
    """Through real ctypes calls: cuDNN answers with a status (not a crash), so every argument converted.

    Which status depends on the machine: BAD_PARAM for the null handle, or SUBLIBRARY_LOADING_FAILED where the
    heuristics' engine library needs a CUDA driver before it looks at the handle.
    """
    x, w, conv, y = descs
    handle = _NullHandle()
    with pytest.raises(cudnn.CudnnBadParamError, match=r"WorkspaceSize.*\[" + pass_):
        cudnn.workspace_size(pass_, handle, x, w, conv, y, 0)
    with pytest.raises(cudnn.CudnnBadParamError, match="AlgorithmMaxCount"):
        cudnn.heuristic_algorithms(pass_, handle, x, w, conv, y)


# cuDNN before 9.27 loads its engines without the driver library: nothing fails before the null handle is read
_V7_REACHES_THE_HANDLE = "before cuDNN 9.27 the _v7 heuristics read a null handle (a segfault) without a driver too"


@needs_cudnn
@pytest.mark.skipif(
    driver.driver_library_loaded(),
    reason="with a CUDA driver library (or the tests' stand-in for one) cuDNN's _v7 heuristics dereference a null "
    "handle (a segfault); test_wrappers_reach_cudnn_without_a_driver_library runs this in a process without one",
)
@pytest.mark.parametrize("pass_", PASSES)
def test_search_and_convolution_wrappers_reach_cudnn(monkeypatch, descs, pass_):
    """As above, for the calls that come after a handle's count query: the null handle gets an error status."""
    if not driver.engines_link_the_driver():
        pytest.skip(_V7_REACHES_THE_HANDLE)
    x, w, conv, y = descs
    handle = _NullHandle()
    monkeypatch.setattr(conv_mod, "_max_count", lambda spec, handle: 8)  # get past the count query
    with pytest.raises(cudnn.CudnnError, match="Algorithm_v7"):
        cudnn.heuristic_algorithms(pass_, handle, x, w, conv, y)
    with pytest.raises(cudnn.CudnnError, match="AlgorithmEx"):
        cudnn.find_algorithms(pass_, handle, x, 0, w, 0, conv, y, 0, 0, 0)
    # The error names what was being run: the pass, the shapes, the algorithm and the workspace.
    context = rf"\[{pass_}: x \(2, 4, 9, 9\), w \(6, 4, 3, 3\), y \(2, 6, 9, 9\), .*, algo \w+, workspace 64 bytes\]"
    with pytest.raises(cudnn.CudnnError, match=r"cudnnConvolution\w+ returned .*" + context):
        cudnn.convolution(pass_, handle, x_desc=x, x_ptr=0, w_desc=w, w_ptr=0, conv_desc=conv, y_desc=y, y_ptr=0,
                          algo=0, workspace_bytes=64)


@needs_cudnn
@pytest.mark.skipif(gpu_unusable_reason() is None, reason="a GPU machine has its driver library: no such process")
def test_wrappers_reach_cudnn_without_a_driver_library():
    """The test above in a child process that does without the stand-in for libcuda.so.1 (conftest)."""
    if not driver.engines_link_the_driver():
        pytest.skip(_V7_REACHES_THE_HANDLE)
    target = f"{__file__}::test_search_and_convolution_wrappers_reach_cudnn"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", target],
        env={**os.environ, "WSARENA_TEST_DRIVER_STAND_IN": "0"}, cwd=Path(__file__).parents[1],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0 and "3 passed" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]


def test_pass_names_and_algorithms():
    assert PASSES == ("fwd", "bwd_data", "bwd_filter")
    assert cudnn.ALGORITHMS == {
        "fwd": cudnn.ConvolutionFwdAlgo,
        "bwd_data": cudnn.ConvolutionBwdDataAlgo,
        "bwd_filter": cudnn.ConvolutionBwdFilterAlgo,
    }
    assert len(cudnn.algorithms("fwd")) == 8 and "COUNT" not in {a.name for a in cudnn.algorithms("bwd_filter")}
    assert cudnn.algorithm("fwd", "FFT") is cudnn.ConvolutionFwdAlgo.FFT
    assert cudnn.algorithm("bwd_data", 1) is cudnn.ConvolutionBwdDataAlgo.ALGO_1
    with pytest.raises(ValueError, match="pass must be one of .*forward"):
        cudnn.algorithms("forward")


def test_scaling_factors_follow_the_data_type():
    assert isinstance(conv_mod._scale(1.0, cudnn.DataType.DOUBLE), ctypes.c_double)
    for dtype in (cudnn.DataType.FLOAT, cudnn.DataType.HALF, cudnn.DataType.BFLOAT16):
        assert isinstance(conv_mod._scale(1.0, dtype), ctypes.c_float)


@needs_cudnn
def test_a_convolution_passes_its_scaling_factors_as_cudnn_reads_them(monkeypatch, descs):
    """alpha 1 and beta 0, every convolution's, go to cuDNN through pointers made once per width (float for every
    data type but double's), the same from call to call; other factors through scalars of their own. An algorithm
    given by value reaches cuDNN as its enum member."""
    x, w, conv, y = descs
    seen = []
    monkeypatch.setattr(conv_mod, "call", lambda name, *args, context="": seen.append(args))

    def run(pass_, data_type=None, **scales):
        cudnn.convolution(pass_, _NullHandle(), x_desc=x, x_ptr=X_PTR, w_desc=w, w_ptr=W_PTR, conv_desc=conv,
                          y_desc=y, y_ptr=Y_PTR, algo=1, data_type=data_type, **scales)
        args = seen.pop()  # (handle, &alpha, in, in, in, in, conv, algo, ws, bytes, &beta, out, out)
        assert args[7] is cudnn.ALGORITHMS[pass_](1)
        return args[1], args[10]

    first = run("fwd")
    for pass_ in PASSES:
        again = run(pass_)
        assert again[0] is first[0] and again[1] is first[1]
    assert [(type(p._obj), p._obj.value) for p in first] == [(ctypes.c_float, 1.0), (ctypes.c_float, 0.0)]
    half = run("fwd", data_type=cudnn.DataType.HALF)
    assert half[0] is first[0] and half[1] is first[1]
    double = run("bwd_data", data_type=cudnn.DataType.DOUBLE)
    assert run("fwd", data_type=cudnn.DataType.DOUBLE) == double and double[0] is not first[0]
    assert [(type(p._obj), p._obj.value) for p in double] == [(ctypes.c_double, 1.0), (ctypes.c_double, 0.0)]
    scaled = run("bwd_filter", alpha=0.5, beta=1.0)
    assert [(type(p._obj), p._obj.value) for p in scaled] == [(ctypes.c_float, 0.5), (ctypes.c_float, 1.0)]
    again = run("bwd_filter", alpha=0.5, beta=1.0, data_type=cudnn.DataType.DOUBLE)
    assert [(type(p._obj), p._obj.value) for p in again] == [(ctypes.c_double, 0.5), (ctypes.c_double, 1.0)]
    with pytest.raises(ValueError, match="pass must be one of .*forward"):
        run("forward")
