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

Forward mode follows from the same bilinearity: the tangent of ``P(a, b)`` is ``P(da, b) + P(a, db)``, each
Function's pass again, run only for an operand that has a tangent (``torch.func.jvp``, ``jacfwd``, ``hessian``, and
``torch.autograd.forward_ad``'s dual tensors). ``torch.compile`` takes no Function that defines ``jvp``: the public
Functions define none, and :func:`apply` runs forms of them that do (:data:`_OLDER`, :data:`_BIASED`) outside
torch.func's transforms and torch.compile traces; under those, the operators, which have a forward mode of their own
(but for dual tensors a compiled function may be given, which run such a form by a graph break).

:func:`apply` runs a Function as cheaply as the context allows: outside torch.func's transforms in autograd's older
form, which takes a bias as a third operand (:data:`_BIASED`: the bias added in its forward, its gradient computed in
its backward, one autograd node, as PyTorch's convolution with a bias is); elsewhere the bias is added to the result
by PyTorch (:func:`add_bias`), which records the add where it is differentiated (the graphs of ``torch.compile`` and
``torch.export`` hold it beside the operators, which take no bias). The operators are differentiable by themselves
too, with the Functions' setup and backward: a backward pass calls them, not the Functions (:func:`_pass`), and so
do torch.func's transforms, a graph that holds them rather than the Functions (``torch.compile``'s and
``torch.export``'s), and a call of ``torch.ops.wsarena.*`` itself, in both modes: their autograd kernel
(:func:`_autograd_kernel`) applies a form of the Function with a ``jvp`` made of the operator. Under
``torch.func.vmap`` the operators batch themselves (:mod:`wsarena.torch._ops`), and the Functions follow.

A backward pass runs under the settings (:func:`wsarena.config`) its forward ran under: PyTorch runs the backward
passes of CUDA tensors on a thread of its own, which a ``config()`` block of the caller's does not reach. A warning
from a forward pass names the user's line that called it; one from a backward pass names the forward call whose
gradient it computes (:mod:`wsarena._callsite`), as do the passes of a gradient of that gradient.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._functorch.utils import enable_single_level_autograd_function as _single_level
from torch.autograd import forward_ad
from torch.autograd.function import _SingleLevelFunction

from .. import _callsite, _config
from . import _ops

__all__ = ["ConvFunction", "ConvTransposeFunction", "WeightGradFunction", "add_bias", "apply"]

_NO_GRADS = (None,) * 6  # for the arguments after the two operands: shapes and parameters


class _Pass(torch.autograd.Function):
    """What the three Functions share: what they keep for their backward, and their vmap rules, generated from
    those of the operators they run."""

    generate_vmap_rule = True

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _setup(ctx, inputs, output)


class ConvFunction(_Pass):
    """A convolution without bias: ``ConvFunction.apply(x, w, stride, padding, dilation, groups, layout)``.

    ``stride``, ``padding`` and ``dilation`` are lists (or tuples) of one int per spatial dimension, ``layout`` is
    ``"NCHW"`` or ``"NHWC"`` (a channels-last tensor); the functions :func:`conv2d` and its kin work them out.
    Differentiable any number of times (reverse mode; forward mode through :func:`conv2d` and its kin, which apply
    a form of it with a ``jvp``), and batched by ``torch.func.vmap``.
    """

    @staticmethod
    def forward(
        x: Tensor, w: Tensor, stride: list[int], padding: list[int], dilation: list[int], groups: int, layout: str
    ) -> Tensor:
        return torch.ops.wsarena.conv_forward(x, w, stride, padding, dilation, groups, layout)

    @staticmethod
    def backward(ctx: Any, dy: Tensor | None) -> tuple[Tensor | None, ...]:
        x, w = ctx.saved_tensors
        dx = dw = None
        site, settings = _as_started(ctx.started)
        with site, settings:
            if _wanted(ctx, 0, dy):
                dx = _pass(ConvTransposeFunction, dy, w, list(x.shape), *ctx.conv)
            if _wanted(ctx, 1, dy):
                dw = _pass(WeightGradFunction, x, dy, list(w.shape), *ctx.conv)
        return (dx, dw, *_NO_GRADS[:5])


class ConvTransposeFunction(_Pass):
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
    def backward(ctx: Any, dy: Tensor | None) -> tuple[Tensor | None, ...]:
        x, w = ctx.saved_tensors
        dx = dw = None
        site, settings = _as_started(ctx.started)
        with site, settings:
            if _wanted(ctx, 0, dy):
                dx = _pass(ConvFunction, dy, w, *ctx.conv)
            if _wanted(ctx, 1, dy):
                dw = _pass(WeightGradFunction, dy, x, list(w.shape), *ctx.conv)
        return (dx, dw, *_NO_GRADS)


class WeightGradFunction(_Pass):
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
    def backward(ctx: Any, g: Tensor | None) -> tuple[Tensor | None, ...]:
        x, dy = ctx.saved_tensors
        dx = ddy = None
        site, settings = _as_started(ctx.started)
        with site, settings:
            if _wanted(ctx, 0, g):
                dx = _pass(ConvTransposeFunction, dy, g, list(x.shape), *ctx.conv)
            if _wanted(ctx, 1, g):
                ddy = _pass(ConvFunction, x, g, *ctx.conv)
        return (dx, ddy, *_NO_GRADS)


# Autograd runs the form above, whose forward has no ctx (setup_context does its part), about 15 us a call slower than
# the older one, binding the arguments to forward's signature. Outside torch.func's transforms (which take a Function
# only in the form above: under them the operators run, whose autograd kernel applies its own form) and outside a
# torch.compile trace (which takes only the public form: it refuses a Function with a jvp) each runs in the older
# form, made here from the same setup and backward, whose forward runs the operator by _ops.call and which defines
# the jvp of forward mode (_jvp).
_transforms_active = _ops.transforms_active
_compiling = _ops.compiling
_OPERATORS: dict[type[torch.autograd.Function], Any] = {
    ConvFunction: _ops.conv_forward, ConvTransposeFunction: _ops.conv_backward_data,
    WeightGradFunction: _ops.conv_backward_filter,
}


def _eager_backward(backward: Callable[..., Any]) -> Callable[..., Any]:
    """``backward``, a Function's backward, run uncompiled where autograd runs it in code a compiled function runs
    eagerly (after a graph break, as at ``torch.autograd.grad`` in a gradient penalty), as a C++ operator's backward
    runs: Dynamo compiled it as a frame of its own, which raised ``AssertionError: Expected FakeBackwardCFunction``
    where it calls another Function's backward (the forms with a bias, the operators'), and elsewhere ran it under
    the process-wide settings, not its forward's, and computed every gradient required, asked for or not. Its code is
    marked for Dynamo to skip its frames and those they call, which costs nothing outside a compile (the older forms'
    backward is the public Function's, skipped alike); where PyTorch has no such mark, a wrapper disables Dynamo
    (0.5 us a call). Dynamo still traces it where it traces the Function (a public one applied in a compiled
    function): the mark is read only where a frame starts."""
    if _SKIP_FRAMES is None:
        return torch.compiler.disable(backward)
    _set_code_exec_strategy(backward.__code__, _SKIP_FRAMES)
    return backward


try:  # Dynamo's own skip of a code object's frames, here with those they call (its skip_code leaves these)
    from torch._dynamo.eval_frame import set_code_exec_strategy as _set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy
    _SKIP_FRAMES: Any = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
except (ImportError, AttributeError, TypeError):  # pragma: no cover - a PyTorch without it, or with another form
    _SKIP_FRAMES = None


def _jvp(function: type[torch.autograd.Function]) -> Callable[..., Tensor | None]:
    """``function``'s ``jvp``: the tangent of its output, bilinear in its two operands, from theirs."""

    def jvp(ctx: Any, da: Tensor | None, db: Tensor | None, *_: Any) -> Tensor | None:
        a, b = ctx.saved_tensors
        site, settings = _as_started(ctx.started)
        with site, settings:
            first = None if da is None else _pass(function, da, b, *ctx.rest)
            second = None if db is None else _pass(function, a, db, *ctx.rest)
        return second if first is None else first if second is None else first + second

    return jvp


def _older_form(function: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    op = _OPERATORS[function]

    def forward(ctx: Any, *args: Any) -> Tensor:
        output = _ops.call(op, *args)
        function.setup_context(ctx, args, output)
        return output

    body = {"forward": staticmethod(forward), "backward": staticmethod(_eager_backward(function.backward)),
            "jvp": staticmethod(_jvp(function)), "__doc__": function.__doc__}
    return type(function.__name__, (torch.autograd.Function,), body)


def _biased_form(function: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    """``function``'s older form with a bias, applied as ``(a, b, bias, *rest)``: its forward adds the bias to the
    operator's result (:func:`add_bias`), its backward gives the bias's gradient too, the output gradient summed
    over all but the channels (differentiable where the backward makes a graph), and its ``jvp`` adds the bias's
    tangent. One autograd node, as PyTorch's convolution with a bias is one: the bias reshaped and added to the
    result were two more, which cost 7-10 us more a training step (bench/RESULTS.md)."""
    op, jvp_of_pass = _OPERATORS[function], _jvp(function)

    def forward(ctx: Any, a: Tensor, b: Tensor, bias: Tensor, *rest: Any) -> Tensor:
        output = add_bias(_ops.call(op, a, b, *rest), bias)
        function.setup_context(ctx, (a, b, *rest), output)
        return output

    def backward(ctx: Any, dy: Tensor | None) -> tuple[Tensor | None, ...]:
        dx, dw, *nones = function.backward(ctx, dy)
        dbias = dy.sum(_ALL_BUT_CHANNELS[dy.dim()]) if dy is not None and _wanted(ctx, 2, dy) else None
        return (dx, dw, dbias, *nones)

    def jvp(ctx: Any, da: Tensor | None, db: Tensor | None, dbias: Tensor | None, *_: Any) -> Tensor | None:
        tangent = jvp_of_pass(ctx, da, db)
        if dbias is None:
            return tangent
        dbias = dbias.reshape(*_PER_CHANNEL[len(ctx.conv[0]) + 2])
        # the bias's tangent alone: one value a channel, broadcast over the output (autograd copies it out)
        return dbias.expand(ctx.output_shape) if tangent is None else tangent + dbias

    body = {"forward": staticmethod(forward), "backward": staticmethod(_eager_backward(backward)),
            "jvp": staticmethod(jvp), "__doc__": function.__doc__}
    return type(function.__name__, (torch.autograd.Function,), body)


# By an (N, C, *spatial) result's number of dimensions: the bias's shape that adds to it, one value a channel, and the
# dimensions its gradient sums
_PER_CHANNEL = {n: (1, -1, *(1,) * (n - 2)) for n in range(3, 6)}
_ALL_BUT_CHANNELS = {n: (0, *range(2, n)) for n in range(3, 6)}


_FUNCTIONS: tuple[type[torch.autograd.Function], ...] = (ConvFunction, ConvTransposeFunction, WeightGradFunction)
_OLDER: dict[type[torch.autograd.Function], type[torch.autograd.Function]] = {f: _older_form(f) for f in _FUNCTIONS}
_BIASED: dict[type[torch.autograd.Function], type[torch.autograd.Function]] = {
    f: _biased_form(f) for f in (ConvFunction, ConvTransposeFunction)
}
for _function in _FUNCTIONS:
    # under the transforms, inspect takes a signature kept on forward instead of working it out on every call
    _function.forward.__signature__ = inspect.signature(_function.forward)  # type: ignore[attr-defined]


def _operator_form(function: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    """The Function an operator's autograd kernel applies, as ``(a, b, *rest, keyset, grad, forward_grad)``:
    ``function``'s setup and backward, a forward that passes the call on below autograd, and a ``jvp`` made of the
    operator itself, called as a C++ operator's formulas call operators. A single-level Function, as torch.func's own
    rule for a Function applies: the kernel runs at one transform's level. Autograd runs a Function's forward and
    ``jvp`` with gradient modes off; what they call reaches the transforms below this level (a ``grad`` or ``jvp``
    around this one) in the modes the kernel was called in, as a C++ operator's calls do: with them off, the outer
    transform recorded nothing (``grad`` of ``grad`` gave zeros, ``jacfwd`` of ``jacrev`` a wrong Hessian)."""
    op = _OPERATORS[function]._opoverload
    below = torch._C._after_autograd_keyset

    def forward(*args: Any) -> Tensor:
        *operands, keyset, grad, forward_grad = args
        with torch.set_grad_enabled(grad), forward_ad._set_fwd_grad_enabled(forward_grad), \
                torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & below, *operands)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        function.setup_context(ctx, inputs[:-3], output)
        ctx.save_for_forward(*inputs[:2])

    def backward(ctx: Any, grad: Tensor | None) -> tuple[Tensor | None, ...]:
        return (*function.backward(ctx, grad), None, None, None)

    def jvp(ctx: Any, da: Tensor | None, db: Tensor | None, *_: Any) -> Tensor | None:
        # the operands' primals: they are the dual tensors themselves, whose tangents would be taken a second time
        a, b = (forward_ad.unpack_dual(t, level=0).primal for t in ctx.saved_tensors)
        site, settings = _as_started(ctx.started)
        with site, settings, forward_ad._set_fwd_grad_enabled(True):  # it was on: autograd runs no jvp otherwise
            first = None if da is None else op(da, b, *ctx.rest)
            second = None if db is None else op(a, db, *ctx.rest)
        return second if first is None else first if second is None else first + second

    body = {"forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
            "backward": staticmethod(_eager_backward(backward)), "jvp": staticmethod(jvp), "__doc__": function.__doc__}
    if _COMPILED_AUTOGRAD_KEY is not None:
        body["_compiled_autograd_key"] = _COMPILED_AUTOGRAD_KEY
    return type(function.__name__, (_SingleLevelFunction,), body)


# What compiled autograd asks of a Function's node, which only torch.autograd.Function defines, not the single-level
# base the operators' form is made on: without it, a backward under compiled autograd of a graph that holds the
# operators (torch.compile's eager backend, an operator called directly) raised AttributeError
_COMPILED_AUTOGRAD_KEY = torch.autograd.Function.__dict__.get("_compiled_autograd_key")


def _autograd_kernel(function: type[torch.autograd.Function]) -> Callable[..., Tensor]:
    """The operator's kernel for PyTorch's Autograd key, in place of the one ``register_autograd`` makes, whose
    Function has neither a ``jvp`` (forward AD's tangents were dropped: none for dual tensors, zeros from
    ``torch.func.jvp``) nor a ``setup_context`` (torch.func's ``grad`` and ``jacrev`` refused it). Where a gradient
    may be asked of the result (grad mode on and an operand that requires one) or an operand may have a tangent
    (:func:`_dual`), the operator's form with a ``jvp`` (:func:`_operator_form`); elsewhere the operator below
    autograd, as PyTorch's kernel does."""
    op, form = _OPERATORS[function]._opoverload, _operator_form(function)
    below = torch._C._after_autograd_keyset

    # Disabled to Dynamo, which would compile the Function's frames where it runs eagerly inside a compiled function,
    # as they are not PyTorch's own; the kernel itself is not, so that a call that records nothing (grad mode off, as
    # in an inference run of a compiled or exported graph) pays no wrapper (0.4-0.6 us)
    @torch.compiler.disable
    def recorded(keyset: Any, a: Tensor, b: Tensor, rest: tuple[Any, ...], grad: bool, forward_grad: bool) -> Tensor:
        with _single_level():
            return form.apply(a, b, *rest, keyset, grad, forward_grad)

    def kernel(keyset: Any, a: Tensor, b: Tensor, *rest: Any) -> Tensor:
        grad, forward_grad = torch.is_grad_enabled(), torch._C._is_fwd_grad_enabled()
        if (grad and (a.requires_grad or b.requires_grad)) or (forward_grad and _dual(a, b)):
            return recorded(keyset, a, b, rest, grad, forward_grad)
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & below, a, b, *rest)

    if _SKIP_FRAMES is not None:
        # nor the kernel's frames, where it is called in code a compiled function runs eagerly (a frame it runs
        # rather than traces): Dynamo compiled them, and ran the kernel as if compiling (_dual true), applying the
        # Function where nothing records. Marked as the backward forms' are (_eager_backward), at no cost a call
        _set_code_exec_strategy(kernel.__code__, _SKIP_FRAMES)
    return kernel


def _dual(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` or ``b`` may have a tangent (forward AD's grad mode found on): a dual level entered by
    ``torch.autograd.forward_ad`` (torch.func's ``jvp`` enters one too), a compile tracing (a graph enters its own),
    else an operand's own tangent, asked of PyTorch (1-2 us each): a graph run as it is (``torch.compile``'s
    ``eager`` backend, an exported program) enters its dual level without the flag Python keeps."""
    if forward_ad._current_level >= 0 or _compiling():
        return True
    return _unpack_dual(a, 0)[1] is not None or _unpack_dual(b, 0)[1] is not None


_unpack_dual = torch._C._VariableFunctions._unpack_dual  # forward_ad.unpack_dual, at level 0, the only one


# Each operator is differentiable as its Function is, by the same setup and backward, in forward mode too: a graph
# that holds the operators themselves (an exported program's, a compiled one's) is differentiated as the Functions
# are. Registered over the kernel custom_op made (which PyTorch warns of), which Library.impl refuses to override
# unless told to (allow_override: False by default in PyTorch 2.8 to 2.10), and before 2.8 while it keeps a record of
# that kernel, dropped here.
_LIBRARY = torch.library.Library("wsarena", "IMPL")
_OVERRIDE = "allow_override" in inspect.signature(torch.library.Library.impl).parameters
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "Warning only once for all operators")
    for _function, _op in _OPERATORS.items():
        if _OVERRIDE:
            _LIBRARY.impl(_op._name, _autograd_kernel(_function), "Autograd", with_keyset=True, allow_override=True)
        else:
            torch.library._impls.discard(f"wsarena/{_op._name}/Autograd")
            _LIBRARY.impl(_op._name, _autograd_kernel(_function), "Autograd", with_keyset=True)


def apply(function: type[torch.autograd.Function], bias: Tensor | None, *args: Any) -> Tensor:
    """``function.apply(*args)``, and ``bias`` added to its result (one value per channel, or ``None``): its older
    form (with a ``jvp``), which takes the bias as a third operand (:data:`_BIASED`). Under torch.func's transforms
    the operator, differentiable at each of their levels by its autograd kernel (:func:`_autograd_kernel`), which
    costs some 40 % less of a ``grad`` than a Function at the transforms' own level calling the operator (two
    Functions a convolution). Under a ``torch.compile`` or ``torch.export`` trace, the operator itself,
    differentiable in both modes by its autograd kernel (:func:`_autograd_kernel`): an exported program keeps no
    Function (a strict export runs a Function's forward without gradient), Dynamo takes no Function with a ``jvp``,
    and would trace one without into ``autograd_function_apply``, whose backward is handed zeros where no gradient
    reaches the output, where the operator's gradient is handed ``None``. Under forward AD the graph holds the
    tangents' convolutions too (torch.func's ``jvp``, ``jacfwd``, ``hessian``; dual tensors made in the compiled
    function). But where Dynamo traces a convolution under a dual level and no operand has a tangent there, so that
    they may be dual tensors given to the compiled function, the form with a ``jvp`` outside the graph, by a graph
    break (:data:`_uncompiled`): a graph is traced without the tangents of the tensors it is given, and runs on them
    as its backend made it (inductor's kernels write the result of one operation over another's, which keeps the
    first one's tangent: a wrong one). In a function Dynamo runs on fake tensors rather than traces (allow_in_graph's,
    nonstrict_trace's), the break falls on the function's call. Where no gradient can be asked of the result (grad
    mode off, as under ``torch.no_grad()`` and in inference mode, no forward AD, no ``torch.jit.trace``), the
    operator alone, by :func:`wsarena.torch._ops.call_unrecorded`: a Function would record nothing there, and costs
    some 15 us a call (bench/RESULTS.md). Except in the older form, the bias is added to the result by PyTorch
    (:func:`add_bias`), which records it where it is differentiated."""
    if _ops.exporting():
        return add_bias(function.forward(*args), bias)
    if _compiling():
        # the level read as Dynamo traces, which guards it: a graph compiled without dual tensors compiles again
        # where it is called with them
        if forward_ad._current_level >= 0 and not _ops.transforms_traced() \
                and not _traced_tangent(args[0], args[1], bias):
            if torch.compiler.is_dynamo_compiling():
                return _uncompiled(function, bias, *args)
            if _dynamo_fake_run():
                # a function Dynamo runs rather than traces (allow_in_graph's, nonstrict_trace's): the graph break
                # falls on its call
                raise torch._dynamo.exc.Unsupported(_BREAK)
        return add_bias(function.forward(*args), bias)
    if _transforms_active():
        return add_bias(function.forward(*args), bias)
    if not torch.is_grad_enabled() and forward_ad._current_level < 0 and not torch.jit.is_tracing():
        # (a torch.jit.trace records the Function: its check reruns the model without grad, to the same graph)
        return add_bias(_ops.call_unrecorded(_OPERATORS[function], *args), bias)
    if bias is None:
        return _OLDER[function].apply(*args)
    return _BIASED[function].apply(args[0], args[1], bias, *args[2:])


def _traced_tangent(*operands: Tensor | None) -> bool:
    """Whether an operand has a tangent as Dynamo traces it: a dual tensor made in the compiled function has; one it
    is given has none there (the graph takes its primal alone)."""
    return any(t is not None and forward_ad.unpack_dual(t).tangent is not None for t in operands)


def _dynamo_fake_run() -> bool:
    """Whether a compile runs this on Dynamo's fake tensors, as it runs a function of ``allow_in_graph``'s or
    ``nonstrict_trace``'s (AOTAutograd's trace of the graph, which runs it again, functionalizes). A fake mode in
    force on this thread: ``is_compiling()`` reads a flag of the process, found on too by eager code that another
    thread runs while one compiles."""
    return _dispatch_mode(_FAKE) is not None and _dispatch_mode(_FUNCTIONAL) is None \
        and _dispatch_mode(_PROXY) is None


_dispatch_mode = torch._C._get_dispatch_mode
_KEY = torch._C._TorchDispatchModeKey
_FAKE, _FUNCTIONAL, _PROXY = _KEY.FAKE, _KEY.FUNCTIONAL, _KEY.PROXY


# apply() where a torch.compile trace meets dual tensors: a graph break (fullgraph=True refuses it), run eagerly
_BREAK = "wsarena.torch: a convolution of dual tensors given to a compiled function runs outside its graph"
try:
    _uncompiled = torch.compiler.disable(apply, reason=_BREAK)
except TypeError:  # PyTorch before 2.7 takes no reason
    _uncompiled = torch.compiler.disable(apply)


def add_bias(y: Tensor, bias: Tensor | None) -> Tensor:
    """``y``, a pass's new result, with ``bias`` added by PyTorch, in place, as PyTorch's own convolution adds it
    (``y`` is new, and no backward keeps it: no second tensor of its size). A float16 or bfloat16 ``y`` is rounded
    already: PyTorch's CPU kernel adds the bias before rounding (README). A new tensor where ``y`` may not be ours
    alone to change: under torch.func's transforms (``vmap`` over the biases alone batches the bias and not ``y``,
    which cannot take a batched value in place) and under a dispatch mode, which may keep the operator's result
    (selective activation checkpointing refuses a result it saved that has changed since). A torch.compile trace
    asks for the transforms by :func:`~wsarena.torch._ops.transforms_traced`, which leaves no call in its graph."""
    if bias is None:
        return y
    bias = bias.reshape(*_PER_CHANNEL[y.dim()])  # the sizes as arguments: a tuple takes PyTorch 3k instructions more
    if _compiling():
        shared = _ops.transforms_traced()
    else:
        shared = _transforms_active() or _dispatch_modes()
    return y + bias if shared else y.add_(bias)


# the TorchDispatchModes in force (which a torch.compile trace cannot ask: a trace functionalizes the add)
_dispatch_modes = _ops._dispatch_modes


def _pass(function: type[torch.autograd.Function], *args: Any) -> Tensor:
    """One pass of a backward pass or of a tangent (``function``'s forward): the operator under torch.func's
    transforms (differentiable at their levels by its autograd kernel), its older form where forward AD is on (dual
    tensors may come, whose tangents its ``jvp`` gives), else the operator, which costs less and is differentiable by
    itself where the backward makes a graph (grad mode is on in a backward only then). Not the Function there: under
    ``is_grads_batched``'s batching a Function's graph stays on the batched wrapper, and the gradients that come out
    of it have none. Under a torch.compile trace the operator (the Function's forward calls it), in every mode: its
    autograd kernel takes transforms and forward AD, where the public Function, which Dynamo takes, has no ``jvp``."""
    if _compiling() or _transforms_active():
        return function.forward(*args)
    if forward_ad._current_level >= 0:  # dual tensors may come (forward over reverse): the jvp gives their tangents
        return _OLDER[function].apply(*args)
    return _ops.call(_OPERATORS[function], *args)


def _wanted(ctx: Any, i: int, grad: Tensor | None) -> bool:
    """Whether a backward pass computes the gradient of its ``i``-th input: one that requires it and that the
    backward running uses, as PyTorch's convolution computes only those (``torch.autograd.grad(y, x)`` asks nothing
    of the weights, ``backward(inputs=[w])`` nothing of the input); none where no gradient reaches the output
    (``grad`` is ``None``, :func:`_setup`), whose gradients are then ``None``, as PyTorch's convolution's are. Where
    autograd cannot say (a torch.compile trace, a backward called outside autograd's engine), every gradient
    required."""
    if grad is None or not ctx.needs_input_grad[i]:
        return False
    if _compiling() or _will_execute is None:
        return True
    try:
        return bool(_will_execute(ctx.next_functions[i][0]))
    except RuntimeError:  # outside the engine; or a leaf that torch.autograd.grad asks for, which it refuses to say
        return True


# What torch.autograd.graph's multi-grad hooks ask the engine; a private name, so a PyTorch without it computes every
# gradient required, as before
_will_execute: Callable[[Any], bool] | None = getattr(torch._C, "_will_engine_execute_node", None)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    """What each Function keeps: its two operands (for its backward and its ``jvp``), the arguments after them
    (``rest``: a shape argument, where it takes one, then ``conv``: stride, padding, dilation, groups, layout), and
    where its forward started. Autograd hands the backward and the ``jvp`` ``None`` for an output gradient or a
    tangent there is none of (``set_materialize_grads(False)``), not zeros: a tangent of the input or the weight
    alone runs one convolution, not two (the bias's alone none), and where no gradient reaches the output the
    operands get none, as PyTorch's convolution gives none (not zeros, which an optimizer would apply weight decay
    and momentum to). So is a compiled graph's backward, which the operator's gradient runs in (set up outside
    Dynamo's trace); not a Function that Dynamo traces (a public one applied directly): its ``autograd_function_apply``
    hands the backward zeros whatever the setting, which is left as it was there."""
    a, b, *rest = inputs
    ctx.save_for_backward(a, b)
    if torch.compiler.is_dynamo_compiling():
        ctx.save_for_forward(a, b)
    else:
        ctx.set_materialize_grads(False)
        # for a jvp, which runs only where forward AD or torch.func's transforms are on as the Function runs; or a
        # dispatch mode is, as where a compile runs a function rather than traces it (allow_in_graph's, on fake
        # tensors), whose dual level the graph entered without the flag Python keeps
        if forward_ad._current_level >= 0 or _transforms_active() or _dispatch_modes():
            ctx.save_for_forward(a, b)
            ctx.output_shape = output.shape
    ctx.rest = tuple(rest)
    ctx.conv = ctx.rest[-5:]
    ctx.started = _started()


def _started() -> tuple[_callsite.Site, _config.Config | None] | None:
    """Where a forward was called and the ``config()`` block it ran in (``None``: none, so the process-wide
    settings, which ``configure()`` may change before the backward), for its backward passes (none while
    ``torch.compile`` traces it: a compiled backward runs the operators without these functions, and a warning
    names the first line outside PyTorch and wsarena). Inside a backward pass (a gradient of a gradient) that is
    the backward's own forward call and settings."""
    return None if _compiling() else (_callsite.caller(), _config.overridden())


def _as_started(
    started: tuple[_callsite.Site, _config.Config | None] | None,
) -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
    """A backward pass's body's two scopes, entered together (``with site, settings:``): its warnings reported at
    the forward's call, and the forward's settings (``torch.compile`` traces neither: each sets a context variable).
    Two scopes, not one made of them by a generator, which cost about 2 us more a backward pass. No settings scope
    where the forward ran under the process-wide settings and so does the backward (no block in force either side,
    as on PyTorch's autograd thread): it would change nothing, for some 0.5 us."""
    if started is None or _compiling():
        return _UNCHANGED
    site, settings = started
    if settings is None and _config.overridden() is None:
        return _callsite.reported_at(site), _UNCHANGED[1]
    return _callsite.reported_at(site), _config.using(settings)


_UNCHANGED = (contextlib.nullcontext(), contextlib.nullcontext())  # reusable: they hold nothing
