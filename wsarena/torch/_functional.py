"""``conv1d``, ``conv2d``, ``conv3d``: drop-ins for ``torch.nn.functional``'s, their three passes run by wsarena.

Each checks its arguments as wsarena's ops do (a clear ``ValueError``/``TypeError`` before anything runs), applies
``torch.autocast`` as PyTorch does for its convolutions, and runs :class:`ConvFunction`, whose forward,
input-gradient and weight-gradient are wsarena's ``conv_forward``, ``conv_backward_data`` and
``conv_backward_filter`` (as the custom operators of :mod:`wsarena.torch._ops`). The bias is added by PyTorch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._geometry import conv_geometry
from . import _ops

__all__ = ["ConvFunction", "conv1d", "conv2d", "conv3d"]


class ConvFunction(torch.autograd.Function):
    """A convolution without bias: ``ConvFunction.apply(x, w, stride, padding, dilation, groups, layout)``.

    ``stride``, ``padding`` and ``dilation`` are lists with one int per spatial dimension, ``layout`` is
    ``"NCHW"`` or ``"NHWC"`` (a channels-last tensor); the functions :func:`conv2d` and its kin work them out.
    Differentiable once.
    """

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, w: Tensor, stride: list[int], padding: list[int], dilation: list[int], groups: int,
        layout: str,
    ) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.conv = (stride, padding, dilation, groups, layout)
        return torch.ops.wsarena.conv_forward(x, w, stride, padding, dilation, groups, layout)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, w = ctx.saved_tensors
        stride, padding, dilation, groups, layout = ctx.conv
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch.ops.wsarena.conv_backward_data(
                dy, w, list(x.shape), stride, padding, dilation, groups, layout
            )
        if ctx.needs_input_grad[1]:
            dw = torch.ops.wsarena.conv_backward_filter(
                x, dy, list(w.shape), stride, padding, dilation, groups, layout
            )
        return dx, dw, None, None, None, None, None


def _autocast(x: Tensor, w: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """The operands cast as ``torch.autocast`` casts a convolution's: floating types but float64 to its dtype."""
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return x, w, bias
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t: Tensor) -> Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t

    return cast(x), cast(w), None if bias is None else cast(bias)


def _conv(nd: int, x: Tensor, w: Tensor, bias: Tensor | None, stride: Any, padding: Any, dilation: Any,
          groups: int) -> Tensor:
    if not isinstance(x, Tensor) or not isinstance(w, Tensor):
        raise TypeError(f"input and weight must be tensors, not {type(x).__name__} and {type(w).__name__}")
    unbatched = x.dim() == nd + 1  # (C, *spatial), as torch.nn.functional takes it
    if unbatched:
        x = x.unsqueeze(0)
    if x.dim() != nd + 2 or w.dim() != nd + 2:
        raise ValueError(
            f"conv{nd}d needs a {nd + 1}- or {nd + 2}-D input and a {nd + 2}-D weight, not {x.dim()}-D and {w.dim()}-D"
        )
    x, w, bias = _autocast(x, w, bias)
    geom = conv_geometry(x.shape, w.shape, stride=stride, padding=padding, dilation=dilation, groups=groups)
    if x.dtype != w.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"dtypes differ: input is {x.dtype}, weight is {w.dtype}"
                        + (f", bias is {bias.dtype}" if bias is not None else ""))
    layout = _ops.layout_of(x, w)
    y = ConvFunction.apply(x, w, list(geom.stride), list(geom.padding), list(geom.dilation), geom.groups, layout)
    if bias is not None:
        y = y + bias.reshape(1, -1, *(1,) * nd)
    return y.squeeze(0) if unbatched else y


def conv1d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride: Any = 1, padding: Any = 0,
           dilation: Any = 1, groups: int = 1) -> Tensor:
    """``torch.nn.functional.conv1d`` with wsarena's passes (``padding`` symmetric, an int, a tuple, ``"valid"``
    or ``"same"``)."""
    return _conv(1, input, weight, bias, stride, padding, dilation, groups)


def conv2d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride: Any = 1, padding: Any = 0,
           dilation: Any = 1, groups: int = 1) -> Tensor:
    """``torch.nn.functional.conv2d`` with wsarena's passes (``padding`` symmetric, an int, a tuple, ``"valid"``
    or ``"same"``)."""
    return _conv(2, input, weight, bias, stride, padding, dilation, groups)


def conv3d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride: Any = 1, padding: Any = 0,
           dilation: Any = 1, groups: int = 1) -> Tensor:
    """``torch.nn.functional.conv3d`` with wsarena's passes (``padding`` symmetric, an int, a tuple, ``"valid"``
    or ``"same"``)."""
    return _conv(3, input, weight, bias, stride, padding, dilation, groups)
