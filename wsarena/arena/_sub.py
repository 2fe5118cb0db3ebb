"""One stream's sub-arena: its buffer, the lease that holds it, and the buffer it outgrew under that lease.

Every method here runs with the arena's lock held and calls no provider: a buffer let go is put on the arena's
``to_free`` queue, which the arena drains once it has let go of the lock. Each method that changes something
first does whatever calls it needs, then changes the fields by plain stores and C calls, the one that matters
first, so that a Ctrl-C (which CPython delivers as a Python function starts or a call returns) finds either
all of a change made or none of it (see :mod:`wsarena.arena._interrupts`).
"""

from __future__ import annotations

import collections
import itertools
import threading
import weakref
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from .streams import PerThreadStream, is_own_stream

if TYPE_CHECKING:
    from ._workspace import Workspace

__all__: list[str] = []

_serials = itertools.count(1)

Queue = collections.deque[Any]


class _Totals:
    """The arena's counters since it was created; they survive sub-arenas that are swept or trimmed away."""

    __slots__ = ("allocations", "frees", "growths", "high_water")

    def __init__(self) -> None:
        self.allocations = 0
        self.growths = 0
        self.frees = 0
        self.high_water = 0


class _Block:
    """A buffer of a sub-arena (current or outgrown)."""

    __slots__ = ("buffer", "freed", "ptr", "size")

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer
        self.ptr: int = buffer.ptr  # copied: the lease fast path reads them, and `buffer` is dropped once freed
        self.size: int = buffer.size
        self.freed = False


class _SubArena:
    """One stream's (or CPU lane's) buffer and who holds it.

    At most one lease holds a sub-arena at a time. ``holder`` refers to its
    :class:`~wsarena.arena.Workspace` weakly: a Workspace dropped while it holds the lane (its release cut short
    by an interrupt) puts itself on ``dropped`` for the arena to end its lease. ``holder_block`` is the block the
    lease uses, which is ``retired`` when ``reserve`` grew the buffer under the lease (one lease uses one block,
    so at most one is retired at a time). ``growing`` is the token of whoever is allocating a larger buffer right
    now (a lease's weak reference, or a ``reserve`` call's own object).
    """

    __slots__ = (
        "_died", "allocations", "anchor", "block", "cond", "dropped", "growing", "growths", "high_water", "holder",
        "holder_block", "holder_thread", "key", "orphan", "retired", "serial", "stream", "to_free", "totals",
        "waiters",
    )

    def __init__(self, key: Hashable, lock: threading.RLock, totals: _Totals, to_free: Queue, dropped: Queue) -> None:
        self.key = key
        # What the provider is told to allocate, fill and free on: the plain handle (2 for a PerThreadStream).
        # Only the key's own thread may use 2 this way: see free_stream().
        self.stream: Any = key.handle if type(key) is PerThreadStream else key
        self.serial = next(_serials)  # tells a re-created sub-arena for the same key from its predecessor
        self.totals = totals
        self.to_free = to_free
        self.dropped = dropped
        self._died = self.holder_died  # bound once: one would be made per lease otherwise
        self.block: _Block | None = None
        self.retired: _Block | None = None
        self.holder: weakref.ref[Workspace] | None = None
        self.holder_thread = 0
        self.holder_block: _Block | None = None
        self.growing: object = None
        self.waiters = 0  # threads waiting on cond for the holder to leave or a growth to end
        self.cond = threading.Condition(lock)
        self.high_water = 0
        self.allocations = 0
        self.growths = 0
        self.anchor: weakref.finalize | None = None  # watches one stream object (or the thread of a lane)
        self.orphan = False  # every watched object died: release once idle

    # ------------------------------------------------------------------------------------------- queries
    def capacity(self) -> int:
        return self.block.size if self.block is not None else 0

    def retired_bytes(self) -> int:
        return self.retired.size if self.retired is not None else 0

    def idle(self) -> bool:
        return self.holder is None and self.waiters == 0 and self.growing is None

    def holds(self, ws: Workspace) -> bool:
        holder = self.holder
        return holder is not None and holder() is ws

    def free_stream(self, gone: bool = False) -> Any:
        """The stream to free this sub-arena's buffers on: its own, unless that may be gone (``gone``) or is
        another thread's per-thread stream (handle 2 would name the calling thread's): then ``None``."""
        if gone or not is_own_stream(self.key):
            return None
        return self.stream

    # ------------------------------------------------------------------------------------------- leases
    def take(self, ws: Workspace, thread: int) -> None:
        """Make ``ws`` the lane's holder: the one change every other thread waits for."""
        ref = weakref.ref(ws, self._died)
        self.holder_thread = thread
        self.holder_block = None
        self.holder = ref

    def leave(self) -> None:
        """The lane's lease ended: its bytes are free for the next lease."""
        self.holder = None
        self.holder_block = None

    def holder_died(self, ref: weakref.ref[Any]) -> None:
        """Weakref callback: a Workspace that still held the lane was dropped. Never takes the arena's lock (the
        collector may run this anywhere); the arena ends the lease at its next operation."""
        self.dropped.append((self, ref))

    def wake(self) -> None:
        if self.waiters:
            self.cond.notify_all()

    # ------------------------------------------------------------------------------------------- buffers
    def install(self, buffer: Any) -> _Block:
        """Make ``buffer`` the current one; the outgrown one is retired if the holder uses it, else let go."""
        new = _Block(buffer)
        stream = self.free_stream()
        old = self.block
        self.block = new
        self.allocations += 1
        self.totals.allocations += 1
        if old is not None:
            self.growths += 1
            self.totals.growths += 1
            if old is self.holder_block:
                self.retired = old  # the holder uses at most one block: nothing else can be retired now
            elif not old.freed:
                old.freed = True
                self.totals.frees += 1
                self.to_free.append((old.buffer, stream))
        return new

    # tidy() and empty() detach a block and queue it inline, with no call in between: a helper's first
    # instruction would be a place where an interrupt finds the block detached and never freed.
    def tidy(self) -> int:
        """Let go of the outgrown buffer once no lease uses it; return the bytes let go."""
        block = self.retired
        if block is None or block is self.holder_block:
            return 0
        stream = self.free_stream()
        self.retired = None
        if block.freed:
            return 0
        block.freed = True
        self.totals.frees += 1
        self.to_free.append((block.buffer, stream))
        return block.size

    def empty(self, gone: bool = False) -> int:
        """Let go of the current buffer unless a lease uses it (``gone``: the stream may no longer exist)."""
        block = self.block
        if block is None or block is self.holder_block:
            return 0
        stream = self.free_stream(gone)
        self.block = None
        if block.freed:
            return 0
        block.freed = True
        self.totals.frees += 1
        self.to_free.append((block.buffer, stream))
        return block.size
