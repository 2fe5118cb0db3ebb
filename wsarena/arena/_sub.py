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
from _thread import allocate_lock as _allocate_lock
from collections.abc import Hashable
from typing import Any, Self

from ._interrupts import RECHECK_SECONDS
from .streams import PerThreadStream, is_own_stream, raw_handle

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
    """A buffer of a sub-arena (current or outgrown), and the pins of the CUDA graphs that captured it."""

    __slots__ = ("buffer", "freed", "installed", "pins", "ptr", "size")

    def __init__(self, buffer: Any, ptr: int, size: int) -> None:
        self.buffer = buffer
        self.ptr = ptr  # the buffer's, as ints: the lease fast path reads them, and `buffer` is dropped once freed
        self.size = size
        self.freed = False
        # Made a sub-arena's buffer (by install): from then on the sub-arena frees it, so the growth that allocated
        # it must not. Whether it is still current says nothing: a trim or another growth may have let it go since.
        self.installed = False
        self.pins: list[Any] = []  # wsarena.arena._pins.GraphPin (or a test's), one per graph that captured it

    def pinned(self) -> bool:
        """Whether a graph that captured this buffer still exists (released pins are dropped)."""
        pins = self.pins
        if pins:
            live = [pin for pin in pins if pin.live()]
            if len(live) != len(pins):
                self.pins = live
            return bool(live)
        return False


class _Anchor(weakref.ref):
    """A weak reference to what shows that a sub-arena's stream is alive (a stream object, the holder of a thread's
    lane, a lane key object). Its callback is the arena's ``dead.append``, a C call, so that an interrupt can never
    land in it; the sweep reads the key from the reference itself."""

    __slots__ = ("eager", "key", "serial")
    key: Hashable
    serial: int
    eager: bool

    def __new__(cls, target: Any, callback: Any, key: Hashable, serial: int, eager: bool) -> Self:
        self = super().__new__(cls, target, callback)
        self.key, self.serial, self.eager = key, serial, eager
        return self

    def __init__(self, target: Any, callback: Any, key: Hashable, serial: int, eager: bool) -> None:
        weakref.ref.__init__(self, target, callback)  # type: ignore[call-arg]  # it takes these two only


class _Owner:
    """What a call holds while others wait for what it does (a ``reserve`` call's growth, a release's poisoning): the
    sub-arena refers to it weakly, so once the call is over, however it ended, so is what it was doing."""

    __slots__ = ("__weakref__",)


class _ThisThread(threading.local):
    """``this_thread.token``: an object of the calling thread's own, which records who holds a lane. Not the thread's
    id: a lease may outlive the thread that entered it (handed to another thread to end), and the id of a thread that
    has exited is given to new threads, one of which would then be refused as the holder. The token, kept alive by
    the record, is never another thread's."""

    def __init__(self) -> None:
        self.token = object()


this_thread = _ThisThread()


# Buffers of device arenas shut down at exit while a graph still held them: kept, never freed, for that graph.
abandoned: list[Any] = []


def park(waiters: collections.deque[Any], waiter: Any = None) -> Any:
    """A locked lock of the caller's own, queued on ``waiters``: :meth:`_SubArena.wake` releases it. (Lock held.)

    ``waiter``: the lock the caller waited on last, if any. One still queued (its wait timed out: a woken one was
    taken off the queue first) is queued once, not again beside a new one at every recheck."""
    if waiter is not None and waiter in waiters:
        return waiter
    waiter = _allocate_lock()
    waiter.acquire()
    waiters.append(waiter)
    return waiter


def wait(waiter: Any) -> None:
    """Wait (lock not held) until ``waiter`` is released or ``RECHECK_SECONDS`` pass. A C call: an interrupt raises
    out of it with nothing held, and a waiter left queued is released harmlessly by the next wake."""
    waiter.acquire(True, RECHECK_SECONDS)


