"""The arena's routing table: which sub-arena serves a stream key, and when a sub-arena or a lease goes away.

A sub-arena is made on the first lease or reserve for its key, and forgotten when nothing uses it any more and it
holds nothing, when its stream is gone (a stream object, a lane key object or a thread that dies queues its
:class:`~wsarena.arena._sub._Anchor` on ``dead``, and the next operation of the arena sweeps it), or when more
than ``MAX_IDLE_STREAMS`` sub-arenas of caller-chosen keys sit idle (:meth:`_Table.evict_idle`).

A stream object's death does not say that its stream is gone: PyTorch hands out a new wrapper of a live stream on
each ``torch.cuda.current_stream()``. So its sub-arena is only marked ``orphan``, and whoever leases on the handle
again adopts it. But CUDA gives a destroyed stream's handle to the next stream made, and the dead stream's kernels
may still be using the buffer. Where the provider tells streams apart (``stream_id``), the id read when the
sub-arena was first watched is compared with the handle's id at adoption: another stream's lease lets the old
sub-arena go as gone (:meth:`_Table.let_go_replaced`) and gets a new one.

A lease ends when its release runs, or when nothing can run it any more: the ``with`` statement that entered it is
over, or its Workspace is gone (:meth:`_Table.reap`). Whoever finds such a lease ends it: a thread that wants the
lane, :meth:`Arena.stats`, :meth:`Arena.trim`, :meth:`Arena.close`; and so does a growth whose owner is gone (a
thread that would grow the stream, and those three).

Every method runs with the arena's lock held; ``dead`` is only appended to from outside it (by weakref callbacks,
which must never block on the lock).
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING, Any

from .._sizes import short_repr
from ..errors import ArenaClosedError, BackendUnavailableError, CaptureError, ReleasedAtExitError
from . import _kept
from ._keys import GoneStream, _caller_chosen, _LaneKey
from ._pins import KeptBytes
from ._refusals import Refusals
from ._sub import Queue, _Anchor, _Block, _SubArena, _Totals, park, this_thread
from .streams import PER_THREAD_DEFAULT_STREAM, PerThreadStream, ThreadLane

if TYPE_CHECKING:
    from ._workspace import Workspace

__all__ = ["MAX_IDLE_STREAMS"]

# Idle sub-arenas of caller-chosen keys (CPU lane keys, raw stream handles) kept with their buffers. A step uses a
# few streams at once; keys beyond that are one-off (a request id per call) and would each keep a buffer until
# trim(). An evicted sub-arena whose key comes back costs one allocation. A constant, not a setting: it bounds a
# misuse, and nothing a correct program does comes near it. Per-thread lanes and per-thread streams are not
# counted: they are bounded by the live threads and swept when their thread exits.
MAX_IDLE_STREAMS = 64


# Handles 0, 1 and 2 name the default streams (legacy and per-thread), which are never destroyed: no id is read.
_DEFAULT_STREAMS = PER_THREAD_DEFAULT_STREAM


def _may_go_on(pin: Any) -> bool:
    """Whether a capture recorded in ``_Table.capturing`` with ``pin`` (``False``: none) may still be under way."""
    return pin is None or (pin is not False and bool(pin.live()))


class _Table:
    """The sub-arenas of one arena, by key, and the queue that says which of them go away."""

    __slots__ = (
        "captures", "capturing", "closed", "dead", "exited", "forked", "held_back", "kept", "kept_arrays", "lanes",
        "lock", "pid", "refusals", "rewatched", "stream_id", "subs", "to_free", "totals", "unplaced", "watches",
    )

    def __init__(
        self, lock: threading.RLock, lanes: bool, stream_id: Callable[[int], int | None] | None = None
    ) -> None:
        self.lock = lock
        self.lanes = lanes  # keys are CPU lanes (else CUDA streams)
        self.stream_id = stream_id  # the provider's stream_id(handle): CUDA's id of that stream (None: unknown)
        self.subs: dict[Hashable, _SubArena] = {}
        self.dead: collections.deque[_Anchor] = collections.deque()  # streams, threads, key objects gone
        self.to_free: Queue = collections.deque()  # (buffer, stream) let go, for the provider
        # (buffer, stream) from the provider that a growth cut short gave no sub-arena, for let_go_unplaced()
        self.unplaced: Queue = collections.deque()
        self.kept: list[tuple[Hashable, _Block, Any]] = []  # pinned buffers no sub-arena uses: (key, block, stream)
        self.captures: dict[Any, Any] = {}  # capture sequence id -> the pin of the graph it captures into
        self.kept_arrays = KeptBytes()  # what the pins of captures keep besides buffers (ArenaStats.kept_bytes)
        # Keys of the streams a lease was taken on during a capture that may still be under way, in order, to the pin
        # of the graph it records into (None: wsarena.capture began it, and no lease there has come yet; BEGINNING:
        # wsarena.capture is seeding its buffer, its capture not begun yet, wsarena.arena._pinning): asked before
        # a free with no stream (wsarena.arena._pinning.give_back), forgotten once found not captured.
        self.capturing: dict[Hashable, Any] = {}
        # How many times wsarena.capture began to watch a stream (wsarena.arena._pinning.watch_capture): a record of
        # None or BEGINNING found after a question is the one asked about only while this count is the same.
        self.watches = 0
        # Handles whose buffers were held back while their stream was captured, to the id the arena read when it began
        # to watch that stream (wsarena.arena._pinning.give_back): freed on the handle only while it names that stream.
        self.held_back: dict[int, Any] = {}
        # Keys whose sub-arena wsarena.capture's stream object watches in place of another, to that one's anchor
        # (Table.rewatch), watching it again once the capture block is over (wsarena.arena._pinning.unwatch_capture).
        self.rewatched: dict[Hashable, Any] = {}
        self.totals = _Totals()
        self.refusals = Refusals()  # the growths the provider refused lately (wsarena.arena._refusals)
        self.closed = False
        self.exited = False  # a device arena released by the exit handler: the interpreter is ending
        self.forked = False  # a device arena in a forked child: its memory is the parent's
        self.pid = os.getpid()  # the process whose buffers these are: a forked child gives none to a provider

    def closed_error(self) -> BaseException:
        if self.forked:
            return BackendUnavailableError(
                "this arena's device memory belongs to the parent process: CUDA cannot be used in a child forked "
                "after it was initialised (start workers with the 'spawn' or 'forkserver' method)"
            )
        if self.exited:
            thread = threading.current_thread()
            if thread.daemon and not isinstance(thread, threading._DummyThread):
                # A daemon thread still at work while the interpreter exits: an error would print a traceback
                # in a process that is ending well. SystemExit ends the thread quietly (threading prints nothing
                # for it) and unwinds it, so the locks it holds are let go for the exit handlers still to run.
                # (A thread made outside threading, such as PyTorch's autograd thread, gets the error.)
                return SystemExit("this arena was released at interpreter exit")
            return ReleasedAtExitError("this arena was released at interpreter exit")
        return ArenaClosedError("this arena is closed")

    def sub_for(self, key: Hashable, anchor: Any, capturing: bool = False) -> _SubArena:
        """The sub-arena of ``key``, made if needed; ``anchor`` is an object whose death means the stream is gone.
        ``capturing``: the stream is being captured, and its id cannot be asked (:meth:`replaced`); an orphan whose
        stream must be asked before it is adopted raises :class:`~wsarena.errors.CaptureError` then."""
        sub, stream_id = self.serving(key, capturing)
        if capturing and sub is not None and self.unchecked(sub):
            raise CaptureError(
                f"the buffer of stream {key!r} was last used through a stream object that is gone, and whether the "
                "stream is still the same one (CUDA gives a destroyed stream's handle to the next stream made) "
                "cannot be asked during a CUDA graph capture: use the stream once more before capturing, through a "
                "stream object that lives until the capture ends (wsarena.capture(stream) does this itself)"
            )
        if self.kept:
            self.release_kept()
        read_id = self.stream_id
        if sub is None:
            self.sweep_orphans()  # a new stream appeared: a good moment to let go of dead ones
            if len(self.subs) >= MAX_IDLE_STREAMS:
                self.evict_idle()
            stored = _LaneKey(key) if self.lanes and anchor is key else key  # a lane key object: held weakly
            sub = _SubArena(stored, self.totals, self.to_free, self.kept)
            self.subs[stored] = sub
        if anchor is not None and sub.anchor is None:
            watch = True
            if sub.stream_id is None and read_id is not None and type(key) is int and key > _DEFAULT_STREAMS:
                if capturing:
                    # The id cannot be read during the capture: the stream is left unwatched, so that its first lease
                    # after the capture reads the id and watches it. Watched without one, its death would make an
                    # orphan that no lease could check against the next stream given its handle.
                    watch = False
                else:
                    sub.stream_id = read_id(key) if stream_id is None else stream_id
            if watch:
                # A dead thread's lane (or per-thread stream), or a dead key object, is never used again: swept at once.
                eager = anchor is key or isinstance(key, (ThreadLane, PerThreadStream))
                sub.anchor = _Anchor(anchor, self.dead.append, sub.key, sub.serial, eager)
        sub.orphan = False  # whoever leases on it shows the stream is alive
        return sub

    def rewatch(self, sub: _SubArena, anchor: Any) -> Any:
        """Have ``anchor``, a live object of ``sub``'s stream, watch ``sub`` in place of the one watching it now, and
        return that one's anchor (``None``: ``anchor`` watches it already), for :meth:`watch_back`. Only where
        :meth:`sub_for` just gave ``sub`` an anchor and its stream's id, so that the death of ``anchor`` makes an
        orphan that can be checked. The replaced anchor, should its object die, is not ``sub``'s: the sweep passes
        over it."""
        old = sub.anchor
        if old is None or old() is anchor:
            return None
        sub.anchor = _Anchor(anchor, self.dead.append, sub.key, sub.serial, old.eager)
        return old

    def watch_back(self, key: Hashable, old: Any) -> None:
        """The object that watched the sub-arena of ``key`` before :meth:`rewatch` (``old``, its anchor) watches it
        again, if it lives and the sub-arena is the same: the one that replaced it may die first (a stream object
        made for one capture), leaving an orphan of a stream still in use."""
        sub = self.subs.get(key)
        if sub is not None and sub.serial == old.serial and sub.anchor is not None and old() is not None:
            sub.anchor = old

    def unchecked(self, sub: _SubArena) -> bool:
        """Whether ``sub`` is an orphan whose stream must be asked its id before anyone adopts it (:meth:`replaced`)."""
        return sub.orphan and sub.stream_id is not None and self.stream_id is not None

    def replaced(self, sub: _SubArena, capturing: bool = False) -> tuple[bool, int | None]:
        """Whether ``sub``'s stream object died and its handle names another stream now, and the id that handle's
        stream has (``None``: not read, or CUDA cannot tell). The handle is live: the caller is about to use it.
        Not asked where the stream is ``capturing``: CUDA refuses cudaStreamGetId on a stream being captured, and the
        refusal invalidates the capture, in every capture mode (:meth:`unchecked` says whether it would be)."""
        read_id = self.stream_id
        if capturing or not self.unchecked(sub):
            return False, None
        assert read_id is not None
        # Is this the same stream (a new wrapper), or another given the same handle? Asked only of an orphan, never
        # on the fast path of a lease on a watched stream. (``None``, CUDA cannot tell: another.)
        stream_id = read_id(sub.stream)
        return stream_id != sub.stream_id, stream_id

    def serving(self, key: Hashable, capturing: bool = False) -> tuple[_SubArena | None, int | None]:
        """The sub-arena that would serve a lease on ``key`` now, if there is one (none is made), and the id of the
        handle's stream if it was read (see :meth:`replaced`): a dead stream's whose handle another stream has serves
        no one, and is let go here, as the lease would."""
        if self.dead:
            self.sweep()
        sub = self.subs.get(key)
        if sub is None:
            return None, None
        replaced, stream_id = self.replaced(sub, capturing)
        if replaced:
            self.let_go_replaced(sub)
            return None, stream_id
        return sub, stream_id

    def let_go_replaced(self, sub: _SubArena) -> None:
        """``sub``'s stream is gone and another stream has its handle: let ``sub`` go as gone (its buffers freed with
        no stream, once the device is idle; one a graph holds is kept for it). It is moved to a key of its own
        (:class:`GoneStream`), with the buffers it kept for graphs, which are the dead stream's, not the handle's. If
        a lease or a growth still uses it, it waits for that there, still an orphan, and goes as soon as that ends
        (:meth:`after_lease`, :meth:`end_growth`, :meth:`growth_over`): no lease will look it up there again. A lease
        or growth that nothing can end any more (its owner is gone) ends here first, as one on its lane would."""
        handle = sub.key
        moved = GoneStream(handle)
        # Plain stores with no call between them: an interrupt finds all of the move made or none of it. (Once
        # moved, an orphan that nothing uses is forgotten by the next sweep of orphans, should this stop here.)
        self.subs[moved] = sub
        del self.subs[handle]
        sub.key = moved
        self.unstream_kept(handle, moved)
        ref = sub.holder
        if ref is not None and ref() is None and not sub.releasing():
            self.reap(sub)  # and the orphan goes with its lease
        elif sub.growing is not None:
            self.growth_over(sub)  # ends a growth whose owner is gone
        self.drop_if_gone(sub)
        sub.wake()  # threads queued for it look the handle up again, and find the new stream's sub-arena

    def take_lane(self, ws: Workspace, anchor: Any, waiter: Any, capturing: bool = False) -> Any:
        """Make ``ws`` (ended by ``anchor``) the holder of its lane and return the sub-arena; or, if another lease
        holds it (or it is kept for threads that waited, and this one has not), queue a lock to wait on and return
        that (see :func:`~wsarena.arena._sub.wait`). ``waiter``: the lock this thread waited on last, or ``None``."""
        if self.closed:
            raise self.closed_error()
        me = this_thread.token
        sub = self.sub_for(ws.stream, ws._anchor, capturing)
        ref = sub.holder
        if ref is not None and ref() is None and (not sub.releasing() or sub.holder_thread is me):
            self.reap(sub)  # nothing can release that lease any more
            ref = sub.holder
        if ref is None and (waiter is not None or not sub.handoff):
            ws._ref = ref = weakref.ref(anchor)
            ws._sub = sub
            sub.take(ref, me)
            return sub
        if ref is not None and sub.holder_thread is me:
            raise self._nested_error(sub.key)
        return park(sub.lane_waiters, waiter)

    def growth_over(self, sub: _SubArena) -> bool:
        """Whether no one is growing ``sub`` (a growth whose owner is gone is ended here); else the caller waits."""
        growing = sub.growing
        if growing is None:
            return True
        if growing() is not None:
            return False
        if growing is not sub.holder:  # a reserve cut short by an interrupt
            sub.growing = None
            sub.wake()
            self.drop_if_gone(sub)
        elif sub.releasing():  # its owner is releasing it right now
            return False
        else:  # a lease cut short while it grew: it ends, and its growth with it
            self.reap(sub)
        return True

    def end_growth(self, sub: _SubArena, token: Any, block: _Block | None) -> tuple[Hashable, _Block] | None:
        """End ``token``'s growth of ``sub``, installing ``block`` (if any) unless the arena closed meanwhile, or
        ``block`` overlaps a buffer the arena holds (:meth:`holding`, returned then): ``block.installed`` stays false
        and the caller frees it (unless ``block.freed``: it is a buffer the arena holds). Idempotent: a repeat after
        an interrupt finds the block installed (it may have been let go since: ``installed`` says so, not
        ``sub.block``) and the growth ended."""
        if self.unplaced:
            self.let_go_unplaced()
        clash = None
        if sub.growing is token:
            if block is not None and not block.installed:
                clash = self.holding(block)
                if clash is not None and clash[1].buffer is block.buffer:
                    block.freed = True  # the very buffer held, handed out again: freed as that one, never as this
                elif clash is None and not self.closed:
                    sub.install(block)
                    self.refusals.granted(block.size)
            sub.growing = None  # last
            sub.wake()
        if block is None or not block.installed:
            self.drop_if_idle(sub)
        self.drop_if_gone(sub)  # a reserve of a dead stream's sub-arena, moved aside while it grew
        return clash

    def let_go_unplaced(self) -> None:
        """Queue to be freed each buffer that a growth cut short after the provider's ``allocate`` returned gave no
        sub-arena (``unplaced``), unless it is the very buffer of one the arena holds (handed out again): freed, that
        one would be. Each is taken off and queued in one C call, so that an interrupt here loses none and queues
        none twice (the growth's error path runs this under :func:`~wsarena.arena._interrupts.finish`, and trim and
        close do, for a growth cut short before it could)."""
        unplaced = self.unplaced
        while unplaced:
            buffer = unplaced[0][0]
            if any(held.buffer is buffer for _, held in self.held_blocks()):
                unplaced.popleft()
            else:
                self.to_free.extend(itertools.islice(iter(unplaced.popleft, None), 1))

    def holding(self, block: _Block) -> tuple[Hashable, _Block] | None:
        """The buffer the arena holds (any stream's, current, outgrown or kept for a graph) whose bytes overlap those
        of ``block``, a new one from the provider, and the key it is held under; ``None`` if there is none. Checked in
        the locked step that installs ``block``: two streams' buffers must never share a byte. Growth is rare, and a
        few buffers are held, so each growth looks at every one; a lease that needs no growth looks at none."""
        start, stop = block.ptr, block.ptr + block.size
        for key, held in self.held_blocks():
            if held.ptr < stop and start < held.ptr + held.size:
                return key, held
        return None

    def held_blocks(self) -> Iterator[tuple[Hashable, _Block]]:
        """Every buffer the arena holds (each stream's current and outgrown one, those kept for graphs), with the key
        it is held under."""
        for sub in self.subs.values():
            for held in (sub.block, sub.retired):
                if held is not None:
                    yield sub.key, held
        for key, held, _ in self.kept:
            yield key, held

    def _nested_error(self, key: Hashable) -> RuntimeError:
        """This thread leases again on a lane / stream it holds (nothing was changed)."""
        if self.lanes:
            return RuntimeError(
                f"this thread already holds a lease on CPU lane {short_repr(key)}; a nested lease there would "
                "share its bytes: lease the inner workspace on another lane (stream=<any hashable>)"
            )
        return RuntimeError(
            f"this thread already holds a lease on stream {short_repr(key)}; a nested lease there would get the "
            "same bytes and overwrite what the outer lease still holds (e.g. a wsarena call inside your own "
            "arena.lease() on the same stream): lease the inner workspace on another stream, or after the outer "
            "lease is released"
        )

    def forget(self, sub: _SubArena, gone: bool = False) -> int:
        """Drop an idle sub-arena and let go of its buffers (``gone``: its stream may no longer exist).

        The buffers are let go first, while the table still holds the sub-arena: an interrupt that stops this half
        way leaves it in the table, where a later sweep, trim or close finds what it still holds. (Dropped first, a
        sub-arena stopped before its buffers were queued took them out of the arena's reach for good.)

        The stream object that watched it is let go: the stream's death would go unseen from now on, so the buffers
        kept for graphs there are freed with no stream once the graphs are gone, as a dead stream's are. So are those
        of a raw handle (no object watched it), whose owner may destroy the stream once nothing of the arena uses it.
        """
        released = sub.tidy() + sub.empty(gone, forgotten=True)
        key = sub.key
        if sub.anchor is not None or (type(key) is int and key > _DEFAULT_STREAMS):
            self.unstream_kept(key)
        if self.subs.get(sub.key) is sub:
            # A capture recorded there may go on (a close() during it): the frees with no stream that forgetting the
            # stream brings wait for it, until it is found over (wsarena.arena._pinning._capture_under_way). Where
            # ``gone``, the sweep that found its stream object dead dropped the record of then: one there now was
            # made since, by a keep or a capture block that used the handle (a new stream CUDA gave it, say).
            del self.subs[sub.key]
        sub.anchor = None  # a reference dropped before its object dies never calls back
        sub.wake()  # threads queued for it look the key up again
        return released

    def drop_if_idle(self, sub: _SubArena, gone: bool = False) -> None:
        """Forget ``sub`` if no one uses it and it holds nothing or the arena is closed (then free its buffer)."""
        if sub.idle() and (sub.block is None or self.closed) and self.subs.get(sub.key) is sub:
            self.forget(sub, gone)

    def drop_if_gone(self, sub: _SubArena) -> None:
        """Forget ``sub`` if it was moved aside as a dead stream's (:meth:`let_go_replaced`) and no one uses it."""
        if type(sub.key) is GoneStream and sub.idle() and self.subs.get(sub.key) is sub:
            self.forget(sub, gone=True)

    def after_lease(self, sub: _SubArena, granted: bool) -> None:
        """Tidy up once a lease of ``sub`` ended; ``granted``: it had its bytes (else it failed on its way)."""
        sub.wake()
        sub.tidy()
        if (sub.orphan or self.closed) and sub.idle() and self.subs.get(sub.key) is sub:
            self.forget(sub, gone=sub.orphan)
        elif not granted:
            self.drop_if_idle(sub)  # a first lease whose growth failed leaves nothing behind

    def reap(self, sub: _SubArena) -> None:
        """End the lease of ``sub``, which nothing can release any more (its holder reference is dead)."""
        if sub.growing is sub.holder:
            sub.growing = None  # its growth was cut short too
        granted = sub.holder_block is not None
        sub.leave()
        self.after_lease(sub, granted)

    def reap_all(self) -> None:
        """End every lease that nothing can release any more (except one its owner is releasing right now), and every
        growth that nothing can end any more (a reserve cut short before it could end its growth)."""
        for sub in list(self.subs.values()):
            ref = sub.holder
            if ref is not None and ref() is None and not sub.releasing():
                self.reap(sub)
            growing = sub.growing
            if growing is not None and growing() is None:
                self.growth_over(sub)

    def close_subs(self) -> None:
        """Wake every sub-arena's waiters, which see the arena closed, and forget the idle sub-arenas. Its own
        function, run under the arena's lock, for the loop's jump back (:mod:`wsarena.arena._interrupts`, rule 8)."""
        for sub in list(self.subs.values()):
            sub.wake()
            if sub.idle():
                self.forget(sub)

    def sweep(self) -> int:
        """Mark the sub-arenas of dead streams, threads and key objects, forgetting those that can never be used
        again. Each entry is removed once handled, so an interrupted sweep leaves the rest for the next one.
        Returns the bytes let go."""
        released = 0
        while self.dead:
            anchor = self.dead[0]
            gone = self.subs.get(anchor.key)
            # else already gone, a newer one, or an anchor replaced (rewatch) whose object died meanwhile
            if gone is not None and gone.serial == anchor.serial and gone.anchor is anchor:
                # No call into Python between these: an orphan's record of then is dropped (forget() keeps a later one)
                gone.anchor = None
                gone.orphan = True
                self.capturing.pop(gone.key, None)  # its stream may be gone: never asked about again
                self.unstream_kept(gone.key)
                if anchor.eager and gone.idle():
                    released += self.forget(gone, gone=True)
            self.dead.popleft()
        return released

    def sweep_orphans(self) -> int:
        released = 0
        for sub in list(self.subs.values()):
            if sub.orphan and sub.idle():
                released += self.forget(sub, gone=True)
        return released

    def evict_idle(self) -> None:
        """Forget idle sub-arenas of caller-chosen keys beyond ``MAX_IDLE_STREAMS``: first those not leased again
        since the last pass (a one-off key is leased once, when it is made), then the rest, oldest first. A stream in
        steady use is leased again all the time, so it keeps its buffer. So does a stream that a capture may still
        be using, or whose buffer a graph holds: forgetting it would free nothing (a pinned buffer is kept for its
        graphs), and the capture's next lease there would find no buffer, which it cannot grow (once its graph is
        gone, the capture is over)."""
        idle = [
            sub for sub in self.subs.values()
            if _caller_chosen(sub.key) and sub.idle() and not _may_go_on(self.capturing.get(sub.key, False))
            and not (sub.block is not None and sub.block.pinned())
        ]
        excess = len(idle) - MAX_IDLE_STREAMS + 1  # room for the one about to be made
        for second_pass in (False, True):
            for sub in idle:
                if excess <= 0:
                    return
                if sub.used and not second_pass:
                    sub.used = False
                elif self.subs.get(sub.key) is sub:
                    self.forget(sub)
                    excess -= 1

    def check_overlap(self, sub: _SubArena, ptr: int, n: int) -> None:
        """Debug mode: a lease of ``[ptr, ptr + n)`` on ``sub`` must not overlap a live lease of another one."""
        end = ptr + n
        for other in self.subs.values():
            block, ref = other.holder_block, other.holder
            if other is sub or block is None or ref is None or ref() is None:
                continue
            start, stop = block.ptr, block.ptr + other.holder_nbytes
            if start < end and ptr < stop:
                raise AssertionError(
                    f"wsarena debug: a lease of [{ptr:#x}, {end:#x}) on stream {short_repr(sub.key)} overlaps the live "
                    f"lease [{start:#x}, {stop:#x}) on stream {short_repr(other.key)}"
                )

    # ------------------------------------------------------------------------- pinned buffers (_kept.py)
    release_kept = _kept.release_kept
    unstream_kept = _kept.unstream_kept
    pinned_bytes = _kept.pinned_bytes
    let_go_everything = _kept.let_go_everything
    let_go_collected = _kept.let_go_collected
