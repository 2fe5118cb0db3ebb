"""The convolution layers of a PyTorch model, for :func:`wsarena.plan`, :func:`wsarena.tune` and ``wsarena report``.

A model's convolutions are only known once it runs: their input sizes follow from the input. :func:`layers` runs
the model once and reads each convolution module's call, so that a PyTorch user plans the workspace of their own
model, and picks its cap, without exporting it to ONNX first.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map_only

from .. import _forksafe
from ..models import ConvLayer, ModelError
from ._shapes import per_dim

__all__ = ["layers"]

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)  # wsarena.torch's modules and the lazy ones are subclasses
_TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_EXPORT = "export the model to ONNX and load that (wsarena.load_model)"


def layers(model: nn.Module, /, *args: Any, **kwargs: Any) -> list[ConvLayer]:
    """The convolutions ``model(*args, **kwargs)`` runs, in the order it runs them, as :class:`~wsarena.ConvLayer`.

    The model runs once, under ``torch.no_grad()``, in the mode it is in (a training-mode model may run other layers):
    give it an input of the size it will see (its batch does not matter, the planner sets its own), on the model's
    device. A model with a parameter or buffer on the meta device (built there, never loaded, or
    ``copy.deepcopy(model).to("meta")``) computes nothing with them: a tensor an operation takes beside a meta tensor is
    moved there as the operation is called, as only its size matters, so that a real input will do and the forward may
    still read the value of one that has met none (``.item()`` of a step count given as a tensor, an ``if`` on a flag);
    what the input's tensors compute among themselves before they meet the model's is computed where they are. An
    operation that fails on the moved tensors, as it reads the values of one (a boolean mask selecting from a meta
    tensor, ``repeat_interleave``'s repeats), runs on them as they are. The tensors stay the caller's: a forward that
    writes into one in place (``x.div_(255)``) writes into it, as the model would. The moving is the calling thread's: a
    forward that runs branches in threads of its own is given a meta input. Its buffers (BatchNorm's running statistics)
    and the random generators (PyTorch's, Python's and NumPy's) are as they were afterwards; the generators are the
    process's, so draws another thread makes meanwhile are undone too.
    Every call of an ``nn.Conv1d/2d/3d`` or ``nn.ConvTranspose1d/2d/3d`` (wsarena.torch's and lazy ones included) is one
    layer, named by the module's path in ``model`` (``layer1.0.conv2``); a module called again is listed again, ``#2``
    and on after its name. Convolutions called as functions (``F.conv2d`` in a ``forward``) are not seen: export such a
    model to ONNX and load that (:func:`wsarena.load_model`). A lazy module is initialized by the run, its buffers left
    as first made. Of a ``torch.compile`` wrapper, the model it wraps runs; nothing is compiled (a model compiled in
    place with ``Module.compile()``, or a compiled submodule, runs uncompiled). To that end torch.compile's stance is
    ``"force_eager"`` while the model runs, and that stance is the process's: compiled code that another thread runs
    meanwhile runs uncompiled too (a child forked meanwhile by another thread compiles as asked).

    Padding is modelled as PyTorch runs it: ``"same"`` with an even total (a kernel of even size) pads the input by
    one more at the end, and a ``padding_mode`` other than ``"zeros"`` pads the input itself before an unpadded
    convolution (by the padding the module was made with: PyTorch reads none set later); in both cases the layer's
    input is that padded one. A stride, padding or dilation of one value in a sequence is that value in every
    dimension. A transposed convolution's ``output_padding`` (or ``output_size``) makes its layer's input larger, as
    :class:`~wsarena.ConvLayer` describes.

    ``model`` is positional-only: a keyword argument named ``model`` is passed on to its ``forward``.

    Raises
    ------
    TypeError
        ``model`` is not an ``nn.Module``.
    ModelError
        It ran no such convolution, or one whose result has another size than its settings give (a subclass whose
        ``forward`` pads the input itself, as timm's ``Conv2dSame``) or is no tensor.

    Whatever the model raises while it runs is raised as it is.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    # torch.compile's wrapper: the model it wraps runs the same convolutions, uncompiled (no seconds of compiling),
    # and names them as its state_dict does (without "_orig_mod.")
    model = _uncompiled(model)
    names: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if name:
            names.setdefault(id(module), name)  # a module under two names is known by its first
    found: list[ConvLayer] = []
    calls: dict[str, int] = {}

    def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        name = names.get(id(module)) or type(module).__name__  # the model itself, or a module added meanwhile
        calls[name] = calls.get(name, 0) + 1
        if calls[name] > 1:
            name = f"{name}#{calls[name]}"
        x: Any = args[0] if args else kwargs.get("input", next(iter(kwargs.values()), None))  # or a subclass's name
        found.append(_layer(name, module, x, output))

    # The run leaves the model and the random streams as they were: a training-mode BatchNorm updates its running
    # statistics and a dropout draws from the generator, which would change the user's next step.
    buffers = _copies(model.modules())
    # a lazy module's buffers (LazyBatchNorm's) are made as it is first called: kept as made, before its forward
    lazy = [m for m in model.modules() if any(is_lazy(b) for b in m.buffers(recurse=False))]

    def made(module: nn.Module, args: tuple[Any, ...]) -> None:
        buffers.extend(_copies((module,)))

    # a model built on the meta device, planned with a real input: a convolution's meta weight beside it is a
    # TypeError (wsarena's) or memory never written (PyTorch's), and other layers refuse the mix
    meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()) if not is_lazy(t))
    cuda = sorted({t.device.index or 0 for t in (*model.parameters(), *model.buffers()) if t.is_cuda})
    convs = [m for m in model.modules() if isinstance(m, _CONVS + _TRANSPOSED)]
    # first: a user's hook may change the result (crop it), and the layer is the convolution's
    hooks = [m.register_forward_hook(record, with_kwargs=True, prepend=True) for m in convs]
    hooks += [m.register_forward_pre_hook(made) for m in lazy]  # after the module's own, which makes them
    try:
        # force_eager: a model compiled in place (Module.compile()) or holding a torch.compile'd module runs
        # uncompiled too (no seconds of compiling, and the hooks run as written)
        with torch.no_grad(), torch.random.fork_rng(devices=cuda), _host_random(), _force_eager(), \
                _MetaWhereMet() if meta else contextlib.nullcontext():
            model(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
        with torch.inference_mode():  # a model made in inference mode holds inference tensors, updated only there
            _restore(buffers)
    if not found:
        raise ModelError(f"{type(model).__name__} ran no nn.Conv1d/2d/3d or nn.ConvTranspose1d/2d/3d")
    return found


class _MetaWhereMet(TorchFunctionMode):
    """Moves to the meta device the tensors an operation takes beside a meta tensor, as it is called: a model on the
    meta device runs on a real input, whose tensors hold their values until they meet the model's (a forward may read
    a step count's ``.item()``, or branch on a flag), where moving them all first left none to read. An operation
    that fails so, as it reads the values of a real tensor it is given (a boolean mask selecting from a meta tensor,
    ``repeat_interleave``'s repeats, a size given as a tensor), runs on the tensors as they were: PyTorch's meta
    kernels read those values where they are. The mode is the calling thread's."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not any(t.is_meta for t in tensors) or all(t.is_meta for t in tensors):
            return func(*args, **kwargs)
        # an operation that writes into a real tensor (add_, x[i] = ...) writes into its meta copy, which it
        # returns: the tensor keeps its values, as PyTorch's own add_ of a meta tensor into a CPU one does
        moved, moved_kwargs = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
        try:
            return func(*moved, **moved_kwargs)
        except Exception as error:
            # the values it reads are the real tensors' (a mask's, the repeats); its other work is the meta kernels'
            with contextlib.suppress(Exception):
                return func(*args, **kwargs)
            # the moved call's error, which may name as meta a tensor the forward was given real: the note says why
            error.add_note(f"wsarena.torch.layers: {getattr(func, '__name__', func)} was given the model's meta "
                           "tensors beside others, and failed with those moved to the meta device (which holds no "
                           "values to read) and as they were")
            raise error from None


# torch.compile's stance is one for the process, and torch offers none for one thread: torch.compiler.disable acts
# on the calling thread only, but a torch.compile'd module or function called under it compiles all the same.
# So layers() calls that overlap in several threads share one "force_eager", set by the first and restored by the
# last: each restoring the stance it found would leave "force_eager" set for good when the first ends first.
_eager_lock = _forksafe.lock()
_eager_calls: dict[int, int] = {}  # per thread (its ident), its calls under way
_eager_stance = contextlib.ExitStack()


@contextlib.contextmanager
def _force_eager() -> Iterator[None]:
    """torch.compile's stance ``"force_eager"`` until the last of the overlapping calls ends."""
    me = threading.get_ident()
    counted = False
    try:  # the count taken inside: a Ctrl-C as the lock is let go would leave it, and "force_eager", for good
        with _eager_lock:
            if not _eager_calls:
                _eager_stance.enter_context(torch.compiler.set_stance("force_eager"))
            _eager_calls[me] = _eager_calls.get(me, 0) + 1
            counted = True
        yield
    finally:
        with _eager_lock:
            if counted:
                _eager_calls[me] -= 1
                if not _eager_calls[me]:
                    del _eager_calls[me]
            if not _eager_calls:
                # the stance the first found; also where this call set it and a Ctrl-C came before it was counted
                _eager_stance.close()


def _after_fork_in_child() -> None:
    """Only the forking thread goes on in a child: the other threads' calls, which never end there, are forgotten,
    and the stance the first call found is restored unless the forking thread has calls of its own under way."""
    own = _eager_calls.get(threading.get_ident())
    _eager_calls.clear()
    if own:
        _eager_calls[threading.get_ident()] = own
    else:
        _eager_stance.close()


os.register_at_fork(after_in_child=_after_fork_in_child)  # once, as this module is imported


@contextlib.contextmanager
def _host_random() -> Iterator[None]:
    """Python's and NumPy's global random streams, as they were, once the block ends (a forward may draw from them:
    a layer drop drawn with ``random.uniform``, as older Hugging Face encoders draw it). NumPy's is taken as a
    dict: its global generator may be other than MT19937 (``np.random.set_bit_generator``), where the legacy tuple
    warns."""
    python, numpy = random.getstate(), np.random.get_state(legacy=False)
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


def _uncompiled(model: nn.Module) -> nn.Module:
    """``model``, or the module a ``torch.compile`` wrapper (``OptimizedModule``) holds."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule" else model


def _copies(modules: Iterable[nn.Module]) -> list[tuple[nn.Module, str, torch.Tensor, torch.Tensor | None]]:
    """Each made buffer of ``modules``, not their submodules': its module, name, tensor and a copy of it (``None``
    for one expanded over a dimension, which takes no write in place: its elements share memory)."""
    return [(m, name, b, None if _expanded(b) else b.clone())
            for m in modules for name, b in m.named_buffers(recurse=False) if not is_lazy(b)]


def _restore(buffers: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor | None]]) -> None:
    """Give each module its buffer back, with the values :func:`_copies` saved. Its own function, for the loop's jump
    back: CPython 3.13 may take a Ctrl-C there outside the caller's ``with torch.inference_mode()``, whose exit then
    does not run, leaving the thread in inference mode (python/cpython#130279); raised in here, it reaches the
    caller at the call."""
    for owner, name, buffer, saved in reversed(buffers):  # a lazy module called twice: its first copy last
        owner._buffers[name] = buffer  # where a forward replaced it (self.calls = self.calls + 1)
        if saved is not None:
            buffer.copy_(saved)


def _expanded(t: torch.Tensor) -> bool:
    """Whether ``t`` repeats its elements along a dimension (a stride of 0, as ``expand()`` makes)."""
    return t.layout == torch.strided and any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape))


def _layer(name: str, module: Any, x: torch.Tensor, y: torch.Tensor) -> ConvLayer:
    """One call of ``module`` on ``x`` that gave ``y``, as a layer at batch 1."""
    for what, t in (("took", x), ("returned", y)):  # a subclass's forward (a partial convolution's result and mask)
        if not isinstance(t, torch.Tensor):
            raise ModelError(f"{name} ({type(module).__name__}) {what} a {type(t).__name__}, not a tensor: its forward "
                             f"convolves otherwise than PyTorch's; {_EXPORT}")
    nd = module.weight.dim() - 2
    weight = tuple(module.weight.shape)
    # as PyTorch reads them (per_dim): (2,) in every dimension, and an int a model's code set; else as they are,
    # for ConvLayer to say what is wrong
    stride, dilation = (per_dim(v, nd) or v for v in (module.stride, module.dilation))
    common = {"stride": stride, "dilation": dilation, "groups": module.groups}
    if isinstance(module, _TRANSPOSED):  # stored as its forward-equivalent convolution: its output is the input
        padding: Any = per_dim(module.padding, nd) or module.padding  # a transposed convolution takes no "same"
        layer = ConvLayer(name, _batched(y, nd), weight, padding=padding, transposed=True, **common)
        return _checked(layer, module, _batched(x, nd))
    shape = _batched(x, nd)
    if module.padding_mode != "zeros":
        # PyTorch pads the input itself (F.pad), by the ends its construction worked out from the padding (one set
        # later is not read), in F.pad's order (the last dimension's first), then convolves without padding
        ends = module._reversed_padding_repeated_twice
        widened, pads = [n + sum(ends[2 * (nd - 1 - i):2 * (nd - i)]) for i, n in enumerate(shape[2:])], [0] * nd
    else:
        pads, widened = _padding(module, shape[2:])
    layer = ConvLayer(name, (1, shape[1], *widened), weight, padding=tuple(pads), **common)
    return _checked(layer, module, _batched(y, nd))


def _checked(layer: ConvLayer, module: Any, made: tuple[int, ...]) -> ConvLayer:
    """``layer``, whose convolution gives the shape the module's call ``made`` (a transposed one's: its input):
    a subclass whose ``forward`` convolves otherwise (pads the input itself, as timm's ``Conv2dSame``) is refused."""
    gives = tuple(layer.geometry().output_shape)  # a ModelError where the settings fit no convolution of the input
    if gives[1:] != made[1:]:
        raise ModelError(f"{layer.name} ({type(module).__name__}) made {made[2:]} where its settings give "
                         f"{gives[2:]}: its forward convolves otherwise than PyTorch's; {_EXPORT}")
    return layer


def _batched(t: torch.Tensor, nd: int) -> tuple[int, ...]:
    """``t``'s shape with a batch of one in front where PyTorch took it unbatched (``(C, *spatial)``)."""
    shape = tuple(t.shape)
    return (1, *shape) if len(shape) == nd + 1 else (1, *shape[1:])


def _padding(module: Any, spatial: Sequence[int]) -> tuple[list[int], list[int]]:
    """The symmetric padding PyTorch convolves with, and the input size once the extra end of ``"same"`` (an odd
    total padding: one more at the end) is added to it. ``padding`` and ``dilation`` are read as PyTorch reads them
    (:func:`~wsarena.torch._shapes.per_dim`): an int, which a model's code may set after construction, or one value
    in a sequence stands for every dimension."""
    nd = len(spatial)
    if module.padding == "valid":
        return [0] * nd, list(spatial)
    if module.padding != "same":
        return per_dim(module.padding, nd) or list(module.padding), list(spatial)  # not ints: ConvLayer says so
    totals = [d * (k - 1) for d, k in zip(per_dim(module.dilation, nd) or module.dilation, module.kernel_size)]
    return [t // 2 for t in totals], [s + t % 2 for s, t in zip(spatial, totals)]
