"""The C prototypes of every cuDNN function wsarena calls, and their binding to the loaded library.

:data:`PROTOTYPES` is the one declarative table (name -> restype, argtypes). A function is declared on the
library the first time :func:`function` asks for it (so a symbol missing from an old libcudnn fails only when
that function is used, as :class:`~wsarena.cudnn.CudnnSymbolError`), or all at once by :func:`bind_all`.
A test checks every entry against the prototypes parsed from the shipped headers.

C types map to ctypes as follows: ``cudnnStatus_t`` and every other enum -> ``c_int``; opaque handles and
descriptors, ``cudaStream_t``, ``void *`` -> ``c_void_p``; ``T *`` and ``T[]`` -> ``POINTER(T)``; ``size_t`` ->
``c_size_t``; ``const char *`` -> ``c_char_p``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from enum import IntEnum
from typing import Any

from .. import _forksafe
from . import _errors
from ._errors import CudnnSymbolError, check
from ._library import LoadedLibrary, load_library
from ._owned import Owned
from ._structs import ConvolutionBwdDataAlgoPerfStruct, ConvolutionBwdFilterAlgoPerfStruct, ConvolutionFwdAlgoPerfStruct

__all__ = ["OPTIONAL", "PROTOTYPES", "LibraryProperty", "available", "bind_all", "call", "function", "get_property"]


class LibraryProperty(IntEnum):
    """``libraryPropertyType`` from CUDA's ``library_types.h``, the argument of ``cudnnGetProperty``."""

    MAJOR_VERSION = 0
    MINOR_VERSION = 1
    PATCH_LEVEL = 2


_P = ctypes.POINTER
_status = ctypes.c_int  # cudnnStatus_t
_enum = ctypes.c_int  # any cudnn*_t enumeration, passed by value
_opaque = ctypes.c_void_p  # cudnnHandle_t, cudnn*Descriptor_t, cudaStream_t, device and host void pointers
_int = ctypes.c_int
_size = ctypes.c_size_t
_out_int = _P(ctypes.c_int)  # int *, int[], const int[], and pointers to enums written back
_out_size = _P(ctypes.c_size_t)
_out_opaque = _P(ctypes.c_void_p)  # cudnnHandle_t *, cudnn*Descriptor_t *, cudaStream_t *
_int64 = ctypes.c_int64
_out_int64 = _P(ctypes.c_int64)
_fwd_perf = _P(ConvolutionFwdAlgoPerfStruct)
_bwd_data_perf = _P(ConvolutionBwdDataAlgoPerfStruct)
_bwd_filter_perf = _P(ConvolutionBwdFilterAlgoPerfStruct)

Prototype = tuple[type[Any] | None, tuple[type[Any], ...]]  # (restype, None for void; argtypes): ctypes types
_Function = Callable[..., Any]  # a declared ctypes function