class _SubArena:
    """One stream's (or CPU lane's) buffer and who holds it.

    At most one lease holds a sub-arena at a time. ``holder`` is a weak reference to what ends that lease: the bound
    ``__exit__`` of the ``with`` statement that entered it, or else its :class:`~wsarena.arena.Workspace`. Once that
    is gone the lease can never be released, so whoever finds it so ends it (:func:`wsarena.arena._interrupts.gone`).
    ``holder_block`` is the block the lease uses, which is ``retired`` when ``reserve`` grew the buffer under the
    lease (one lease uses one block, so at most one is retired at a time). ``growing`` is a weak reference to
    whoever is allocating a larger buffer right now (the lease's ``holder``, or a ``reserve`` call's owner object);
    ``grower``, the thread doing so, which must not wait for it (a provider's ``allocate`` that leases again there).

    A buffer that a graph captured (:mod:`wsarena.arena._pins`) is never freed while it is pinned: the current one
    stays current (eager calls and later captures on the stream go on using it), and an outgrown, trimmed or
    forgotten one goes on the table's ``kept`` list, freed in stream order once no graph holds it.

    Threads waiting for the lane queue a lock of their own on ``lane_waiters``; those waiting for a growth, on
    ``growth_waiters``. When the lane is released to waiting threads, ``handoff`` keeps it for them: a thread that
    has not waited yet queues behind them instead of taking it again at once.
    """

    __slots__ = (
        "allocations", "anchor", "block", "ending", "grower", "growing", "growth_waiters", "growths", "handoff",
        "high_water", "holder", "holder_block", "holder_nbytes", "holder_thread", "kept", "key", "lane_waiters",
        "orphan", "retired", "serial", "stream", "stream_id", "to_free", "totals", "used",
    )

    def __init__(self, key: Hashable, totals: _Totals, to_free: Queue, kept: list[Any]) -> None:
        self.key = key
        # What the provider is told to allocate and fill on: the plain handle (2 for a PerThreadStream). Only the
        # key's own thread may use 2 this way; a buffer is queued to be freed with the key instead: see free_stream().
        self.stream: Any = raw_handle(key)
        self.serial = next(_serials)  # tells a re-created sub-arena for the same key from its predecessor
        self.totals = totals
        self.to_free = to_free
        self.kept = kept  # (key, block, stream) of pinned buffers this sub-arena no longer uses
        self.block: _Block | None = None
        self.retired: _Block | None = None
        self.holder: weakref.ref[Any] | None = None
        self.holder_thread: object = None  # this_thread.token of the thread that took the lane
        self.holder_block: _Block | None = None
        self.holder_nbytes = 0
        self.ending: weakref.ref[Any] | None = None  # the _Owner of the holder's release while it poisons the bytes
        self.growing: weakref.ref[Any] | None = None
        self.grower: object = None  # this_thread.token of the thread that set ``growing`` last
        self.lane_waiters: collections.deque[Any] = collections.deque()
        self.growth_waiters: collections.deque[Any] = collections.deque()
        self.handoff = False
        self.used = False  # leased again, free and found, since the last eviction pass (_Table.evict_idle)
        self.high_water = 0
        self.allocations = 0
        self.growths = 0
        self.anchor: _Anchor | None = None  # watches one stream object (or the thread of a lane, or a key object)
        self.orphan = False  # every watched object died: release once idle
        # CUDA's id of the stream that the watched object was of (None: unknown), read when it was first watched:
        # once it dies, a stream object for the same handle is the same stream only if its id is this one.
        self.stream_id: int | None = None

    # ------------------------------------------------------------------------------------------- queries
    def capacity(self) -> int:
        return self.block.size if self.block is not None else 0

    def retired_bytes(self) -> int:
        return self.retired.size if self.retired is not None else 0

    @property
    def waiters(self) -> int:
        """Threads queued for the lane or for a growth (a queued lock whose thread was interrupted counts until the
        next wake)."""
        return len(self.lane_waiters) + len(self.growth_waiters)

    def idle(self) -> bool:
        return self.holder is None and self.growing is None

    def releasing(self) -> bool:
        """Whether the holder's own release is poisoning its bytes right now: no one else may end the lease."""
        ending = self.ending
        return ending is not None and ending() is not None

    def free_stream(self, gone: bool = False) -> Any:
        """The stream to queue this sub-arena's buffers to be freed on: its own, unless that may be gone (``gone``,
        or every object that showed it alive died) or is another thread's per-thread stream (handle 2 would name the
        calling thread's): then ``None``. The per-thread default stream is queued as its key, not as handle 2: any
        thread may drain the queue, and the drain frees on handle 2 only in the key's own thread
        (:func:`wsarena.arena._lifecycle.give_back`)."""
        key = self.key
        if gone or self.orphan or not is_own_stream(key):
            return None
        return key if type(key) is PerThreadStream else self.stream

    # ------------------------------------------------------------------------------------------- leases
    def take(self, ref: weakref.ref[Any], thread: object) -> None:
        """Make ``ref`` the lane's holder: the one change every other thread waits for."""
        self.holder_thread = thread
        self.holder_block = None
        self.handoff = False
        self.holder = ref

    def leave(self) -> None:
        """The lane's lease ended: its bytes are free for the next lease."""
        self.holder = None
        self.holder_block = None
        self.ending = None

    def wake(self) -> None:
        """Release every queued waiter; the lane goes to those waiting for it (``handoff``) if it is free."""
        waiters = self.lane_waiters
        if waiters:
            if self.holder is None:
                self.handoff = True
            while waiters:
                waiters.popleft().release()
        waiters = self.growth_waiters
        while waiters:
            waiters.popleft().release()

    # ------------------------------------------------------------------------------------------- buffers
    def install(self, new: _Block) -> None:
        """Make ``new`` the current buffer; the outgrown one is retired if the holder uses it, else let go."""
        stream = self.free_stream()
        old = self.block
        keep = old is not None and old.pinned()
        self.block = new
        new.installed = True
        self.allocations += 1
        self.totals.allocations += 1
        if old is not None:
            self.growths += 1
            self.totals.growths += 1
            if old is self.holder_block:
                self.retired = old  # the holder uses at most one block: nothing else can be retired now
            elif keep:
                self.kept.append((self.key, old, stream))
            elif not old.freed:
                old.freed = True
                self.totals.frees += 1
                self.to_free.append((old.buffer, stream))

    def tidy(self) -> int:
        """Let go of the outgrown buffer once no lease uses it; return the bytes let go."""
        block = self.retired
        if block is None or block is self.holder_block:
            return 0
        return self._let_go(block, self.free_stream(), block.pinned(), retired=True)

    def empty(self, gone: bool = False, forgotten: bool = False) -> int:
        """Let go of the current buffer unless a lease uses it (``gone``: the stream may no longer exist). A pinned
        one stays current, unless the sub-arena is being ``forgotten``: then it is kept for its graphs."""
        block = self.block
        if block is None or block is self.holder_block:
            return 0
        keep = block.pinned()
        if keep and not forgotten:
            return 0
        return self._let_go(block, self.free_stream(gone), keep, retired=False)

    def _let_go(self, block: _Block, stream: Any, keep: bool, retired: bool) -> int:
        """Detach ``block``, the outgrown buffer (``retired``) or the current one, and queue it: on ``kept`` for its
        graphs (``keep``), else to be freed on ``stream`` unless it was already. Returns the bytes queued to be freed.

        The detaching and the queueing happen here, by plain stores and one C call, with no call between them: an
        interrupt as this method starts finds the block where it was, and one once the queueing call returns finds
        it queued. (Detached by the caller and queued by a helper, it would be lost to an interrupt as the helper
        starts.)"""
        if retired:
            self.retired = None
        else:
            self.block = None
        if keep:
            self.kept.append((self.key, block, stream))
            return 0
        if block.freed:
            return 0
        block.freed = True
        self.totals.frees += 1
        self.to_free.append((block.buffer, stream))
        return block.size
