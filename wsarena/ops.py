"""The public convolution ops: forward, backward-data and backward-filter.

NumPy arrays run on the ``cpu`` backend, CuPy arrays on ``cudnn``. 1-, 2- or 3-D convolution follows from
``x.ndim`` (3, 4 or 5). Every workspace is leased from the arena's sub-arena for ``stream``; no op allocates
scratch memory of its own. Arguments are checked before any workspace is leased or any work enqueued.

On cuDNN, float16 and bfloat16 are computed in float32 with tensor cores allowed, as PyTorch does.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np


from ._config import get_config
from ._geometry import DTYPES, ConvGeometry, conv_geometry
from .algos import forced, run_with_fallback, select
from .backends import Candidate, array_backend_name, get_backend, is_masked_type, type_backend_name

__all__ = ["conv_backward_data", "conv_backward_filter", "conv_forward"]

# str(dtype) costs microseconds; a dict lookup on the dtype object does not (this runs on every call)
_NAMES = {np.dtype(k): k for k in ("float16", "float32", "float64")}


class _Uncacheable(Exception):
    pass


def _frozen(value: Any) -> Any:
    """``value`` with lists turned into tuples, so that the arguments of a call can key a cache."""
    kind = type(value)
    if kind is int or kind is str or value is None:
        return value
    if kind is tuple or kind is list:
        return tuple(v if type(v) is int else _frozen(v) for v in value)
    # Anything else is checked every time: a float or a bool equals an int as a key (True == 1) yet is invalid.
    raise _Uncacheable


def _dtype_name(name: str, dtype: Any) -> str:
    text = str(dtype)
    if text not in DTYPES:
        raise TypeError(f"{name} must be a floating-point array (float16, bfloat16, float32 or float64), not {text}")
    return text


def _backend_for(types: dict[str, type], configured: str) -> Any:
    kinds = {}
    for name, kind in types.items():
        backend = type_backend_name(kind)
        if backend is None:
            masked = " (its mask would be ignored; pass .filled(0))" if is_masked_type(kind) else ""
            raise TypeError(f"{name} must be a NumPy or CuPy array, not {kind.__name__}{masked}")
        kinds[name] = backend
    if len(set(kinds.values())) > 1:
        detail = ", ".join(f"{n} is {'NumPy' if k == 'cpu' else 'CuPy'}" for n, k in kinds.items())
        raise TypeError(f"cannot mix NumPy and CuPy arrays in one convolution ({detail})")
    kind = next(iter(kinds.values()))
    if configured != "auto" and configured != kind:
        raise TypeError(
            f"backend={configured!r} is configured but the arrays are {'NumPy' if kind == 'cpu' else 'CuPy'}; "
            f"pass {'CuPy' if configured == 'cudnn' else 'NumPy'} arrays or configure backend='auto'"
        )
    return get_backend(kind)


class _Call(NamedTuple):
    """What a call's array types, shapes, dtypes and parameters determine."""

    backend: Any
    geom: ConvGeometry
    dtype: str
    out_shape: tuple[int, ...]


def _prepare(
    pass_: str, names: tuple[str, str], types: tuple[type, type], shapes: tuple[Any, Any], dtypes: tuple[Any, Any],
    input_shape: Any, weight_shape: Any, stride: Any, padding: Any, dilation: Any, groups: Any, layout: str,
    configured: str,
) -> _Call:
    """Check what a call's array types, shapes and dtypes and its parameters determine.

    Raises the ``TypeError``/``ValueError`` that names a bad argument."""
    backend = _backend_for(dict(zip(names, types)), configured)
    named = {name: _dtype_name(name, dtype) for name, dtype in zip(names, dtypes)}
    if len(set(named.values())) > 1:
        raise TypeError(f"dtypes differ: {', '.join(f'{n} is {d}' for n, d in named.items())}")
    dtype = named[names[0]]
    backend.check_dtype(dtype)
    geom = conv_geometry(
        shapes[0] if input_shape is None else input_shape,
        shapes[1] if weight_shape is None else weight_shape,
        stride=stride, padding=padding, dilation=dilation, groups=groups,
        layout=layout, dtype=dtype,
    )
    expected = geom.operand_shapes(pass_)
    for name, shape, want in zip(names, shapes, expected):
        if tuple(shape) != want:
            raise ValueError(
                f"{name} has shape {tuple(shape)}; expected {want} for this convolution "
                f"(input {geom.input_shape}, weight {geom.weight_shape}, layout {layout})"
            )
    return _Call(backend, geom, dtype, expected[2])


# A training loop repeats the same calls every step: remember what their arguments determine.
_prepared = functools.lru_cache(maxsize=4096)(_prepare)


def _prepare_call(
    pass_: str, names: tuple[str, str], a: Any, b: Any, input_shape: Any, weight_shape: Any, params: tuple,
    layout: str, configured: str,
) -> _Call:
    """:func:`_prepare` for a call's operands, cached where the arguments can key a cache."""
    shapes = (getattr(a, "shape", None), getattr(b, "shape", None))
    dtypes = (getattr(a, "dtype", None), getattr(b, "dtype", None))
    head = (pass_, names, (type(a), type(b)), shapes, dtypes)
    try:
        key = (*head, *map(_frozen, (input_shape, weight_shape, *params)), layout, configured)
        hash(key)
    except (_Uncacheable, TypeError):
        return _prepare(*head, input_shape, weight_shape, *params, layout, configured)
    return _prepared(*key)


