"""One arena per device: ``get_arena("cpu")`` for the host, ``get_arena(ordinal)`` for a GPU."""

from __future__ import annotations

import os
from typing import Any

from .. import _forksafe
from .._config import get_config
from .._gpu import gpu_count, gpu_unusable_reason, no_such_device
from .._sizes import short_repr
from ..errors import BackendUnavailableError
from ._arena import Arena, _non_negative_int
from .providers import CupyProvider, HostProvider, TorchProvider

__all__ = ["get_arena", "make_device_arena", "reset_arenas", "set_arena"]

_arenas: dict[str | int, Arena] = {}
_cuda_in_parent = False  # in a forked child: the parent had a device arena, so CUDA was initialised before fork
_lock = _forksafe.lock()  # guards _arenas; held while an arena is created so each device gets exactly one


def _device_key(device: Any) -> str | int | None:
    """``"cpu"``, a device ordinal, or ``None`` for "the current CUDA device"."""
    if device is None:
        return None
    if isinstance(device, str):
        if device.strip().lower() == "cpu":
            return "cpu"
        raise ValueError(f"device must be 'cpu', a CUDA device ordinal or None, not {short_repr(device)}")
    return _non_negative_int(device, "a CUDA device ordinal", "device must be 'cpu', a CUDA device ordinal or None")


def _require_gpu(what: str) -> None:
    reason = gpu_unusable_reason()
    if reason is not None:
        raise BackendUnavailableError(f"{what} needs a usable CUDA GPU: {reason}")


def get_arena(device: Any = None) -> Arena:
    """The process's arena for ``device``, created on first use (and again after it was closed).

    Parameters
    ----------
    device : "cpu", int or None
        ``"cpu"``: the host arena (NumPy buffers, one lane per thread by default). An ``int``: the arena of that
        CUDA device, its memory from the allocator the setting ``allocator`` names when the arena is made (CuPy's
        current allocator unless it is ``"torch"``). ``None``: the current CUDA device.

    Raises
    ------
    BackendUnavailableError
        A device arena was asked for and no GPU is usable (or this process was forked from one that used CUDA).
    ValueError, TypeError
        ``device`` is not ``"cpu"``, a non-negative int or ``None``, or no such device exists.
    """
    if type(device) is str or type(device) is int:  # an existing arena's own key: every convolution asks so
        arena = _arenas.get(device)
        if arena is not None and not arena.closed:
            return arena
    key = _device_key(device)
    if key is not None:
        arena = open_arena(key)
        if arena is not None:
            return arena
    if key == "cpu":
        return _made("cpu", HostProvider)
    if _cuda_in_parent:
        raise BackendUnavailableError(
            f"get_arena({short_repr(device)}) in a process forked after CUDA was initialised: CUDA cannot be used "
            "here (start workers with the 'spawn' or 'forkserver' method); the cpu arena works"
        )
    _require_gpu(f"get_arena({short_repr(device)})")
    if key is None:
        import cupy

        ordinal = int(cupy.cuda.Device().id)
    else:
        ordinal = int(key)  # not "cpu": an ordinal
        count = gpu_count()
        if ordinal >= count:
            raise ValueError(f"get_arena({short_repr(device)}): {no_such_device(ordinal, count)}")
    return make_device_arena(ordinal, get_config().allocator)


def open_arena(key: str | int) -> Arena | None:
    """The open arena of ``key`` (``"cpu"`` or a device ordinal), or ``None``; never makes one."""
    arena = _arenas.get(key)
    return arena if arena is not None and not arena.closed else None


def make_device_arena(ordinal: int, allocator: str) -> Arena:
    """The arena of CUDA device ``ordinal``; made, unless one is open, with the memory of ``allocator``:
    ``"torch"`` (PyTorch's caching allocator), else CuPy's current allocator."""
    arena = open_arena(ordinal)
    if arena is not None:
        return arena
    provider = TorchProvider if allocator == "torch" else CupyProvider
    return _made(ordinal, lambda: provider(ordinal))


def _made(key: str | int, provider: Any) -> Arena:
    """The arena of ``key``, made with ``provider()`` unless one is open already; one per key, under the lock."""
    with _lock:
        arena = _arenas.get(key)
        if arena is None or arena.closed:
            arena = _arenas[key] = Arena(provider())
        return arena


def _after_fork_in_child() -> None:
    global _cuda_in_parent
    _cuda_in_parent = _cuda_in_parent or any(key != "cpu" for key in _arenas)


os.register_at_fork(after_in_child=_after_fork_in_child)


def set_arena(device: Any, arena: Arena | None) -> Arena | None:
    """Make ``arena`` the one :func:`get_arena` returns for ``device`` (``None``: forget it); return the old one.

    For tests and for setups that want another provider, e.g. ``set_arena(0, Arena(AsyncProvider(0)))``. The
    old arena is not closed. Once ``arena`` is closed, :func:`get_arena` replaces it by a default one.
    ``device`` here must be ``"cpu"`` or an ordinal (``None`` is not resolved), and ``arena.device`` that device
    (``None`` for ``"cpu"``): ``ValueError`` otherwise.
    """
    key = _device_key(device)
    if key is None:
        raise ValueError("set_arena needs 'cpu' or a device ordinal, not None")
    if arena is not None and not isinstance(arena, Arena):
        raise TypeError(f"arena must be an Arena or None, not {short_repr(arena)}")
    if arena is not None and arena.device != (None if key == "cpu" else key):
        # get_arena() would hand host memory to cuDNN, or one device's memory to another's calls
        where = "the host" if arena.device is None else f"CUDA device {arena.device}"
        raise ValueError(
            f"set_arena({short_repr(device)}, ...) was given an arena of {where} (its provider's device_id)"
        )
    with _lock:
        old = _arenas.pop(key, None)
        if arena is not None:
            _arenas[key] = arena
    return old


def reset_arenas() -> None:
    """Close and forget every arena :func:`get_arena` made or was given (for tests)."""
    with _lock:
        arenas = list(_arenas.values())
        _arenas.clear()
    for arena in arenas:
        arena.close()
