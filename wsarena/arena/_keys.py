"""The keys the arena's routing table (:mod:`wsarena.arena._table`) holds a sub-arena under, beside the caller's own:
a lane key object, held weakly, and the key a dead stream's sub-arena is moved aside to."""

from __future__ import annotations

import weakref
from collections.abc import Hashable

from .streams import PerThreadStream, ThreadLane

__all__ = ["GoneStream", "callers_key"]


class _LaneKey(weakref.ref):
    """A CPU lane key object, held weakly by the table: equal to (and hashing as) the object while it lives, so that
    the object itself finds its sub-arena, and the sub-arena goes away with the object."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if type(other) is _LaneKey:
            return weakref.ref.__eq__(self, other)
        target = self()
        return target is not None and bool(target == other)

    __hash__ = weakref.ref.__hash__

    def __repr__(self) -> str:
        return repr(self())


class GoneStream:
    """The key a sub-arena is moved to when its stream is gone and another stream has its handle while a lease (or a
    growth) still uses it: it stays in the table, orphaned, so that it is let go as gone once that ends."""

    __slots__ = ("handle",)

    def __init__(self, handle: Hashable) -> None:
        self.handle = handle

    def __repr__(self) -> str:
        return f"GoneStream({self.handle!r})"


def callers_key(key: Hashable) -> Hashable:
    """``key`` as the caller gave it: a lane key object rather than the table's weak reference to it (the reference
    itself only if the object has just died, before the sweep that forgets its lane)."""
    if type(key) is _LaneKey:
        target = key()
        if target is not None:
            return target
    return key


def _caller_chosen(key: Hashable) -> bool:
    """Whether ``key`` is one the caller chose (a lane key, a raw handle), not a thread's own lane or per-thread
    stream, which go with their thread: only those count towards the table's ``MAX_IDLE_STREAMS``."""
    return type(key) is not ThreadLane and type(key) is not PerThreadStream
