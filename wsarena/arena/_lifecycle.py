"""Releasing memory when no one will: a closed arena that nothing else refers to (and the one a collected arena hands
what it held to: :func:`wsarena.arena._arena._collected`), interpreter exit; and a forked child's arenas.

Finalizers never raise (a failed free warns) and do nothing once the interpreter is finalizing; device arenas are
released by an atexit handler instead, while CUDA is still up.

Fork: a child gets a copy of every arena as it was at the fork, with leases and growths of threads that do not
exist in the child (and maybe the arena's lock held by one of them). ``os.register_at_fork`` makes every arena
start again in the child (:func:`_after_fork_in_child`): no sub-arena, no lease, nothing given back to a provider.
"""

from __future__ import annotations

import atexit
import collections
import os
import reprlib
import threading
import warnings
import weakref
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from .. import _forksafe
from .._sizes import short_repr
from ._pins import let_go_kept, posted_in_turn
from ._table import _Table
from .streams import PER_THREAD_DEFAULT_STREAM, PerThreadStream, own_per_thread_stream

if TYPE_CHECKING:
    from ._arena import Arena

__all__ = [
    "device_arenas", "give_back", "keep_parents_memory", "keep_while_holding", "let_go_posted", "release_closed",
    "track_arena", "track_device_arena",
]


def give_back(
    provider: Any, to_free: collections.deque[tuple[Any, Any]], quiet: bool = False, waiting: Collection[Any] = (),
    unstreamed: Collection[Any] = (),
) -> None:
    """Drain ``to_free``, giving each ``(buffer, stream)`` back to ``provider``; a failure warns (or, ``quiet``,
    is ignored), never raises. Any thread may drain the queue; each entry is taken by one. An entry whose stream is
    in ``waiting`` (streams being captured: :func:`wsarena.arena._pinning.give_back`) is set aside and queued again;
    one whose stream is in ``unstreamed`` (found gone since) is freed with no stream. An entry of a per-thread
    default stream carries its :class:`~wsarena.arena.streams.PerThreadStream` key: it is freed on handle 2 in the
    key's own thread, and with no stream in any other (where handle 2 names another stream, which nothing orders
    after the owner's work).

    A ``KeyboardInterrupt`` (or another ``BaseException``) during one free is raised only after the rest are
    freed: their blocks are already let go, so nothing else would ever give them back.
    """
    interrupted: BaseException | None = None
    aside: list[tuple[Any, Any]] = []
    own = own_per_thread_stream()
    try:
        # `while True` and a test at the end, not `while to_free:`: CPython 3.12 and 3.13 compile the latter's test to a
        # jump back that no handler covers, and on 3.13, which checks for an interrupt at the jump itself, a Ctrl-C
        # there (the queue found empty, then refilled by another thread) skipped the finally (CPython's gh-130279)
        while True:
            try:
                # The for loop takes each entry off the queue in C and hands it to deallocate() (or sets it aside)
                # with no place between where an interrupt can land (one lands as a call returns to Python code, or
                # as a Python function starts: just after `to_free.popleft()` returned, or in a helper that set the
                # entry aside, it would lose the buffer). So a per-thread stream's key is told from the others by an
                # attribute read, not by a call such as type().
                for buffer, stream in iter(to_free.popleft, None):
                    if stream in waiting:
                        aside.append((buffer, stream))
                        continue
                    if stream.__class__ is PerThreadStream:
                        stream = PER_THREAD_DEFAULT_STREAM if stream is own else None
                    try:
                        provider.deallocate(buffer, stream=None if stream in unstreamed else stream)
                    except Exception as exc:  # noqa: BLE001 - a failed free must not break a lease's exit
                        if not quiet:
                            warnings.warn(
                                f"wsarena: freeing {_BUFFER.repr(buffer)} failed: {short_repr(exc)}", RuntimeWarning,
                                stacklevel=3,
                            )
            except IndexError:  # the queue is empty (another thread may have taken the last one): the drain ends below
                # Not `break`: from CPython 3.12 on, the finally's code lies ahead of the handlers, and a break from
                # one is a jump back, where an interrupt can land (as at a loop's), just before the extend below,
                # which it would skip: the entries set aside would be lost. The test below leaves by a jump forward.
                pass
            except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt: raised once the rest are freed
                interrupted = interrupted or exc
            if not to_free:  # a jump forward, out of the handlers, to the finally's code, which comes next
                break
    finally:
        to_free.extend(aside)  # one C call: those set aside wait for the next drain
    if interrupted is not None:
        try:
            raise interrupted
        finally:
            interrupted = None


