"""ctypes bindings to cuDNN 9 (layer 1 of wsarena): loading, enums, structs, errors, descriptors, handles.

Importing this package loads nothing: libcudnn is found and loaded on first use, so everything imports on a
machine without cuDNN or a GPU. Search order (details in :mod:`wsarena.cudnn._library`): first
``$CUDNN_PATH/lib/libcudnn.so.9`` (or ``lib64``), unless a libcudnn.so.9 is already loaded in the process; then
cuda.pathfinder's ``load_nvidia_dynamic_lib("cudnn")``, which tries a copy already loaded, the nvidia-cudnn wheel,
conda, the system loader, ``$CUDNN_PATH`` and ``$CUDA_PATH``. Only cuDNN 9 is accepted.

- :func:`bind_all` loads libcudnn, declares every function of :data:`PROTOTYPES` and returns the ``ctypes.CDLL``;
  :func:`library_info` reports what was found (for ``wsarena info``) and never raises.
- Enums generated from the headers (``tools/gen_cudnn_enums.py``): :class:`Status`, :class:`DataType`,
  :class:`TensorFormat`, :class:`ConvolutionMode`, :class:`MathType`, :class:`Determinism`,
  :class:`ConvolutionFwdAlgo`, :class:`ConvolutionBwdDataAlgo`, :class:`ConvolutionBwdFilterAlgo`.
- Errors: :class:`CudnnError` with one subclass per status (``CudnnBadParamError``, ...), raised by :func:`check`;
  :class:`CudnnNotFoundError`, :class:`CudnnVersionError`, :class:`CudnnSymbolError` and
  :class:`CudnnGpuUnavailableError` are :class:`~wsarena.errors.BackendUnavailableError`.
- Descriptors (no GPU needed): :class:`TensorDescriptor`, :class:`FilterDescriptor`,
  :class:`ConvolutionDescriptor`; :func:`data_type` for a dtype name.
- Handles (GPU): :func:`get_handle` per device and host thread, :meth:`Handle.set_stream`.
- Convolution calls (GPU): :func:`workspace_size`, :func:`heuristic_algorithms`, :func:`find_algorithms`,
  :func:`convolution`, each returning plain ints or frozen :class:`AlgoPerf` records.
"""

from __future__ import annotations

from ._enums import (
    C_NAMES,
    C_TYPEDEFS,
    HEADER_VERSION,
    ConvolutionBwdDataAlgo,
    ConvolutionBwdFilterAlgo,
    ConvolutionFwdAlgo,
    ConvolutionMode,
    DataType,
    Determinism,
    MathType,
    Status,
    TensorFormat,
)
from ._errors import (
    STATUS_ERRORS,
    CudnnError,
    CudnnGpuUnavailableError,
    CudnnNotFoundError,
    CudnnSymbolError,
    CudnnVersionError,
    check,
    error_class,
    status_message,
)
from ._errors import __all__ as _errors_all
from ._library import LoadedLibrary, library_info, load_library
from ._prototypes import PROTOTYPES, LibraryProperty, bind_all, function, get_property
from ._structs import (
    AlgoPerf,
    ConvolutionBwdDataAlgoPerfStruct,
    ConvolutionBwdFilterAlgoPerfStruct,
    ConvolutionFwdAlgoPerfStruct,
)
from .conv import ALGORITHMS, algorithm, algorithms, convolution, find_algorithms, heuristic_algorithms, workspace_size
from .descriptors import (
    DATA_TYPES,
    ConvolutionDescriptor,
    FilterDescriptor,
    TensorDescriptor,
    data_type,
)
from .handle import Handle, close_all_handles, get_handle

# The per-status classes (CudnnBadParamError, CudnnNotSupportedError, ...) are generated in _errors.
globals().update({cls.__name__: cls for cls in STATUS_ERRORS.values()})

__all__ = sorted(
    {
        "ALGORITHMS",
        "C_NAMES",
        "C_TYPEDEFS",
        "DATA_TYPES",
        "HEADER_VERSION",
        "PROTOTYPES",
        "AlgoPerf",
        "ConvolutionBwdDataAlgo",
        "ConvolutionBwdDataAlgoPerfStruct",
        "ConvolutionBwdFilterAlgo",
        "ConvolutionBwdFilterAlgoPerfStruct",
        "ConvolutionDescriptor",
        "ConvolutionFwdAlgo",
        "ConvolutionFwdAlgoPerfStruct",
        "ConvolutionMode",
        "DataType",
        "Determinism",
        "FilterDescriptor",
        "Handle",
        "LibraryProperty",
        "LoadedLibrary",
        "MathType",
        "Status",
        "TensorDescriptor",
        "TensorFormat",
        "algorithm",
        "algorithms",
        "bind_all",
        "close_all_handles",
        "convolution",
        "data_type",
        "find_algorithms",
        "function",
        "get_handle",
        "get_property",
        "heuristic_algorithms",
        "library_info",
        "load_library",
        "workspace_size",
        *_errors_all,
    }
)

del _errors_all
