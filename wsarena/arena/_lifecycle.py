"""Releasing memory when no one will: a collected arena, a dead stream or thread, interpreter exit.

Finalizers here never raise (a failed free warns) and do nothing once the interpreter is finalizing; device
arenas are released by an atexit handler instead, while CUDA is still up.
"""

from __future__ import annotations

import atexit
import sys
import threading
import warnings
import weakref
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._arena import Arena
    from ._sub import _Block, _Sub

__all__: list[str] = []


def _free_now(provider: Any, frees: list[tuple[_Block, Any]], quiet: bool = False) -> None:
    """Give blocks back to ``provider``; a failure warns (or, ``quiet``, is ignored), never raises.

    A ``KeyboardInterrupt`` (or another ``BaseException``) during one free is raised only after the rest are
    freed: the blocks are already marked freed, so nothing would ever give them back.
    """
    interrupted: BaseException | None = None
    for block, stream in frees:
        buffer = block.buffer
        block.buffer = None
        try:
            provider.free(buffer, stream=stream)
        except Exception as exc:  # noqa: BLE001 - a failed free must not break a lease's exit
            if not quiet:
                warnings.warn(f"wsarena: freeing {buffer!r} failed: {exc}", RuntimeWarning, stacklevel=3)
        except BaseException as exc:
            interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted


def _release_all(provider: Any, subs: dict[Hashable, _Sub]) -> None:
    """Finalizer of a collected arena: free every buffer it held (no lease can be live: leases hold the arena)."""
    if sys.is_finalizing():
        return
    frees = []
    for sub in list(subs.values()):
        if sub.anchor is not None:
            sub.anchor.detach()
        for block in [sub.block, *sub.retired]:
            if block is not None and not block.freed:
                block.freed = True
                frees.append((block, None))  # its streams may be gone too
    subs.clear()
    _free_now(provider, frees)


def _anchor_died(arena_ref: weakref.ref, key: Hashable, serial: int, eager: bool) -> None:
    """A watched stream object (or a thread's lane holder) died. Never blocks on the arena's lock."""
    arena = arena_ref()
    if arena is None or sys.is_finalizing():
        return
    arena._dead.append((key, serial, eager))
    if not arena._lock._is_owned() and arena._lock.acquire(blocking=False):  # not inside this thread's own hold
        frees: list = []
        try:
            arena._process_dead(frees)
        finally:
            arena._lock.release()
        arena._free(frees)


_device_arenas: weakref.WeakSet[Arena] = weakref.WeakSet()
_device_lock = threading.Lock()  # guards _device_arenas and _atexit_registered
_atexit_registered = False


def _track_device_arena(arena: Arena) -> None:
    """Remember a device arena, so that it is released at exit before the CUDA context is torn down.

    The handler is registered when the first device arena exists, hence after its provider imported CuPy;
    atexit runs handlers last-in first-out, so it runs before anything CuPy registered at import.
    """
    global _atexit_registered
    with _device_lock:
        _device_arenas.add(arena)
        if not _atexit_registered:
            atexit.register(_shutdown_device_arenas)
            _atexit_registered = True


def _shutdown_device_arenas() -> None:
    with _device_lock:
        arenas = list(_device_arenas)
    for arena in arenas:
        arena._shutdown()
