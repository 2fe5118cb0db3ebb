"""Thin typed wrappers of the legacy convolution calls the cuDNN backend makes. They all need a GPU.

Every wrapper takes the pass first (a :class:`~wsarena._pass.Pass` or its name: ``"fwd"``, ``"bwd_data"``,
``"bwd_filter"``), and the same three descriptors whatever the pass, named after the forward convolution
``y = conv(x, w)``:

==========  ======================  ===========================  ============================
argument    ``"fwd"``               ``"bwd_data"``               ``"bwd_filter"``
==========  ======================  ===========================  ============================
``x_desc``  input x (read)          input gradient dx (written)  input x (read)
``w_desc``  filter w (read)         filter w (read)              filter gradient dw (written)
``y_desc``  output y (written)      output gradient dy (read)    output gradient dy (read)
==========  ======================  ===========================  ============================

Each wrapper reorders them into the C function's own argument order (``Pass.cudnn_order``). Pointers are raw device
addresses (ints); handles and descriptors are the objects of :mod:`wsarena.cudnn.handle` and
:mod:`wsarena.cudnn.descriptors`.
"""

from __future__ import annotations

import ctypes
import dataclasses
from enum import IntEnum
from typing import Any

from .._pass import Pass
from ._enums import ConvolutionBwdDataAlgo, ConvolutionBwdFilterAlgo, ConvolutionFwdAlgo, DataType
from ._prototypes import call
from ._structs import (
    AlgoPerf,
    ConvolutionBwdDataAlgoPerfStruct,
    ConvolutionBwdFilterAlgoPerfStruct,
    ConvolutionFwdAlgoPerfStruct,
)
from .descriptors import ConvolutionDescriptor, FilterDescriptor, TensorDescriptor
from .handle import Handle

__all__ = [
    "ALGORITHMS",
    "algorithm",
    "algorithms",
    "convolution",
    "find_algorithms",
    "heuristic_algorithms",
    "workspace_size",
]


@dataclasses.dataclass(frozen=True)
class _Pass:
    algo_enum: type[IntEnum]
    perf_struct: type[ctypes.Structure]
    workspace_size: str
    max_count: str
    heuristic: str
    find_ex: str
    run: str


_PASSES: dict[str, _Pass] = {
    Pass.FWD: _Pass(
        ConvolutionFwdAlgo,
        ConvolutionFwdAlgoPerfStruct,
        "cudnnGetConvolutionForwardWorkspaceSize",
        "cudnnGetConvolutionForwardAlgorithmMaxCount",
        "cudnnGetConvolutionForwardAlgorithm_v7",
        "cudnnFindConvolutionForwardAlgorithmEx",
        "cudnnConvolutionForward",
    ),
    Pass.BWD_DATA: _Pass(
        ConvolutionBwdDataAlgo,
        ConvolutionBwdDataAlgoPerfStruct,
        "cudnnGetConvolutionBackwardDataWorkspaceSize",
        "cudnnGetConvolutionBackwardDataAlgorithmMaxCount",
        "cudnnGetConvolutionBackwardDataAlgorithm_v7",
        "cudnnFindConvolutionBackwardDataAlgorithmEx",
        "cudnnConvolutionBackwardData",
    ),
    Pass.BWD_FILTER: _Pass(
        ConvolutionBwdFilterAlgo,
        ConvolutionBwdFilterAlgoPerfStruct,
        "cudnnGetConvolutionBackwardFilterWorkspaceSize",
        "cudnnGetConvolutionBackwardFilterAlgorithmMaxCount",
        "cudnnGetConvolutionBackwardFilterAlgorithm_v7",
        "cudnnFindConvolutionBackwardFilterAlgorithmEx",
        "cudnnConvolutionBackwardFilter",
    ),
}

# pass -> its algorithm enum.
ALGORITHMS: dict[str, type[IntEnum]] = {name: spec.algo_enum for name, spec in _PASSES.items()}


def _spec(pass_: str) -> _Pass:
    # a member or its name is found as it is (Pass(name) costs more than the lookup); anything else Pass() refuses
    found = _PASSES.get(pass_) if isinstance(pass_, str) else None
    return found if found is not None else _PASSES[Pass(pass_)]


def algorithm(pass_: str, value: int | str) -> IntEnum:
    """The algorithm enum member of ``pass_`` for a value or a member name (``algorithm("fwd", "FFT")``)."""
    enum = _spec(pass_).algo_enum
    return enum[value] if isinstance(value, str) else enum(value)