# name -> (restype, argtypes), grouped by the header that declares it. Argument names in the comments are the
# header's.
PROTOTYPES: dict[str, Prototype] = {
    # cudnn_graph.h: library, errors, handles
    "cudnnGetVersion": (_size, ()),
    "cudnnGetCudartVersion": (_size, ()),
    "cudnnGetErrorString": (ctypes.c_char_p, (_enum,)),  # (status)
    "cudnnGetLastErrorString": (None, (ctypes.c_char_p, _size)),  # (message, max_size)
    "cudnnGetProperty": (_status, (_enum, _out_int)),  # (type, value)
    "cudnnCreate": (_status, (_out_opaque,)),  # (handle)
    "cudnnDestroy": (_status, (_opaque,)),  # (handle)
    "cudnnSetStream": (_status, (_opaque, _opaque)),  # (handle, streamId)
    "cudnnGetStream": (_status, (_opaque, _out_opaque)),  # (handle, streamId)
    # cudnn_ops.h: tensor descriptors
    "cudnnCreateTensorDescriptor": (_status, (_out_opaque,)),
    "cudnnSetTensor4dDescriptor": (_status, (_opaque, _enum, _enum, _int, _int, _int, _int)),  # format, type, nchw
    "cudnnSetTensorNdDescriptor": (_status, (_opaque, _enum, _int, _out_int, _out_int)),  # type, nbDims, dim, stride
    "cudnnGetTensorNdDescriptor": (_status, (_opaque, _int, _out_int, _out_int, _out_int, _out_int)),
    "cudnnGetTensorSizeInBytes": (_status, (_opaque, _out_size)),
    "cudnnDestroyTensorDescriptor": (_status, (_opaque,)),
    # cudnn_ops.h: filter descriptors
    "cudnnCreateFilterDescriptor": (_status, (_out_opaque,)),
    "cudnnSetFilterNdDescriptor": (_status, (_opaque, _enum, _enum, _int, _out_int)),  # type, format, nbDims, dims
    "cudnnGetFilterNdDescriptor": (_status, (_opaque, _int, _out_int, _out_int, _out_int, _out_int)),
    "cudnnDestroyFilterDescriptor": (_status, (_opaque,)),
    # cudnn_cnn.h: convolution descriptors
    "cudnnCreateConvolutionDescriptor": (_status, (_out_opaque,)),
    # (convDesc, arrayLength, padA, filterStrideA, dilationA, mode, computeType)
    "cudnnSetConvolutionNdDescriptor": (_status, (_opaque, _int, _out_int, _out_int, _out_int, _enum, _enum)),
    # (convDesc, arrayLengthRequested, arrayLength, padA, strideA, dilationA, mode, computeType)
    "cudnnGetConvolutionNdDescriptor": (
        _status,
        (_opaque, _int, _out_int, _out_int, _out_int, _out_int, _out_int, _out_int),
    ),
    "cudnnSetConvolutionGroupCount": (_status, (_opaque, _int)),
    "cudnnGetConvolutionGroupCount": (_status, (_opaque, _out_int)),
    "cudnnSetConvolutionMathType": (_status, (_opaque, _enum)),
    "cudnnGetConvolutionMathType": (_status, (_opaque, _out_int)),
    "cudnnDestroyConvolutionDescriptor": (_status, (_opaque,)),
    # (convDesc, inputTensorDesc, filterDesc, nbDims, tensorOuputDimA)
    "cudnnGetConvolutionNdForwardOutputDim": (_status, (_opaque, _opaque, _opaque, _int, _out_int)),
    # cudnn_cnn.h: workspace sizes (handle, 4 descriptors, algo, sizeInBytes)
    "cudnnGetConvolutionForwardWorkspaceSize": (
        _status,
        (_opaque, _opaque, _opaque, _opaque, _opaque, _enum, _out_size),
    ),
    "cudnnGetConvolutionBackwardDataWorkspaceSize": (
        _status,
        (_opaque, _opaque, _opaque, _opaque, _opaque, _enum, _out_size),
    ),
    "cudnnGetConvolutionBackwardFilterWorkspaceSize": (
        _status,
        (_opaque, _opaque, _opaque, _opaque, _opaque, _enum, _out_size),
    ),
    # cudnn_cnn.h: algorithm counts (handle, count)
    "cudnnGetConvolutionForwardAlgorithmMaxCount": (_status, (_opaque, _out_int)),
    "cudnnGetConvolutionBackwardDataAlgorithmMaxCount": (_status, (_opaque, _out_int)),
    "cudnnGetConvolutionBackwardFilterAlgorithmMaxCount": (_status, (_opaque, _out_int)),
    # cudnn_cnn.h: heuristics (handle, 4 descriptors, requestedAlgoCount, returnedAlgoCount, perfResults)
    "cudnnGetConvolutionForwardAlgorithm_v7": (
        _status,
        (_opaque, _opaque, _opaque, _opaque, _opaque, _int, _out_int, _fwd_perf),
    ),
    "cudnnGetConvolutionBackwardDataAlgorithm_v7": (
        _status,
        (_opaque, _opaque, _opaque, _opaque, _opaque, _int, _out_int, _bwd_data_perf),
    ),
    "cudnnGetConvolutionBackwardFilterAlgorithm_v7": (
        _status,
        (_opaque, _opaque, _opaque, _opaque, _opaque, _int, _out_int, _bwd_filter_perf),
    ),
    # cudnn_cnn.h: timed search in a caller-provided workspace
    # (handle, desc, ptr, desc, ptr, convDesc, desc, ptr, requestedAlgoCount, returnedAlgoCount, perfResults,
    #  workSpace, workSpaceSizeInBytes)
    "cudnnFindConvolutionForwardAlgorithmEx": (
        _status,
        (_opaque, _opaque, _opaque, _opaque, _opaque, _opaque, _opaque, _opaque, _int, _out_int, _fwd_perf,
         _opaque, _size),
    ),
    "cudnnFindConvolutionBackwardDataAlgorithmEx": (
        _status,
        (_opaque, _opaque, _opaque, _opaque, _opaque, _opaque, _opaque, _opaque, _int, _out_int, _bwd_data_perf,
         _opaque, _size),
    ),
    "cudnnFindConvolutionBackwardFilterAlgorithmEx": (
        _status,
        (_opaque, _opaque, _opaque, _opaque, _opaque, _opaque, _opaque, _opaque, _int, _out_int, _bwd_filter_perf,
         _opaque, _size),
    ),
    # cudnn_cnn.h: the convolutions
    # (handle, alpha, desc, ptr, desc, ptr, convDesc, algo, workSpace, workSpaceSizeInBytes, beta, desc, ptr)
    "cudnnConvolutionForward": (
        _status,
        (_opaque, _opaque, _opaque, _opaque, _opaque, _opaque, _opaque, _enum, _opaque, _size, _opaque, _opaque,
         _opaque),
    ),
    "cudnnConvolutionBackwardData": (
        _status,
        (_opaque, _opaque, _opaque, _opaque, _opaque, _opaque, _opaque, _enum, _opaque, _size, _opaque, _opaque,
         _opaque),
    ),
    "cudnnConvolutionBackwardFilter": (
        _status,
        (_opaque, _opaque, _opaque, _opaque, _opaque, _opaque, _opaque, _enum, _opaque, _size, _opaque, _opaque,
         _opaque),
    ),
    # cudnn_graph.h: the backend (graph) API
    "cudnnBackendCreateDescriptor": (_status, (_enum, _out_opaque)),  # (descriptorType, descriptor)
    "cudnnBackendDestroyDescriptor": (_status, (_opaque,)),  # (descriptor)
    "cudnnBackendFinalize": (_status, (_opaque,)),  # (descriptor)
    # (descriptor, attributeName, attributeType, elementCount, arrayOfElements)
    "cudnnBackendSetAttribute": (_status, (_opaque, _enum, _enum, _int64, _opaque)),
    # (descriptor, attributeName, attributeType, requestedElementCount, elementCount, arrayOfElements)
    "cudnnBackendGetAttribute": (_status, (_opaque, _enum, _enum, _int64, _out_int64, _opaque)),
    "cudnnBackendExecute": (_status, (_opaque, _opaque, _opaque)),  # (handle, executionPlan, variantPack)
    # (handle, executionPlan, variantPack, workspaceSizeInBytes); cuDNN 9.23+, see OPTIONAL
    "cudnnGetExecutionPlanWorkspaceSize": (_status, (_opaque, _opaque, _opaque, _out_size)),
}

