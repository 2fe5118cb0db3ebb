"""Releasing memory when no one will: a collected arena, a dead stream or thread, interpreter exit.

Finalizers here never raise (a failed free warns) and do nothing once the interpreter is finalizing; device
arenas are released by an atexit handler instead, while CUDA is still up.
"""

from __future__ import annotations

import atexit
import collections
import sys
import threading
import warnings
import weakref
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._arena import Arena
    from ._table import _Table

__all__ = ["anchor_died", "give_back", "release_all", "track_device_arena"]


def give_back(provider: Any, to_free: collections.deque[tuple[Any, Any]], quiet: bool = False) -> None:
    """Drain ``to_free``, giving each ``(buffer, stream)`` back to ``provider``; a failure warns (or, ``quiet``,
    is ignored), never raises. Any thread may drain the queue; each entry is taken by one.

    A ``KeyboardInterrupt`` (or another ``BaseException``) during one free is raised only after the rest are
    freed: their blocks are already let go, so nothing else would ever give them back.
    """
    interrupted: BaseException | None = None
    while to_free:
        try:
            buffer, stream = to_free.popleft()
        except IndexError:  # another thread took the last one
            break
        try:
            provider.deallocate(buffer, stream=stream)
        except Exception as exc:  # noqa: BLE001 - a failed free must not break a lease's exit
            if not quiet:
                warnings.warn(f"wsarena: freeing {buffer!r} failed: {exc}", RuntimeWarning, stacklevel=3)
        except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt: raised once the rest are freed
            interrupted = interrupted or exc
    if interrupted is not None:
        try:
            raise interrupted
        finally:
            interrupted = None


def release_all(provider: Any, table: _Table) -> None:
    """Finalizer of a collected arena: free every buffer it held (no lease can be live: leases hold the arena)."""
    if sys.is_finalizing():
        return
    table.let_go_everything()
    give_back(provider, table.to_free)


def anchor_died(dead: collections.deque[tuple[Hashable, int, bool]], key: Hashable, serial: int, eager: bool) -> None:
    """A watched stream object (or a thread's lane holder) died: queue its sub-arena for the next operation to
    sweep. Never takes the arena's lock: the collector may run this inside a locked region of any thread."""
    if not sys.is_finalizing():
        dead.append((key, serial, eager))


_device_arenas: weakref.WeakSet[Arena] = weakref.WeakSet()
_device_lock = threading.Lock()  # guards _device_arenas and _atexit_registered
_atexit_registered = False


def track_device_arena(arena: Arena) -> None:
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
