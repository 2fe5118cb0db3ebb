"""The checked geometry of a :mod:`wsarena.torch` call: remembered per call signature, and symbolic where PyTorch
traces with symbolic sizes.

A training step repeats its calls, and checking a convolution's arguments (:func:`~wsarena._geometry.conv_geometry`)
costs more than the rest of what this package adds to a call: each call signature (the operands' shapes and
strides, and the parameters) is checked once, as the ops remember theirs (:mod:`wsarena.ops`), and looked up after,
with what else it determines (:class:`Checked`: the layout's channels-last test, the parameters as the operators
take them).

Under ``torch.compile(dynamic=True)`` or ``torch.export`` with a ``Dim``, the batch and spatial sizes are
``SymInt`` objects: checked as ints they would be fixed to the traced values (a graph per shape, an export refused).
There the parameters, channels and weight are checked on a stand-in input whose symbolic sizes are replaced by
sizes any valid call may have; each spatial size is checked with ``torch._check_with``, which a traced graph
keeps as an assertion on the sizes it runs with, and the ops check the real sizes again when they run.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .._callkeys import freeze_params, remember
from .._geometry import ConvGeometry, conv_geometry, conv_transpose_geometry, transposed_output_size
from . import _ops
from ._ops import exporting

__all__ = ["Checked", "each", "forward_call", "forward_geometry", "per_dim", "transpose_call"]

_Make = Callable[..., ConvGeometry]

# What each call signature determines, bounded as the ops' records are (wsarena._callkeys.remember).
_remembered: dict[tuple[Any, ...], Checked] = {}


def each(value: Any, nd: int) -> Any:
    """A sequence of one value as that value in each of ``nd`` dimensions, as PyTorch's convolutions read a stride,
    padding, dilation or output padding (ATen's ``expand_param_if_needed``; ``nn.Conv2d(..., padding=(2,))`` keeps
    it as it is, and runs it so); anything else as it is, to be checked."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        return list(value) * nd
    return value


def per_dim(value: Any, nd: int) -> list[int] | None:
    """``value`` (an int, one per dimension, or one in a sequence for every dimension: :func:`each`) as a list of
    ``nd`` ints, or ``None`` when it is no such thing (for :func:`conv_geometry` to say what is wrong with it)."""
    value = each(value, nd)
    values = list(value) if isinstance(value, (list, tuple)) else [value] * nd
    try:
        ints = [operator.index(v) for v in values]
    except TypeError:
        return None
    return ints if len(ints) == nd and not any(isinstance(v, bool) for v in values) else None


def _forward(x_shape: Sequence[Any], w_shape: Sequence[Any], stride: Any, padding: Any, dilation: Any,
             groups: Any) -> ConvGeometry:
    return conv_geometry(x_shape, w_shape, stride=stride, padding=padding, dilation=dilation, groups=groups)


def _transpose(x_shape: Sequence[Any], w_shape: Sequence[Any], stride: Any, padding: Any, dilation: Any,
               groups: Any, output_padding: Any) -> ConvGeometry:
    return conv_transpose_geometry(x_shape, w_shape, stride=stride, padding=padding, output_padding=output_padding,
                                   dilation=dilation, groups=groups)


class Checked(NamedTuple):
    """What a call signature determines: its checked geometry, the shape of a transposed convolution's output
    (channels first), the parameters as the operators take them (``stride``, ``padding``, ``dilation`` with one
    int per spatial dimension, and ``groups``), and whether an operand is channels-last by its strides (``None``:
    not known, asked each call)."""

    geom: ConvGeometry
    shape: tuple[Any, ...]
    args: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]
    channels_last: bool | None


def forward_geometry(x_shape: Sequence[Any], w_shape: Sequence[Any], stride: Any, padding: Any, dilation: Any,
                     groups: Any) -> ConvGeometry:
    """The checked geometry of a convolution of ``x_shape`` by ``w_shape`` (channels first); under a trace, that of
    a stand-in input (:func:`_stand_in`)."""
    return _checked(_forward, x_shape, w_shape, (stride, padding, dilation, groups)).geom


def forward_call(x: Tensor, w: Tensor, stride: Any, padding: Any, dilation: Any, groups: Any) -> Checked:
    """What the convolution of ``x`` by ``w`` determines (:class:`Checked`), its geometry as
    :func:`forward_geometry` checks it."""
    return _checked(_forward, x.shape, w.shape, (stride, padding, dilation, groups), (x, w))


def transpose_call(x: Tensor, w: Tensor, stride: Any, padding: Any, dilation: Any, groups: Any,
                   output_padding: Any) -> Checked:
    """What the transposed convolution of ``x`` by ``w`` determines (:class:`Checked`): the checked geometry of the
    convolution whose input gradient it is (:func:`~wsarena._geometry.conv_transpose_geometry`), and as ``shape``
    its output shape: the geometry's input shape (channels first), or under a trace, the shape that ``x``'s gives,
    symbolic where it is."""
    return _checked(_transpose, x.shape, w.shape, (stride, padding, dilation, groups, output_padding), (x, w))


