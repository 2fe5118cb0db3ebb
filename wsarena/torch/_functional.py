"""``conv1d``, ``conv2d``, ``conv3d``, ``conv_transpose1d``, ``conv_transpose2d``, ``conv_transpose3d``: drop-ins for
``torch.nn.functional``'s, their three passes run by wsarena.

Each checks its arguments as wsarena's ops do (a clear ``ValueError``/``TypeError`` before anything runs), applies
``torch.autocast`` as PyTorch does for its convolutions, and runs :class:`ConvFunction`, whose forward,
input-gradient and weight-gradient are wsarena's ``conv_forward``, ``conv_backward_data`` and
``conv_backward_filter`` (as the custom operators of :mod:`wsarena.torch._ops`), or :class:`ConvTransposeFunction`,
which runs the same three in other roles: a transposed convolution is a convolution's backward-data
(:mod:`wsarena.torch._autograd`, where the backward passes run under their forward's settings). The bias goes with
them: in an ordinary forward with gradient it is the Function's third operand, whose gradient the Function's backward
computes, as PyTorch's convolution does; elsewhere it is added to the result by PyTorch.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function_variadic
from torch.utils import checkpoint as _checkpoint

from .. import _callsite, _config
from . import _autograd, _ops, _shapes
from ._autograd import ConvFunction, ConvTransposeFunction
from ._shapes import each, per_dim

__all__ = [
    "ConvFunction", "ConvTransposeFunction", "checkpoint_context", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d",
]

# PyTorch's module call, autograd and custom-operator frames lie between a model's line and the op: a warning
# passes over them to the user's line (fx's generated code is PyTorch's too, under torch.compile).
_callsite.skip(os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
_callsite.skip("<eval_with_key>")


def checkpoint_context() -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the recomputed forward
    runs under the settings the checkpointed forward ran under (its ``config()`` block, else the process-wide
    settings), as an ordinary forward's backward passes do; without it, under those in force where ``backward()``
    runs. Under ``torch.compile``, which takes only two ``TorchDispatchMode`` objects from a ``context_fn``, those
    of PyTorch's own checkpointing there (every operator recomputed): the compiled backward, its recompute
    included, runs under the settings where it runs."""
    if _checkpoint_compiling(None, (), {}) or _autograd._dispatch_mode(_autograd._FUNCTIONAL) is not None:
        return _checkpoint.create_selective_checkpoint_contexts(_recompute)
    return contextlib.nullcontext(), _config.using(_config.overridden())


def _recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> _checkpoint.CheckpointPolicy:
    """The selective checkpointing policy of PyTorch's own compiled checkpointing: recompute every operator."""
    return _checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


# Whether torch.utils.checkpoint traces for torch.compile (AOTAutograd), where it takes a context_fn's two contexts
# only as TorchDispatchModes (its own test; a private name, so a PyTorch without it runs the contexts as they are):
# a proxy mode in force, since PyTorch 2.8 or so. Before (2.7) its test looks for functional tensors among the
# checkpointed function's arguments, which a context_fn is not given, so it found none, and torch.compile refused the
# eager form's two contexts ("must generate a tuple of two `TorchDispatchMode`s"): checkpoint_context asks for a
# functional mode in force too, which AOTAutograd's traces hold where they hold such tensors (a first one, of
# metadata, has no proxy mode). An eager torch.func.functionalize holds none (it functionalizes at a torch.func
# level, below Python's modes): the eager form there.
_checkpoint_compiling: Callable[[Any, Any, Any], bool] = getattr(_checkpoint, "_is_compiling", lambda *_: False)


# Whether autocast is on for any device type that has it (in PyTorch since 2.4); before, asked as if it were.
_any_autocast: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _autocast(x: Tensor, w: Tensor, bias: Tensor | None, compiling: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """The operands cast as ``torch.autocast`` casts a convolution's: floating types but float64 to its dtype.
    ``compiling``: whether a torch.compile trace runs (:func:`wsarena.torch._ops.compiling`)."""
    if not compiling and not _any_autocast():  # the common case, in one call
        return x, w, bias
    device_type = x.device.type
    # A device autocast has no mode for (the meta device) makes is_autocast_enabled raise. Before PyTorch 2.13
    # torch.compile cannot trace is_autocast_available (fullgraph=True fails on it): a trace asks of meta by name.
    if device_type == "meta" if compiling else not torch.amp.is_autocast_available(device_type):
        return x, w, bias
    if not torch.is_autocast_enabled(device_type):
        return x, w, bias
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t: Tensor) -> Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t

    return cast(x), cast(w), None if bias is None else cast(bias)


