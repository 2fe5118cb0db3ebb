"""A bounded map that builds what it lacks: the one cache of objects that are costly to build or to find (cuDNN
descriptors and execution plans, the algorithms chosen per call).

Lookups take no lock: a hit is one dictionary read and a move to the end, which CPython does atomically. A miss
builds the value outside the lock (building may call into cuDNN and take milliseconds), then inserts it unless
another thread inserted one first, in which case that one wins and the new one is given to ``discard``. A value
made elsewhere goes in with ``put``, in place of the key's, or beside a check of the key's that may keep it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from . import _forksafe

__all__ = ["LRU"]

V = TypeVar("V")


class LRU(Generic[V]):
    """At most ``maxsize`` values, the least recently used evicted first.

    Parameters
    ----------
    maxsize : int
        How many entries to keep (>= 1).
    valid : callable, optional
        ``valid(value) -> bool``; a cached value that is no longer valid (a descriptor closed by mistake) is
        built again on its next request.
    discard : callable, optional
        Called with a value built by a thread that lost the race to insert it. Evicted values are *not*
        discarded: whoever still holds one keeps it usable, and its own finalizer cleans it up.
    """

    def __init__(
        self,
        maxsize: int,
        *,
        valid: Callable[[V], bool] | None = None,
        discard: Callable[[V], None] | None = None,
    ) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, not {maxsize}")
        self.maxsize = maxsize
        self.builds = 0
        self._valid = valid
        self._discard = discard
        self._items: collections.OrderedDict[Hashable, V] = collections.OrderedDict()
        self._lock = _forksafe.lock()  # guards inserts and evictions; never held while building

    def lookup(self, key: Hashable) -> V | None:
        """The valid value cached for ``key``, now the most recently used; ``None`` on a miss. A caller whose
        miss needs arguments looks up first and makes its ``build`` for :meth:`get` only then (no closure per hit).
        """
        value = self._items.get(key)
        if value is not None and (self._valid is None or self._valid(value)):
            try:
                self._items.move_to_end(key)
            except KeyError:  # evicted by another thread meanwhile: still a good value for this caller
                pass
            return value
        return None

    def get(self, key: Hashable, build: Callable[[], V]) -> V:
        """The value for ``key``, built with ``build()`` on a miss (an exception from it caches nothing)."""
        value = self.lookup(key)
        if value is not None:
            return value
        value = build()
        with self._lock:
            current = self._items.get(key)
            if current is not None and (self._valid is None or self._valid(current)):
                winner, loser = current, value
                self._items.move_to_end(key)
            else:
                self._insert(key, value)
                winner, loser = value, None
        if loser is not None and self._discard is not None:
            self._discard(loser)
        return winner

    def put(self, key: Hashable, value: V, *, keep: Callable[[V], bool] | None = None) -> bool:
        """Cache ``value`` for ``key`` as the most recently used, in place of any value it had (which is not
        discarded: whoever read it may still use it), unless ``keep(that value)`` says it stays, which is decided
        under the lock that guards inserts. Returns whether ``value`` went in."""
        with self._lock:
            if keep is not None:
                current = self._items.get(key)
                if current is not None and (self._valid is None or self._valid(current)) and keep(current):
                    return False
            self._insert(key, value)
            return True

    def _insert(self, key: Hashable, value: V) -> None:
        """Under the lock: ``value`` in, the most recently used, and the least recently used out past the bound."""
        self._items[key] = value
        self._items.move_to_end(key)
        self.builds += 1
        while len(self._items) > self.maxsize:
            self._items.popitem(last=False)

    def values(self) -> list[V]:
        """The cached values, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._items.values())

    def items(self) -> list[tuple[Hashable, V]]:
        """``(key, value)`` of each cached entry, in no set order: a snapshot read without the lock (a finalizer's,
        which may run where it is held). Read as a plain dict's entries: the ordered view would hash each key again
        (a geometry's ``__hash__`` is Python code), where a hit in another thread moving an entry cuts it short."""
        return list(dict.items(self._items))

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items
