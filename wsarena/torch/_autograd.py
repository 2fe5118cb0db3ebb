"""wsarena's three convolution passes as autograd Functions, each differentiable through the other two.

A convolution is bilinear in its two operands, so every gradient of a pass is one of the three passes again, and
so is every gradient of those: double backward (a gradient penalty), ``torch.func.grad`` over ``grad``, Hessians.

=========================  ==========================================  ==========================================
Function (what it gives)   gradient of its first operand               gradient of its second operand
=========================  ==========================================  ==========================================
ConvFunction: y(x, w)      dx = ConvTransposeFunction(dy, w)           dw = WeightGradFunction(x, dy)
ConvTransposeFunction:     d(dy) = ConvFunction(g, w)                  dw = WeightGradFunction(g, dy)
dx(dy, w)
WeightGradFunction:        dx = ConvTransposeFunction(dy, g)           d(dy) = ConvFunction(x, g)
dw(x, dy)
=========================  ==========================================  ==========================================

Under ``torch.func.vmap`` the mapped dimension joins the batch where the weight is shared, and becomes groups
otherwise (B weights are one grouped convolution with B times the groups), as PyTorch batches its own convolution.
Forward mode (``torch.func.jvp``, ``jacfwd``) is not offered: ``torch.compile`` takes no Function that defines it.

A backward pass runs under the settings (:func:`wsarena.config`) its forward ran under: PyTorch runs the backward
passes of CUDA tensors on a thread of its own, which a ``config()`` block of the caller's does not reach. A warning
from a forward pass names the user's line that called it; one from a backward pass names the forward call whose
gradient it computes (:mod:`wsarena._callsite`), as do the passes of a gradient of that gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from .. import _callsite, _config

__all__ = ["ConvFunction", "ConvTransposeFunction", "WeightGradFunction"]

_NO_GRADS = (None,) * 6  # for the arguments after the two operands: shapes and parameters


class ConvFunction(torch.autograd.Function):
    """A convolution without bias: ``ConvFunction.apply(x, w, stride, padding, dilation, groups, layout)``.

    ``stride``, ``padding`` and ``dilation`` are lists with one int per spatial dimension, ``layout`` is
    ``"NCHW"`` or ``"NHWC"`` (a channels-last tensor); the functions :func:`conv2d` and its kin work them out.
    Differentiable any number of times (reverse mode), and batched by ``torch.func.vmap``.
    """

    @staticmethod
    def forward(
        x: Tensor, w: Tensor, stride: list[int], padding: list[int], dilation: list[int], groups: int, layout: str
    ) -> Tensor:
        return torch.ops.wsarena.conv_forward(x, w, stride, padding, dilation, groups, layout)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _setup(ctx, inputs)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, w = ctx.saved_tensors
        dx = dw = None
        with _as_started(ctx.started):
            if ctx.needs_input_grad[0]:
                dx = ConvTransposeFunction.apply(dy, w, list(x.shape), *ctx.conv)
            if ctx.needs_input_grad[1]:
                dw = WeightGradFunction.apply(x, dy, list(w.shape), *ctx.conv)
        return (dx, dw, *_NO_GRADS[:5])

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], x: Tensor, w: Tensor, *conv: Any) -> tuple[Tensor, int]:
        stride, padding, dilation, groups, layout = conv
        size = info.batch_size
        if in_dims[1] is None:  # one weight for all: the mapped dimension joins the batch
            y = ConvFunction.apply(_first(x, in_dims[0], size).flatten(0, 1), w, *conv)
            return y.unflatten(0, (size, -1)), 0
        y = ConvFunction.apply(_channels(x, in_dims[0], size), _first(w, in_dims[1], size).flatten(0, 1), stride,
                               padding, dilation, groups * size, layout)
        return y.unflatten(1, (size, -1)), 1


class ConvTransposeFunction(torch.autograd.Function):
    """A transposed convolution without bias:
    ``ConvTransposeFunction.apply(x, w, output_shape, stride, padding, dilation, groups, layout)``.

    It is the input gradient of the convolution of an ``output_shape`` input by ``w`` (``output_shape`` logical,
    channels first); its own input gradient is that convolution's forward, its weight gradient the convolution's
    weight gradient with the gradient as the convolution's input and ``x`` as its output gradient. Arguments as
    :class:`ConvFunction`'s, and differentiable as it is.
    """

    @staticmethod
    def forward(
        x: Tensor, w: Tensor, output_shape: list[int], stride: list[int], padding: list[int], dilation: list[int],
        groups: int, layout: str,
    ) -> Tensor:
        return torch.ops.wsarena.conv_backward_data(x, w, output_shape, stride, padding, dilation, groups, layout)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _setup(ctx, inputs)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, w = ctx.saved_tensors
        dx = dw = None
        with _as_started(ctx.started):
            if ctx.needs_input_grad[0]:
                dx = ConvFunction.apply(dy, w, *ctx.conv)
            if ctx.needs_input_grad[1]:
                dw = WeightGradFunction.apply(dy, x, list(w.shape), *ctx.conv)
        return (dx, dw, *_NO_GRADS)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], x: Tensor, w: Tensor, output_shape: list[int],
             *conv: Any) -> tuple[Tensor, int]:
        stride, padding, dilation, groups, layout = conv
        size = info.batch_size
        batch, channels, *spatial = output_shape
        if in_dims[1] is None:
            dx = ConvTransposeFunction.apply(_first(x, in_dims[0], size).flatten(0, 1), w,
                                             [size * batch, channels, *spatial], *conv)
            return dx.unflatten(0, (size, -1)), 0
        dx = ConvTransposeFunction.apply(_channels(x, in_dims[0], size), _first(w, in_dims[1], size).flatten(0, 1),
                                         [batch, size * channels, *spatial], stride, padding, dilation, groups * size,
                                         layout)
        return dx.unflatten(1, (size, -1)), 1


class WeightGradFunction(torch.autograd.Function):
    """A convolution's weight gradient:
    ``WeightGradFunction.apply(x, dy, weight_shape, stride, padding, dilation, groups, layout)``, the gradient of the
    ``weight_shape`` weight of the convolution of ``x`` whose output has the gradient ``dy``. Arguments as
    :class:`ConvFunction`'s, and differentiable as it is."""

    @staticmethod
    def forward(
        x: Tensor, dy: Tensor, weight_shape: list[int], stride: list[int], padding: list[int], dilation: list[int],
        groups: int, layout: str,
    ) -> Tensor:
        return torch.ops.wsarena.conv_backward_filter(x, dy, weight_shape, stride, padding, dilation, groups, layout)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _setup(ctx, inputs)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        x, dy = ctx.saved_tensors
        dx = ddy = None
        with _as_started(ctx.started):
            if ctx.needs_input_grad[0]:
                dx = ConvTransposeFunction.apply(dy, g, list(x.shape), *ctx.conv)
            if ctx.needs_input_grad[1]:
                ddy = ConvFunction.apply(x, g, *ctx.conv)
        return (dx, ddy, *_NO_GRADS)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], x: Tensor, dy: Tensor, weight_shape: list[int],
             *conv: Any) -> tuple[Tensor, int]:
        stride, padding, dilation, groups, layout = conv
        size = info.batch_size
        dw = WeightGradFunction.apply(_channels(x, in_dims[0], size), _channels(dy, in_dims[1], size),
                                      [size * weight_shape[0], *weight_shape[1:]], stride, padding, dilation,
                                      groups * size, layout)
        return dw.unflatten(0, (size, -1)), 0


