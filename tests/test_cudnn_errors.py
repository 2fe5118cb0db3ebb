"""The status -> exception mapping and the package's public names (no GPU needed)."""

from __future__ import annotations

import ctypes
import pickle

import pytest

import wsarena
from wsarena import cudnn
from wsarena.errors import (
    ArenaOutOfMemoryError,
    BackendUnavailableError,
    NoAlgorithmFitsError,
    WorkspaceCapError,
    WsarenaError,
)


def test_one_class_per_status():
    canonical = [m for m in cudnn.Status if m is not cudnn.Status.SUCCESS]
    assert set(cudnn.STATUS_ERRORS) == {m.value for m in canonical}
    assert len({cls.__name__ for cls in cudnn.STATUS_ERRORS.values()}) == len(canonical)
    for member in canonical:
        cls = cudnn.error_class(member)
        assert issubclass(cls, cudnn.CudnnError)
        assert f"CUDNN_STATUS_{member.name}" in cls.__doc__
        assert getattr(cudnn, cls.__name__) is cls
    # Deprecated aliases share their canonical status's class.
    assert cudnn.error_class(cudnn.Status.ALLOC_FAILED) is cudnn.error_class(4003)


def test_class_names():
    assert cudnn.error_class(2000).__name__ == "CudnnBadParamError"
    assert cudnn.error_class(3000).__name__ == "CudnnNotSupportedError"
    assert cudnn.error_class(1001).__name__ == "CudnnNotInitializedError"
    assert cudnn.error_class(4000).__name__ == "CudnnInternalError"
    assert cudnn.error_class(2002).__name__ == "CudnnBadParamNullPointerError"


def test_specific_statuses_derive_from_their_category():
    assert issubclass(cudnn.CudnnBadParamNullPointerError, cudnn.CudnnBadParamError)
    assert issubclass(cudnn.CudnnNotSupportedShapeError, cudnn.CudnnNotSupportedError)
    assert issubclass(cudnn.CudnnExecutionFailedCudartError, cudnn.CudnnExecutionFailedError)
    assert issubclass(cudnn.CudnnInternalErrorHostAllocationFailedError, cudnn.CudnnInternalError)
    assert cudnn.CudnnNotInitializedError.__bases__ == (cudnn.CudnnError,)  # no 1000 category status
    assert not issubclass(cudnn.CudnnNotSupportedError, cudnn.CudnnBadParamError)


def test_only_the_allocation_failures_are_memory_errors():
    """cuDNN's failure to allocate host or device memory (ALLOC_FAILED is the first) is a MemoryError too, as CuPy's
    out of memory is, so that the ops run the next algorithm; no other status is."""
    memory = {value for value, cls in cudnn.STATUS_ERRORS.items() if issubclass(cls, MemoryError)}
    status = cudnn.Status
    assert memory == {status.INTERNAL_ERROR_HOST_ALLOCATION_FAILED, status.INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED}
    err = cudnn.CudnnError(int(cudnn.Status.ALLOC_FAILED), "no host memory")
    assert isinstance(err, MemoryError) and isinstance(err, cudnn.CudnnInternalError)
    assert type(pickle.loads(pickle.dumps(err))) is type(err)


def test_base_class_picks_the_subclass():
    err = cudnn.CudnnError(2008, "shapes differ")
    assert type(err) is cudnn.CudnnBadParamShapeMismatchError
    assert err.status is cudnn.Status.BAD_PARAM_SHAPE_MISMATCH and str(err) == "shapes differ"
    unknown = cudnn.CudnnError(7777)
    assert type(unknown) is cudnn.CudnnError and unknown.status == 7777
    assert "7777" in str(unknown)
    assert isinstance(err, WsarenaError) and isinstance(err, RuntimeError)


def test_check_passes_success_and_raises_the_rest():
    assert cudnn.check(0, "cudnnAnything") is None
    cudnn.bind_all() if cudnn.library_info()["found"] else None
    with pytest.raises(cudnn.CudnnNotSupportedShapeError) as info:
        cudnn.check(3002, "cudnnSomething", "x (1, 2, 3, 4)")
    err = info.value
    assert err.func_name == "cudnnSomething" and err.context == "x (1, 2, 3, 4)"
    text = str(err)
    assert "cudnnSomething" in text and "CUDNN_STATUS_NOT_SUPPORTED_SHAPE" in text and "x (1, 2, 3, 4)" in text
    if cudnn.library_info()["found"]:
        # cudnnGetErrorString's own text is part of the message.
        assert text.count("CUDNN_STATUS_NOT_SUPPORTED_SHAPE") >= 2


def test_a_context_function_is_called_only_for_an_error():
    calls = []

    def context() -> str:
        calls.append(1)
        return "x (1, 2, 3, 4), algo FFT"

    assert cudnn.check(0, "cudnnConvolutionForward", context) is None
    assert calls == []  # success: nothing formatted
    with pytest.raises(cudnn.CudnnBadParamError) as info:
        cudnn.check(2000, "cudnnConvolutionForward", context)
    assert calls == [1]
    assert info.value.context == "x (1, 2, 3, 4), algo FFT" and "[x (1, 2, 3, 4), algo FFT]" in str(info.value)