_BUFFER = reprlib.Repr()  # a warning names the buffer even when its repr() fails, and not a whole array of it
_BUFFER.maxother = 120


# Closed arenas that still hold something, by id: a buffer a CUDA graph may still use, or one whose free waits for a
# capture to end. Kept alive here, so that release_closed() frees them (not while a graph or a capture may use them)
# whether or not anything else refers to the arena: get_arena() replaces a closed arena, and nothing else refers to it
# then. A collected arena hands what it held to a new closed arena, kept here alike (wsarena.arena._arena._collected).
_closed_holding: dict[int, Arena] = {}


def keep_while_holding(arena: Arena, holding: bool) -> None:
    """Keep ``arena``, which is closed, while it still ``holding`` anything; else let it go. Called with the arena's
    lock held, in the step that saw what it holds: two threads that decide at once decide in turn."""
    if holding:
        _closed_holding[id(arena)] = arena
    else:
        _closed_holding.pop(id(arena), None)


def release_closed() -> None:
    """Free what closed arenas held for graphs gone since, or for captures over since, and let go of those that hold
    nothing more: each is closed again (:meth:`Arena.close` is idempotent, and frees what it may). Called by every
    arena's trim, stats and growth, with no arena's lock held; does nothing while no closed arena holds anything, and
    closes again only those of which something may be freed or let go now. What captured calls kept for graphs gone
    since goes too, once no capture is under way (:func:`~wsarena.arena._pins.let_go_kept`)."""
    let_go_kept(_no_capture_under_way)
    if _closed_holding:
        for arena in list(_closed_holding.values()):  # list(): one C call, whatever other threads do
            if _may_let_go(arena._table):
                arena.close()


def let_go_posted() -> None:
    """An eager lease's look at what pins keep that may free device memory as it goes (``_pins.freeing``, which it
    reads first: nothing to look at, it is not called): where the pin whose turn it is was posted, what graphs gone
    since kept is let go, once no capture is under way (:func:`~wsarena.arena._pins.let_go_kept`). So a program that
    captures with CuPy's ``stream.begin_capture()`` in a loop, with no pool (``cupy.cuda.set_allocator(None)``), and
    no trim, stats or growth, lets go of it at its eager calls: within ``_pins.LOOK_EVERY`` times as many as
    there are graphs keeping so."""
    if posted_in_turn():
        let_go_kept(_no_capture_under_way)


def _no_capture_under_way() -> bool:
    """Whether no CUDA graph capture that an arena knows of may be under way in this process, in any thread: each
    arena that can tell captures is asked (``Arena._capture_under_way``: the calling thread's current stream, the
    legacy default stream, and the streams of the captures that it or another arena of its device recorded, a lease's,
    a keep's or a :func:`wsarena.capture` block's). Each arena asks through its own provider, each stream once; the
    streams each device's arenas recorded are read once, for all of them (read by each arena, they made the question
    grow with the square of the arenas alive). No lock: the lists are read in one C call each."""
    live = _live_arenas()
    listed = set(map(id, live))
    arenas = live + [arena for arena in list(_closed_holding.values()) if id(arena) not in listed]
    streams: dict[int | None, dict[Any, None]] = {}  # device -> the streams its live arenas recorded, each once
    alive: list[Any] = []  # their keeps' stream objects: none dies, its stream destroyed, before it is asked about
    for arena in live:
        device = arena.device
        if device is not None:
            streams.setdefault(device, {}).update(dict.fromkeys(arena._recorded_streams(alive)))
    for arena in arenas:  # a loop, not a generator any() leaves suspended (a Ctrl-C as it is closed is lost)
        if arena._capture is not None and arena._capture_under_way(None, streams.get(arena.device, ())):
            return False
    return True


def _may_let_go(table: _Table) -> bool:
    """Whether closing again an arena of ``table``, closed, may free or let go of something: a buffer is queued, a
    lease or a growth is left, a graph it kept a buffer for, or one it recorded a capture for, is gone, or it holds
    nothing at all (then it is let go). No lock, and nothing changed: each list is read in one C call, and a graph once
    gone stays gone."""
    if table.to_free or table.subs or table.unplaced or not (table.kept or table.captures):
        return True
    pins = [pin for _, block, _ in list(table.kept) for pin in list(block.pins) or (None,)]
    return any(pin is None or not pin.live() for pin in pins + list(table.captures.values()))