def _checked(
    make: _Make, x_shape: Sequence[Any], w_shape: Sequence[Any], params: tuple[Any, ...],
    operands: tuple[Tensor, Tensor] | None = None,
) -> Checked:
    # Traced, sizes may be symbolic, and torch.compile shows them as ints (isinstance and type say int). Nor does a
    # trace read a remembered signature: it would guard on the dictionary. torch.jit.trace's sizes are tensors, a
    # new key every call.
    if _ops.compiling():
        return _made(*_stand_in(make, x_shape, w_shape, params))
    if torch.jit.is_tracing():
        return _made(*_sized(make(x_shape, w_shape, *params)))
    frozen = freeze_params(params)  # None: a float or a bool, which equal ints as keys, checked every time
    if frozen is None:
        return _made(*_sized(make(x_shape, w_shape, *params)))
    # The operands' strides key the signature too: whether one is channels-last follows from its sizes and strides
    # (wsarena.torch._ops.layout_of), so it is worked out once.
    strides = None
    if operands is not None:
        try:
            strides = (operands[0].stride(), operands[1].stride())
        except RuntimeError:  # a tensor without strides (a sparse one): its layout asked each call, as it fails
            operands = None
    key = (make, x_shape, w_shape, strides, *frozen)
    try:
        checked = _remembered.get(key)
    except TypeError:  # symbolic sizes outside torch.compile (a symbolic make_fx trace)
        return _made(*_stand_in(make, x_shape, w_shape, params))
    if checked is None:
        channels_last = None if operands is None else _ops.channels_last(*operands)
        checked = _made(*_sized(make(x_shape, w_shape, *params)), channels_last)
        remember(_remembered, key, checked)
    return checked


def _made(geom: ConvGeometry, shape: list[Any], channels_last: bool | None = None) -> Checked:
    # tuples, which key the ops' records as they are (wsarena._callkeys.freeze_params), and which no caller can
    # change in the record every later call of the signature reads
    return Checked(geom, tuple(shape), (geom.stride, geom.padding, geom.dilation, geom.groups), channels_last)


def _sized(geom: ConvGeometry) -> tuple[ConvGeometry, list[Any]]:
    # the fields, not ConvGeometry's cached properties, whose lock torch.compile cannot trace on Python 3.11
    return geom, [geom.batch, geom.in_channels, *geom.input_size]


def _stand_in(
    make: _Make, x_shape: Sequence[Any], w_shape: Sequence[Any], params: tuple[Any, ...]
) -> tuple[ConvGeometry, list[Any]]:
    """The geometry of a traced call, checked on a stand-in input: a batch of 1, and in each spatial dimension the
    smallest size the kernel (a convolution) or the padding (a transposed one) allows; the real spatial sizes are
    checked by ``torch._check_with``, which a graph keeps as an assertion on the sizes it runs with. The channels
    and the weight's sizes are made ints: a convolution's are fixed by its weight."""
    _, padding, dilation, _, *extra = params
    nd = len(x_shape) - 2
    kernel = [operator.index(k) for k in w_shape[2:]]
    transposed = make is _transpose
    if transposed:
        paddings = per_dim(padding, nd)
        spans = None if paddings is None else [2 * p + 1 for p in paddings]
    else:
        dilations = per_dim(dilation, nd)
        spans = None if dilations is None else [d * (k - 1) + 1 for d, k in zip(dilations, kernel)]
    weight = [operator.index(n) for n in w_shape]
    if spans is None:  # a parameter is wrong: checked as ints, which says what
        return _sized(make([operator.index(n) for n in x_shape], weight, *params))
    geom = make([1, operator.index(x_shape[1]), *spans], weight, *params)
    sizes = list(x_shape[2:])
    if transposed:
        extra_t = per_dim(extra[0], nd) or [0] * nd  # output_padding, checked by make
        sizes = [transposed_output_size(*dims) for dims in zip(
            sizes, geom.kernel_size, geom.stride, geom.padding, geom.dilation, extra_t)]
    kernel_t, padding_t, dilation_t = geom.kernel_size, geom.padding, geom.dilation  # no ConvGeometry in a message
    for i, size in enumerate(sizes):
        if transposed:
            _check(size >= 1, f"padding={padding_t} leaves an output of no elements in dimension {i}")
        else:
            span = dilation_t[i] * (kernel_t[i] - 1) + 1
            _check(size + 2 * padding_t[i] >= span,
                   f"kernel {kernel_t} (dilation {dilation_t}) is larger than the padded input in dimension {i}")
    return geom, [x_shape[0], geom.in_channels, *sizes]


def _check(condition: Any, message: str) -> None:
    """A ``ValueError`` with ``message`` unless ``condition``, kept by a traced graph as an assertion on its sizes,
    which a compiled graph raises as a ``RuntimeError`` with the message. A trace before PyTorch 2.13 takes neither
    ``torch._check_with``'s error type for a symbolic size nor a message function with a closure: the message is the
    function's default. Under ``torch.export`` without the message: a strict export takes none (torch 2.13 keeps the
    function in its graph, and fails); nor under ``torch.compile`` where Dynamo takes none (:data:`_TRACED_MESSAGE`),
    whose error then names no reason."""
    if exporting() or (not _TRACED_MESSAGE and _ops.compiling()):
        torch._check(condition)
    elif _ops.compiling():
        torch._check(condition, lambda message=message: message)
    else:
        torch._check_with(ValueError, condition, lambda: message)


def _traced_message() -> bool:
    """Whether Dynamo traces ``torch._check``'s message function, by a rule of its own for ``torch._check``
    (PyTorch 2.11 and 2.13 have one). Without it (2.7) it records the call as any other in its graph, and fails on
    the function, which it cannot put in a graph (``Unsupported: Failed to convert args/kwargs to proxy``): no
    convolution compiled. A private table of Dynamo's; where it is not found, the rule is taken to be there."""
    try:
        from torch._dynamo.variables.torch import TorchInGraphFunctionVariable

        return torch._check in TorchInGraphFunctionVariable._get_handlers()
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - a Dynamo without the table
        return True


_TRACED_MESSAGE = _traced_message()
