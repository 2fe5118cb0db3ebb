"""The arena: one sub-arena per stream (or CPU lane), each holding a single buffer, leased out in order.

Why one buffer per stream is safe: a stream runs its kernels in order, so two calls on one stream may use the
same bytes; calls on different streams get different sub-arenas, hence disjoint bytes. A sub-arena grows to
the largest request it has seen (rounded by :func:`~wsarena.arena._stats.aligned_size`); the buffer it outgrows
is *retired*, not freed, while a lease still uses it (:meth:`Arena.reserve` may grow a buffer under a live
lease), and freed in stream order when that lease ends.

Keys: a host arena (``provider.device_id is None``) keys its sub-arenas by CPU lane, a device arena by raw
stream handle, handle 2 (the per-thread default stream) per thread (:mod:`wsarena.arena.streams`).

Who may use a sub-arena at once: one lease, on host lanes and device streams alike.

- A lease on a lane or stream makes other threads that lease there wait until it is released. On a device
  this keeps the kernels of two calls that each enqueue several kernels from interleaving on the shared bytes.
- A thread that leases again (``nbytes > 0``) on a lane or stream it already holds gets a ``RuntimeError``,
  because a nested lease would get the same bytes as the outer one while the outer lease's owner still uses
  them (say ``wsarena.conv_forward(..., stream=S)`` inside the caller's own ``with arena.lease(n, stream=S)``).
  Lease the inner workspace on another lane or stream, or after the outer lease ends. Zero-byte leases take
  nothing, so they may nest anywhere.

The lock. ``_lock`` guards the arena's routing table (:mod:`wsarena.arena._table`) and every field of its
sub-arenas and blocks. It is held only for bookkeeping: never across a provider call (allocate, free and fill
can be slow, synchronise the device or run the garbage collector), never across the body of a lease, never
while a thread waits. A thread that must wait (for the lane's holder, or for another thread's growth) queues a
lock of its own on that sub-arena, lets go of the arena's lock, and waits on its own. Only the thread whose token
is in ``growing`` installs a new buffer. How the bookkeeping survives Ctrl-C is written down in
:mod:`wsarena.arena._interrupts`; what a forked child gets, in :meth:`Arena._after_fork_in_child`.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Hashable, Iterable, Sized
from typing import Any

from .._config import get_config, setting
from .._sizes import TEXT_OR_BYTES, as_int, cap_for, checked_ordered, format_size, is_sequence, short_repr
from ..errors import CaptureError, WorkspaceCapError
from . import _growth, _leases, _lifecycle, _pinning, _refusals
from ._interrupts import finish
from ._leases import POISON_BYTE
from ._lifecycle import give_back, keep_while_holding, release_closed, track_arena, track_device_arena
from ._pins import free_posted
from ._stats import ArenaStats, aligned_size, snapshot
from ._table import _Table
from ._workspace import Workspace
from .streams import raw_handle, resolve_stream

__all__ = ["POISON_BYTE", "Arena"]

_CONFIGURED: Any = object()  # lease(cap=): the configured cap


def _non_negative_int(value: Any, name: str = "nbytes", expected: str | None = None) -> int:
    """``value`` as a non-negative ``int`` (any integer type, not a ``bool``). ``TypeError`` says ``expected``
    (by default "``name`` must be an int"), ``ValueError`` that ``name`` cannot be negative."""
    n = as_int(value)
    if n is None:
        raise TypeError(f"{expected or f'{name} must be an int'}, not {short_repr(value)}")
    if n < 0:
        raise ValueError(f"{name} cannot be negative: {short_repr(n)}")
    return n


class Arena:
    """Workspace memory for one device (or the host): per stream, one buffer sized to the largest request.

    Parameters
    ----------
    provider : MemoryProvider
        Where buffers come from (:class:`HostProvider`, :class:`CupyProvider`, :class:`AsyncProvider`,
        :class:`TorchProvider`, or any object with the methods of :class:`MemoryProvider`). ``provider.device_id``
        is ``None`` for host memory (sub-arenas are CPU lanes) or a device ordinal (sub-arenas are CUDA streams).

    Notes
    -----
    - Any number of threads may use one arena. A lease holds its lane (host) or stream (device) until released:
      other threads wait, and the same thread leasing there again (``nbytes > 0``) gets ``RuntimeError``.
      The per-thread default stream (handle 2) is a separate sub-arena for each thread.
    - Growth: to ``aligned_size(nbytes)``; the outgrown buffer is freed on the sub-arena's stream once no
      lease uses it.
    - :meth:`stats` returns a frozen :class:`ArenaStats`; fields read as attributes or items.
    - A buffer from the provider whose bytes overlap one the arena holds (the same memory handed out twice) is a
      :class:`~wsarena.errors.ProviderError` as it would be installed, in any mode.
    - Debug mode (``wsarena.configure(debug=True)`` or ``WSARENA_DEBUG=1``, read at each lease) fills released
      bytes with ``POISON_BYTE`` and raises ``AssertionError`` if two live leases on different streams overlap.
    - Memory is released by :meth:`trim`, :meth:`close`, when the arena is collected (what a CUDA graph holds, once
      the graph is gone, as :meth:`close` frees it), when a stream or thread it served is gone, and, for device
      arenas, at interpreter exit before CUDA is torn down.
    - ``copy.copy`` and ``copy.deepcopy`` return the arena itself; pickling it is a ``TypeError``.
    """

    _heir = False  # the closed arena that a collected one hands its buffers to (_collected): close() lets them go so

    def __init__(self, provider: Any) -> None:
        if isinstance(provider, type):  # its methods are unbound: the first lease would fail on them
            raise TypeError(f"provider {provider!r} is a class: pass an instance, {provider.__name__}(...)")
        if not hasattr(provider, "device_id") or not all(
            callable(getattr(provider, name, None)) for name in ("allocate", "deallocate")
        ):  # a provider that cannot free would be given every buffer in vain, and warn of each
            raise TypeError(
                f"provider {short_repr(provider)} is not a MemoryProvider (device_id, allocate, deallocate, ...)"
            )
        if provider.device_id is not None:  # "cpu" would make a device arena of CUDA streams over the host's memory
            _non_negative_int(
                provider.device_id, "provider.device_id",
                "provider.device_id must be None (host memory) or a CUDA device ordinal",
            )
        lanes = provider.device_id is None
        stream_id = None if lanes else getattr(provider, "stream_id", None)  # stream_id(handle) -> int or None
        self._attach(provider, _Table(threading.RLock(), lanes, stream_id))
        track_arena(self)
        if not self._lanes:
            track_device_arena(self)

    def _attach(self, provider: Any, table: _Table) -> None:
        """Serve the buffers of ``table`` from ``provider``; once this object is collected, :func:`_collected` frees
        them. (A forked child's arena starts again with a table of its own: ``_lifecycle.reset_in_child``.)"""
        self.provider = provider
        self._lanes = provider.device_id is None
        self._current = None if self._lanes else getattr(provider, "current_stream", None)
        self._capture = getattr(provider, "capture", None)  # capture(stream) -> the capture under way, or None
        self._lock = table.lock
        self._table = table
        self._subs = table.subs  # the table's own dict and queues, read directly on the fast paths
        self._dead, self._to_free = table.dead, table.to_free
        self._finalizer = weakref.finalize(self, _collected, provider, table)
        self._finalizer.atexit = False  # at exit, device arenas are released by an atexit handler instead

    # ---------------------------------------------------------------------------------------------- public
    @property
    def device(self) -> int | None:
        """CUDA device ordinal, or ``None`` for the host arena."""
        device_id: int | None = self.provider.device_id
        return device_id

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._table.closed

    def lease(self, nbytes: int, *, stream: Any = None, cap: Any = _CONFIGURED) -> Workspace:
        """Lease ``nbytes`` of workspace on ``stream``; use as ``with arena.lease(n) as ws:``.

        The sub-arena of ``stream`` grows if it holds less than ``nbytes`` (the outgrown buffer is retired in
        stream order); the provider is asked, whatever it refused before (a caller that has a fallback asks
        :meth:`defers_growth` first). Zero bytes is legal and takes nothing. ``cap`` is the cap to check
        ``nbytes`` against (bytes or ``None``); by default ``get_config().cap_workspace``. The ops pass the cap
        their algorithm was chosen under, so that a ``configure()`` in another thread, or a plan made under its
        own cap, cannot refuse a workspace that the choice already checked.

        Raises
        ------
        TypeError, ValueError
            ``nbytes`` is not a non-negative int, or ``stream`` is not a stream / lane key.
        WorkspaceCapError
            ``nbytes`` is above the cap; the arena is unchanged.
        ArenaOutOfMemoryError
            (on entering) The provider could not grow the sub-arena; the arena's buffers are unchanged (the
            refusal is remembered: :meth:`defers_growth`).
        ArenaClosedError
            (on entering) The arena is closed; :class:`~wsarena.errors.BackendUnavailableError` instead for a
            device arena in a forked child.
        ProviderError
            (on entering) The provider broke its contract: a buffer smaller than asked or overlapping one the arena
            holds, a ``StopIteration``, or a request for this stream from inside its ``allocate``.
        CaptureError
            (on entering) The stream is being captured into a CUDA graph and the lease needs the arena to grow, or
            CUDA refuses the stream now (its capture invalidated; the legacy default stream beside a capture).
        RuntimeError
            (on entering) This thread already holds a lease on this lane or stream (and ``nbytes > 0``): a
            nested lease would share the outer lease's bytes.
        """
        n = nbytes if type(nbytes) is int and nbytes >= 0 else _non_negative_int(nbytes)
        key, anchor = resolve_stream(stream, lanes=self._lanes, current=self._current)
        cfg = get_config()
        if cap is _CONFIGURED:
            cap = cfg.cap_workspace
        elif cap is not None and (type(cap) is not int or cap < 0):
            cap = _non_negative_int(cap, "cap", "cap must be an int, in bytes, or None for no cap")
        if cap is not None and n > cap:
            self._refuse(n, key, cap)
        return Workspace(self, n, key, anchor, cfg.debug, cap)

    def reserve(self, nbytes: int, *, stream: Any = None) -> None:
        """Grow the sub-arena of ``stream`` to hold at least ``nbytes`` now, so that later leases do not allocate.

        Raises as :meth:`lease` does (``WorkspaceCapError`` above the cap, ``ArenaOutOfMemoryError``).
        """
        n = _non_negative_int(nbytes)
        key, anchor = resolve_stream(stream, lanes=self._lanes, current=self._current)
        cap = get_config().cap_workspace
        if cap is not None and n > cap:
            self._refuse(n, key, cap)
        self._reserve(n, key, anchor, cap)

    def reserve_for(self, plan: Any, *, streams: Iterable[Any] | None = None) -> None:
        """Pre-size the sub-arenas a run of ``plan`` will use, so that the run itself allocates nothing.

        Parameters
        ----------
        plan : wsarena.planner.Plan
            Anything with ``stream_bytes``: the capacity each planned stream needs, in order. A plan's ``backend``
            must be the one the arena serves: ``"cpu"`` for the host arena, ``"cudnn"`` for a device's
            (``ValueError``).
        streams : iterable, optional
            The stream (or CPU lane) each planned stream will run on, in the same order (a list, a tuple, a
            generator; not a set). By default the calling thread's default stream, which a one-stream plan needs; a
            plan for several streams must name them. A stream named more than once runs the calls of those planned
            streams one after another, so it is reserved for the largest of them, not their sum.

        The plan was made under its own cap, so its sizes are not checked against the configured cap again
        (each is rounded up by ``aligned_size``, as any growth is, so the capacity may sit just above it).
        Every stream is checked before anything is reserved; if the provider fails part-way, the streams before
        the failing one stay reserved.
        """
        stream_bytes = getattr(plan, "stream_bytes", None)
        if not is_sequence(stream_bytes):
            raise TypeError(f"plan must be a wsarena.plan() result (with stream_bytes), not {short_repr(plan)}")
        backend, serves = getattr(plan, "backend", None), "cpu" if self._lanes else "cudnn"
        if backend in ("cpu", "cudnn") and backend != serves:  # its sizes are another backend's algorithms'
            arena = "the host arena" if self._lanes else f"the arena of CUDA device {self.device}"
            raise ValueError(
                f"the plan is for the {backend} backend and {arena} serves the {serves} backend: plan with "
                f"backend={serves!r} for it"
            )
        sizes = [_non_negative_int(n, "plan.stream_bytes") for n in stream_bytes]
        if streams is None:
            if len(sizes) > 1:
                raise ValueError(f"a plan for {len(sizes)} streams needs streams=[...], one per planned stream")
            streams = [None] * len(sizes)
        # in the plan's order: "ab" is no list of two lanes, nor is a set in any order
        streams = checked_ordered("streams", streams, "a sequence of streams, one per planned stream",
                                  "and each planned stream's size goes to the stream at its place in streams")
        sized = isinstance(streams, Sized)  # an iterator is read one past the plan: an endless one ends there
        streams = list(streams if sized else itertools.islice(streams, len(sizes) + 1))
        if len(streams) != len(sizes):
            given = len(streams) if sized or len(streams) < len(sizes) else "more"
            raise ValueError(f"the plan has {len(sizes)} stream(s) but {given} were given")
        resolved = [resolve_stream(s, lanes=self._lanes, current=self._current) for s in streams]
        for (key, anchor), n in zip(resolved, sizes):
            self._reserve(n, key, anchor, None)  # a plan's own cap is not known here

    @property
    def refusing(self) -> bool:
        """Whether :meth:`defers_growth` may say yes now: the provider refused a growth twice or more in a row
        lately, and the wait that follows is not over (no lock: for a caller's fast path)."""
        refusals = self._table.refusals
        return refusals.times > 1 and _refusals.clock() < refusals.until  # the clock read only after refusals

    def defers_growth(self, nbytes: int, *, stream: Any = None, fallback: int = 0) -> bool:
        """Whether a caller that can do with ``fallback`` bytes should not ask for a lease of ``nbytes`` on
        ``stream`` now, rather than have the provider asked for memory that it has just refused.

        Yes when the lease would grow the sub-arena to at least as much as the provider refused twice or more in a
        row lately (since it last granted as much, or since :meth:`trim`), less than 100 times that refusal's own
        duration ago (doubled with each further refusal in a row, at most a minute), and a lease of ``fallback``
        bytes there needs no growth. Under lasting memory pressure a refusal is costly: CuPy's pool runs the
        garbage collector first, PyTorch's allocator drops its cache, which synchronizes the device. The ops ask
        this before each algorithm that has a smaller one after it (:func:`wsarena.algos.run_with_fallback`). Never
        while ``stream`` is being captured (a capture grows nothing, and says so itself). Where the answer would be
        yes, the buffers that released CUDA graphs kept are freed first: if there were any, the answer is no. The
        buffer of a stream object that died counts as held only once the handle is known to name that stream still
        (:meth:`held_bytes`).
        """
        n = nbytes if type(nbytes) is int and nbytes >= 0 else _non_negative_int(nbytes)
        least = fallback if type(fallback) is int and fallback >= 0 else _non_negative_int(fallback, "fallback")
        key, _ = resolve_stream(stream, lanes=self._lanes, current=self._current)
        with self._lock:
            if self._table.dead:
                self._table.sweep()
            sub = self._subs.get(key)
            # an orphan whose handle may name another stream now is not asked its id here (a lease does that)
            held = sub.capacity() if sub is not None and not self._table.unchecked(sub) else 0
            defer = n > held >= least
            if defer and self._table.kept and self._table.release_kept():
                defer = False  # what released graphs held is free now: worth asking
            defer = defer and self._table.refusals.defers(aligned_size(n), _refusals.clock())
        if self._to_free:
            self._give_back(key)
        if defer and self._capture is not None:
            try:
                defer = self._capture(raw_handle(key)) is None
            except CaptureError:  # a stream CUDA will not use now: the lease says so
                defer = False
        return defer

    def capturing(self, *, stream: Any = None) -> bool:
        """Whether ``stream`` is being captured into a CUDA graph (never, for a provider that cannot tell).

        Raises :class:`~wsarena.errors.CaptureError` where CUDA refuses the question because using ``stream`` would
        break a capture under way (the legacy default stream while another stream of the device is captured)."""
        # the stream checked first: one that is none is refused by any arena, not only by those that can tell
        key, _ = resolve_stream(stream, lanes=self._lanes, current=self._current)
        if self._capture is None:
            return False
        return self._capture(raw_handle(key)) is not None

    def keep_with_capture(self, objects: Iterable[Any], *, stream: Any = None) -> bool:
        """Keep ``objects`` (arrays whose memory kernels captured on ``stream`` write or read) as long as the CUDA graph
        being captured on ``stream`` exists, as a workspace buffer pinned to it is kept; returns whether it is being
        captured (else nothing is kept). Freed meanwhile, an array's memory would go to the next allocation (CuPy's
        ``MemoryPool`` hands it to the next on that stream), which every replay would overwrite. They are let go by the
        first trim, stats or growth of an arena, or end of a :func:`wsarena.capture` block, once CUDA has destroyed
        the graph and no capture that an arena knows of is under way in the process (an array dropped may free its
        memory, ``cudaFree``, which a capture forbids). A capture an earlier error invalidated keeps nothing: it
        becomes no graph. (The ops keep what they allocate during a capture so; what of theirs a memory pool takes
        back as it is dropped goes with the first keep of a later capture too.) :meth:`stats` counts what is kept so
        in ``kept_bytes``, each array's size read once, here.

        ``objects`` is a collection of arrays, read before anything is kept: one array is a ``TypeError`` (iterated,
        it would be kept as its rows, one view each), as are text and binary data (``"lane"``, a stream given in
        place of the arrays, would be kept as its characters) and what cannot be iterated. A Ctrl-C once the keep has
        begun loses none of them: it completes, then the interrupt is raised
        (:func:`~wsarena.arena._interrupts.finish`)."""
        if hasattr(objects, "shape") or hasattr(objects, "__cuda_array_interface__") or hasattr(objects, "__dlpack__"):
            raise TypeError(f"keep_with_capture() takes a collection of arrays, not one: [{short_repr(objects)}]")
        if isinstance(objects, TEXT_OR_BYTES):  # iterable, but of characters or small ints: no arrays to keep
            raise TypeError(f"keep_with_capture()'s objects must be a collection of arrays, not {short_repr(objects)} "
                            "(a stream, or a CPU lane, goes as stream=)")
        try:
            each = iter(objects)
        except TypeError:
            raise TypeError(f"keep_with_capture()'s objects must be a collection of arrays, not {short_repr(objects)}"
                            ) from None
        return finish(_pinning.keep_with_capture, self, list(each), stream)

    def held_bytes(self, *, stream: Any = None) -> int:
        """Capacity of the sub-arena of ``stream``: the largest lease it serves without growing (0 if none; 0 too for
        a new stream that CUDA gave a dead stream's handle: the dead stream's buffer is not its own)."""
        key, _ = resolve_stream(stream, lanes=self._lanes, current=self._current)
        # A stream being captured is not asked its id (Table.replaced): its orphaned buffer is counted as held. Where
        # the provider can tell captures, no id is read unless CUDA has said the stream is not captured, which it is
        # asked only where an id would be (an orphan's): so an orphan that a stream object's death makes between the
        # two locked steps below is counted as held too.
        capture = self._capture
        capturing = capture is not None
        if capture is not None:
            with self._lock:
                if self._table.dead:
                    self._table.sweep()
                sub = self._table.subs.get(key)
                ask = sub is not None and self._table.unchecked(sub)
            if ask:
                try:
                    capturing = capture(raw_handle(key)) is not None
                except CaptureError:  # one CUDA will not use now (an invalidated capture): not asked its id either
                    pass
        with self._lock:
            sub, _ = self._table.serving(key, capturing)
            held = sub.capacity() if sub is not None else 0
        if self._to_free:  # what a sweep let go
            self._give_back(key)
        return held

    def trim(self) -> int:
        """Free every buffer that no live lease uses; return the number of bytes given back.

        Sub-arenas left empty are forgotten (their per-stream counters with them), and so are the growths the
        provider refused lately (:meth:`defers_growth` says no until it refuses again). Kept: a buffer a CUDA graph
        captured, and the one :func:`wsarena.capture` gave its stream until the capture's first lease there.
        """
        seeded = _pinning.seeded_streams(self)
        released = 0
        with self._lock:
            self._table.reap_all()
            released += self._table.sweep()
            if self._table.unplaced:
                self._table.let_go_unplaced()
            for sub in list(self._subs.values()):
                if sub.orphan and sub.idle():
                    released += self._table.forget(sub, gone=True)
                    continue
                released += sub.tidy()
                if sub.key not in seeded:  # once a capture's first lease came there meanwhile, its buffer is pinned
                    released += sub.empty()
                self._table.drop_if_idle(sub)
            released += self._table.release_kept()
            self._table.refusals.forget()
        self._give_back()
        release_closed()
        return released

    def stats(self) -> ArenaStats:
        """A snapshot of the arena's sizes and counters (attribute or item access: ``s.capacity_bytes``)."""
        release_closed()  # first: what graphs gone since kept is let go before kept_bytes is read
        with self._lock:
            self._table.reap_all()
            self._table.sweep()
            self._table.release_kept()
            stats = snapshot(self._table)
        self._give_back()
        return stats

    def close(self) -> None:
        """Free what no lease uses and refuse new leases; buffers of live leases are freed when they end.

        Later leases and reserves raise :class:`~wsarena.errors.ArenaClosedError`, and so does one still growing,
        or waiting for its stream, when ``close`` runs; what it allocated is freed. :func:`get_arena` replaces a
        closed arena by a new one. A buffer a CUDA graph holds is freed once the graph is gone (one whose free waits
        for a capture, once that ends), by the next :meth:`trim`, :meth:`stats` or growth of any arena, or this call
        again: until then the closed arena is kept, whoever else lets go of it. Idempotent.
        """
        with self._lock:
            self._table.closed = True
            if self._heir:
                self._table.let_go_collected()
            self._table.reap_all()
            self._table.sweep()
            if self._table.unplaced:
                self._table.let_go_unplaced()
            self._table.close_subs()
            self._table.release_kept()  # what graphs still hold is freed once they are gone (release_closed)
            _pinning.forget_released(self._table.captures)
        self._give_back()
        # Kept while a lease, a graph or a capture under way holds a buffer of it, for release_closed() to free each
        # once it may, whoever else lets go of the arena (_lifecycle._closed_holding). Decided in a locked step, as
        # another thread's drain that held back a buffer for a capture, and queues it again, keeps the arena in one
        # too (wsarena.arena._pinning.give_back): the later of the two decides.
        with self._lock:
            keep_while_holding(self, bool(self._subs or self._table.kept or self._table.captures or self._to_free))
        free_posted()  # the pins dropped before their graphs went, once CUDA let go of them

    def __copy__(self) -> Arena:
        return self  # one arena per table of buffers: a copy's buffers would be freed under it by this one's finalizer

    def __deepcopy__(self, memo: Any) -> Arena:
        return self

    def __reduce__(self) -> Any:
        raise TypeError(
            "an Arena holds memory of this process and cannot be pickled: call wsarena.get_arena() where it is needed"
        )

    def __repr__(self) -> str:
        capacity = sum(sub.capacity() for sub in list(self._subs.values()))  # for repr only: no lock
        closed = ", closed" if self._table.closed else ""
        return f"<Arena {short_repr(self.provider)}: {len(self._subs)} stream(s), {format_size(capacity)}{closed}>"

    # --------------------------------------------------------- leases, called by Workspace (_leases.py)
    _acquire = _leases._acquire
    _take_lane = _leases._take_lane
    _end = _leases._end
    _hold_by_workspace = _leases._hold_by_workspace
    _grant = _leases._grant

    # --------------------------------------------------------------------------------- growth (_growth.py)
    _grow_for = _growth._grow_for
    _reserve = _growth._reserve
    _grow = _growth._grow
    _end_growth = _growth._end_growth

    # ---------------------------------------------------------------------------- capture (_pinning.py)
    _acquire_captured = _pinning._acquire_captured
    _pin_for = _pinning._pin_for
    _capture_under_way = _pinning._capture_under_way
    _recorded_streams = _pinning.recorded_streams
    _growth_refusal = _pinning.growth_refusal

    # ----------------------------------------------------------------------------------- lock not held
    def _refuse(self, n: int, key: Hashable, cap: int) -> None:
        with self._lock:
            sub = self._subs.get(key)
            held = sub.capacity() if sub is not None else 0
        raise WorkspaceCapError(
            f"a workspace of {cap_for(n)} on stream {short_repr(key)} is above the workspace cap",
            requested=n, held=held, cap=cap,
        )

    def _give_back(self, key: Any = None) -> None:
        """Give the buffers let go to the provider (lock not held; any thread may drain the queue). ``key``: the
        stream of the call that drains it, if any; where streams can be captured, a buffer whose stream is being
        captured stays queued (:func:`wsarena.arena._pinning.give_back`). Reads the debug setting alone: an invalid
        environment variable of another setting (which a config() block around the leases replaced) is no error of a
        free, nor of a finalizer, trim or stats that frees."""
        if self._table.captures and setting("debug"):
            _pinning.check_unpinned(self)
        if self._capture is None:
            give_back(self.provider, self._to_free)
        else:
            _pinning.give_back(self, key)


def _collected(provider: Any, table: _Table) -> None:
    """Finalizer of a collected arena (never one's at interpreter exit): what it held goes to an heir, a closed arena
    over the same table (the collected one stays gone), which frees it as :meth:`Arena.close` frees a closed arena's
    and is kept while a graph or a capture under way holds some of it; a buffer a graph holds is freed once the graph
    is gone (:func:`~wsarena.arena._lifecycle.release_closed`). Its streams may be gone with the arena: each buffer is
    freed with no stream (:meth:`_Table.let_go_collected`), once no capture the arena knew of may be under way.

    Where closing the heir fails (the collector ran this near the recursion limit, the provider raised) or is
    interrupted, the heir is kept as a closed arena holding something is, for the next ``release_closed()`` to close
    again; a failure warns. Let go, the heir's own finalizer, which is this function, would run at once, at the same
    depth, and fail alike, for ever. An interrupt before the heir has its finalizer leaves the buffers to their owner
    objects' collection.

    In a forked child, the collector may find an arena of the parent before the child starts its arenas again (an
    at-fork hook that runs before wsarena's allocates): its buffers are the parent's, and none goes to the provider, as
    :func:`~wsarena.arena._lifecycle.reset_in_child` gives none."""
    if sys.is_finalizing():
        return
    if table.pid != os.getpid():
        _lifecycle.keep_parents_memory(table)
        return
    if table.subs or table.kept or table.to_free or table.unplaced:
        heir = Arena.__new__(Arena)
        heir._heir = True
        key = id(heir)
        try:
            heir._attach(provider, table)
            track_arena(heir)  # a forked child starts it again. At exit, release_closed's list has it: no lock taken
            heir.close()
        except BaseException as exc:
            if "_finalizer" in heir.__dict__:  # attached: its finalizer would run this again
                _lifecycle._closed_holding[key] = heir  # a plain store: no call, which could fail as the last did
            if not isinstance(exc, Exception):
                raise
            warnings.warn(
                f"wsarena: freeing what a collected arena held failed: {short_repr(exc)}; the next trim(), "
                "stats() or growth of an arena tries again", RuntimeWarning, stacklevel=2,
            )
    free_posted()
