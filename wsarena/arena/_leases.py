"""Taking and ending a lease: the fast path of a lease on a lane that is free and large enough, the slow path that
waits for the lane, and the release (poisoning first in debug mode). These functions are the arena's methods
(``Arena._acquire``, ``Arena._end`` and the like, which :class:`~wsarena.arena.Workspace` calls), written here to
keep each module to one job; the rules they keep are written in :mod:`wsarena.arena._arena`.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from ._lifecycle import let_go_posted
from ._pins import freeing
from ._sub import _Block, _Owner, _SubArena, this_thread, wait
from .providers import missing_method
from .streams import PerThreadStream

if TYPE_CHECKING:
    from ._arena import Arena
    from ._workspace import Workspace

__all__ = ["POISON_BYTE"]  # and the arena's own methods: Arena._acquire, ._take_lane, ._end, ...

POISON_BYTE = 0xA5  # what debug mode writes over released workspace bytes


def _acquire(self: Arena, ws: Workspace) -> None:
    """Take the lease ``ws``; on any exception the Workspace gives back what was taken (:meth:`_end`).

    The lease is held by the bound ``__exit__`` of the ``with`` statement that enters it, or else by ``ws``
    (:mod:`wsarena.arena._table`): weakly, from here on (a strong reference would keep ``ws`` alive)."""
    anchor, ws._with = ws._with, None
    if anchor is not None:
        ref = weakref.ref(anchor)
        anchor = None  # a method only ws._with held (a lookup that was no with statement's) is gone now
        anchor = ref()
    if anchor is None:  # entered by hand
        anchor = ws
        ref = weakref.ref(ws)
    capture = None
    try:
        if self._capture is not None:
            # raw_handle(ws.stream), inline: this runs once per lease of a device arena
            capture = self._capture(ws.stream.handle if type(ws.stream) is PerThreadStream else ws.stream)
            if capture is not None:
                self._acquire_captured(ws, anchor, capture)
                return
        with self._lock:
            sub = self._subs.get(ws.stream)
            if (
                sub is None or sub.holder is not None or sub.handoff or self._table.closed or self._dead
                or sub.orphan or (ws._anchor is not None and sub.anchor is None)
            ):
                sub = None  # the slow path, below: wait, create, sweep, refuse, adopt an orphan
            else:  # the lane is free: take it (sub.take, inline: this runs once per convolution)
                ws._ref = ref
                ws._sub = sub
                sub.holder_thread = this_thread.token
                sub.holder_block = None
                sub.used = True
                sub.holder = ref
                block = sub.block
                if block is not None and block.size >= ws.nbytes and not ws._debug:  # the fast path
                    self._grant(sub, ws, block)
                    return
        if sub is None:
            sub = self._take_lane(ws, anchor)
        self._grow_for(ws, sub)
    finally:
        if self._to_free:  # what a sweep or a growth let go, even if this lease failed
            self._give_back(ws.stream)
        if freeing and capture is None:  # an eager lease: what graphs gone kept that may free device memory
            let_go_posted()


def _take_lane(self: Arena, ws: Workspace, anchor: Any, capturing: bool = False) -> _SubArena:
    """Wait (with the lock let go) until ``ws`` holds its lane (``capturing``: its stream is being captured)."""
    waiter = None
    while True:
        with self._lock:
            got = self._table.take_lane(ws, anchor, waiter, capturing)
        if type(got) is _SubArena:
            return got
        waiter = got
        wait(waiter)


def _end(self: Arena, ws: Workspace) -> None:
    """End whatever ``ws`` holds: its lease, its growth. Idempotent, and safe at any point of :meth:`_acquire`
    (the Workspace runs it under :func:`~wsarena.arena._interrupts.finish`); does nothing if the lease was
    ended already (by whoever found its ``with`` statement over: :meth:`_Table.reap`)."""
    sub = ws._sub
    if sub is None:  # nothing was taken
        if ws._state == 1:
            ws._state = 2
        return
    block = ws._block
    if ws._debug and ws._state == 1 and block is not None:
        # Poison while this lease still holds the lane, so the next user never sees it half written; `ending`
        # keeps others from ending the lease meanwhile (its with statement is over, its anchor may be gone). It
        # refers weakly to an object of this call's own, dropped once the fill is over, however that ended (a
        # failed fill, an interrupt): then whoever finds the lease's holder gone may end it.
        # The fill is ordered on the sub-arena's stream: none where that may be gone (a dead stream's handle may
        # name another stream now) or is another thread's per-thread stream (handle 2 would name this thread's).
        owner = _Owner()
        with self._lock:
            ref = ws._ref  # read under the lock, as :meth:`_hold_by_workspace` changes it
            ordered = self._lanes or sub.free_stream() is not None
            poison = sub.holder is ref and not block.freed and ordered
            if poison:
                sub.ending = weakref.ref(owner)
        try:
            if poison:
                fill = getattr(self.provider, "fill", None)
                if fill is None:  # a provider of leases alone
                    raise missing_method(self.provider, "fill")
                fill(block.buffer, POISON_BYTE, ws.nbytes, stream=sub.stream)
        finally:
            del owner  # not kept alive by a traceback that holds this frame
    with self._lock:
        ref = ws._ref
        if sub.holder is ref:
            if sub.growing is ref:
                sub.growing = None  # its growth was cut short
            granted = sub.holder_block is not None
            sub.holder = sub.holder_block = sub.ending = None  # sub.leave(), inline: the lane is free again
            ws._state = 2
            if (
                sub.lane_waiters or sub.growth_waiters or sub.retired is not None or sub.orphan
                or self._table.closed or not granted
            ):
                self._table.after_lease(sub, granted)
        elif ws._state == 1:
            ws._state = 2
    if self._to_free:
        self._give_back(ws.stream)


def _hold_by_workspace(self: Arena, ws: Workspace) -> None:
    """Make ``ws`` the holder of its live lease: another ``with`` statement tried to enter it. That statement
    looked ``__exit__`` up before it failed to enter; if it did so in another thread just before this lease was
    taken, its bound method is what holds the lease (see :meth:`_acquire`), and it goes with that statement."""
    with self._lock:
        ref, sub = ws._ref, ws._sub
        holder = ref() if ref is not None else None
        if sub is not None and sub.holder is ref and holder is not None and holder is not ws:
            ws._ref = sub.holder = weakref.ref(ws)


def _grant(self: Arena, sub: _SubArena, ws: Workspace, block: _Block) -> None:
    """Give ``ws`` the bytes of ``block`` (``ws`` holds the lane; lock held)."""
    n = ws.nbytes
    if ws._debug:
        self._table.check_overlap(sub, block.ptr, n)
    sub.holder_block = block
    sub.holder_nbytes = n
    if n > sub.high_water:
        sub.high_water = n
        self._table.totals.high_water = max(self._table.totals.high_water, n)
    ws._block = block
    ws.ptr = block.ptr
    ws.cuda_stream = None if self._lanes else sub.stream
    ws._state = 1
