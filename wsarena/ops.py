"""The public convolution ops: forward, backward-data and backward-filter.

NumPy arrays run on the ``cpu`` backend, CuPy arrays on ``cudnn``; arrays of other libraries (PyTorch, JAX,
Numba, anything with DLPack or an array interface) run as NumPy or CuPy views of their memory, and the result
comes back in the caller's library (:mod:`wsarena._interop`). 1-, 2- or 3-D convolution follows from
``x.ndim`` (3, 4 or 5). Every workspace is leased from the arena's sub-arena for ``stream``; no op allocates
scratch memory of its own. Arguments are checked before any workspace is leased or any work enqueued. During a CUDA
graph capture, what a call allocates (copies of operands that are not C-contiguous, a result made without ``out=``)
is kept as long as the graph (:meth:`~wsarena.arena.Arena.keep_with_capture`).

On cuDNN, float16 and bfloat16 are computed in float32 with tensor cores allowed, as PyTorch does.

A training loop repeats the same calls every step, so what a call's arguments determine (backend, checked
geometry, output shape, and the algorithm choice for the settings in force) is kept in one record per call
signature: a repeated call makes one dictionary lookup, then leases and runs.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import _interop, algos
from ._callkeys import Uncacheable, freeze, freeze_params, remember
from ._config import Config, get_config, using
from ._geometry import (
    DTYPES,
    ITEMSIZES,
    ConvGeometry,
    array_dtype_name,
    byte_order_note,
    conv_geometry,
    describe_geometry,
)
from ._pass import Pass
from ._sizes import exact_cap, format_size, is_sequence, short_repr
from .algos import forced, run_with_fallback, select
from .arena._interrupts import finish
from .backends import Backend, Candidate, array_backend_name, get_backend, is_masked_type, type_backend_name
from .errors import CaptureError

__all__ = ["conv_backward_data", "conv_backward_filter", "conv_forward"]

# str(dtype) costs microseconds; a dict lookup on the dtype object does not (this runs on every call)
_NAMES = {np.dtype(k): k for k in ("float16", "float32", "float64")}


class _Record:
    """What one call signature determines: its backend, geometry and output, and the algorithms chosen for it.

    ``choices`` maps a device key to the usable candidates, best first, as :func:`wsarena.algos.select` chose
    them under the signature's cap and search (kept only once the algorithm cache keeps them too).
    """

    __slots__ = ("backend", "choices", "dtype", "generation", "geom", "out_shape")

    def __init__(self, backend: Backend, geom: ConvGeometry, dtype: str, out_shape: tuple[int, ...]) -> None:
        self.backend = backend
        self.geom = geom
        self.dtype = dtype
        self.out_shape = out_shape
        self.choices: dict[Any, tuple[Candidate, ...]] = {}
        self.generation = algos.generation()


_records: dict[tuple[Any, ...], _Record] = {}


def records_clear() -> None:
    """Forget every remembered call signature (the settings and algorithm cache are unaffected)."""
    _records.clear()


def _dtype_name(name: str, dtype: Any) -> str:
    """The name of array ``name``'s dtype, one of :data:`DTYPES`, as :func:`dtype_name` names a dtype given to the
    planner (a dtype in the other byte order is none of them), or the ``TypeError`` that refuses it."""
    text = _NAMES.get(dtype) or array_dtype_name(dtype)
    if text not in DTYPES:
        raise TypeError(f"{name} must be a floating-point array (float16, bfloat16, float32 or float64), not {text}"
                        f"{byte_order_note(dtype)}")
    return text


def _backend_for(names: tuple[str, str], types: tuple[type, type], cfg: Config) -> Backend:
    """The backend of the operands' types, on the cuDNN API of ``cfg``: the settings the call read, which its record's
    key holds, not what a configure() of another thread made meanwhile."""
    configured = cfg.backend
    kinds: dict[str, str] = {}
    for name, kind in zip(names, types):
        found = type_backend_name(kind)
        if found is None:
            masked = " (its mask would be ignored; pass .filled(0))" if is_masked_type(kind) else ""
            raise TypeError(f"{name} must be a NumPy or CuPy array, not {kind.__name__}{masked}")
        kinds[name] = found
    if len(set(kinds.values())) > 1:
        detail = ", ".join(f"{n} is {'NumPy' if k == 'cpu' else 'CuPy'}" for n, k in kinds.items())
        raise TypeError(f"cannot mix NumPy and CuPy arrays in one convolution ({detail})")
    backend = next(iter(kinds.values()))
    if configured != "auto" and configured != backend:
        # by their memory: another library's operands (PyTorch's tensors) come here as NumPy or CuPy views of them
        where, wanted = (("in host memory", "on a CUDA device (CuPy's, or another library's)") if backend == "cpu"
                         else ("on a CUDA device", "in host memory (NumPy's, or another library's)"))
        raise TypeError(f"backend={configured!r} is configured but the arrays are {where}; pass arrays {wanted} or "
                        "configure backend='auto'")
    return get_backend(backend, cfg.cudnn_api)


def _record(
    pass_: Pass, a: Any, b: Any, shape_arg: Any, params: tuple[Any, Any, Any, Any], layout: str, cfg: Config
) -> _Record:
    """Check what a call's array types, shapes and dtypes and its parameters determine.

    Raises the ``TypeError``/``ValueError`` that names a bad argument."""
    names = pass_.names
    backend = _backend_for(names[:2], (type(a), type(b)), cfg)
    named = {name: _dtype_name(name, array.dtype) for name, array in zip(names, (a, b))}
    if len(set(named.values())) > 1:
        raise TypeError(f"dtypes differ: {', '.join(f'{n} is {d}' for n, d in named.items())}")
    dtype = named[names[0]]
    try:
        backend.check_dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"{names[0]} has dtype {dtype}: {exc}") from None
    shapes = (a.shape, b.shape)
    stride, padding, dilation, groups = params
    geom = conv_geometry(
        shape_arg if pass_ is Pass.BWD_DATA else shapes[0],  # x: given for bwd_data, else the first operand
        shape_arg if pass_ is Pass.BWD_FILTER else shapes[1],  # w: given for bwd_filter, else the second one
        stride=stride, padding=padding, dilation=dilation, groups=groups, layout=layout, dtype=dtype,
    )
    expected = geom.operand_shapes(pass_)
    for name, shape, want in zip(names, shapes, expected):
        if tuple(shape) != want:
            raise ValueError(
                f"{name} has shape {tuple(shape)}; expected {want} for this convolution "
                f"(input {geom.input_shape}, weight {geom.weight_shape}, layout {layout})"
            )
    return _Record(backend, geom, dtype, expected[2])


def _check_out(record: _Record, out: Any, a: Any, b: Any) -> None:
    backend = record.backend
    # The common case in a few comparisons: out is of a's own type, shape and dtype, C-contiguous and (NumPy's
    # flag; CuPy has none) writeable.
    flags = getattr(out, "flags", None)
    if not (
        type(out) is type(a) and out.shape == record.out_shape and out.dtype == a.dtype
        and flags is not None and flags.c_contiguous and getattr(flags, "writeable", True)
    ):
        if array_backend_name(out) != backend.name:
            kind = "NumPy" if backend.name == "cpu" else "CuPy"
            raise TypeError(f"out must be a {kind} array, not {type(out).__name__}")
        if tuple(out.shape) != record.out_shape:
            raise ValueError(f"out has shape {tuple(out.shape)}; this convolution writes {record.out_shape}")
        if (_NAMES.get(out.dtype) or array_dtype_name(out.dtype)) != record.dtype:
            raise TypeError(f"out has dtype {out.dtype}{byte_order_note(out.dtype)}; this convolution writes "
                            f"{record.dtype}")
        if not out.flags.c_contiguous:
            raise ValueError("out must be C-contiguous")
        if not getattr(out.flags, "writeable", True):
            raise ValueError("out is read-only")
    if backend.may_share_memory(out, a) or backend.may_share_memory(out, b):
        raise ValueError("out overlaps an input; convolutions cannot run in place")


_copy = operator.methodcaller("copy", order="C")  # a C-contiguous copy, made from C (_made_contiguous)


def _shape_arg(name: str, shape: Any) -> tuple[int, ...]:
    if type(shape) is tuple or type(shape) is list:  # the common case, without the isinstance of an ABC (0.1 us)
        return tuple(shape)
    # a subclass (torch.Size, a tensor's .shape) is no text either: 0.24 us, where is_sequence's ABC takes 0.6
    if not isinstance(shape, (tuple, list)) and not is_sequence(shape):  # nor binary data (b"\x02\x04" as (2, 4))
        raise TypeError(f"{name} must be a sequence of ints, not {short_repr(shape)}")
    return tuple(shape)


def _execute(
    pass_: Pass, a: Any, b: Any, shape_arg: Any, params: tuple[Any, Any, Any, Any], out: Any, stream: Any,
    layout: str, algo: str | None,
) -> Any:
    """Run one pass on the operands ``a`` and ``b``; ``params`` is ``(stride, padding, dilation, groups)``.

    Operands of other array libraries run as NumPy or CuPy views (:mod:`wsarena._interop`)."""
    native = _interop.NATIVE
    if type(a) not in native or type(b) not in native or (out is not None and type(out) not in native):
        return _interop.execute(_run, pass_, a, b, shape_arg, params, out, stream, layout, algo)
    return _run(pass_, a, b, shape_arg, params, out, stream, layout, algo)


def _run(
    pass_: Pass, a: Any, b: Any, shape_arg: Any, params: tuple[Any, Any, Any, Any], out: Any, stream: Any,
    layout: str, algo: str | None, empty: Callable[[tuple[int, ...], str], Any] | None = None,
) -> Any:
    """:func:`_execute` on NumPy or CuPy arrays; a new result comes from ``empty`` (default: the backend's)."""
    cfg = get_config()
    stride, padding, dilation, groups = params
    if type(stride) is int and type(padding) is int and type(dilation) is int and type(groups) is int:
        frozen: tuple[Any, ...] | None = params  # the common case, in four comparisons
    else:
        frozen = freeze_params(params)
    if shape_arg is not None and frozen is not None:
        try:
            shape_arg = freeze(shape_arg)
        except Uncacheable:
            frozen = None
    record = key = None
    if frozen is not None:
        key = (
            pass_, type(a), type(b), getattr(a, "shape", None), getattr(b, "shape", None),
            getattr(a, "dtype", None), getattr(b, "dtype", None), shape_arg, frozen, layout, cfg.backend,
            cfg.cap_workspace, cfg.algo_search, cfg.cudnn_api, cfg.cudnn_heuristic,
        )
        try:
            record = _records.get(key)
        except TypeError:  # something unhashable (a shape that is no tuple): checked below, never remembered
            key = None
    if record is None:
        record = _record(pass_, a, b, shape_arg, params, layout, cfg)
        if key is not None:
            remember(_records, key, record)
    if out is not None:
        _check_out(record, out, a, b)
    backend, geom = record.backend, record.geom
    # Everything that touches memory happens on the operands' device with `stream` current, so copies and the
    # convolution are ordered on one stream. A forced algorithm is checked there too (its workspace size is the
    # device's), before anything is allocated or enqueued.
    with backend.context((a, b) if out is None else (a, b, out), stream):
        chosen = None if algo is None else forced(backend, pass_, geom, algo, cap=cfg.cap_workspace)
        result = _new_output(record, empty) if out is None else out
        if geom.batch == 0:
            # Takes nothing, and refuses what a real call's lease refuses (a bad stream, a closed arena, a stream
            # CUDA cannot use during a capture) before dw's zeros are enqueued
            with backend.arena().lease(0, stream=stream) as ws:
                if pass_ is Pass.BWD_FILTER:
                    result[...] = 0
            if ws.pin is not None:  # dw's zeros are written at every replay
                finish(_keep_with_capture, backend, stream, ws.pin, [], (), None if out is not None else result)
            return result
        operands = [a, b]  # made C-contiguous, by copies, once the algorithm is chosen (or for its search)
        pin = _NOT_RUN  # once a lease ran the call: the pin of the graph it was captured into, or None
        try:
            try:
                if chosen is None:
                    chosen = _choice(record, pass_, cfg, operands, result, stream)
                x, y = _made_contiguous(operands)  # (made for the search already, if it ran)

                def run(cand: Candidate, ws: Any) -> None:
                    nonlocal pin
                    pin = ws.pin
                    backend.run(pass_, cand, geom, x, y, result, ws, stream)

                run_with_fallback(backend.arena(), chosen, run, stream=stream, cap=cfg.cap_workspace,
                                  retry=backend.retry_errors, warn_for=(pass_, geom))
            finally:
                # During a capture, what the call allocated stays as long as the graph: the copies once made (and
                # enqueued), the result once the call ran. Outside one, the first lease said so (pin None).
                if pin is not None and (pin is not _NOT_RUN or operands[0] is not a or operands[1] is not b):
                    finish(
                        _keep_with_capture, backend, stream, pin, operands, (a, b), None if out is not None else result
                    )
        except BaseException:
            if out is None:  # a result returned to no one (the convolution may have run: a warning made an error)
                result = None
            raise
        finally:
            # The operands' copies go while the call's stream object lives: CuPy's stream-ordered allocator frees them
            # on it, after the convolution that reads them, where once it is gone it would free them on the stream
            # current then (arena.streams.cupy_stream). The result is the caller's, once returned. (During a capture,
            # the graph's pin keeps them.)
            operands.clear()
            x = y = None
    return result


def _made_contiguous(operands: list[Any]) -> list[Any]:
    """``operands``, ``[a, b]``, made C-contiguous in place: copies where they are not, made once.

    Each copy goes to ``operands`` within the C call that makes it (a slice assignment over a ``map``): during a
    capture its kernel is the graph's from then on, and ``_run`` keeps what ``operands`` holds. A Ctrl-C as the copy
    returned to a Python frame would lose it, freed while every replay writes it (``_interrupts``, rule 7)."""
    for i in (0, 1):
        if not operands[i].flags.c_contiguous:
            operands[i:i + 1] = map(_copy, operands[i:i + 1])
    return operands


_NOT_RUN: Any = object()  # _run's pin before a lease ran the call


def _keep_with_capture(
    backend: Backend, stream: Any, pin: Any, operands: list[Any], given: tuple[Any, ...], result: Any
) -> None:
    """Keep what a call allocated while the graph being captured on ``stream`` exists, whose kernels write and read it
    at every replay: the copies among ``operands`` (of the arrays ``given``), enqueued once made, whatever the call
    did since, and ``result`` (a new one, or ``None``), where a kernel of the call was captured. ``pin``: the graph's,
    as the call's lease gave it, or :data:`_NOT_RUN` where no lease ran the call (the capture refused it): the arena is
    asked, and keeps nothing where no capture is under way. What the graph allocates itself is left as it is
    (:meth:`~wsarena.backends.Backend.graph_allocated`); whether dropping the rest may free device memory at once
    (:meth:`~wsarena.backends.Backend.frees_when_dropped`) decides when it may be let go. Idempotent: the call runs it
    under :func:`~wsarena.arena._interrupts.finish`, again after a Ctrl-C, which would otherwise leave what its kernels
    use to be freed as the call returns."""
    made = [copy for copy, array in zip(operands, given) if copy is not array]
    if pin is not _NOT_RUN and result is not None:
        made.append(result)
    kept = [array for array in made if not backend.graph_allocated(array)]
    if not kept:
        return
    if pin is _NOT_RUN:
        backend.arena().keep_with_capture(kept, stream=stream)
    else:
        pin.keep(kept, frees=any(map(backend.frees_when_dropped, kept)))


def _new_output(record: _Record, empty: Callable[[tuple[int, ...], str], Any] | None) -> Any:
    """An array for the result; a ``MemoryError`` that names the output's shape and size when there is no room."""
    try:
        return (empty or record.backend.empty)(record.out_shape, record.dtype)
    except MemoryError as exc:
        nbytes = math.prod(record.out_shape) * ITEMSIZES[record.dtype]
        raise MemoryError(
            f"no memory for the output: {record.out_shape} of {record.dtype} is {format_size(nbytes)} "
            "(check padding and the shapes, or pass out=)"
        ) from exc


def _choice(
    record: _Record, pass_: Pass, cfg: Config, operands: list[Any], out: Any, stream: Any
) -> tuple[Any, ...]:
    """The record's candidates for the current device, chosen by :func:`select` on first use; an exhaustive search
    times them on ``operands`` (``[a, b]``, made C-contiguous in place for it) and ``out``."""
    backend = record.backend
    device = backend.device_key()
    if record.generation == algos.generation():
        chosen = record.choices.get(device)
        if chosen is not None:
            return chosen
    else:
        record.choices.clear()
        record.generation = algos.generation()
    # Chosen under the settings the call read, which the record's key holds: what the algorithm cache's key and the
    # backend read of them (cudnn_heuristic) is not what a configure() of another thread made meanwhile.
    with using(cfg):
        geom = record.geom
        cap, search = cfg.cap_workspace, cfg.algo_search
        capturing = False
        if not algos.is_cached(backend, pass_, geom, cap=cap, search=search):
            capturing = backend.arena().capturing(stream=stream)
            if capturing and not algos.is_chosen(backend, pass_, geom, cap=cap, search=search):
                raise CaptureError(
                    f"the first {pass_} call of this shape ({describe_geometry(geom)}) under the settings in force "
                    f"(cap_workspace {exact_cap(cap)}, algo_search {search}) came during CUDA graph capture, where its "
                    "algorithm cannot be chosen (a search or a cuDNN query is not a graph node): run the step once "
                    "before capturing, under the same settings (a configure() since the eager step changes them)"
                )
        # A search cut short by memory runs again once memory allows, but not in a capture: the kept ranking serves.
        chosen = select(backend, pass_, geom, cap=cap, search=search, stream=stream, search_again=not capturing,
                        operands=lambda: (*_made_contiguous(operands), out))
        # Kept for good: not a search cut short, nor one for operands like its own (algos serves those), and this
        # call's, not one another thread's choice has kept since in place of it
        if algos.is_cached(backend, pass_, geom, cap=cap, search=search, ranking=chosen):
            record.choices[device] = chosen
    return chosen


def conv_forward(
    x: Any, w: Any, stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1, *,
    out: Any = None, stream: Any = None, layout: str = "NCHW", algo: str | None = None,
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
        Where to write ``y``: the right shape and dtype, C-contiguous, writable, in the operands' memory (host or
        device), of any array library.
    stream : optional
        CUDA stream (CuPy stream, raw ``cudaStream_t`` int, or anything with ``__cuda_stream__``), or a lane
        key on the CPU. ``None``: the calling thread's default; PyTorch's current stream for PyTorch tensors.
    layout : ``"NCHW"`` or ``"NHWC"``
    algo : str, optional
        Force an algorithm by name (``ValueError`` if it needs more workspace than the cap, or, a graph-API engine,
        if it would compute the dtype below wsarena's precision: float32 in TF32 or from inputs rounded down,
        float16 or bfloat16 with a half-precision accumulator). A graph-API engine leases its plan's workspace for
        16-byte-aligned operands; operands aligned otherwise whose plan needs more raise
        :class:`~wsarena.AlignmentWorkspaceError`.

    Returns
    -------
    array
        ``y``, ``(N, K, *out_spatial)`` or channels last: ``out`` when given, else an array of ``x``'s library.
    """
    return _execute(Pass.FWD, x, w, None, (stride, padding, dilation, groups), out, stream, layout, algo)


def conv_backward_data(
    dy: Any, w: Any, input_shape: Sequence[int], stride: Any = 1, padding: Any = 0, dilation: Any = 1,
    groups: int = 1, *, out: Any = None, stream: Any = None, layout: str = "NCHW", algo: str | None = None,
) -> Any:
    """Gradient of the forward convolution with respect to its input: ``dx`` of shape ``input_shape``.

    Parameters are those of :func:`conv_forward`; ``dy`` has the forward output's shape.
    """
    return _execute(
        Pass.BWD_DATA, dy, w, _shape_arg("input_shape", input_shape), (stride, padding, dilation, groups), out,
        stream, layout, algo,
    )


def conv_backward_filter(
    x: Any, dy: Any, weight_shape: Sequence[int], stride: Any = 1, padding: Any = 0, dilation: Any = 1,
    groups: int = 1, *, out: Any = None, stream: Any = None, layout: str = "NCHW", algo: str | None = None,
) -> Any:
    """Gradient of the forward convolution with respect to its filters: ``dw`` of shape ``weight_shape``.

    Parameters are those of :func:`conv_forward`; ``dy`` has the forward output's shape.
    """
    return _execute(
        Pass.BWD_FILTER, x, dy, _shape_arg("weight_shape", weight_shape), (stride, padding, dilation, groups), out,
        stream, layout, algo,
    )