def _operands(
    name: str, nd: int, x: Tensor, w: Tensor, bias: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None, bool]:
    """``x``, ``w`` and ``bias`` checked and cast as ``torch.autocast`` casts them, ``x`` batched; and whether it
    came unbatched."""
    if not isinstance(x, Tensor) or not isinstance(w, Tensor):
        raise TypeError(f"input and weight must be tensors, not {type(x).__name__} and {type(w).__name__}")
    unbatched = x.dim() == nd + 1  # (C, *spatial), as torch.nn.functional takes it
    if unbatched:
        x = x.unsqueeze(0)
    if x.dim() != nd + 2 or w.dim() != nd + 2:
        raise ValueError(
            f"{name} needs a {nd + 1}- or {nd + 2}-D input and a {nd + 2}-D weight, not {x.dim()}-D and {w.dim()}-D"
        )
    if bias is not None and not isinstance(bias, Tensor):
        raise TypeError(f"bias must be a tensor or None, not {type(bias).__name__}")
    compiling = _ops.compiling()
    x, w, bias = _autocast(x, w, bias, compiling)
    if x.dtype != w.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"dtypes differ: input is {x.dtype}, weight is {w.dtype}"
                        + (f", bias is {bias.dtype}" if bias is not None else ""))
    if x.dtype not in _FLOATS:  # PyTorch's CPU convolution takes integers too; wsarena's ops do not
        raise TypeError(f"{name} takes float16, bfloat16, float32 or float64 tensors, not {x.dtype}")
    if x.layout != torch.strided or w.layout != torch.strided:  # sparse or oneDNN (to_mkldnn) tensors
        raise TypeError(f"{name} takes dense tensors (torch.strided), not {x.layout} and {w.layout}")
    # Under a trace too (a fake tensor is on its tensor's device): the bias is no operand of the operators, whose
    # fake kernels refuse a meta weight, and PyTorch's in-place add adds nothing from the meta device.
    if _on_meta(w, compiling) or (bias is not None and _on_meta(bias, compiling)):
        _no_meta_beside(x, w, compiling)
    return x, w, bias, unbatched


def _on_meta(t: Tensor, compiling: bool) -> bool:
    """Whether ``t`` is on the meta device: asked of its device while anything compiles (Dynamo's trace makes that
    a constant, where ``is_meta`` would be a call in its graph; the flag is the process's, true for another thread's
    eager calls meanwhile too), else of ``is_meta``, which costs less."""
    return t.device.type == "meta" if compiling else t.is_meta


def _no_meta_beside(x: Tensor, w: Tensor, compiling: bool) -> None:
    """Refuse a meta weight or bias beside a real input: the operator's fake kernel would answer, with a result on
    the input's device never written. A meta input beside real weights gives a meta result, as PyTorch's does."""
    if not _on_meta(x, compiling):
        meta = "weight" if _on_meta(w, compiling) else "bias"
        raise TypeError(f"{meta} is on the meta device, which holds no values, and input on {x.device}: "
                        "load the model's weights, or give a meta input to run on the meta device")


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_bias(bias: Tensor | None, channels: int) -> None:
    """A bias of other than one value per output channel is refused, as PyTorch refuses it (adding it would
    broadcast a ``(channels, 1)`` bias, or reshape any other of ``channels`` values)."""
    if bias is not None and [operator.index(n) for n in bias.shape] != [channels]:  # ints, not torch.jit.trace's
        raise ValueError(f"bias must have shape ({channels},), one value per output channel, not {tuple(bias.shape)}")