def algorithms(pass_: str) -> list[IntEnum]:
    """Every real algorithm of ``pass_``, in enum order (``COUNT`` left out)."""
    return [member for member in _spec(pass_).algo_enum if member.name != "COUNT"]


def _in_c_order(pass_: str, x: Any, w: Any, y: Any) -> tuple[Any, Any, Any]:
    """x, w and y (descriptors, or (descriptor, pointer) pairs) in the C argument order of ``pass_``:
    first input, second input, written tensor. The convolution descriptor (and, where the call has them, the
    algorithm, workspace and scale) go between the inputs and the written tensor::

        fwd        (xDesc, x, wDesc, w,   convDesc, ..., yDesc, y)
        bwd_data   (wDesc, w, dyDesc, dy, convDesc, ..., dxDesc, dx)
        bwd_filter (xDesc, x, dyDesc, dy, convDesc, ..., dwDesc, dw)
    """
    order = _C_ORDER.get(pass_) if isinstance(pass_, str) else None
    first, second, written = order if order is not None else _C_ORDER[Pass(pass_)]
    xwy = (x, w, y)
    return xwy[first], xwy[second], xwy[written]


# Where cuDNN's first input, second input and written tensor stand in (x, w, y), per pass
_C_ORDER: dict[str, tuple[int, int, int]] = {
    p: ("xwy".index(p.cudnn_order[0]), "xwy".index(p.cudnn_order[1]), "xwy".index(p.cudnn_order[2])) for p in Pass
}


def _context(pass_: str, x_desc, w_desc, conv_desc, y_desc) -> str:
    return f"{pass_}: x {x_desc.shape}, w {w_desc.shape}, y {y_desc.shape}, {conv_desc!r}"


def workspace_size(
    pass_: str,
    handle: Handle,
    x_desc: TensorDescriptor,
    w_desc: FilterDescriptor,
    conv_desc: ConvolutionDescriptor,
    y_desc: TensorDescriptor,
    algo: int,
) -> int:
    """Workspace bytes ``algo`` needs for this convolution.

    C: ``cudnnGetConvolutionForwardWorkspaceSize``, ``cudnnGetConvolutionBackwardDataWorkspaceSize`` or
    ``cudnnGetConvolutionBackwardFilterWorkspaceSize``. An algorithm that cannot run this convolution raises
    (usually :class:`~wsarena.cudnn.CudnnNotSupportedError` or :class:`~wsarena.cudnn.CudnnBadParamError`).
    """
    spec = _spec(pass_)
    a, b, c = _in_c_order(pass_, x_desc, w_desc, y_desc)
    size = ctypes.c_size_t()
    algo = spec.algo_enum(algo)
    call(
        spec.workspace_size, handle, a, b, conv_desc, c, algo, ctypes.byref(size),
        context=f"{_context(pass_, x_desc, w_desc, conv_desc, y_desc)}, algo {algo.name}",
    )
    return size.value


def _max_count(spec: _Pass, handle: Handle) -> int:
    count = ctypes.c_int()
    call(spec.max_count, handle, ctypes.byref(count))
    return max(count.value, 1)


def heuristic_algorithms(
    pass_: str,
    handle: Handle,
    x_desc: TensorDescriptor,
    w_desc: FilterDescriptor,
    conv_desc: ConvolutionDescriptor,
    y_desc: TensorDescriptor,
) -> list[AlgoPerf]:
    """cuDNN's heuristic ranking of the algorithms of ``pass_``, expected fastest first; nothing is run or timed.

    C: ``cudnnGet{ConvolutionForward,ConvolutionBackwardData,ConvolutionBackwardFilter}Algorithm_v7`` with as many
    results as ``...AlgorithmMaxCount`` allows. Entries whose ``status`` is not ``SUCCESS`` (``AlgoPerf.ok`` is
    false) cannot run this convolution; ``memory`` is each one's workspace size.
    """
    spec = _spec(pass_)
    a, b, c = _in_c_order(pass_, x_desc, w_desc, y_desc)
    return _ranked(
        spec, handle, spec.heuristic, (a, b, conv_desc, c), (), _context(pass_, x_desc, w_desc, conv_desc, y_desc)
    )


