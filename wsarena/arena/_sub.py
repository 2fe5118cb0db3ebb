"""A sub-arena's bookkeeping: its buffers and who holds them. Every field is guarded by the arena's lock."""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Hashable
from typing import Any

from .streams import PerThreadStream

__all__: list[str] = []

_serials = itertools.count(1)


class _Block:
    """A buffer and the number of live leases on it."""

    __slots__ = ("buffer", "ptr", "nbytes", "live", "freed")

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer
        self.ptr = buffer.ptr  # copied: the lease fast path reads them, and `buffer` is dropped once freed
        self.nbytes = buffer.nbytes
        self.live = 0
        self.freed = False


class _Sub:
    """One stream's sub-arena. Every field is guarded by the arena's lock."""

    __slots__ = (
        "key", "stream", "serial", "block", "retired", "live", "owner", "waiters", "growing", "cond",
        "high_water", "allocations", "growths", "anchor", "orphan",
    )

    def __init__(self, key: Hashable, lock: threading.Lock) -> None:
        self.key = key
        # What the provider is told to allocate, fill and free on: the plain handle (2 for a PerThreadStream).
        # Only the key's own thread may use 2 this way: see Arena._free_stream.
        self.stream = int(key) if type(key) is PerThreadStream else key
        self.serial = next(_serials)  # tells a re-created sub-arena for the same key from its predecessor
        self.block: _Block | None = None  # the current buffer
        self.retired: list[_Block] = []  # outgrown buffers that live leases still use
        self.live = 0
        self.owner: int | None = None  # the thread whose lease holds the lane / stream (one lease at a time)
        self.waiters = 0  # threads waiting on cond for the owner to leave or a growth to finish
        self.growing = False
        self.cond = threading.Condition(lock)
        self.high_water = 0
        self.allocations = 0
        self.growths = 0
        self.anchor: weakref.finalize | None = None  # watches one stream object (or the thread of a lane)
        self.orphan = False  # every watched object died: release once idle

    def idle(self) -> bool:
        return self.live == 0 and self.owner is None and self.waiters == 0 and not self.growing

    def capacity(self) -> int:
        return self.block.nbytes if self.block is not None else 0
