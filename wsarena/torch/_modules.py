"""``Conv1d``, ``Conv2d``, ``Conv3d`` modules and :func:`convert`, which swaps a model's convolutions in place.

The modules are ``torch.nn.Conv1d/2d/3d`` with the same constructor, parameters and ``state_dict``; only the
convolution itself runs through :mod:`wsarena.torch`'s functions. ``padding_mode="zeros"`` only: the others pad
the input on their own, and are refused with a ``ValueError``, as is ``padding="same"`` where it would need
asymmetric padding (an even kernel), which wsarena's convolutions do not take.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from . import _functional

__all__ = ["Conv1d", "Conv2d", "Conv3d", "convert"]


def unsupported(module: nn.Module) -> str | None:
    """Why wsarena cannot run ``module``'s convolution, or ``None`` when it can."""
    padding_mode = getattr(module, "padding_mode", "zeros")
    if padding_mode != "zeros":
        return f"padding_mode={padding_mode!r} (only 'zeros' is supported; pad the input with F.pad instead)"
    if getattr(module, "padding", None) == "same":
        kernel: Any = getattr(module, "kernel_size", ())
        dilation: Any = getattr(module, "dilation", ())
        if any(d * (k - 1) % 2 for k, d in zip(kernel, dilation)):
            return (f"padding='same' with kernel_size={tuple(kernel)} and dilation={tuple(dilation)} needs "
                    "asymmetric padding, which wsarena's convolutions do not take")
    return None


class _WsarenaConv(nn.Module):
    """What the three modules add to PyTorch's: the convolution through wsarena."""

    _nd: int

    def _check(self) -> None:
        reason = unsupported(self)
        if reason is not None:
            raise ValueError(f"{type(self).__name__}: {reason}")

    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        self._check()  # padding_mode is a plain attribute: it may have changed since construction
        conv = (_functional.conv1d, _functional.conv2d, _functional.conv3d)[self._nd - 1]
        return conv(input, weight, bias, self.stride, self.padding, self.dilation, self.groups)  # type: ignore[arg-type]


class Conv1d(_WsarenaConv, nn.Conv1d):
    """``torch.nn.Conv1d`` (same arguments, parameters and ``state_dict``), run by wsarena."""

    _nd = 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._check()


class Conv2d(_WsarenaConv, nn.Conv2d):
    """``torch.nn.Conv2d`` (same arguments, parameters and ``state_dict``), run by wsarena."""

    _nd = 2

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._check()


class Conv3d(_WsarenaConv, nn.Conv3d):
    """``torch.nn.Conv3d`` (same arguments, parameters and ``state_dict``), run by wsarena."""

    _nd = 3

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._check()


_SWAPS: dict[type[nn.Module], type[nn.Module]] = {nn.Conv1d: Conv1d, nn.Conv2d: Conv2d, nn.Conv3d: Conv3d}


def convert(model: nn.Module) -> nn.Module:
    """Make every ``nn.Conv1d``, ``nn.Conv2d`` and ``nn.Conv3d`` of ``model`` run through wsarena, in place.

    Each such module (``model`` itself included) becomes the matching :class:`Conv2d` (or 1-D, 3-D) in place: the
    same object, with the same parameters, buffers, hooks and ``state_dict``, so that an optimizer made before
    still trains it. Subclasses of those modules (with a ``forward`` of their own, or parametrized weights) and
    transposed convolutions are left as they are.

    Returns
    -------
    torch.nn.Module
        ``model``.

    Raises
    ------
    ValueError
        A convolution wsarena cannot run (``padding_mode`` other than ``"zeros"``, or ``padding="same"`` that
        needs asymmetric padding), naming each; nothing is changed then.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    found = [(name, module) for name, module in model.named_modules() if type(module) in _SWAPS]
    problems = [f"{name or 'the model'}: {reason}" for name, module in found if (reason := unsupported(module))]
    if problems:
        raise ValueError("cannot convert these convolutions, so nothing was converted: " + "; ".join(problems))
    for _, module in found:
        module.__class__ = _SWAPS[type(module)]
    return model
