"""The arena's routing table: which sub-arena serves a stream key, and when a sub-arena goes away.

A sub-arena is made on the first lease or reserve for its key, and forgotten when nothing uses it any more and
it holds nothing, or when its stream is gone: a stream object or a thread (for its lane and its per-thread
stream) that dies queues the key on ``dead``, a Workspace dropped while it still held its lane queues itself on
``dropped``, and the next operation of the arena sweeps both. Every method runs with the arena's lock held; the
queues are only appended to from outside it (by weakref callbacks, which must never block on the lock).
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Hashable
from threading import get_ident
from typing import TYPE_CHECKING, Any

from ._interrupts import RECHECK_SECONDS
from ._lifecycle import anchor_died
from ._sub import Queue, _Block, _SubArena, _Totals
from .streams import PerThreadStream, ThreadLane

if TYPE_CHECKING:
    from ._workspace import Workspace

__all__: list[str] = []


class _Table:
    """The sub-arenas of one arena, by key, and the queues that say which of them go away."""

    __slots__ = ("closed", "dead", "dropped", "lanes", "lock", "subs", "to_free", "totals")

    def __init__(self, lock: threading.RLock, lanes: bool) -> None:
        self.lock = lock
        self.lanes = lanes  # keys are CPU lanes (else CUDA streams)
        self.subs: dict[Hashable, _SubArena] = {}
        self.dead: collections.deque[tuple[Hashable, int, bool]] = collections.deque()  # streams, threads gone
        # (sub-arena, weak reference) of Workspaces dropped live
        self.dropped: collections.deque[tuple[_SubArena, Any]] = collections.deque()
        self.to_free: Queue = collections.deque()  # (buffer, stream) let go, for the provider
        self.totals = _Totals()
        self.closed = False

    def sub_for(self, key: Hashable, anchor: Any) -> _SubArena:
        """The sub-arena of ``key``, made if needed; ``anchor`` is an object whose death means the stream is gone."""
        if self.dead or self.dropped:
            self.sweep()
        sub = self.subs.get(key)
        if sub is None:
            self.sweep_orphans()  # a new stream appeared: a good moment to let go of dead ones
            sub = _SubArena(key, self.lock, self.totals, self.to_free, self.dropped)
            self.subs[key] = sub
        if anchor is not None and sub.anchor is None:
            # A dead thread's lane (or per-thread stream) is never used again: swept at once, not when idle later.
            eager = isinstance(key, (ThreadLane, PerThreadStream))
            sub.anchor = weakref.finalize(anchor, anchor_died, self.dead, key, sub.serial, eager)
            sub.anchor.atexit = False
        sub.orphan = False  # whoever leases on it shows the stream is alive
        return sub

    def take_lane(self, ws: Workspace) -> _SubArena:
        """Wait until no other thread holds ``ws``'s lane, then make ``ws`` its holder."""
        key, me = ws.stream, get_ident()
        sub = None
        while True:
            if self.closed:
                if sub is not None:  # it waited here: the holder that left may have left it idle
                    self.drop_if_idle(sub)
                raise RuntimeError("this arena is closed")
            sub = self.sub_for(key, ws._anchor)
            if sub.holder is None:
                ws._sub = sub
                sub.take(ws, me)
                return sub
            if sub.holder_thread == me:
                raise self._nested_error(key)
            self._wait(sub)

    def wait_for_growth(self, sub: _SubArena, n: int) -> _Block | None:
        """Wait while another thread grows ``sub``; its buffer if that now holds ``n`` bytes."""
        while sub.growing is not None:
            self._wait(sub)
            if self.closed:
                raise RuntimeError("this arena is closed")
        block = sub.block
        return block if block is not None and block.size >= n else None

    def end_growth(self, sub: _SubArena, token: object, buffer: Any) -> None:
        """End ``token``'s growth of ``sub``, installing ``buffer`` (if any) unless the arena closed meanwhile.
        Idempotent: a repeat after an interrupt finds the buffer installed and the growth ended."""
        if sub.growing is token:
            current = sub.block
            if buffer is not None and not self.closed and (current is None or current.buffer is not buffer):
                sub.install(buffer)
            sub.growing = None  # last
            sub.wake()
        current = sub.block
        if buffer is None or current is None or current.buffer is not buffer:
            self.drop_if_idle(sub)

    @staticmethod
    def _wait(sub: _SubArena) -> None:
        sub.waiters += 1
        try:
            sub.cond.wait(RECHECK_SECONDS)
        finally:
            sub.waiters -= 1

    def _nested_error(self, key: Hashable) -> RuntimeError:
        """This thread leases again on a lane / stream it holds (nothing was changed)."""
        if self.lanes:
            return RuntimeError(
                f"this thread already holds a lease on CPU lane {key!r}; a nested lease there would "
                "share its bytes: lease the inner workspace on another lane (stream=<any hashable>)"
            )
        return RuntimeError(
            f"this thread already holds a lease on stream {key!r}; a nested lease there would get the same "
            "bytes and overwrite what the outer lease still holds (e.g. a wsarena call inside your own "
            "arena.lease() on the same stream): lease the inner workspace on another stream, or after the outer "
            "lease is released"
        )

    def forget(self, sub: _SubArena, gone: bool = False) -> int:
        """Drop an idle sub-arena and let go of its buffers (``gone``: its stream may no longer exist)."""
        if self.subs.get(sub.key) is sub:
            del self.subs[sub.key]
        if sub.anchor is not None:
            sub.anchor.detach()
            sub.anchor = None
        return sub.tidy() + sub.empty(gone)

    def drop_if_idle(self, sub: _SubArena, gone: bool = False) -> None:
        """Forget ``sub`` if no one uses it and it holds nothing or the arena is closed (then free its buffer)."""
        if sub.idle() and (sub.block is None or self.closed) and self.subs.get(sub.key) is sub:
            self.forget(sub, gone)

    def after_lease(self, sub: _SubArena, granted: bool) -> None:
        """Tidy up once a lease of ``sub`` ended; ``granted``: it had its bytes (else it failed on its way)."""
        sub.wake()
        sub.tidy()
        if (sub.orphan or self.closed) and sub.idle() and self.subs.get(sub.key) is sub:
            self.forget(sub, gone=sub.orphan)
        elif not granted:
            self.drop_if_idle(sub)  # a first lease whose growth failed leaves nothing behind

    def sweep(self) -> int:
        """End the leases of dropped Workspaces; mark the sub-arenas of dead streams and threads. Each entry is
        removed once handled, so an interrupted sweep leaves the rest for the next one. Returns the bytes let go."""
        released = 0
        while self.dropped:  # a Workspace dropped while it held its lane: its lease ends now
            sub, ref = self.dropped[0]
            if sub.holder is ref:
                if sub.growing is ref:
                    sub.growing = None  # its growth was cut short too
                granted = sub.holder_block is not None
                sub.leave()
                if self.subs.get(sub.key) is sub:
                    self.after_lease(sub, granted)
            self.dropped.popleft()
        while self.dead:
            key, serial, eager = self.dead[0]
            gone = self.subs.get(key)
            if gone is not None and gone.serial == serial:  # else already gone, or a newer one for the same key
                gone.anchor = None
                gone.orphan = True
                if eager and gone.idle():
                    released += self.forget(gone, gone=True)
            self.dead.popleft()
        return released

    def sweep_orphans(self) -> int:
        released = 0
        for sub in list(self.subs.values()):
            if sub.orphan and sub.idle():
                released += self.forget(sub, gone=True)
        return released

    def check_overlap(self, sub: _SubArena, ptr: int, n: int) -> None:
        """Debug mode: a lease of ``[ptr, ptr + n)`` on ``sub`` must not overlap a live lease of another one."""
        end = ptr + n
        for other in self.subs.values():
            holder = other.holder() if other.holder is not None else None
            if other is sub or holder is None or holder._block is None:
                continue
            start, stop = holder.ptr, holder.ptr + holder.nbytes
            if start < end and ptr < stop:
                raise AssertionError(
                    f"wsarena debug: a lease of [{ptr:#x}, {end:#x}) on stream {sub.key!r} overlaps the live lease "
                    f"[{start:#x}, {stop:#x}) on stream {other.key!r}"
                )

    def let_go_everything(self) -> None:
        """At exit, or when the arena is collected: queue every buffer, even under live leases, and forget all."""
        for sub in list(self.subs.values()):
            if sub.anchor is not None:
                sub.anchor.detach()
                sub.anchor = None
            for block in (sub.block, sub.retired):
                if block is not None and not block.freed:
                    block.freed = True
                    self.totals.frees += 1
                    self.to_free.append((block.buffer, None))  # its streams may be gone too
            sub.block = sub.retired = sub.holder_block = None
        self.subs.clear()