def test_errors_pickle():
    err = cudnn.CudnnError(2000, "message", "cudnnFoo", "ctx")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cudnn.CudnnBadParamError
    assert (back.status, str(back), back.func_name, back.context) == (err.status, "message", "cudnnFoo", "ctx")
    gpu = cudnn.CudnnGpuUnavailableError(1001, "no GPU", "cudnnCreate")
    assert type(pickle.loads(pickle.dumps(gpu))) is cudnn.CudnnGpuUnavailableError
    missing = cudnn.CudnnNotFoundError([("/opt/cudnn", "no such file")])
    back = pickle.loads(pickle.dumps(missing))
    assert type(back) is cudnn.CudnnNotFoundError and back.tried == missing.tried and str(back) == str(missing)


@pytest.mark.parametrize("cls", [WorkspaceCapError, ArenaOutOfMemoryError, NoAlgorithmFitsError])
def test_memory_errors_pickle_with_their_numbers(cls):
    err = cls("no room", requested=4096, held=1024, cap=None)
    err.add_note("tried 3 algorithms")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls and str(back) == str(err)
    assert (back.requested, back.held, back.cap, back.__notes__) == (4096, 1024, None, ["tried 3 algorithms"])


def test_every_error_wsarena_errors_exports_pickles_as_itself():
    """Each exception class of wsarena.errors comes back from a pickle (a worker process's error reaching its parent)
    as itself, with its message and attributes: those taking the message alone by Exception's own pickling, the
    memory errors by their __reduce__. A class given an __init__ of other arguments and no __reduce__ fails here."""
    from wsarena import errors

    classes = [getattr(errors, name) for name in errors.__all__]
    classes = [cls for cls in classes if issubclass(cls, Exception) and not issubclass(cls, Warning)]
    assert errors.ArenaClosedError in classes and errors.CaptureError in classes
    for cls in classes:
        if issubclass(cls, errors.WorkspaceMemoryError):
            err = cls("no room", requested=4096, held=1024, cap=None)
        else:
            err = cls("what went wrong")
        if cls is errors.CaptureError:
            err.stream = 0x51  # set where a growth was refused
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is cls and str(back) == str(err) and vars(back) == vars(err), cls


def test_environment_errors_are_backend_unavailable():
    for cls in (cudnn.CudnnNotFoundError, cudnn.CudnnVersionError, cudnn.CudnnSymbolError,
                cudnn.CudnnGpuUnavailableError):
        assert issubclass(cls, BackendUnavailableError)
    assert issubclass(cudnn.CudnnGpuUnavailableError, cudnn.CudnnError)
    err = cudnn.CudnnNotFoundError([("here", "not there"), ("there", "no such file")])
    assert err.tried == [("here", "not there"), ("there", "no such file")]
    assert "here: not there" in str(err) and "there: no such file" in str(err)


def test_public_names():
    assert cudnn.__all__ == sorted(cudnn.__all__)
    for name in cudnn.__all__:
        assert hasattr(cudnn, name), name
    assert wsarena.cudnn is cudnn
    for name in ("bind_all", "library_info", "get_handle", "TensorDescriptor", "FilterDescriptor",
                 "ConvolutionDescriptor", "data_type", "workspace_size", "heuristic_algorithms", "find_algorithms",
                 "convolution", "AlgoPerf", "CudnnError", "CudnnBadParamError", "Status", "ConvolutionFwdAlgo"):
        assert name in cudnn.__all__, name
    # Every generated status class is public, and nothing public is left out of __all__.
    assert {cls.__name__ for cls in cudnn.STATUS_ERRORS.values()} <= set(cudnn.__all__)
    public = {name for name in vars(cudnn) if not name.startswith("_")} - {"annotations"}
    modules = {name for name in public if type(getattr(cudnn, name)).__name__ == "module"}
    assert public - modules == set(cudnn.__all__)


@pytest.mark.skipif(not cudnn.library_info()["found"], reason="libcudnn not loadable")
def test_an_error_does_not_carry_a_message_an_earlier_call_left_unread():
    lib = cudnn.bind_all()
    desc = ctypes.c_void_p()
    assert lib.cudnnCreateTensorDescriptor(ctypes.byref(desc)) == 0
    dims, strides = (ctypes.c_int * 4)(1, -2, 3, 4), (ctypes.c_int * 4)(1, 1, 1, 1)
    # A raw call (as another library sharing libcudnn makes) fails and leaves its message unread.
    assert lib.cudnnSetTensorNdDescriptor(desc, 0, 4, dims, strides) == int(cudnn.Status.BAD_PARAM)
    assert lib.cudnnDestroyTensorDescriptor(desc) == 0  # a success does not clear it
    with pytest.raises(cudnn.CudnnNotSupportedError) as info:  # fails without a message of its own
        cudnn.TensorDescriptor("float32", (1,) * 9)
    assert "invalid size -2" not in str(info.value)
