"""The public convolution ops: forward, backward-data and backward-filter.

NumPy arrays run on the ``cpu`` backend, CuPy arrays on ``cudnn``. 1-, 2- or 3-D convolution follows from
``x.ndim`` (3, 4 or 5). Every workspace is leased from the arena's sub-arena for ``stream``; no op allocates
scratch memory of its own. Arguments are checked before any workspace is leased or any work enqueued.

On cuDNN, float16 and bfloat16 are computed in float32 with tensor cores allowed, as PyTorch does.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._config import get_config
from ._geometry import DTYPES, ConvGeometry, conv_geometry
from .algos import forced, run_with_fallback, select
from .backends import Candidate, array_backend_name, get_backend

__all__ = ["conv_backward_data", "conv_backward_filter", "conv_forward"]

# str(dtype) costs microseconds; a dict lookup on the dtype object does not (this runs on every call)
_NAMES = {np.dtype(k): k for k in ("float16", "float32", "float64")}


def _dtype_name(name: str, array: Any) -> str:
    dtype = getattr(array, "dtype", None)
    text = _NAMES.get(dtype) or str(dtype)
    if text not in DTYPES:
        raise TypeError(f"{name} must be a floating-point array (float16, bfloat16, float32 or float64), not {text}")
    return text


class _Uncacheable(Exception):
    pass


def _frozen(value: Any) -> Any:
    """``value`` with lists turned into tuples, so that the arguments of a call can key a cache."""
    kind = type(value)
    if kind is int or kind is str:
        return value
    if kind is tuple or kind is list:
        return tuple(v if type(v) is int else _frozen(v) for v in value)
    if isinstance(value, bool | float):  # equal to ints as keys (True == 1), yet invalid: check them every time
        raise _Uncacheable
    return value


@functools.lru_cache(maxsize=4096)
def _cached_geometry(*args: Any) -> ConvGeometry:
    input_shape, weight_shape, stride, padding, dilation, groups, layout, dtype = args
    return conv_geometry(
        input_shape, weight_shape, stride=stride, padding=padding, dilation=dilation, groups=groups,
        layout=layout, dtype=dtype,
    )


def _geometry(input_shape: Any, weight_shape: Any, params: dict[str, Any], layout: str, dtype: str) -> ConvGeometry:
    """:func:`conv_geometry`, remembered for arguments seen before (a training loop repeats them every step)."""
    try:
        args = (
            _frozen(input_shape), _frozen(weight_shape), _frozen(params["stride"]), _frozen(params["padding"]),
            _frozen(params["dilation"]), _frozen(params["groups"]), layout, dtype,
        )
        hash(args)
    except (_Uncacheable, TypeError):
        return conv_geometry(input_shape, weight_shape, layout=layout, dtype=dtype, **params)
    return _cached_geometry(*args)


def _backend_for(arrays: dict[str, Any]) -> Any:
    kinds = {}
    for name, array in arrays.items():
        kind = array_backend_name(array)
        if kind is None:
            raise TypeError(f"{name} must be a NumPy or CuPy array, not {type(array).__name__}")
        kinds[name] = kind
    if len(set(kinds.values())) > 1:
        detail = ", ".join(f"{n} is {'NumPy' if k == 'cpu' else 'CuPy'}" for n, k in kinds.items())
        raise TypeError(f"cannot mix NumPy and CuPy arrays in one convolution ({detail})")
    kind = next(iter(kinds.values()))
    configured = get_config().backend
    if configured != "auto" and configured != kind:
        raise TypeError(
            f"backend={configured!r} is configured but the arrays are {'NumPy' if kind == 'cpu' else 'CuPy'}; "
            f"pass {'CuPy' if configured == 'cudnn' else 'NumPy'} arrays or configure backend='auto'"
        )
    return get_backend(kind)


def _contiguous(array: Any) -> Any:
    return array if array.flags.c_contiguous else array.copy(order="C")


def _check_out(backend: Any, out: Any, shape: tuple[int, ...], dtype: str, inputs: tuple[Any, ...]) -> None:
    if array_backend_name(out) != backend.name:
        raise TypeError(f"out must be a {'NumPy' if backend.name == 'cpu' else 'CuPy'} array, not {type(out).__name__}")
    if tuple(out.shape) != shape:
        raise ValueError(f"out has shape {tuple(out.shape)}; this convolution writes {shape}")
    if (_NAMES.get(out.dtype) or str(out.dtype)) != dtype:
        raise TypeError(f"out has dtype {out.dtype}; this convolution writes {dtype}")
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")
    if any(backend.may_share_memory(out, array) for array in inputs):
        raise ValueError("out overlaps an input; convolutions cannot run in place")


def _shape_arg(name: str, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, Sequence) or isinstance(shape, str):
        raise TypeError(f"{name} must be a sequence of ints, not {shape!r}")
    return tuple(shape)


def _execute(
    pass_: str, arrays: dict[str, Any], input_shape: Any, weight_shape: Any, params: dict[str, Any],
    out: Any, stream: Any, layout: str, algo: str | None,
) -> Any:
    backend = _backend_for(arrays)
    names = list(arrays)
    dtypes = {name: _dtype_name(name, arrays[name]) for name in names}
    if len(set(dtypes.values())) > 1:
        raise TypeError(f"dtypes differ: {', '.join(f'{n} is {d}' for n, d in dtypes.items())}")
    dtype = dtypes[names[0]]
    backend.check_dtype(dtype)
    geom = _geometry(input_shape, weight_shape, params, layout, dtype)
    a_shape, b_shape, out_shape = geom.operand_shapes(pass_)
    for name, shape in zip(names, (a_shape, b_shape)):
        if tuple(arrays[name].shape) != shape:
            raise ValueError(
                f"{name} has shape {tuple(arrays[name].shape)}; expected {shape} for this convolution "
                f"(input {geom.input_shape}, weight {geom.weight_shape}, layout {layout})"
            )
    operands = tuple(arrays.values())
    if out is not None:
        _check_out(backend, out, out_shape, dtype, operands)
    cfg = get_config()
    chosen = None if algo is None else forced(backend, pass_, geom, algo, cap=cfg.cap_workspace)
    # Everything that touches memory happens on the operands' device with `stream` current, so copies and the
    # convolution are ordered on one stream.
    with backend.context(operands if out is None else (*operands, out), stream):
        result = backend.empty(out_shape, dtype) if out is None else out
        a, b = (_contiguous(x) for x in operands)
        if geom.batch == 0:
            if pass_ == "bwd_filter":
                result[...] = 0
            return result
        _run(backend, pass_, geom, a, b, result, stream, cfg, chosen)
    return result


def _run(
    backend: Any, pass_: str, geom: ConvGeometry, a: Any, b: Any, out: Any, stream: Any, cfg: Any,
    candidates: tuple[Candidate, ...] | None,
) -> None:
    """Choose (unless ``algo=`` already did), lease and run, falling back when the arena cannot grow."""
    if candidates is None:
        candidates = select(
            backend, pass_, geom, cap=cfg.cap_workspace, search=cfg.algo_search, operands=(a, b, out), stream=stream
        )

    def run(cand: Candidate, ws: Any) -> None:
        backend.run(pass_, cand, geom, a, b, out, ws, stream)

    run_with_fallback(backend.arena(), candidates, run, stream=stream, cap=cfg.cap_workspace)


def conv_forward(
    x: Any, w: Any, stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1,
    out: Any = None, stream: Any = None, *, layout: str = "NCHW", algo: str | None = None,
) -> Any:
    """Convolve ``x`` with ``w``: ``y = conv(x, w)``.

    Parameters
    ----------
    x : array
        Input, ``(N, C, *spatial)`` (``layout="NCHW"``) or ``(N, *spatial, C)`` (``"NHWC"``); 1-, 2- or 3-D.
    w : array
        Filters, ``(K, C/groups, *kernel)`` or, channels last, ``(K, *kernel, C/groups)``.
    stride, dilation : int or sequence of int
        One value, or one per spatial dimension; each >= 1.
    padding : int, sequence of int, ``"valid"`` or ``"same"``
        Symmetric zero padding per spatial dimension. ``"same"`` needs stride 1 and an even total padding.
    groups : int
        Grouped convolution; ``groups == C`` is depthwise.
    out : array, optional
        Where to write ``y``: the right shape and dtype, C-contiguous, same array library.
    stream : optional
        CUDA stream (CuPy stream, raw ``cudaStream_t`` int, or anything with ``__cuda_stream__``), or a lane
        key on the CPU. ``None``: the calling thread's default.
    layout : ``"NCHW"`` or ``"NHWC"``
    algo : str, optional
        Force an algorithm by name (``ValueError`` if it needs more workspace than the cap).

    Returns
    -------
    array
        ``y``, ``(N, K, *out_spatial)`` or channels last.
    """
    return _execute(
        "fwd", {"x": x, "w": w}, getattr(x, "shape", ()), getattr(w, "shape", ()),
        dict(stride=stride, padding=padding, dilation=dilation, groups=groups), out, stream, layout, algo,
    )


def conv_backward_data(
    dy: Any, w: Any, input_shape: Sequence[int], stride: Any = 1, padding: Any = 0, dilation: Any = 1,
    groups: int = 1, out: Any = None, stream: Any = None, *, layout: str = "NCHW", algo: str | None = None,
) -> Any:
    """Gradient of the forward convolution with respect to its input: ``dx`` of shape ``input_shape``.

    Parameters are those of :func:`conv_forward`; ``dy`` has the forward output's shape.
    """
    return _execute(
        "bwd_data", {"dy": dy, "w": w}, _shape_arg("input_shape", input_shape), getattr(w, "shape", ()),
        dict(stride=stride, padding=padding, dilation=dilation, groups=groups), out, stream, layout, algo,
    )


def conv_backward_filter(
    x: Any, dy: Any, weight_shape: Sequence[int], stride: Any = 1, padding: Any = 0, dilation: Any = 1,
    groups: int = 1, out: Any = None, stream: Any = None, *, layout: str = "NCHW", algo: str | None = None,
) -> Any:
    """Gradient of the forward convolution with respect to its filters: ``dw`` of shape ``weight_shape``.

    Parameters are those of :func:`conv_forward`; ``dy`` has the forward output's shape.
    """
    return _execute(
        "bwd_filter", {"x": x, "dy": dy}, getattr(x, "shape", ()), _shape_arg("weight_shape", weight_shape),
        dict(stride=stride, padding=padding, dilation=dilation, groups=groups), out, stream, layout, algo,
    )