def _contiguous(array: Any) -> Any:
    return array if array.flags.c_contiguous else array.copy(order="C")


def _check_out(call: _Call, out: Any, a: Any, b: Any) -> None:
    backend = call.backend
    # The common case in a few comparisons: out is of a's own type, shape and dtype, C-contiguous and (NumPy's
    # flag; CuPy has none) writeable.
    flags = getattr(out, "flags", None)
    if not (
        type(out) is type(a) and out.shape == call.out_shape and out.dtype == a.dtype
        and flags.c_contiguous and getattr(flags, "writeable", True)
    ):
        if array_backend_name(out) != backend.name:
            kind = "NumPy" if backend.name == "cpu" else "CuPy"
            raise TypeError(f"out must be a {kind} array, not {type(out).__name__}")
        if tuple(out.shape) != call.out_shape:
            raise ValueError(f"out has shape {tuple(out.shape)}; this convolution writes {call.out_shape}")
        if (_NAMES.get(out.dtype) or str(out.dtype)) != call.dtype:
            raise TypeError(f"out has dtype {out.dtype}; this convolution writes {call.dtype}")
        if not flags.c_contiguous:
            raise ValueError("out must be C-contiguous")
        if not getattr(flags, "writeable", True):
            raise ValueError("out is read-only")
    if backend.may_share_memory(out, a) or backend.may_share_memory(out, b):
        raise ValueError("out overlaps an input; convolutions cannot run in place")


def _shape_arg(name: str, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, Sequence) or isinstance(shape, str):
        raise TypeError(f"{name} must be a sequence of ints, not {shape!r}")
    return tuple(shape)


def _execute(
    pass_: str, names: tuple[str, str], a: Any, b: Any, input_shape: Any, weight_shape: Any,
    params: tuple[Any, Any, Any, Any], out: Any, stream: Any, layout: str, algo: str | None,
) -> Any:
    """Run one pass on the operands ``a`` and ``b`` (named ``names``); ``params`` is ``(stride, padding,
    dilation, groups)``."""
    cfg = get_config()
    call = _prepare_call(pass_, names, a, b, input_shape, weight_shape, params, layout, cfg.backend)
    backend, geom = call.backend, call.geom
    if out is not None:
        _check_out(call, out, a, b)
    # Everything that touches memory happens on the operands' device with `stream` current, so copies and the
    # convolution are ordered on one stream. A forced algorithm is checked there too (its workspace size is the
    # device's), before anything is allocated or enqueued.
    with backend.context((a, b) if out is None else (a, b, out), stream):
        chosen = None if algo is None else forced(backend, pass_, geom, algo, cap=cfg.cap_workspace)
        result = backend.empty(call.out_shape, call.dtype) if out is None else out
        if geom.batch == 0:
            backend.arena().lease(0, stream=stream)  # takes nothing; checks `stream` as a real call would
            if pass_ == "bwd_filter":
                result[...] = 0
            return result
        _run(backend, pass_, geom, _contiguous(a), _contiguous(b), result, stream, cfg, chosen)
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

    run_with_fallback(
        backend.arena(), candidates, run, stream=stream, cap=cfg.cap_workspace, retry=backend.retry_errors
    )


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
        "fwd", ("x", "w"), x, w, None, None, (stride, padding, dilation, groups), out, stream, layout, algo
    )


def conv_backward_data(
    dy: Any, w: Any, input_shape: Sequence[int], stride: Any = 1, padding: Any = 0, dilation: Any = 1,
    groups: int = 1, out: Any = None, stream: Any = None, *, layout: str = "NCHW", algo: str | None = None,
) -> Any:
    """Gradient of the forward convolution with respect to its input: ``dx`` of shape ``input_shape``.

    Parameters are those of :func:`conv_forward`; ``dy`` has the forward output's shape.
    """
    return _execute(
        "bwd_data", ("dy", "w"), dy, w, _shape_arg("input_shape", input_shape), None,
        (stride, padding, dilation, groups), out, stream, layout, algo,
    )


def conv_backward_filter(
    x: Any, dy: Any, weight_shape: Sequence[int], stride: Any = 1, padding: Any = 0, dilation: Any = 1,
    groups: int = 1, out: Any = None, stream: Any = None, *, layout: str = "NCHW", algo: str | None = None,
) -> Any:
    """Gradient of the forward convolution with respect to its filters: ``dw`` of shape ``weight_shape``.

    Parameters are those of :func:`conv_forward`; ``dy`` has the forward output's shape.
    """
    return _execute(
        "bwd_filter", ("x", "dy"), x, dy, None, _shape_arg("weight_shape", weight_shape),
        (stride, padding, dilation, groups), out, stream, layout, algo,
    )