# Every arena, for the fork handler: weak references without callbacks (a callback is Python code, where an
# interrupt would be lost), by their ids, the dead ones dropped as it grows. Each entry is added and dropped by its own
# key, one C call, and the dict is never replaced by a pruned copy: an arena that another thread (or a finalizer that
# runs meanwhile) adds while one prunes stays on it.
_arenas: dict[int, weakref.ref[Arena]] = {}
_parents_memory: list[Any] = []  # in a forked child: device arenas' tables of the parent, never released


def track_arena(arena: Arena) -> None:
    """Remember ``arena``, so that a forked child resets it."""
    n = len(_arenas)
    if n >= 64 and n & (n - 1) == 0:  # at each power of two
        # list() of the keys: one C call, whatever other threads do, and one that makes no object the collector
        # counts (the items' pairs are such objects): a collection there could run a collected arena's finalizer,
        # which tracks its heir, and the dict would change size under the copy
        for key in list(_arenas):
            ref = _arenas.get(key)
            if ref is not None and ref() is None:
                _arenas.pop(key, None)
    ref = weakref.ref(arena)
    _arenas[id(ref)] = ref


def device_arenas(device: int) -> list[Arena]:
    """The arenas of CUDA device ``device`` that live now (closed ones too). No lock: the list of every arena is read
    in one C call, so that an interrupt here leaves nothing held."""
    return [arena for arena in _live_arenas() if arena.device == device]


def _live_arenas() -> list[Arena]:
    """The arenas that live now (closed ones too): the list of every arena read in one C call, and its weak references
    followed in C (``map``), where the dead ones it keeps until it is pruned would each cost a turn of a Python loop."""
    return list(filter(None, map(_follow, list(_arenas.values()))))


_follow = weakref.ref.__call__  # _follow(ref) is ref(): the object, or None once it is gone


def keep_parents_memory(table: _Table) -> None:
    """In a forked child: give none of the parent's buffers in ``table`` to a provider. A device arena's table (and the
    parent's device buffers it refers to) is kept alive and untouched for good: dropping them would free device memory
    through CUDA, which cannot run in the child, and is the parent's. A host arena's is dropped (copy-on-write pages of
    the child's own)."""
    if not table.lanes:
        _parents_memory.append(table)


def _after_fork_in_child() -> None:
    # And the closed arenas kept here that are not listed (the heir of a collected arena whose listing failed): let go
    # as they are, their finalizers would give the parent's buffers to the provider
    arenas = [ref() for ref in list(_arenas.values())]
    arenas += [arena for arena in list(_closed_holding.values()) if not any(arena is seen for seen in arenas)]
    for arena in arenas:
        if arena is not None:
            reset_in_child(arena)
    # Let go of only once started again, holding nothing (no graph of the parent's is the child's): one collected
    # before would give the parent's buffers to the provider
    _closed_holding.clear()


def reset_in_child(arena: Arena) -> None:
    """Start ``arena`` again in a child forked from this process: no sub-arena and no lease (the threads that held
    them do not exist here), and the parent's buffers never given to the provider.

    A host arena drops its copies of the buffers (copy-on-write pages of the child's own; a live lease of the
    forking thread keeps its bytes until it ends). A device arena keeps the parent's table referenced and
    unreleased for good, and refuses every lease and reserve with a
    :class:`~wsarena.errors.BackendUnavailableError` that says why (as ``get_arena(device)`` is refused there).
    """
    old = arena._table
    table = _Table(threading.RLock(), arena._lanes, old.stream_id)
    table.closed = old.closed
    if not arena._lanes:
        table.closed = table.forked = True
    keep_parents_memory(old)
    arena._finalizer.detach()
    arena._attach(arena.provider, table)


os.register_at_fork(after_in_child=_after_fork_in_child)


_device_arenas: weakref.WeakSet[Arena] = weakref.WeakSet()
_device_lock = _forksafe.lock()  # guards _device_arenas and _atexit_registered
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
    # and the heirs of collected arenas that still hold something (wsarena.arena._arena._collected), not tracked here
    arenas += [arena for arena in list(_closed_holding.values()) if not arena._lanes and arena not in arenas]
    for arena in arenas:
        _shutdown(arena)


def _shutdown(arena: Arena) -> None:
    """At interpreter exit: free every buffer of ``arena``, even under live leases; later releases do nothing."""
    lock = arena._lock
    if not lock.acquire(timeout=1.0):
        return
    try:
        arena._table.closed = arena._table.exited = True
        arena._table.let_go_everything()
    finally:
        lock.release()
    arena._finalizer.detach()
    give_back(arena.provider, arena._to_free, quiet=True)