# Functions of PROTOTYPES that an older cuDNN 9 lacks (name -> the first version that has it): bind_all() skips
# them where missing, and their callers ask available() first. The parity tests check them where the headers
# declare them.
OPTIONAL: dict[str, int] = {"cudnnGetExecutionPlanWorkspaceSize": 92300}

# Guards _bound and the one-time install of the error describers. Reentrant: a garbage collection while this
# thread holds it (in _declare) may run a descriptor's finalizer, which binds its Destroy function here.
_lock = _forksafe.rlock()
_bound: dict[str, _Function] = {}
_describers_installed = False


def _declare(lib: ctypes.CDLL, path: str, version: str, name: str) -> _Function:
    restype, argtypes = PROTOTYPES[name]
    try:
        fn = getattr(lib, name)
    except AttributeError:
        raise CudnnSymbolError(f"{path} (cuDNN {version}) does not export {name}, which wsarena needs") from None
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


def _library() -> ctypes.CDLL:
    """The loaded library, with cuDNN's error texts hooked into :func:`check` on first use."""
    loaded = load_library()
    if not _describers_installed:
        with _lock:
            if not _describers_installed:
                _declare_describers(loaded)
    return loaded.cdll


def _declare_describers(loaded: LoadedLibrary) -> None:
    """Declare cuDNN's error-text functions and, where both are exported, have :func:`_errors._install_describers`
    hook them into :func:`check`, under ``_lock``: its own function, for the loop's jump back
    (:mod:`wsarena.arena._interrupts`, rule 8)."""
    global _describers_installed
    for name in ("cudnnGetErrorString", "cudnnGetLastErrorString"):
        try:
            _bound[name] = _declare(loaded.cdll, loaded.path, loaded.version_string, name)
        except CudnnSymbolError:
            pass  # errors then carry no cuDNN text; the call that needs it will say so
    if "cudnnGetErrorString" in _bound and "cudnnGetLastErrorString" in _bound:
        _errors._install_describers(loaded.cdll)
    _describers_installed = True