def _same(x: Tensor, w: Tensor, stride: Any, dilation: Any, nd: int) -> tuple[Tensor, Any]:
    """``x`` and the padding to run ``padding="same"`` with: where a dimension's total padding is odd (an even
    kernel), ``x`` padded by PyTorch with the one more at the end that torch's own convolution adds there, and the
    rest symmetric. Left as ``"same"`` where the stride or dilation is not valid, or there is nothing to add."""
    strides, dilations = per_dim(stride, nd), per_dim(dilation, nd)
    if strides is None or dilations is None or any(s != 1 for s in strides) or any(d < 1 for d in dilations):
        return x, "same"  # conv_geometry names what is wrong
    totals = [d * (operator.index(k) - 1) for d, k in zip(dilations, w.shape[2:])]  # ints, not torch.jit.trace's
    if not any(t % 2 for t in totals):
        return x, "same"
    ends = [p for t in reversed(totals) for p in (0, t % 2)]  # F.pad's order: the last dimension first
    return torch.nn.functional.pad(x, ends), [t // 2 for t in totals]


def _conv(nd: int, x: Tensor, w: Tensor, bias: Tensor | None, stride: Any, padding: Any, dilation: Any,
          groups: int) -> Tensor:
    x, w, bias, unbatched = _operands(f"conv{nd}d", nd, x, w, bias)
    stride, padding, dilation = each(stride, nd), each(padding, nd), each(dilation, nd)
    if isinstance(padding, str) and padding == "same":
        x, padding = _same(x, w, stride, dilation, nd)
    checked = _shapes.forward_call(x, w, stride, padding, dilation, groups)
    _check_bias(bias, checked.geom.out_channels)
    layout = _ops.layout_of(x, w, checked.channels_last)
    y = _autograd.apply(ConvFunction, bias, x, w, *checked.args, layout)
    return y.squeeze(0) if unbatched else y


def _conv_transpose(nd: int, x: Tensor, w: Tensor, bias: Tensor | None, stride: Any, padding: Any,
                    output_padding: Any, groups: int, dilation: Any) -> Tensor:
    x, w, bias, unbatched = _operands(f"conv_transpose{nd}d", nd, x, w, bias)
    stride, padding, output_padding, dilation = (each(v, nd) for v in (stride, padding, output_padding, dilation))
    checked = _shapes.transpose_call(x, w, stride, padding, dilation, groups, output_padding)
    _check_bias(bias, checked.geom.in_channels)  # the output's channels: the input's of the convolution it transposes
    layout = _ops.layout_of(x, w, checked.channels_last)
    y = _autograd.apply(ConvTransposeFunction, bias, x, w, checked.shape, *checked.args, layout)
    return y.squeeze(0) if unbatched else y


_F = TypeVar("_F", bound=Callable[..., Tensor])


def _overridable(function: _F) -> _F:
    """``function`` as ``torch.nn.functional``'s convolutions are: an operand with ``__torch_function__`` (an fx
    ``Proxy``, a tensor subclass) or a torch-function mode gets the call, so that ``torch.fx.symbolic_trace`` of a
    converted model records each as one call, as it records ``F.conv2d``."""

    @functools.wraps(function)
    def overridable(input: Tensor, weight: Tensor, bias: Tensor | None = None, *args: Any, **kwargs: Any) -> Tensor:
        if has_torch_function_variadic(input, weight, bias):
            return handle_torch_function(overridable, (input, weight, bias), input, weight, bias, *args, **kwargs)
        return function(input, weight, bias, *args, **kwargs)

    return overridable  # type: ignore[return-value]


@_overridable
def conv1d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride: Any = 1, padding: Any = 0,
           dilation: Any = 1, groups: int = 1) -> Tensor:
    """``torch.nn.functional.conv1d`` with wsarena's passes (``padding`` an int, a tuple, ``"valid"`` or ``"same"``,
    which pads an even kernel's input by one more at the end, as PyTorch does)."""
    return _conv(1, input, weight, bias, stride, padding, dilation, groups)


@_overridable
def conv2d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride: Any = 1, padding: Any = 0,
           dilation: Any = 1, groups: int = 1) -> Tensor:
    """``torch.nn.functional.conv2d`` with wsarena's passes (``padding`` an int, a tuple, ``"valid"`` or ``"same"``,
    which pads an even kernel's input by one more at the end, as PyTorch does)."""
    return _conv(2, input, weight, bias, stride, padding, dilation, groups)


@_overridable
def conv3d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride: Any = 1, padding: Any = 0,
           dilation: Any = 1, groups: int = 1) -> Tensor:
    """``torch.nn.functional.conv3d`` with wsarena's passes (``padding`` an int, a tuple, ``"valid"`` or ``"same"``,
    which pads an even kernel's input by one more at the end, as PyTorch does)."""
    return _conv(3, input, weight, bias, stride, padding, dilation, groups)


@_overridable
def conv_transpose1d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride: Any = 1, padding: Any = 0,
                     output_padding: Any = 0, groups: int = 1, dilation: Any = 1) -> Tensor:
    """``torch.nn.functional.conv_transpose1d`` with wsarena's passes (``output_padding`` below ``stride``)."""
    return _conv_transpose(1, input, weight, bias, stride, padding, output_padding, groups, dilation)


@_overridable
def conv_transpose2d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride: Any = 1, padding: Any = 0,
                     output_padding: Any = 0, groups: int = 1, dilation: Any = 1) -> Tensor:
    """``torch.nn.functional.conv_transpose2d`` with wsarena's passes (``output_padding`` below ``stride``)."""
    return _conv_transpose(2, input, weight, bias, stride, padding, output_padding, groups, dilation)


@_overridable
def conv_transpose3d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride: Any = 1, padding: Any = 0,
                     output_padding: Any = 0, groups: int = 1, dilation: Any = 1) -> Tensor:
    """``torch.nn.functional.conv_transpose3d`` with wsarena's passes (``output_padding`` below ``stride``)."""
    return _conv_transpose(3, input, weight, bias, stride, padding, output_padding, groups, dilation)
