"""``Conv1d``, ``Conv2d``, ``Conv3d``, ``ConvTranspose1d``, ``ConvTranspose2d``, ``ConvTranspose3d`` modules,
:func:`convert`, which swaps a model's convolutions in place, and :func:`revert`, which swaps them back.

The modules are ``torch.nn``'s with the same constructor, parameters and ``state_dict``; only the convolution itself
runs through :mod:`wsarena.torch`'s functions. ``padding_mode="zeros"`` only: the others pad the input on their
own, and are refused with a ``ValueError``, as is a transposed convolution's ``output_padding`` as large as its
stride (PyTorch takes it below the dilation too; wsarena runs a transposed convolution as a convolution's
backward-data, which has no such output).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .._sizes import short_repr
from . import _functional
from ._shapes import per_dim

__all__ = [
    "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d", "convert", "revert",
]


def unsupported(module: nn.Module) -> str | None:
    """Why wsarena cannot run ``module``'s convolution, or ``None`` when it can."""
    padding_mode = getattr(module, "padding_mode", "zeros")
    if padding_mode != "zeros":
        return f"padding_mode={short_repr(padding_mode)} (only 'zeros' is supported; pad the input with F.pad instead)"
    beyond = _output_padding_beyond_stride(module)
    if beyond is not None:
        output_padding, stride = beyond
        return (f"output_padding={tuple(output_padding)} is not smaller than stride={tuple(stride)}, which "
                "wsarena's transposed convolutions need")
    return None


def _output_padding_beyond_stride(module: nn.Module) -> tuple[list[int], list[int]] | None:
    """A transposed convolution's ``output_padding`` and ``stride``, an int per dimension, where the first is not
    below the second: an output no convolution's backward-data gives (PyTorch takes it below the dilation too).
    ``None`` otherwise, and for values that are no ints (the convolution says what is wrong with them). PyTorch's
    modules read these attributes each call, where an int (or a one-element sequence) stands for every dimension."""
    if not getattr(module, "transposed", False):
        return None
    nd = len(getattr(module, "kernel_size", ()))
    extra, stride = (per_dim(getattr(module, name, 0), nd) for name in ("output_padding", "stride"))
    if extra is None or stride is None or not any(e >= s for e, s in zip(extra, stride)):
        return None
    return extra, stride


class _TorchSignature:
    """A module class's signature, as ``inspect`` (and the tools that build a model from its arguments) reads it:
    that of the ``torch.nn`` class it extends, whose ``__init__`` takes the arguments, not ``(*args, **kwargs)``;
    ``None`` (``inspect``'s own reading) for a subclass with an ``__init__`` of its own. Instances have none of
    their own: theirs is their call's."""

    def __get__(self, instance: Any, owner: type) -> inspect.Signature | None:
        if instance is not None:
            raise AttributeError("__signature__")
        if next(c for c in owner.__mro__ if "__init__" in vars(c)) is not _Checked:
            return None
        return inspect.signature(next(c for c in owner.__mro__ if c.__module__.startswith("torch.nn.")))


class _Checked(nn.Module):
    """What the modules share: a check, when made and when run, that wsarena can run the convolution."""

    _nd: int
    __signature__ = _TorchSignature()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._check()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__module__ == parametrize.__name__:
            # The class parametrize makes over wsarena's (or convert() over a parametrized one) is wsarena's:
            # TorchScript names a traced module by it, and only PyTorch's own are refused (_torchscript_conv);
            # and its signature is the torch.nn class's it extends, not its own, looked up for ever (_TorchSignature)
            cls.__module__ = __name__

    def _check(self) -> None:
        reason = unsupported(self)
        if reason is not None:
            raise ValueError(f"{type(self).__name__}: {reason}")

    def __prepare_scriptable__(self) -> nn.Module:
        """What ``torch.jit.script`` asks of each module first: here a clear refusal, instead of TorchScript's
        failure to compile wsarena's Python (its first unsupported construct, deep in this package)."""
        raise TypeError(
            f"wsarena.torch.{type(self).__name__} cannot be compiled by TorchScript (torch.jit.script): its "
            "convolution is a Python autograd Function. torch.compile and torch.export take it; torch.jit.trace "
            "runs it, but cannot save it; wsarena.torch.revert(model) gives the model PyTorch's modules back"
        )


