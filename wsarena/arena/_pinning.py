"""Leases taken while their stream is captured into a CUDA graph: no growth, and the buffer pinned to the graph.

A captured kernel keeps the workspace address it was given, so the lease's buffer is pinned to the graph being
captured (:mod:`wsarena.arena._pins`) and is never freed while that graph exists. Growing the sub-arena cannot be
captured (an allocation is not a graph node the arena could keep), so a capture finds the buffer large enough, from
an eager step or a reserve, or gets :class:`~wsarena.errors.CaptureError`; so does a ``reserve`` that would grow a
stream being captured. Nor is a buffer given back to the provider on a stream being captured: the free would be
recorded into the graph (``cudaFreeAsync`` is a graph node), not done, so it waits until the capture is over
(:func:`give_back`); a buffer freed with no stream (the provider synchronises the device first) waits while any
capture the arena knows of is under way, in any thread. Most functions here are the arena's methods
(``Arena._acquire_captured``, ``Arena._pin_for``), written here to keep each module to one job.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING, Any

from .._sizes import format_size, short_repr
from ..errors import CaptureError
from ._keys import callers_key
from ._lifecycle import device_arenas, keep_while_holding
from ._lifecycle import give_back as _give_back
from ._pins import GraphPin
from .streams import PER_THREAD_DEFAULT_STREAM, is_own_stream, raw_handle, resolve_stream

if TYPE_CHECKING:
    from ._arena import Arena
    from ._table import _Table
    from ._workspace import Workspace

__all__: list[str] = []

_PRUNE_AT = 64  # captures remembered before those whose graphs are gone are forgotten


def _acquire_captured(self: Arena, ws: Workspace, anchor: Any, capture: Any) -> None:
    """Take the lease ``ws`` while its stream is being captured: from the buffer the stream holds, pinned to the
    graph (lock not held; on any exception the Workspace gives back what was taken)."""
    pin = self._pin_for(capture)
    sub = self._take_lane(ws, anchor, capturing=True)
    with self._lock:
        if self._table.closed:
            raise self._table.closed_error()
        block = sub.block
        if sub.growing is not None or block is None or block.size < ws.nbytes:
            held = 0 if block is None or sub.growing is not None else block.size
            raise growth_error(f"a lease of {format_size(ws.nbytes)}", sub.key, held)
        if pin not in block.pins:
            block.pins.append(pin)
            pin.blocks.append(block)
        self._table.capturing[ws.stream] = pin  # frees with no stream wait while this capture may go on
        ws.pin = pin
        self._grant(sub, ws, block)


class _Beginning:
    """Recorded in ``_Table.capturing`` by :func:`wsarena.capture` for its stream from before it seeds the stream's
    buffer until its capture has begun: the buffer stays, as a capture's does (:func:`seeded_streams`; idle streams'
    eviction, through :meth:`live`), and the record is not forgotten for want of a capture yet."""

    __slots__ = ()

    def live(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "BEGINNING"


BEGINNING = _Beginning()


def watch_capture(self: Arena, stream: Any, beginning: bool = False) -> tuple[bool, int]:
    """``stream`` was just made to capture (by :func:`wsarena.capture`): frees with no stream wait while its capture
    may go on, from now on. A capture begun elsewhere is known from its first lease; before that, one in CUDA's global
    mode on a non-blocking stream is seen by no question the arena could ask. With ``beginning``, the capture is
    about to begin, and the stream's buffer about to be seeded: a trim, or another thread's eviction of idle streams,
    leaves it from now on (:data:`BEGINNING`). Returns what :func:`recorded_for_another` reads: whether the stream
    was recorded already, and the count of watches with this one. (Lock not held.)"""
    key, anchor = resolve_stream(stream, lanes=self._lanes, current=self._current)
    with self._lock:
        self._table.watches += 1  # first: counted, the record is never taken for one made before
        mark = (key in self._table.capturing, self._table.watches)
        self._table.capturing[key] = BEGINNING if beginning else None
        if beginning and anchor is not None and key in self._table.subs:
            # The buffer's stream object may be gone (one made per call): ``stream`` adopts it now, while the
            # stream's id can still be asked, which a lease during the capture cannot (Table.replaced). Another
            # object watching it may die during the capture: ``stream``, which lives until the capture ends, watches
            # it in its place until the block is over (unwatch_capture).
            old = self._table.rewatch(self._table.sub_for(key, anchor), anchor)
            if old is not None:
                self._table.rewatched[key] = old
    return mark


def recorded_for_another(self: Arena, mark: tuple[bool, int]) -> bool:
    """Whether the record a :func:`wsarena.capture` block made of its stream (``mark``: what :func:`watch_capture`
    returned) may be another block's now, so that a capture of another's under way there keeps it: the stream was
    recorded when the block began to watch it, or a block began to watch a stream since."""
    recorded, watches = mark
    return recorded or self._table.watches != watches


def unwatch_capture(self: Arena, stream: Any, over: bool = True) -> None:
    """The block of :func:`wsarena.capture` on ``stream`` is over: the stream object that watched its buffer before
    the block (:func:`watch_capture`) watches it again, if it lives, unless another block's stream object watches it
    now (a block on the same stream in another thread, whose capture may be under way: its end gives the watch back).
    ``over``: so is the capture recorded there (ended, or discarded, or none begun), and nothing waits for it any more;
    its stream is evicted as idle streams are, whether or not a lease came there. Else another's capture under way
    there keeps the record, as one begun (not :data:`BEGINNING`), which a free with no stream forgets once that
    capture is over. Lock not held."""
    key, anchor = resolve_stream(stream, lanes=self._lanes, current=self._current)
    with self._lock:
        table = self._table
        sub = table.subs.get(key)
        old = table.rewatched.get(key)
        if old is not None and (sub is None or sub.serial != old.serial or sub.anchor is None
                                or sub.anchor() is anchor):
            table.watch_back(key, old)
            del table.rewatched[key]
        if over:
            table.capturing.pop(key, None)
        elif table.capturing.get(key, False) is BEGINNING:
            table.capturing[key] = None


def _pin_for(self: Arena, capture: Any) -> Any:
    """The pin of the graph that ``capture`` records into, made and handed to the graph on the capture's first
    lease (lock not held: ``capture.retain`` calls CUDA)."""
    captures = self._table.captures
    pin = captures.get(capture.id)  # no lock: one C call, and a capture under way's pin is never forgotten (live)
    if pin is not None:
        return pin
    pin = GraphPin(self._table.kept_arrays)
    capture.retain(pin)
    with self._lock:
        if len(captures) >= _PRUNE_AT and len(captures) & (len(captures) - 1) == 0:  # at each power of two
            forget_released(captures)
        # Another thread's first lease of this capture may have recorded a pin meanwhile: that one serves, and this
        # one, which the graph holds too, is dropped (its semaphore is freed once CUDA posts it: _pins.free_posted).
        return captures.setdefault(capture.id, pin)


def keep_with_capture(self: Arena, objects: list[Any], stream: Any) -> bool:
    """:meth:`Arena.keep_with_capture`: ``objects`` kept by the pin of the graph being captured on ``stream``, made
    and handed to the graph if no lease of the capture did yet. The stream is recorded, unless this capture's record
    is there already (a lease's, or :func:`wsarena.capture`'s, whose record keeps its seeded buffer until the first
    lease; :func:`_kept_record`): frees with no stream, and the drop of what graphs gone kept, wait while its capture
    may go on. Idempotent: run again after an interrupt (lock not held). A stream given as an object is recorded with
    a weak reference to it (:class:`KeptOn`), unless a live object watches its buffer (a lease's record, then): CUDA
    is not asked about its handle once the object is gone."""
    key, anchor = resolve_stream(stream, lanes=self._lanes, current=self._current)  # refused by any arena
    if self._capture is None:
        return False
    try:
        capture = self._capture(raw_handle(key))
    except CaptureError:  # invalidated: it becomes no graph (or the legacy stream beside a capture: it ran nothing)
        return False
    if capture is None:
        return False
    pin = self._pin_for(capture)
    recorded = self._table.capturing
    if _kept_record(recorded.get(key, False), pin):  # no lock where nothing is stored: the common case
        with self._lock:
            if self._table.dead:  # as a lease does: a later sweep of a stream object dead now would drop the record
                self._table.sweep()
            old = recorded.get(key, False)
            if _kept_record(old, pin):
                # A live object watching the stream's buffer shows the stream alive: the record is a lease's, which
                # that object's death drops; ``stream`` may be a wrapper made for this call, whose death shows nothing.
                # Over a pin's record of another capture, which was asked about until found over, so is this one.
                sub = self._table.subs.get(key)
                watched = sub is not None and sub.anchor is not None and sub.anchor() is not None
                if anchor is None or anchor is key or watched or (old is not False and type(old) is not KeptOn):
                    recorded[key] = pin
                elif not (type(old) is KeptOn and old.pin is pin and old.stream() is not None):
                    recorded[key] = KeptOn(pin, anchor)
    pin.keep(objects)
    return True


def _kept_record(old: Any, pin: Any) -> bool:
    """Whether a keep for ``pin``'s capture may record its stream where ``old`` is recorded (``False``: nothing): not
    over a capture block's record (``None``, :data:`BEGINNING`) nor this capture's pin. Over a record of another
    capture (over, as one stream captures one graph at a time) or a keep's whose stream object is gone, it records
    its own: kept, that one said nothing of this capture (a dead object's record is dropped unasked, and a lease of
    this capture records its pin over another's)."""
    return old is not None and old is not BEGINNING and old is not pin


class KeptOn:
    """Recorded in ``_Table.capturing`` by a keep (:func:`keep_with_capture`) for a stream given as an object, where no
    lease or capture block recorded it: the pin of the graph it keeps for, and a weak reference to the stream object,
    as a sub-arena's anchor watches it. Once the object is gone, its owner may have destroyed the stream: CUDA is asked
    nothing more about the handle (:func:`_capture_under_way` drops the record), and the capture counts as over."""

    __slots__ = ("pin", "stream")

    def __init__(self, pin: Any, stream: Any) -> None:
        self.pin = pin
        self.stream = weakref.ref(stream)

    def live(self) -> bool:
        return self.stream() is not None and bool(self.pin.live())


def forget_released(captures: dict[Any, Any]) -> None:
    """Forget the captures whose graphs are gone; their pins go with them (lock held)."""
    for key in [key for key, old in captures.items() if not old.live()]:
        del captures[key]


def seeded_streams(self: Arena) -> _Seeded:
    """The streams whose buffer a trim leaves: :func:`wsarena.capture` is capturing them and no lease came there yet.
    The buffer such a stream holds is the one the capture was seeded with, which its first lease needs (a capture
    cannot grow the arena); from that lease on, it is pinned to the graph. A stream recorded so whose capture is over
    is none of them (the end of its block was interrupted before the record was dropped): no capture will lease there,
    and its buffer is freed as any other. Another thread's per-thread stream cannot be asked from here: it counts as
    captured. (Lock not held: CUDA is asked.) A capture block that begins to watch its stream after this call is
    among them too (:class:`_Seeded`)."""
    table = self._table
    watches = table.watches  # before the records are read: a block that records its stream after this is counted
    recorded = table.capturing
    if not recorded or self._capture is None:
        return _Seeded(table, watches, ())
    # list(): one C call, whatever other threads do
    watched = [(key, pin) for key, pin in list(recorded.items()) if pin is None or pin is BEGINNING]
    seeded = [key for key, pin in watched
              if pin is BEGINNING or not is_own_stream(key) or _captured(self._capture, key)]
    return _Seeded(table, watches, seeded)


class _Seeded:
    """What :func:`seeded_streams` found, and, asked with the arena's lock held (``key in seeded``), each stream that
    a capture block may have begun to watch since: a trim that asked before the block recorded its stream, and frees
    after the block seeded it, would free the buffer the capture needs. Once any block began to watch a stream since
    the question, a stream recorded for a capture with no lease yet is taken to be captured, even one recorded when
    asked (the block may have recorded it again: its buffer is left to a later trim, should that capture be over)."""

    __slots__ = ("_seeded", "_table", "_watches")

    def __init__(self, table: _Table, watches: int, seeded: Any) -> None:
        self._table = table
        self._watches = watches
        self._seeded = set(seeded)

    def __contains__(self, key: Any) -> bool:
        if key in self._seeded:
            return True
        pin = self._table.capturing.get(key, False)
        return pin is BEGINNING or (pin is None and self._table.watches != self._watches)


def growth_error(what: str, key: Hashable, held: int) -> CaptureError:
    """The error of ``what`` (a lease, a reserve) on the stream of ``key``, being captured, that needs it to grow."""
    error = CaptureError(
        f"{what} on stream {key!r} during CUDA graph capture needs the arena to grow (it holds {format_size(held)} "
        "there), which cannot be captured: before capturing, run the step once or reserve "
        "(arena.reserve_for(plan) or arena.reserve(nbytes, stream=...))"
    )
    error.stream = callers_key(key)
    return error


def growth_refusal(self: Arena, key: Hashable, n: int) -> CaptureError | None:
    """The error a growth of ``key``'s sub-arena to ``n`` bytes would raise now: its stream is being captured (or,
    the legacy default stream, cannot be used while another is). ``None`` if it may grow. (Lock not held.)"""
    if self._capture is None:
        return None
    try:
        if self._capture(raw_handle(key)) is None:
            return None
    except CaptureError as exc:
        return exc
    with self._lock:
        sub = self._subs.get(key)
        held = sub.capacity() if sub is not None else 0
    return growth_error(f"a reserve of {format_size(n)}", key, held)


def _captured(capture: Any, key: Any) -> bool:
    """Whether work on the stream of ``key`` now would be captured into a graph, or break a capture."""
    try:
        return capture(raw_handle(key)) is not None
    except CaptureError:  # the legacy default stream while another stream is captured
        return True
    except Exception:  # noqa: BLE001 - a stream CUDA no longer knows: the provider's free says what is wrong
        return False


def recorded_streams(self: Arena, alive: list[Any]) -> list[Any]:
    """The keys of the streams this arena recorded for captures that may be under way (:attr:`_Table.capturing`),
    except a keep's whose stream object is gone (CUDA is asked nothing more about its handle). The stream objects of
    keeps' records go in ``alive``: held there, none dies (its owner destroys the stream with it) before the caller has
    asked about its handle. No lock: the records are read in one C call."""
    keys = []
    for k, record in list(self._table.capturing.items()):
        if type(record) is KeptOn:
            stream = record.stream()
            if stream is None:
                continue
            alive.append(stream)
        keys.append(k)
    return keys


def _capture_under_way(self: Arena, key: Any, device_streams: Iterable[Any] | None = None) -> bool:
    """Whether a free with no stream (a device synchronisation) would break a capture under way: on the stream of
    ``key`` (the call that drains the queue, if any), on the calling thread's current stream (a capture block's), on any
    stream a lease was taken on during a capture that may not be over or that :func:`wsarena.capture` is capturing
    (:func:`watch_capture`; in any thread: a capture in CUDA's global mode is broken by another thread's
    synchronisation), recorded by this arena or by another of the device (the one :func:`get_arena` made in place of
    this one, closed, say), or, asked through the legacy default stream, on any blocking stream of the device. A
    stream this arena recorded and found not captured any more is forgotten, unless it was recorded again since it was
    asked (by a new capture block, or a new capture's lease). Each stream is asked once, through this arena's provider.

    ``device_streams``: the streams the device's arenas recorded (:func:`recorded_streams` of each), read once by a
    caller that asks every arena (:func:`~wsarena.arena._lifecycle._no_capture_under_way`), which holds their keeps'
    stream objects until it has asked; by default they are read here."""
    capture, table, recorded = self._capture, self._table, self._table.capturing
    keys = [key]
    if self._lanes:
        keys.append(resolve_stream(None, lanes=True)[0])
    else:
        if self._current is not None:
            keys.append(resolve_stream(None, lanes=False, current=self._current)[0])
        keys.append(0)
    alive: list[Any] = []  # the stream objects of keeps' records: none dies before its handle is asked about
    for k, record in list(recorded.items()):  # list(): one C call, whatever other threads do
        if type(record) is KeptOn:
            stream = record.stream()
            if stream is None:  # a keep's, whose stream object is gone: never asked about again
                if recorded.get(k, False) is record:
                    with self._lock:
                        if recorded.get(k, False) is record:
                            del recorded[k]
                continue
            alive.append(stream)
        keys.append(k)
    device = self.device
    if device_streams is not None:
        keys += device_streams
    elif device is not None:
        for other in device_arenas(device):
            if other is not self:
                keys += recorded_streams(other, alive)
    for k in dict.fromkeys(keys):  # each once, in order
        if k is None or not is_own_stream(k):  # another thread's per-thread stream cannot be asked from here
            continue
        watches = table.watches  # before the record: a block that records the stream again meanwhile is counted
        seen = recorded.get(k, False)  # before the question: a capture that begins meanwhile keeps its record
        if _captured(capture, k):
            return True
        if seen is not False and seen is not BEGINNING:
            with self._lock:  # its capture is over (a lease of a new one, or a new block, records it again)
                if table.watches == watches and recorded.get(k, False) is seen:
                    del recorded[k]
    return False


def give_back(self: Arena, key: Any = None) -> None:
    """Give the arena's queued buffers to its provider, except those whose stream is being captured: they stay
    queued for a later call. The buffers of no stream wait too while a capture is under way that their free, which
    synchronises the device, would break (:func:`_capture_under_way`), and so do those of another thread's per-thread
    stream, which the drain frees with no stream (handle 2 would name this thread's, which is not theirs to ask about
    either). A buffer held back is freed on its stream later only if the handle still names that stream, and the
    arena still uses it (:func:`_gone_since_held`), else with no stream; once the arena is collected, with no stream
    too, as its other buffers are (its streams may be gone with it: :meth:`_Table.let_go_collected`). (Lock not
    held.)

    Which streams wait is asked before anything is taken off the queue (a copy of it is read); the queue is then
    drained as :func:`~wsarena.arena._lifecycle.give_back` always drains it, with no place between taking a buffer
    and handing it to the provider, or setting it aside, where a Ctrl-C could lose it. A closed arena that has buffers
    queued again so is kept for them (:func:`~wsarena.arena._lifecycle.keep_while_holding`): a :meth:`Arena.close`
    that looked while they were set aside did not see them.
    """
    capture = self._capture
    streams = {stream for _, stream in list(self._to_free)}  # list(): one C call, whatever other threads do
    held = self._table.held_back
    waiting, gone, unowned = set(), set(), set()
    for stream in streams:
        if stream is None:
            continue
        if not is_own_stream(stream):
            unowned.add(stream)
        elif held and stream in held and _gone_since_held(self, stream, ask=False):
            gone.add(stream)  # CUDA is asked nothing about a handle that may name no stream
        elif _captured(capture, stream):
            waiting.add(stream)
        elif self._heir or (held and stream in held and _gone_since_held(self, stream, ask=True)):
            gone.add(stream)  # no capture is under way on it
    if (None in streams or gone or unowned) and _capture_under_way(self, key):
        waiting.add(None)
        waiting |= gone | unowned  # freed with no stream: they wait as those do
    if waiting:
        _hold(self, waiting)
    try:
        _give_back(self.provider, self._to_free, waiting=waiting, unstreamed=gone)
    finally:
        if waiting and self._table.closed:
            # What was held back is queued again: a close() that looked while it was off the queue saw none of it
            with self._lock:
                if self._to_free:
                    keep_while_holding(self, True)
    if held:
        for stream in list(held):  # list(): one C call, whatever other threads do
            if stream not in waiting:  # given back now, or nothing queued: a later hold records its stream afresh
                held.pop(stream, None)


_GONE: Any = object()  # held_back: the stream was found gone (its buffers are freed with no stream)


class _Unwatched:
    """Recorded in ``held_back`` for a handle whose stream the arena cannot tell apart (a raw handle, or a provider
    with no ``stream_id``), or whose sub-arena was forgotten before its buffers were held back: the buffers are freed
    on it only while the sub-arena of ``serial`` (0: none) still serves it (:func:`_gone_since_held`)."""

    __slots__ = ("serial",)

    def __init__(self, serial: int) -> None:
        self.serial = serial


def _hold(self: Arena, streams: set[Any]) -> None:
    """Record, for each stream whose buffers are held back now, the id the arena read when it began to watch that
    stream (:attr:`~wsarena.arena._sub._SubArena.stream_id`): the buffers are freed on it later only if the handle
    still names that stream (:func:`_gone_since_held`). No id is read here: CUDA refuses ``cudaStreamGetId`` on a
    stream being captured, and in its global and thread-local modes the refusal invalidates the capture. A stream the
    arena cannot tell apart keeps the handle while its sub-arena serves it (:class:`_Unwatched`); once that is
    forgotten (before the buffers were held back, too: a trim or a close during its owner's capture), nothing of the
    arena uses the stream, and its owner may destroy it. A default stream is not recorded: it is never destroyed."""
    held, subs = self._table.held_back, self._subs
    for stream in streams:
        if type(stream) is int and stream > PER_THREAD_DEFAULT_STREAM and stream not in held:
            sub = subs.get(stream)
            if sub is not None and sub.stream_id is not None:
                held[stream] = sub.stream_id
            else:
                held[stream] = _Unwatched(sub.serial if sub is not None else 0)


def _gone_since_held(self: Arena, stream: Any, ask: bool) -> bool:
    """Whether the handle ``stream``, whose buffers were held back while its stream was captured, may name another
    stream now (or none): the stream was destroyed since, and CUDA may have given its handle to a new one, in whose
    order the buffers must not be freed (CuPy's pool would hand them to that stream at once). Known without asking CUDA
    once the stream object the arena watched died, or its sub-arena was forgotten or is another stream's: the handle
    may name no stream then, and CUDA reads through it. With ``ask`` (no capture is under way on the handle, which the
    question would invalidate), also when CUDA gives the handle's stream another id (or none). A handle recorded as
    :class:`_Unwatched` is asked whether it is captured first, as it was when its buffers were held back (a capture
    the arena may not know of): only with ``ask``, then, is it gone, once the sub-arena that served it is not there
    any more (forgotten, or another), or its stream object died."""
    held = self._table.held_back
    stream_id = held.get(stream)
    if type(stream_id) is _Unwatched:  # asked again at each drain: a later capture of the handle is seen
        sub = self._subs.get(stream)
        return ask and (sub is None or sub.serial != stream_id.serial or sub.orphan)
    if stream_id is not _GONE and _watched(self, stream, stream_id):
        read = self._table.stream_id
        if not ask or (read is not None and read(stream) == stream_id):
            return False
    held[stream] = _GONE  # for good: a new stream with that id would not be this one
    return True


def _watched(self: Arena, stream: Any, stream_id: Any) -> bool:
    """Whether the arena still watches the stream of id ``stream_id`` on the handle ``stream``: the stream object of
    its sub-arena lives (no lock: each field read once, and a death is never undone)."""
    sub = self._subs.get(stream)
    if sub is None or sub.orphan or sub.stream_id != stream_id:
        return False
    anchor = sub.anchor
    return anchor is not None and anchor() is not None


def check_unpinned(self: Arena) -> None:
    """Debug mode: nothing queued to be freed is a buffer that a graph still holds. The graphs' pins name their
    buffers, wherever the arena keeps them (or lost track of them)."""
    with self._lock:
        # A generator, not a set comprehension, for the lock: wsarena.arena._interrupts, rule 8. The queue is read
        # under the lock, and checked after it.
        captures = self._table.captures.values()
        pinned = set(id(block.buffer) for pin in captures if pin.live() for block in pin.blocks)  # noqa: C401
        queued = list(self._to_free)  # a copy: other threads drain the queue without the lock
    # A pin keeps its blocks, and a block its buffer, and the copy the queued buffers: an id in both is one buffer's.
    for buffer, _ in queued:
        if id(buffer) in pinned:
            raise AssertionError(
                f"wsarena debug: {short_repr(buffer)} is about to be freed while a CUDA graph that captured it "
                "still exists"
            )
