"""PyTorch integration: convolutions whose workspace comes from wsarena's capped, shared arena.

::

    import wsarena, wsarena.torch

    wsarena.torch.convert(model)                 # its nn.Conv1d/2d/3d, ConvTranspose1d/2d/3d: through wsarena
    wsarena.configure(cap_workspace="64MiB")     # no convolution call takes more workspace than this
    loss = loss_fn(model(x), target); loss.backward(); optimizer.step()

:func:`conv1d`, :func:`conv2d`, :func:`conv3d` and :func:`conv_transpose1d` (2-D, 3-D) are drop-ins for
``torch.nn.functional``'s; :class:`Conv1d`, :class:`Conv2d`, :class:`Conv3d` and :class:`ConvTranspose1d` (2-D, 3-D) for
``torch.nn``'s modules; :func:`convert` swaps a model's convolutions in place, and :func:`revert` swaps them back.
Forward, input-gradient and weight-gradient are wsarena's three ops, registered as PyTorch custom operators
(``torch.ops.wsarena.conv_forward``, ``conv_backward_data``, ``conv_backward_filter``) so that ``torch.compile`` takes
them whole; a transposed convolution runs the same three in other roles (its forward is a convolution's backward-data).
Stride, padding (symmetric, ``"valid"``, ``"same"``: an even kernel's input padded by one more at the end, as PyTorch
pads it), dilation, groups and a transposed convolution's ``output_padding`` below its stride are supported;
channels-last tensors run as NHWC and give channels-last results (float64 ones on CUDA, and 3-D float64 ones on the CPU,
run contiguous, as PyTorch's); under ``torch.autocast`` the operands are cast as PyTorch casts its own convolution's.
Gradients of gradients are wsarena's passes too (:class:`WeightGradFunction` is the third pass as a Function), and
``torch.func``'s ``grad``, ``vmap`` and ``jacrev`` take them, and so, in forward mode, do ``jvp``, ``jacfwd`` and
``hessian`` (through the functions, modules and operators: the public Functions define no ``jvp``, which
``torch.compile`` refuses). Under ``torch.compile(dynamic=True)`` and ``torch.export`` with a ``Dim`` the batch and
spatial sizes stay symbolic. CUDA tensors run on PyTorch's current stream; the device's arena takes its memory from
PyTorch's caching allocator unless it was made before with another (the setting ``allocator``).
:func:`prepare_capture` gives the stream a ``torch.cuda.graph`` or ``torch.cuda.make_graphed_callables`` will capture
on the workspace its calls need.
:func:`layers` lists a model's convolutions for :func:`wsarena.plan` and :func:`wsarena.tune`.

Needs PyTorch (``pip install "wsarena[torch]"``); ``import wsarena`` alone never imports it.
"""

from __future__ import annotations

try:
    import torch as _torch  # PyTorch itself: this package's name shadows it only as wsarena.torch
except ImportError as exc:  # pragma: no cover - the test environment has PyTorch
    raise ImportError('wsarena.torch needs PyTorch: pip install "wsarena[torch]"') from exc
# 2.7's pre-releases too; older: a missing name (2.6 has no torch.compiler.is_exporting, and its custom_op takes
# no list[int] parameter)
if tuple(map(int, _torch.__version__.split(".")[:2])) < (2, 7):
    raise ImportError(
        f"wsarena.torch needs PyTorch 2.7 or newer (torch.library.custom_op, register_vmap, "
        f"torch.compiler.is_exporting); this is {_torch.__version__}: pip install 'torch>=2.7'"
    )

from ._autograd import WeightGradFunction
from ._functional import (
    ConvFunction,
    ConvTransposeFunction,
    checkpoint_context,
    conv1d,
    conv2d,
    conv3d,
    conv_transpose1d,
    conv_transpose2d,
    conv_transpose3d,
)
from ._graphs import prepare_capture
from ._layers import layers
from ._modules import Conv1d, Conv2d, Conv3d, ConvTranspose1d, ConvTranspose2d, ConvTranspose3d, convert, revert

__all__ = [
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvFunction",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "ConvTransposeFunction",
    "WeightGradFunction",
    "checkpoint_context",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "convert",
    "layers",
    "prepare_capture",
    "revert",
]