class _WsarenaConv(_Checked):
    """What the three convolution modules add to PyTorch's: the convolution through wsarena."""

    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        self._check()  # padding_mode is a plain attribute: it may have changed since construction
        conv = (_functional.conv1d, _functional.conv2d, _functional.conv3d)[self._nd - 1]
        return conv(input, weight, bias, self.stride, self.padding, self.dilation, self.groups)  # type: ignore[arg-type]


class _WsarenaConvTranspose(_Checked):
    """What the three transposed modules add to PyTorch's: their ``forward`` through wsarena."""

    def forward(self, input: Tensor, output_size: list[int] | None = None) -> Tensor:
        self._check()
        # PyTorch's own reading of output_size (a size within one stride of the smallest) as output padding
        output_padding = self._output_padding(  # type: ignore[operator]
            input, output_size, self.stride, self.padding, self.kernel_size, self._nd, self.dilation
        )
        conv = (_functional.conv_transpose1d, _functional.conv_transpose2d, _functional.conv_transpose3d)[self._nd - 1]
        args: Any = (self.weight, self.bias, self.stride, self.padding, output_padding, self.groups, self.dilation)
        return conv(input, *args)


class Conv1d(_WsarenaConv, nn.Conv1d):
    """``torch.nn.Conv1d`` (same arguments, parameters and ``state_dict``), run by wsarena."""

    _nd = 1


class Conv2d(_WsarenaConv, nn.Conv2d):
    """``torch.nn.Conv2d`` (same arguments, parameters and ``state_dict``), run by wsarena."""

    _nd = 2


class Conv3d(_WsarenaConv, nn.Conv3d):
    """``torch.nn.Conv3d`` (same arguments, parameters and ``state_dict``), run by wsarena."""

    _nd = 3


class ConvTranspose1d(_WsarenaConvTranspose, nn.ConvTranspose1d):
    """``torch.nn.ConvTranspose1d`` (same arguments, parameters and ``state_dict``), run by wsarena."""

    _nd = 1


class ConvTranspose2d(_WsarenaConvTranspose, nn.ConvTranspose2d):
    """``torch.nn.ConvTranspose2d`` (same arguments, parameters and ``state_dict``), run by wsarena."""

    _nd = 2


class ConvTranspose3d(_WsarenaConvTranspose, nn.ConvTranspose3d):
    """``torch.nn.ConvTranspose3d`` (same arguments, parameters and ``state_dict``), run by wsarena."""

    _nd = 3


_SWAPS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Conv1d: Conv1d, nn.Conv2d: Conv2d, nn.Conv3d: Conv3d,
    nn.ConvTranspose1d: ConvTranspose1d, nn.ConvTranspose2d: ConvTranspose2d, nn.ConvTranspose3d: ConvTranspose3d,
}
# a TorchScript module's original_name: PyTorch's class's, or the class parametrize makes over it
_NAMES = {prefix + cls.__name__ for cls in _SWAPS for prefix in ("", "Parametrized")}
_TORCH_CLASSES = ("__torch__.torch.nn.modules.conv.", "__torch__.torch.nn.utils.parametrize.")  # their modules


def _torchscript_conv(module: nn.Module) -> bool:
    """Whether ``module`` is TorchScript's of one of PyTorch's convolutions, parametrized or not (by its TorchScript
    type's name: ``__torch__.`` before the Python class's, mangled or not), not of wsarena's (a model traced after
    :func:`convert`)."""
    if not isinstance(module, torch.jit.ScriptModule) or module.original_name not in _NAMES:
        return False
    return bool(module._c._type().qualified_name().startswith(_TORCH_CLASSES))


def _swappable(module: nn.Module) -> type[nn.Module] | None:
    """The ``torch.nn`` class ``module`` is, or was before ``torch.nn.utils.parametrize`` gave it a class of its own
    (weight_norm, spectral_norm), when it is one of those :func:`convert` swaps; else ``None``."""
    if parametrize.is_parametrized(module):
        before = parametrize.type_before_parametrizations(module)
        return before if before in _SWAPS else None
    return type(module) if type(module) in _SWAPS else None