def function(name: str) -> _Function:
    """The declared ctypes function ``name`` (an entry of :data:`PROTOTYPES`), loading libcudnn if needed.

    Raises
    ------
    KeyError
        ``name`` is not in :data:`PROTOTYPES`.
    CudnnSymbolError
        The loaded libcudnn does not export ``name``.
    """
    fn = _bound.get(name)
    if fn is not None:
        return fn
    if name not in PROTOTYPES:
        raise KeyError(f"{name} is not in wsarena.cudnn's prototype table")
    lib = _library()
    loaded = load_library()
    with _lock:
        fn = _bound.get(name)
        if fn is None:
            fn = _bound[name] = _declare(lib, loaded.path, loaded.version_string, name)
    return fn


# Called once per convolution: clearing cuDNN's last-error message before them would add a ctypes call to each.
# Their failures may then carry a message another caller left unread.
_NOT_CLEARED = frozenset(
    ("cudnnSetStream", "cudnnConvolutionForward", "cudnnConvolutionBackwardData", "cudnnConvolutionBackwardFilter",
     "cudnnBackendExecute")
)


def call(name: str, *args: object, context: str | Callable[[], str] = "") -> None:
    """Call the cuDNN function ``name`` and raise its :class:`~wsarena.cudnn.CudnnError` unless it succeeds.

    cuDNN's last-error message is cleared first (except for the per-convolution calls), so that the error
    describes this call and not an earlier one whose message nobody read. ``context`` is text for the error, or
    a function that returns it (called only on failure).
    """
    fn = _bound.get(name)  # function(name)'s own first step, inline: this runs once per convolution
    if fn is None:
        fn = function(name)
    if name not in _NOT_CLEARED:
        _errors.clear_last_error()
    # An owned object's pointer is read here, not by ctypes through its _as_parameter_: ctypes turns whatever that
    # Python code raises, a Ctrl-C's KeyboardInterrupt too, into ArgumentError("argument 1: KeyboardInterrupt: ").
    check(fn(*[arg.handle if isinstance(arg, Owned) else arg for arg in args]), name, context)


def available(name: str) -> bool:
    """Whether the loaded libcudnn exports ``name`` (an entry of :data:`PROTOTYPES`), loading it if needed."""
    try:
        function(name)
    except CudnnSymbolError:
        return False
    return True


def get_property(prop: LibraryProperty) -> int:
    """One part of the loaded library's version (``cudnnGetProperty``): major, minor or patch level."""
    value = ctypes.c_int()
    call("cudnnGetProperty", LibraryProperty(prop), ctypes.byref(value))
    return value.value


def bind_all() -> ctypes.CDLL:
    """Load libcudnn, declare every function of :data:`PROTOTYPES` on it, and return the ``ctypes.CDLL``.

    A function of :data:`OPTIONAL` that this cuDNN lacks is left undeclared (calling it raises
    :class:`~wsarena.cudnn.CudnnSymbolError`).

    Raises
    ------
    CudnnNotFoundError, CudnnVersionError
        libcudnn 9 cannot be loaded.
    CudnnSymbolError
        Naming every function of the table the library does not export.
    """
    lib = _library()
    missing = []
    for name in PROTOTYPES:
        try:
            function(name)
        except CudnnSymbolError:
            if name not in OPTIONAL:
                missing.append(name)
    if missing:
        loaded = load_library()
        raise CudnnSymbolError(
            f"{loaded.path} (cuDNN {loaded.version_string}) does not export {', '.join(missing)}, which wsarena needs"
        )
    return lib


def _reset() -> None:
    """Forget the declared functions (for tests that swap the library search)."""
    global _describers_installed
    with _lock:
        _bound.clear()
        _describers_installed = False