def _setup(ctx: Any, inputs: tuple[Any, ...]) -> None:
    """What each Function keeps: its two operands, its parameters ``(stride, padding, dilation, groups, layout)``
    (after a shape argument, where it takes one), and where its forward started."""
    a, b, *rest = inputs
    ctx.save_for_backward(a, b)
    ctx.conv = tuple(rest[-5:])
    ctx.started = _started()


def _first(t: Tensor, dim: int | None, size: int) -> Tensor:
    """``t`` with its mapped dimension first; expanded to ``size`` where it has none."""
    return t.movedim(dim, 0) if dim is not None else t.expand(size, *t.shape)


def _channels(t: Tensor, dim: int | None, size: int) -> Tensor:
    """``(size, N, C, *spatial)`` as ``(N, size * C, *spatial)``: the mapped dimension as groups of channels."""
    return _first(t, dim, size).movedim(0, 1).flatten(1, 2)


def _started() -> tuple[_callsite.Site, _config.Config | None] | None:
    """Where a forward was called and the ``config()`` block it ran in (``None``: none, so the process-wide
    settings, which ``configure()`` may change before the backward), for its backward passes (none while
    ``torch.compile`` traces it: a compiled backward runs the operators without these functions, and a warning
    names the first line outside PyTorch and wsarena). Inside a backward pass (a gradient of a gradient) that is
    the backward's own forward call and settings."""
    return None if torch.compiler.is_compiling() else (_callsite.caller(), _config.overridden())


@contextlib.contextmanager
def _as_started(started: tuple[_callsite.Site, _config.Config | None] | None) -> Iterator[None]:
    """A backward pass's body: its warnings reported at the forward's call, under the forward's settings
    (``torch.compile`` traces neither: each sets a context variable)."""
    if started is None or torch.compiler.is_compiling():
        yield
        return
    site, settings = started
    with _callsite.reported_at(site), _config.using(settings):
        yield