def _swapped(
    module: nn.Module, base: type[nn.Module], swaps: dict[type[nn.Module], type[nn.Module]] = _SWAPS
) -> type[nn.Module]:
    """The class ``swaps`` gives ``module``, a ``base``: for a parametrized one, its own class (which holds the
    parametrized properties) over that one, so that removing the parametrizations leaves the swapped module. That
    class is parametrize's, in its module (which wsarena's classes make theirs: :meth:`_Checked.__init_subclass__`)."""
    if type(module) is base:
        return swaps[base]
    own = {k: v for k, v in vars(type(module)).items() if k not in ("__dict__", "__weakref__")}
    return type(type(module).__name__, (swaps[base],), {**own, "__module__": parametrize.__name__})


_REVERTS = {wsarena_class: torch_class for torch_class, wsarena_class in _SWAPS.items()}


def convert(model: nn.Module) -> nn.Module:
    """Make every ``nn.Conv1d/2d/3d`` and ``nn.ConvTranspose1d/2d/3d`` of ``model`` run through wsarena, in place.

    Each such module (``model`` itself included) becomes the matching :class:`Conv2d` (or 1-D, 3-D, or
    :class:`ConvTranspose2d` and kin) in place: the same object, with the same parameters, buffers, hooks,
    parametrizations (``torch.nn.utils.parametrize``, ``parametrizations.weight_norm`` and ``spectral_norm``) and
    ``state_dict``, so that an optimizer made before still trains it. Subclasses of those modules (which may have
    a ``forward`` of their own), lazy modules and transposed convolutions whose ``output_padding`` is not below
    their stride are left as they are.

    Returns
    -------
    torch.nn.Module
        ``model``.

    Raises
    ------
    ValueError
        A convolution wsarena cannot run (``padding_mode`` other than ``"zeros"``), naming each; nothing is changed
        then.
    TypeError
        ``model`` is not a module, or holds TorchScript convolutions (``torch.jit.script`` or ``trace`` made them:
        they run TorchScript's code, which converting would not change), naming each; nothing is changed then.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    scripted = [
        f"{name or 'the model'}: {module.original_name}" for name, module in model.named_modules()
        if _torchscript_conv(module)
    ]
    if scripted:
        raise TypeError(
            "cannot convert TorchScript convolutions, which run TorchScript's code, so nothing was converted: "
            + "; ".join(scripted) + "; convert the model before torch.jit.trace (torch.jit.script refuses "
            "wsarena's modules), or use torch.compile or torch.export instead"
        )
    found = [
        (name, module, base) for name, module in model.named_modules()
        if (base := _swappable(module)) is not None and _output_padding_beyond_stride(module) is None
    ]
    problems = [f"{name or 'the model'}: {reason}" for name, module, _ in found if (reason := unsupported(module))]
    if problems:
        raise ValueError("cannot convert these convolutions, so nothing was converted: " + "; ".join(problems))
    for _, module, base in found:
        module.__class__ = _swapped(module, base)
    return model


def revert(model: nn.Module) -> nn.Module:
    """Undo :func:`convert`: every wsarena.torch convolution module of ``model`` (``model`` itself included), made
    by :func:`convert` or constructed as one, becomes the matching ``torch.nn`` class again, in place.

    The same objects, with the same parameters, buffers, hooks, parametrizations and ``state_dict``, as
    :func:`convert` keeps them: train with wsarena, then give the model to what takes only PyTorch's own modules
    (``torch.onnx.export``, ``torch.jit.script``, tools that look for ``nn.Conv2d``). Subclasses of wsarena's
    modules are left as they are.

    Returns
    -------
    torch.nn.Module
        ``model``.

    Raises
    ------
    TypeError
        ``model`` is not a module.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    for module in model.modules():
        before = parametrize.type_before_parametrizations(module)
        if before in _REVERTS:
            module.__class__ = _swapped(module, before, _REVERTS)
    return model
