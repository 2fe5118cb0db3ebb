"""wsarena's three convolution passes as PyTorch custom operators (``torch.ops.wsarena.*``).

Registered with ``torch.library.custom_op``, with fake implementations that give the output's shape, dtype and
memory format, so that ``torch.compile`` traces them as single operators instead of looking inside; their
gradients (the other two operators) and tangents are registered by :mod:`wsarena.torch._autograd`. Each runs
through the public ops (:func:`wsarena.conv_forward` and the two gradients) on the tensors themselves, which
the ops view as NumPy or CuPy arrays without a copy; the result is written into a tensor PyTorch allocated. An
operand that is not dense in the call's layout (a gradient PyTorch hands over strided) is made dense by PyTorch
first, so that all the memory a call touches is PyTorch's or the arena's: what ``torch.cuda.graph`` keeps for its
replays.

Layout: ``"NHWC"`` runs a channels-last tensor (``torch.channels_last``, ``torch.channels_last_3d``) as the
ops' channels-last layout, on its own memory; its results are channels-last tensors, as PyTorch's are.

Under ``torch.func.vmap`` each operator is one call with the mapped dimension folded into the batch or the groups
(their ``register_vmap`` rules). ``torch.utils.flop_counter.FlopCounterMode`` counts each by PyTorch's formula for the
convolution pass it is.

:func:`call` runs an operator's Python function straight, without PyTorch's dispatcher, where the dispatcher would
do nothing else (an ordinary forward and backward on plain tensors, and calls in inference mode).

On the CPU, float16 and bfloat16 tensors are computed in float32 (the CPU backend has no half-precision
kernels) and rounded to their dtype, as PyTorch's CPU convolution accumulates them in float32.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._guards import TracingContext
from torch.autograd import forward_ad
from torch.utils import flop_counter

from .. import ops
from .._geometry import output_size

__all__ = [
    "call", "call_unrecorded", "channels_last", "conv_backward_data", "conv_backward_filter", "conv_forward",
    "layout_of", "transforms_active", "transforms_traced",
]

_HALF = (torch.float16, torch.bfloat16)


def _channels_last(t: Tensor) -> bool:
    """Whether PyTorch takes ``t`` for channels-last (``Tensor.suggest_memory_format()``, which has no Python name):
    its strides grow from the channels through the spatial dimensions, innermost first, to the batch. Strides, not
    ``is_contiguous(memory_format=...)``, which is true of both formats where a dimension is 1 (one channel, a 1x1
    kernel): PyTorch reads those tensors by their strides too (c10's ``is_channels_last_strides_2d``), and a
    tensor under ``torch.func.vmap`` has strides but answers no ``is_contiguous`` question but the plain one."""
    if t.dim() not in (4, 5) or t.layout != torch.strided:
        return False
    # ints, where torch.jit.trace gives tensors; traced by torch.compile or torch.export, as they are (symbolic
    # sizes made ints would be fixed to the traced values)
    sizes = list(t.shape) if compiling() else [operator.index(n) for n in t.shape]
    strides = t.stride()
    if strides[1] == 0:
        return False
    least = 0
    for d in (1, *range(t.dim() - 1, 1, -1), 0):
        if sizes[d] == 0 or strides[d] < least or (d == 0 and least == strides[1]):
            return False
        least = strides[d] * sizes[d]
    return True


def _compiling_traced() -> bool:
    """:func:`compiling` where ``torch.compiler.is_compiling()`` is true only in the frames Dynamo traces (PyTorch
    2.11, 2.7), not in code it runs on its fake tensors rather than traces (an ``allow_in_graph`` or
    ``nonstrict_trace`` function; on 2.7 a module of torch.nn's own classes in a strict export, wsarena's among
    them) nor in AOTAutograd's trace, where symbolic sizes were then made ints (fixed to the traced values) and
    forward AD took the eager path. There the tracing context Dynamo holds while it compiles, on this thread alone,
    says so: a FakeTensorMode of the user's, a meta tensor, eager code on another thread have none. Asked only under
    a dispatch mode (such code runs under the compile's fake mode): its lookup costs some 0.6 us where it finds
    none."""
    return torch.compiler.is_compiling() or (_dispatch_modes() > 0 and _tracing_context() is not None)


_tracing_context = TracingContext.try_get
# how many TorchDispatchModes are in force on this thread (wsarena.torch's one lookup of it)
_dispatch_modes: Callable[[], int] = torch._C._len_torch_dispatch_stack
# Whether a torch.compile or torch.export trace runs this: torch.compiler.is_compiling() itself where PyTorch holds it
# true for the whole compile (2.13: Dynamo enters torch.compiler._compile_session_context for each frame it compiles,
# its backend's call included, and an export sets it too), which costs nothing over it; _compiling_traced's test,
# some 0.12 us a call more (four a forward, fourteen a training step), where it holds it only in the traced frames
compiling: Callable[[], bool] = (torch.compiler.is_compiling if hasattr(torch.compiler, "_compile_session_context")
                                 else _compiling_traced)


def exporting() -> bool:
    """Whether ``torch.export`` is tracing: the flag ``torch.compiler.is_exporting()`` returns, read where PyTorch
    has it. A torch.compile trace before PyTorch 2.13 takes the function itself for True (its table of tracing-state
    functions), which would make every compiled call look exported; it reads the flag as it is."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else bool(flag)


def channels_last(x: Tensor, w: Tensor) -> bool:
    """Whether the input or the weight is channels-last (:func:`_channels_last`), which follows from their sizes and
    strides alone."""
    return _channels_last(x) or _channels_last(w)


def layout_of(x: Tensor, w: Tensor, either_channels_last: bool | None = None) -> str:
    """``"NHWC"`` when the input or the weight is channels-last (PyTorch's rule for its output), else ``"NCHW"``;
    but ``"NCHW"`` for float64 tensors that PyTorch computes contiguous, results and gradients, whatever their
    format: on a CUDA device (cuDNN's format for them, ``cudnn_conv_suggest_memory_format``, is contiguous for
    float64) and 3-D ones in host memory (slow_conv3d: oneDNN takes no float64). (Its 3-D float32 and half results
    on the CPU follow oneDNN's heuristics, of batch size, kernel and threads, which are not repeated here.)
    ``either_channels_last``: :func:`channels_last` of the two, where the caller knows it."""
    if either_channels_last is None:
        either_channels_last = channels_last(x, w)
    if not either_channels_last:
        return "NCHW"
    if x.dtype == torch.float64 and (x.is_cuda or (x.dim() == 5 and x.device.type == "cpu")):
        return "NCHW"
    return "NHWC"


def _order(shape: Sequence[int], layout: str) -> list[int]:
    """A logical ``(N, C, *spatial)`` shape in the order of ``layout``."""
    shape = list(shape)
    return shape if layout == "NCHW" else [shape[0], *shape[2:], shape[1]]


def _memory_format(ndim: int, layout: str) -> torch.memory_format:
    if layout == "NCHW":
        return torch.contiguous_format
    return torch.channels_last if ndim == 4 else torch.channels_last_3d


def _empty(shape: Sequence[int], like: Tensor, layout: str) -> Tensor:
    memory_format = _memory_format(len(shape), layout)
    # the sizes as arguments: a list (a copy of the shape) takes PyTorch's argument parser 1.8-4k instructions more
    return torch.empty(*shape, dtype=like.dtype, device=like.device, memory_format=memory_format)


def _computed(t: Tensor, memory_format: torch.memory_format) -> Tensor:
    """What the ops compute on: ``t`` without autograd history, in float32 when a half type on the CPU, and dense in
    ``memory_format`` (the call's layout). A gradient PyTorch hands over may be strided (an expanded ``sum()``
    gradient, NCHW beside a channels-last input): it is made dense here, by PyTorch's allocator, rather than by the
    ops' copy into their array library's memory, which a CUDA graph captured by ``torch.cuda.graph`` would not keep
    for its replays."""
    if t.requires_grad:  # one that requires none has no history: the same view undetached, without detach's 0.3 us
        t = t.detach()
    if t.is_cpu and t.dtype in _HALF:
        t = t.float()
    return t.contiguous(memory_format=memory_format)


def _run(function: Callable[..., Any], a: Tensor, b: Tensor, out: Tensor, layout: str, *args: Any) -> Tensor:
    """Call one of the public ops on ``a``, ``b`` with ``out=``, through a float32 copy for CPU half types."""
    half_on_cpu = out.is_cpu and out.dtype in _HALF
    target = torch.empty_like(out, dtype=torch.float32) if half_on_cpu else out
    memory_format = _memory_format(out.dim(), layout)
    # `out` is new, nothing has saved it: written through `.data`, which has a version counter of its own, it keeps
    # version 0, as the dispatcher's results do (the ops count a write into a PyTorch out= as an in-place change;
    # so does copy_, for a half type on the CPU)
    a, b, into = _computed(a, memory_format), _computed(b, memory_format), target.data
    if layout != "NCHW":  # channels-last tensors as the ops see them, (N, *spatial, C) views
        a, b, into = a.movedim(1, -1), b.movedim(1, -1), into.movedim(1, -1)
    if a.is_cpu and b.is_cpu and into.is_cpu:
        # All in host memory: the NumPy views the ops would make of them (wsarena._interop), made here, so that
        # the ops take them as they take NumPy arrays. What the ops check of a tensor first holds by construction:
        # nothing here requires grad, `into` is new in the mode the call runs in, and its version bump would land
        # on `.data`'s own counter, which nothing reads.
        function(a.numpy(), b.numpy(), *args, out=into.numpy(), layout=layout)
    else:
        function(a, b, *args, out=into, layout=layout)
    if target is not out:
        out.data.copy_(target)
    return out


def _output_shape(
    x: Sequence[int], w: Sequence[int], stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int]
) -> list[int]:
    return [x[0], w[0], *map(output_size, x[2:], w[2:], stride, padding, dilation)]


def _conv_forward(
    x: Tensor, w: Tensor, stride: list[int], padding: list[int], dilation: list[int], groups: int, layout: str
) -> Tensor:
    """``y = conv(x, w)`` through :func:`wsarena.conv_forward`; shapes and parameters as checked by the caller."""
    y = _empty(_output_shape(x.shape, w.shape, stride, padding, dilation), x, layout)
    return _run(ops.conv_forward, x, w, y, layout, stride, padding, dilation, groups)


conv_forward = torch.library.custom_op("wsarena::conv_forward", mutates_args=())(_conv_forward)


def _no_meta_beside(names: str, a: Tensor, b: Tensor) -> None:
    """Refuse a meta ``b`` beside a real ``a``, whose device the result takes: the fake kernel answers for such a
    mix, with a result never written."""
    if b.is_meta and not a.is_meta:
        first, second = names.split()
        raise TypeError(f"{second} is on the meta device, which holds no values, and {first} on {a.device}")


@conv_forward.register_fake
def _conv_forward_fake(
    x: Tensor, w: Tensor, stride: list[int], padding: list[int], dilation: list[int], groups: int, layout: str
) -> Tensor:
    _no_meta_beside("x w", x, w)
    return _empty(_output_shape(x.shape, w.shape, stride, padding, dilation), x, layout)


def _conv_backward_data(
    dy: Tensor, w: Tensor, input_shape: list[int], stride: list[int], padding: list[int], dilation: list[int],
    groups: int, layout: str,
) -> Tensor:
    """``dx`` of shape ``input_shape`` through :func:`wsarena.conv_backward_data`."""
    dx = _empty(input_shape, dy, layout)
    return _run(ops.conv_backward_data, dy, w, dx, layout, _order(input_shape, layout), stride, padding, dilation,
                groups)


conv_backward_data = torch.library.custom_op("wsarena::conv_backward_data", mutates_args=())(_conv_backward_data)


@conv_backward_data.register_fake
def _conv_backward_data_fake(
    dy: Tensor, w: Tensor, input_shape: list[int], stride: list[int], padding: list[int], dilation: list[int],
    groups: int, layout: str,
) -> Tensor:
    _no_meta_beside("dy w", dy, w)
    return _empty(input_shape, dy, layout)


def _conv_backward_filter(
    x: Tensor, dy: Tensor, weight_shape: list[int], stride: list[int], padding: list[int], dilation: list[int],
    groups: int, layout: str,
) -> Tensor:
    """``dw`` of shape ``weight_shape`` through :func:`wsarena.conv_backward_filter`."""
    dw = _empty(weight_shape, x, layout)
    return _run(ops.conv_backward_filter, x, dy, dw, layout, _order(weight_shape, layout), stride, padding,
                dilation, groups)


conv_backward_filter = torch.library.custom_op("wsarena::conv_backward_filter", mutates_args=())(_conv_backward_filter)


@conv_backward_filter.register_fake
def _conv_backward_filter_fake(
    x: Tensor, dy: Tensor, weight_shape: list[int], stride: list[int], padding: list[int], dilation: list[int],
    groups: int, layout: str,
) -> Tensor:
    _no_meta_beside("x dy", x, dy)
    return _empty(weight_shape, x, layout)


# The Python functions behind the operators, which call() runs straight.
_KERNELS: dict[Any, Callable[..., Tensor]] = {
    conv_forward: _conv_forward, conv_backward_data: _conv_backward_data, conv_backward_filter: _conv_backward_filter,
}
transforms_active: Callable[[], bool] = getattr(torch._C, "_are_functorch_transforms_active", lambda: True)


@torch.compiler.assume_constant_result
def transforms_traced() -> bool:
    """:func:`transforms_active` where a torch.compile trace may ask: a constant of the trace, where Dynamo records
    the call in its graph as well, whose result nothing uses."""
    return transforms_active()


# is_cuda: the dispatch keys of an ordinary and an inference tensor, as their raw_repr() numbers: a DispatchKeySet
# equals only itself before PyTorch 2.8 (2.7 defines no ==), so an ordinary tensor never ran straight there
_plain_keys: dict[bool, tuple[int, int]] = {}


def _plain(is_cuda: bool) -> tuple[int, int]:
    """The dispatch keys of a plain tensor on the CPU (``False``) or a CUDA device, made once: an ordinary tensor's
    (made outside inference mode: backend, ADInplaceOrView, Autograd and Autocast keys) and an inference tensor's
    (made in inference mode: backend and Autocast keys alone). On that device whatever the operands' (a meta
    tensor's are no plain tensor's), and only where no mode is active (a fake mode would make the tensor fake)."""
    device = "cuda" if is_cuda else "cpu"
    with torch.inference_mode(False):
        ordinary = torch._C._dispatch_keys(torch.empty(0, device=device)).raw_repr()
    with torch.inference_mode():
        inference = torch._C._dispatch_keys(torch.empty(0, device=device)).raw_repr()
    keys = _plain_keys[is_cuda] = (ordinary, inference)
    return keys


def call(op: Any, a: Tensor, b: Tensor, *args: Any) -> Tensor:
    """``op(a, b, *args)``, one of the operators: straight to its Python function where PyTorch's dispatcher would
    reach nothing else on the way, which saves the dispatcher's 20-30 us a call (bench/RESULTS.md); through the
    dispatcher otherwise. Straight only with no gradient to record (a Function's forward, a backward without a
    graph), nothing that sees operators (a dispatch or torch-function mode, the profiler, forward AD's dual
    tensors, torch.func's transforms, a trace), and operands that are plain CPU or CUDA tensors to the dispatcher
    (their dispatch keys those of an ordinary or an inference tensor: not batched by ``is_grads_batched``, wrapped
    by torch.func, fake, meta, conjugated, negated, nor of a subclass that handles torch functions or dispatch).
    Inference tensors and inference mode, in any mix with ordinary tensors, leave the dispatcher nothing but the
    operator's backend kernel: inference mode excludes the Autograd keys and includes no ADInplaceOrView, which the
    operators fall through anyway (they mutate nothing), and the kernel run straight runs in the same mode, so its
    results are inference tensors exactly where the dispatcher's are. A torch-function mode
    (``torch.set_default_device``'s among them) is handed wsarena.torch's function first, as it is handed torch's
    own convolution. Inside its handler the mode is not in force, so the function it calls runs straight. While a
    mode is in force, the operators go through the dispatcher: the mode cannot be told from any other by a public
    check, and the kernel run straight under it would pay the mode's Python on each of its own torch calls, which
    the dispatcher spares it.
    What Python cannot ask about goes unseen on the straight path: an ``ExecutionTraceObserver`` started without the
    profiler records the operators only from the dispatcher."""
    if (torch.is_grad_enabled() or forward_ad._current_level >= 0 or transforms_active() or torch.jit.is_tracing()
            or compiling()):
        return op(a, b, *args)
    return call_unrecorded(op, a, b, *args)


def call_unrecorded(op: Any, a: Tensor, b: Tensor, *args: Any) -> Tensor:
    """:func:`call` where the caller has found grad mode and forward AD off, and no torch.func transform or trace
    (:func:`wsarena.torch._autograd.apply`): the rest of its checks."""
    if torch._C._has_torch_function((a, b)) or _dispatch_modes() or \
            torch._C._autograd._profiler_enabled():
        return op(a, b, *args)
    plain = _plain_keys.get(a.is_cuda)
    if plain is None:
        plain = _plain(a.is_cuda)
    ordinary, inference = plain
    keys_a, keys_b = torch._C._dispatch_keys(a).raw_repr(), torch._C._dispatch_keys(b).raw_repr()
    if (keys_a == ordinary or keys_a == inference) and (keys_b == ordinary or keys_b == inference):
        return _KERNELS[op](a, b, *args)
    return op(a, b, *args)


# -- torch.func.vmap -----------------------------------------------------------------------------------------------
# The mapped dimension joins the batch where the weight is shared, and becomes groups otherwise (B weights are one
# grouped convolution with B times the groups), as PyTorch batches its own convolution: one call, not B.


def _first(t: Tensor, dim: int | None, size: int) -> Tensor:
    """``t`` with its mapped dimension first; expanded to ``size`` where it has none."""
    return t.movedim(dim, 0) if dim is not None else t.expand(size, *t.shape)


def _split(t: Tensor, dim: int, size: int) -> Tensor:
    """``t``, a new result, with dimension ``dim`` split in two, ``(size, -1)``: ``unflatten``, but not a view to
    autograd (``aten::_unsafe_view``, the same memory). A vmapped Function's result is what its forward returns
    here, and a view made inside a Function is one autograd forbids to change in place (a ``relu_`` after a
    convolution whose weight requires a gradient)."""
    shape = list(t.shape)
    return torch.ops.aten._unsafe_view(t, [*shape[:dim], size, shape[dim] // size, *shape[dim + 1:]])


def _as_channels(t: Tensor, dim: int | None, size: int) -> Tensor:
    """``(size, N, C, *spatial)`` as ``(N, size * C, *spatial)``: the mapped dimension as groups of channels."""
    return _first(t, dim, size).movedim(0, 1).flatten(1, 2)


@conv_forward.register_vmap
def _conv_forward_vmap(
    info: Any, in_dims: tuple[int | None, ...], x: Tensor, w: Tensor, stride: list[int], padding: list[int],
    dilation: list[int], groups: int, layout: str,
) -> tuple[Tensor, int]:
    size, (dx, dw) = info.batch_size, in_dims[:2]
    if dw is None:
        y = conv_forward(_first(x, dx, size).flatten(0, 1), w, stride, padding, dilation, groups, layout)
        return _split(y, 0, size), 0
    w = _first(w, dw, size).flatten(0, 1)
    y = conv_forward(_as_channels(x, dx, size), w, stride, padding, dilation, groups * size, layout)
    return _split(y, 1, size), 1


@conv_backward_data.register_vmap
def _conv_backward_data_vmap(
    info: Any, in_dims: tuple[int | None, ...], dy: Tensor, w: Tensor, input_shape: list[int], stride: list[int],
    padding: list[int], dilation: list[int], groups: int, layout: str,
) -> tuple[Tensor, int]:
    size, (ddy, dw) = info.batch_size, in_dims[:2]
    batch, channels, *spatial = input_shape
    if dw is None:
        dx = conv_backward_data(_first(dy, ddy, size).flatten(0, 1), w, [size * batch, channels, *spatial], stride,
                                padding, dilation, groups, layout)
        return _split(dx, 0, size), 0
    dx = conv_backward_data(_as_channels(dy, ddy, size), _first(w, dw, size).flatten(0, 1),
                            [batch, size * channels, *spatial], stride, padding, dilation, groups * size, layout)
    return _split(dx, 1, size), 1


@conv_backward_filter.register_vmap
def _conv_backward_filter_vmap(
    info: Any, in_dims: tuple[int | None, ...], x: Tensor, dy: Tensor, weight_shape: list[int], stride: list[int],
    padding: list[int], dilation: list[int], groups: int, layout: str,
) -> tuple[Tensor, int]:
    size = info.batch_size
    dw = conv_backward_filter(_as_channels(x, in_dims[0], size), _as_channels(dy, in_dims[1], size),
                              [size * weight_shape[0], *weight_shape[1:]], stride, padding, dilation, groups * size,
                              layout)
    return _split(dw, 0, size), 0


# -- torch.utils.flop_counter ----------------------------------------------------------------------------------------
# FlopCounterMode counts each operator by PyTorch's own formula for the convolution pass it is, on its logical shapes,
# so that a converted model counts what PyTorch's convolutions count (without these, nothing).


@flop_counter.register_flop_formula(torch.ops.wsarena.conv_forward)
def _conv_forward_flops(x_shape: list[int], w_shape: list[int], *_: Any, out_shape: list[int], **__: Any) -> int:
    return flop_counter.conv_flop_count(x_shape, w_shape, out_shape)


@flop_counter.register_flop_formula(torch.ops.wsarena.conv_backward_data)
def _conv_backward_data_flops(dy_shape: list[int], w_shape: list[int], *_: Any, out_shape: list[int],
                              **__: Any) -> int:
    return flop_counter.conv_flop_count(dy_shape, w_shape, out_shape, transposed=True)


@flop_counter.register_flop_formula(torch.ops.wsarena.conv_backward_filter)
def _conv_backward_filter_flops(x_shape: list[int], dy_shape: list[int], *_: Any, out_shape: list[int],
                                **__: Any) -> int:
    def t(shape: list[int]) -> list[int]:  # channels and batch swapped, as PyTorch counts a weight gradient
        return [shape[1], shape[0], *shape[2:]]

    return flop_counter.conv_flop_count(t(x_shape), t(dy_shape), t(out_shape))