def find_algorithms(
    pass_: str,
    handle: Handle,
    x_desc: TensorDescriptor,
    x_ptr: int,
    w_desc: FilterDescriptor,
    w_ptr: int,
    conv_desc: ConvolutionDescriptor,
    y_desc: TensorDescriptor,
    y_ptr: int,
    workspace_ptr: int,
    workspace_bytes: int,
) -> list[AlgoPerf]:
    """Time the algorithms of ``pass_`` that fit in the given workspace; fastest first.

    C: ``cudnnFind{ConvolutionForward,ConvolutionBackwardData,ConvolutionBackwardFilter}AlgorithmEx``, the
    variant that uses the caller's workspace and never allocates. It runs real kernels on the handle's stream and
    synchronizes; the written tensor of the pass (y, dx or dw, see the module docstring) is overwritten with
    garbage. Entries whose ``status`` is not ``SUCCESS`` did not run.
    """
    spec = _spec(pass_)
    first, second, written = _in_c_order(pass_, (x_desc, x_ptr), (w_desc, w_ptr), (y_desc, y_ptr))
    return _ranked(
        spec, handle, spec.find_ex, (*first, *second, conv_desc, *written),
        (workspace_ptr or None, int(workspace_bytes)),
        f"{_context(pass_, x_desc, w_desc, conv_desc, y_desc)}, workspace {int(workspace_bytes)} bytes",
    )


def _ranked(
    spec: _Pass, handle: Handle, function: str, before: tuple[Any, ...], after: tuple[Any, ...], context: str
) -> list[AlgoPerf]:
    """What ``function`` (a ``_v7`` heuristic or a ``FindEx`` search) ranks, fastest first: it takes the handle, then
    ``before``, then room for as many results as the pass has algorithms, then ``after``."""
    n = _max_count(spec, handle)
    results = (spec.perf_struct * n)()
    returned = ctypes.c_int()
    call(function, handle, *before, n, ctypes.byref(returned), results, *after, context=context)
    return [AlgoPerf.from_struct(results[i]) for i in range(returned.value)]


def _scale(value: float, data: DataType) -> ctypes.c_float | ctypes.c_double:
    # cuDNN reads alpha/beta as double for double data and as float for every other data type.
    return ctypes.c_double(value) if data == DataType.DOUBLE else ctypes.c_float(value)


# alpha 1 and beta 0, every convolution's, as the pointers cuDNN reads them through (it only reads them, during the
# call): made once per width, where each call made two scalars and their pointers
_UNIT_SCALES = {
    double: (ctypes.byref(_scale(1.0, data)), ctypes.byref(_scale(0.0, data)))
    for double, data in ((False, DataType.FLOAT), (True, DataType.DOUBLE))
}


def convolution(
    pass_: str,
    handle: Handle,
    *,
    x_desc: TensorDescriptor,
    x_ptr: int,
    w_desc: FilterDescriptor,
    w_ptr: int,
    conv_desc: ConvolutionDescriptor,
    y_desc: TensorDescriptor,
    y_ptr: int,
    algo: int,
    workspace_ptr: int = 0,
    workspace_bytes: int = 0,
    alpha: float = 1.0,
    beta: float = 0.0,
    data_type: DataType | None = None,
) -> None:
    """Enqueue one convolution pass on the handle's stream: ``out = alpha * op(inputs) + beta * out``.

    C: ``cudnnConvolutionForward`` (writes y), ``cudnnConvolutionBackwardData`` (writes dx, at ``x_ptr``) or
    ``cudnnConvolutionBackwardFilter`` (writes dw, at ``w_ptr``). ``alpha``/``beta`` are passed as host doubles
    when ``data_type`` (default: ``x_desc.dtype``) is ``DOUBLE``, else as host floats. ``workspace_bytes`` may be
    more than :func:`workspace_size` asks for; the workspace must not be used by another stream meanwhile.
    """
    spec = _spec(pass_)
    if type(algo) is not spec.algo_enum:  # a member, the backend's case, as it is
        algo = spec.algo_enum(algo)
    data = x_desc.dtype if data_type is None else DataType(data_type)
    if alpha == 1.0 and beta == 0.0:
        alpha_p, beta_p = _UNIT_SCALES[data == DataType.DOUBLE]
    else:
        alpha_p, beta_p = ctypes.byref(_scale(alpha, data)), ctypes.byref(_scale(beta, data))
    first, second, written = _in_c_order(pass_, (x_desc, x_ptr), (w_desc, w_ptr), (y_desc, y_ptr))
    call(
        spec.run, handle, alpha_p, *first, *second, conv_desc, algo, workspace_ptr or None,
        int(workspace_bytes), beta_p, *written,
        context=lambda: f"{_context(pass_, x_desc, w_desc, conv_desc, y_desc)}, algo {algo.name}, "
        f"workspace {int(workspace_bytes)} bytes",  # formatted only for an error: this runs once per convolution
    )
