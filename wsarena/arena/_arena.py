"""The arena: one sub-arena per stream (or CPU lane), each holding a single buffer, leased out in order.

Why one buffer per stream is safe: a stream runs its kernels in order, so two calls on one stream may use the
same bytes; calls on different streams get different sub-arenas, hence disjoint bytes. A sub-arena grows to
the largest request it has seen (rounded by :func:`aligned_size`); the buffer it outgrows is *retired*, not
freed: it stays valid for the lease that still uses it (:meth:`Arena.reserve` may grow a buffer under a live
lease) and is freed, in stream order, when that lease ends.

Keys: a host arena (``provider.kind == "host"``) keys its sub-arenas by CPU lane, a device arena
(``provider.kind == "device"``) by raw stream handle, with one exception. Handle 2 (``cudaStreamPerThread``,
CuPy's ``Stream.ptds``, and what ``stream=None`` means while a thread's current stream is the per-thread
default) names a *different* stream in each host thread, whose kernels may run concurrently with another
thread's. So it is keyed per thread (a :class:`~wsarena.arena.streams.PerThreadStream`: an ``int`` equal in
value to 2, hashed and compared by its thread), and each thread gets its own bytes; that sub-arena is swept
when its thread exits. Providers are still told stream 2, by the key's own thread; a buffer of another
thread's per-thread stream (freed by :meth:`Arena.trim` or :meth:`Arena.close`) is freed with ``stream=None``,
as for a stream that may be gone, since handle 2 would name the wrong stream there. The legacy null stream 0
is one stream for every thread, and one key.

Who may use a sub-arena at once: one lease, on host lanes and device streams alike.

- A lease on a lane or stream makes other threads that lease there wait until it is released. On a device
  this keeps the kernels of two calls that each enqueue several kernels from interleaving on the shared bytes.
- A thread that leases again (``nbytes > 0``) on a lane or stream it already holds gets a ``RuntimeError``,
  because a nested lease would get the same bytes as the outer one while the outer lease's owner still uses
  them. On the host the CPU work inside a lease is synchronous (and waiting would deadlock); on a device
  stream order does not help: the outer lease's data is still needed after the inner call, which would
  overwrite it (say ``wsarena.conv_forward(..., stream=S)`` inside the caller's own
  ``with arena.lease(n, stream=S)``). Lease the inner workspace on another lane or stream, or after the outer
  lease ends. Zero-byte leases take nothing, so they may nest anywhere.
"""

from __future__ import annotations

import collections
import operator
import threading
import weakref
from threading import get_ident as _get_ident
from collections.abc import Hashable, Sequence
from types import MappingProxyType
from typing import Any

from .._config import get_config
from ..errors import ArenaOutOfMemoryError, WorkspaceCapError
from .._sizes import format_size
from ._lifecycle import _anchor_died, _free_now, _release_all, _track_device_arena
from ._stats import ArenaStats, StreamStats, aligned_size
from ._sub import _Block, _Sub
from ._workspace import Workspace
from .streams import PerThreadStream, ThreadLane, _is_own, _per_thread_key, resolve_stream

__all__ = ["POISON_BYTE", "Arena", "Workspace", "aligned_size"]

_CONFIGURED: Any = object()  # lease(cap=): the configured cap
POISON_BYTE = 0xA5  # what debug mode writes over released workspace bytes


def _check_nbytes(nbytes: Any, name: str = "nbytes") -> int:
    if isinstance(nbytes, bool):
        raise TypeError(f"{name} must be an int, not {nbytes!r}")
    try:
        n = operator.index(nbytes)
    except TypeError:
        raise TypeError(f"{name} must be an int, not {nbytes!r}") from None
    if n < 0:
        raise ValueError(f"{name} cannot be negative: {n}")
    return n


def _hold(lock: Any) -> BaseException | None:
    """Make sure this thread holds the arena's ``lock`` (once), whatever a signal handler raises meanwhile.

    ``acquire`` is interruptible, and a signal's exception (Ctrl-C) is as often delivered just *after* it
    succeeded: so each attempt first asks whether this thread holds the lock already. Returns the first such
    exception, for the caller to raise once its bookkeeping is consistent again.
    """
    interrupted = None
    while True:
        try:
            if not lock._is_owned():
                lock.acquire()
            return interrupted
        except BaseException as exc:  # KeyboardInterrupt, or whatever a signal handler raised
            interrupted = interrupted or exc


class Arena:
    """Workspace memory for one device (or the host): per stream, one buffer sized to the largest request.

    Parameters
    ----------
    provider : MemoryProvider
        Where buffers come from (:class:`HostProvider`, :class:`CupyProvider`, :class:`AsyncProvider`, or any
        object with the same methods). ``provider.kind`` chooses host lanes or device streams.

    Notes
    -----
    - Any number of threads may use one arena. A lease holds its lane (host) or stream (device) until released:
      other threads wait, and the same thread leasing there again (``nbytes > 0``) gets ``RuntimeError``.
      The per-thread default stream (handle 2) is a separate sub-arena for each thread. See the module
      docstring for why.
    - Growth: to ``aligned_size(nbytes)``; the outgrown buffer is freed on the sub-arena's stream once no
      lease uses it.
    - :meth:`stats` returns a frozen :class:`ArenaStats`; fields read as attributes or items
      (``s.capacity_bytes == s["capacity_bytes"]``).
    - Debug mode (``wsarena.configure(debug=True)`` or ``WSARENA_DEBUG=1``, read at each lease) fills released
      bytes with ``POISON_BYTE`` and raises ``AssertionError`` if two live leases on different streams overlap.
    - Memory is released by :meth:`trim`, :meth:`close`, when the arena is collected, when a stream or thread it
      served is gone, and, for device arenas, at interpreter exit before CUDA is torn down.
    """

    def __init__(self, provider: Any) -> None:
        kind = getattr(provider, "kind", None)
        if kind not in ("host", "device"):
            raise TypeError(f"provider {provider!r} must have kind 'host' or 'device', not {kind!r}")
        self.provider = provider
        self._lanes = kind == "host"
        self._current = None if self._lanes else getattr(provider, "current_stream", None)
        # _lock guards everything below and every field of every _Sub and _Block. The rules:
        # 1. It is held only for bookkeeping: never across a provider call (allocate / free / fill can be slow,
        #    synchronise the device or run the garbage collector), never across the body of a lease.
        # 2. A thread that must wait (another thread holds the lane or stream, or is growing its buffer) waits
        #    on that sub-arena's Condition, which is built on this lock and so releases it while waiting.
        # 3. Only the thread that set `growing` replaces a sub-arena's buffer; it re-reads `block` after the
        #    allocation, since trim() may have freed the old one in the meantime.
        # 4. Weakref callbacks (a thread exits, a stream object dies) never block on it: they queue the key in
        #    _dead and sweep only if they get the lock at once and this thread did not hold it already, else
        #    the next operation sweeps. The collector can run them inside a locked region of this very thread.
        # 5. A block is marked `freed` under the lock before the provider frees it, so it is freed once.
        # 6. No thread takes it twice. It is an RLock only for _is_owned(): after an interrupt, the release and
        #    growth paths must know whether they hold it (see _hold).
        self._lock = threading.RLock()
        self._subs: dict[Hashable, _Sub] = {}
        self._dead: collections.deque[tuple[Hashable, int, bool]] = collections.deque()
        self._debug_live: dict[int, tuple[Hashable, int, int]] = {}
        self._closed = False
        self._live = 0
        self._high_water = 0
        self._allocations = 0
        self._growths = 0
        self._frees = 0
        self._finalizer = weakref.finalize(self, _release_all, provider, self._subs)
        self._finalizer.atexit = False  # at exit, device arenas are released by _shutdown_device_arenas
        if not self._lanes:
            _track_device_arena(self)

    # ------------------------------------------------------------------ public
    @property
    def device(self) -> int | None:
        """CUDA device ordinal, or ``None`` for the host arena."""
        return self.provider.device

    def lease(self, nbytes: int, *, stream: Any = None, cap: Any = _CONFIGURED) -> Workspace:
        """Lease ``nbytes`` of workspace on ``stream``; use as ``with arena.lease(n) as ws:``.

        The sub-arena of ``stream`` grows if it holds less than ``nbytes`` (the outgrown buffer is retired in
        stream order). Zero bytes is legal and takes nothing. ``cap`` is the cap to check ``nbytes`` against
        (bytes or ``None``); by default ``get_config().cap_workspace``. The ops pass the cap their algorithm
        was chosen under, so that a ``configure()`` in another thread, or a plan made under its own cap, cannot
        refuse a workspace that the choice already checked.

        Raises
        ------
        TypeError, ValueError
            ``nbytes`` is not a non-negative int, or ``stream`` is not a stream / lane key.
        WorkspaceCapError
            ``nbytes`` is above the cap; the arena is unchanged.
        ArenaOutOfMemoryError
            (on entering) The provider could not grow the sub-arena; the arena is unchanged.
        RuntimeError
            (on entering) This thread already holds a lease on this lane or stream (and ``nbytes > 0``): a
            nested lease would share the outer lease's bytes. Or the arena is closed.
        """
        # The common cases are inlined: this runs once per convolution call. A plain int is its own key, except
        # on a device for handle 2 (the per-thread default stream), which resolve_stream keys by thread.
        n = nbytes if type(nbytes) is int and nbytes >= 0 else _check_nbytes(nbytes)
        kind = type(stream)
        if (kind is int and (self._lanes or (stream >= 0 and stream != 2))) or (kind is str and self._lanes):
            key, anchor = stream, None
        elif kind is int and stream == 2:  # (device) this thread's per-thread stream, as resolve_stream keys it
            key, anchor = _per_thread_key()
        else:
            key, anchor = resolve_stream(stream, lanes=self._lanes, current=self._current)
        cfg = get_config()
        if cap is _CONFIGURED:
            cap = cfg.cap_workspace
        elif cap is not None and (type(cap) is not int or cap < 0):
            cap = _check_nbytes(cap, "cap")
        if cap is not None and n > cap:
            self._check_cap(n, key, cap)
        return Workspace(self, n, key, anchor, cfg.debug, cap)

    def reserve(self, nbytes: int, *, stream: Any = None) -> None:
        """Grow the sub-arena of ``stream`` to hold at least ``nbytes`` now, so that later leases do not allocate.

        Raises as :meth:`lease` does (``WorkspaceCapError`` above the cap, ``ArenaOutOfMemoryError``).
        """
        n = _check_nbytes(nbytes)
        key, anchor = resolve_stream(stream, lanes=self._lanes, current=self._current)
        cap = get_config().cap_workspace
        self._check_cap(n, key, cap)
        self._reserve(n, key, anchor, cap)

    def reserve_for(self, plan: Any, *, streams: Sequence[Any] | None = None) -> None:
        """Pre-size the sub-arenas a run of ``plan`` will use, so that the run itself allocates nothing.

        Parameters
        ----------
        plan : wsarena.planner.Plan
            Anything with ``stream_bytes``: the capacity each planned stream needs, in order.
        streams : sequence, optional
            The stream (or CPU lane) each planned stream will run on, in the same order. By default the calling
            thread's default stream, which a one-stream plan needs; a plan for several streams must name them.

        The plan was made under its own cap, so its sizes are not checked against the configured cap again
        (each is rounded up by :func:`aligned_size`, as any growth is, so the capacity may sit just above it).
        Every stream is checked before anything is reserved; if the provider fails part-way, the streams before
        the failing one stay reserved.
        """
        sizes = [_check_nbytes(n) for n in plan.stream_bytes]
        if streams is None:
            if len(sizes) > 1:
                raise ValueError(f"a plan for {len(sizes)} streams needs streams=[...], one per planned stream")
            streams = [None] * len(sizes)
        streams = list(streams)
        if len(streams) != len(sizes):
            raise ValueError(f"the plan has {len(sizes)} stream(s) but {len(streams)} were given")
        resolved = [resolve_stream(s, lanes=self._lanes, current=self._current) for s in streams]
        for (key, anchor), n in zip(resolved, sizes):
            self._reserve(n, key, anchor, None)  # a plan's own cap is not known here

    def _reserve(self, n: int, key: Hashable, anchor: Any, cap: int | None) -> None:
        if n == 0:
            return
        frees: list[tuple[_Block, Any]] = []
        try:
            with self._lock:
                self._check_open()
                sub = self._sub_for(key, anchor, frees)
                try:
                    self._ensure(sub, n, frees, cap)
                    self._check_open()  # close() may have run while the lock was released to allocate
                finally:
                    self._drop_if_idle(sub, frees)
        finally:
            self._free(frees)  # what a sweep or a growth released, even if this reserve failed

    def held_bytes(self, *, stream: Any = None) -> int:
        """Capacity of the sub-arena of ``stream``: the largest lease it serves without growing (0 if none)."""
        key, _ = resolve_stream(stream, lanes=self._lanes, current=self._current)
        with self._lock:
            sub = self._subs.get(key)
            return sub.capacity() if sub is not None else 0

    def trim(self) -> int:
        """Free every buffer that no live lease uses; return the number of bytes given back.

        Sub-arenas left empty are forgotten (their per-stream counters with them).
        """
        frees: list[tuple[_Block, Any]] = []
        with self._lock:
            self._process_dead(frees)
            for sub in list(self._subs.values()):
                if sub.orphan and sub.idle():
                    self._release_sub(sub, frees, gone=True)
                    continue
                block = sub.block
                if block is not None and block.live == 0:
                    sub.block = None
                    self._retire(sub, block, frees)
                self._drop_if_idle(sub, frees)
            released = sum(block.nbytes for block, _ in frees)
        self._free(frees)
        return released

    def stats(self) -> ArenaStats:
        """A snapshot of the arena's sizes and counters (attribute or item access: ``s.capacity_bytes``)."""
        frees: list[tuple[_Block, Any]] = []
        with self._lock:
            self._process_dead(frees)
            streams = {}
            for key, sub in self._subs.items():
                streams[key] = StreamStats(
                    capacity_bytes=sub.capacity(),
                    high_water_bytes=sub.high_water,
                    allocations=sub.allocations,
                    growths=sub.growths,
                    leases=sub.live,
                    retired_bytes=sum(b.nbytes for b in sub.retired),
                )
            stats = ArenaStats(
                capacity_bytes=sum(s.capacity_bytes for s in streams.values()),
                high_water_bytes=self._high_water,
                allocations=self._allocations,
                growths=self._growths,
                frees=self._frees,
                leases=self._live,
                retired_bytes=sum(s.retired_bytes for s in streams.values()),
                streams=MappingProxyType(streams),
            )
        self._free(frees)
        return stats

    def close(self) -> None:
        """Free what no lease uses and refuse new leases; buffers of live leases are freed when they end.

        A lease or reserve still growing, or waiting for its stream, when ``close`` runs is refused too
        (``RuntimeError``) and what it allocated is freed. :func:`get_arena` replaces a closed arena by a new one.
        Idempotent.
        """
        frees: list[tuple[_Block, Any]] = []
        with self._lock:
            self._closed = True
            self._process_dead(frees)
            for sub in list(self._subs.values()):
                if sub.idle():
                    self._release_sub(sub, frees)
        self._free(frees)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def __repr__(self) -> str:
        return f"<Arena {self.provider!r}: {len(self._subs)} stream(s), {format_size(self._capacity())}>"

    # ----------------------------------------------------------------- private; the lock is held unless noted
    def _capacity(self) -> int:
        return sum(sub.capacity() for sub in list(self._subs.values()))  # for repr only: no lock

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this arena is closed")

    def _check_cap(self, n: int, key: Hashable, cap: int | None) -> None:
        """Lock not held."""
        if cap is not None and n > cap:
            with self._lock:
                sub = self._subs.get(key)
                held = sub.capacity() if sub is not None else 0
            raise WorkspaceCapError(
                f"a workspace of {format_size(n)} on stream {key!r} is above the workspace cap",
                requested=n, held=held, cap=cap,
            )

    def _sub_for(self, key: Hashable, anchor: Any, frees: list) -> _Sub:
        if self._dead:
            self._process_dead(frees)
        sub = self._subs.get(key)
        if sub is None:
            self._sweep_orphans(frees)  # a new stream appeared: a good moment to let go of dead ones
            sub = self._subs[key] = _Sub(key, self._lock)
        if anchor is not None and sub.anchor is None:
            # A dead thread's lane (or per-thread stream) is never used again: sweep it at once.
            eager = isinstance(key, (ThreadLane, PerThreadStream))
            sub.anchor = weakref.finalize(anchor, _anchor_died, weakref.ref(self), key, sub.serial, eager)
            sub.anchor.atexit = False
        sub.orphan = False  # whoever leases on it shows the stream is alive
        return sub

    def _ensure(self, sub: _Sub, n: int, frees: list, cap: int | None) -> _Block:
        """Return ``sub``'s buffer once it holds at least ``n`` bytes, growing it if needed."""
        while True:
            block = sub.block
            if block is not None and block.nbytes >= n:
                return block
            if sub.growing:  # another thread is growing it: wait, then look again
                sub.waiters += 1
                try:
                    sub.cond.wait()
                finally:
                    sub.waiters -= 1
                self._check_open()  # closed meanwhile: do not grow a closed arena only to free it again
                continue
            self._grow(sub, n, frees, cap)

    def _grow(self, sub: _Sub, n: int, frees: list, cap: int | None) -> None:
        """Replace ``sub``'s buffer by one of ``aligned_size(n)`` bytes. Releases the lock while allocating."""
        size = aligned_size(n)
        buffer = failure = None
        try:
            sub.growing = True
            self._lock.release()
            buffer = self.provider.allocate(size, stream=sub.stream)
        except BaseException as exc:  # raised below, once the lock is back and the bookkeeping done
            failure = exc
        interrupted = None
        while True:  # _hold's loop, inline: an interrupt at a function's first instruction would escape unlocked
            try:
                if not self._lock._is_owned():
                    self._lock.acquire()
                break
            except BaseException as exc:
                interrupted = interrupted or exc
        sub.growing = False
        if sub.waiters:
            sub.cond.notify_all()
        if buffer is None and failure is None:
            failure = TypeError(f"{self.provider!r}.allocate returned None for a request of {size} bytes")
        if buffer is not None:
            if buffer.nbytes < size:
                frees.append((_Block(buffer), self._free_stream(sub)))
                failure = RuntimeError(f"{self.provider!r} returned {buffer!r} for a request of {size} bytes")
            else:
                self._install(sub, buffer, frees)
        if interrupted is not None:
            raise interrupted
        if isinstance(failure, MemoryError):
            raise ArenaOutOfMemoryError(
                f"could not grow the workspace of stream {sub.key!r} to {format_size(size)}",
                requested=n, held=sub.capacity(), cap=cap,
            ) from failure
        if failure is not None:
            raise failure

    def _install(self, sub: _Sub, buffer: Any, frees: list) -> None:
        old = sub.block
        sub.block = _Block(buffer)
        sub.allocations += 1
        self._allocations += 1
        if old is not None:
            sub.growths += 1
            self._growths += 1
            self._retire(sub, old, frees)

    def _retire(self, sub: _Sub, block: _Block, frees: list, gone: bool = False) -> None:
        """``block`` is no longer ``sub``'s buffer: free it now if no lease uses it, else when the last one ends."""
        if block.live == 0:
            block.freed = True
            self._frees += 1
            frees.append((block, None if gone else self._free_stream(sub)))
        else:
            sub.retired.append(block)

    @staticmethod
    def _free_stream(sub: _Sub) -> Any:
        """The stream to free ``sub``'s buffers on: its own, unless that is another thread's per-thread stream.

        Handle 2 means the *calling* thread's per-thread stream, so freeing on it from another thread (trim,
        close) would not be ordered after the owner's work: that thread passes ``None`` (the stream may be gone
        for all it knows; the provider waits for the device or relies on its pool's own ordering).
        """
        stream = sub.stream
        if stream is not sub.key and not _is_own(sub.key):
            return None
        return stream

    def _release_sub(self, sub: _Sub, frees: list, gone: bool = False) -> None:
        """Forget an idle sub-arena and free its buffer (``gone``: its stream may no longer exist)."""
        if self._subs.get(sub.key) is sub:
            del self._subs[sub.key]
        if sub.anchor is not None:
            sub.anchor.detach()
            sub.anchor = None
        block, sub.block = sub.block, None
        if block is not None:
            self._retire(sub, block, frees, gone)

    def _drop_if_idle(self, sub: _Sub, frees: list) -> None:
        """Forget ``sub`` if no one uses it and it holds nothing or the arena is closed (then free its buffer).

        Every path that leaves a sub-arena without a lease calls this; close() skipped it while it was busy."""
        if sub.idle() and (sub.block is None or self._closed) and self._subs.get(sub.key) is sub:
            self._release_sub(sub, frees)

    def _process_dead(self, frees: list) -> None:
        while self._dead:
            key, serial, eager = self._dead.popleft()
            sub = self._subs.get(key)
            if sub is None or sub.serial != serial:
                continue  # already gone, or a newer sub-arena for the same key
            sub.anchor = None
            sub.orphan = True
            if eager and sub.idle():
                self._release_sub(sub, frees, gone=True)

    def _sweep_orphans(self, frees: list) -> None:
        for sub in list(self._subs.values()):
            if sub.orphan and sub.idle():
                self._release_sub(sub, frees, gone=True)

    def _leave(self, sub: _Sub) -> None:
        sub.owner = None
        if sub.waiters:
            sub.cond.notify_all()

    def _check_overlap(self, key: Hashable, ptr: int, n: int) -> None:
        end = ptr + n
        for other, start, stop in self._debug_live.values():
            if other != key and start < end and ptr < stop:
                raise AssertionError(
                    f"wsarena debug: a lease of [{ptr:#x}, {end:#x}) on stream {key!r} overlaps the live lease "
                    f"[{start:#x}, {stop:#x}) on stream {other!r}"
                )

    def _acquire(self, ws: Workspace) -> None:
        """Take the lease ``ws`` (lock not held on entry). The fast path is inlined; the rest is in helpers."""
        n = ws.nbytes
        key = ws.stream
        frees: list[tuple[_Block, Any]] = []
        try:
            with self._lock:
                if self._closed:
                    raise RuntimeError("this arena is closed")
                sub = self._subs.get(key)
                if sub is None or self._dead or (ws._anchor is not None and sub.anchor is None):
                    sub = self._sub_for(key, ws._anchor, frees)
                else:
                    sub.orphan = False
                me = _get_ident()
                owner = sub.owner
                if owner is None:
                    sub.owner = me
                elif owner != me:
                    self._wait_for_owner(sub, me, frees)
                else:
                    raise self._nested_error(key)
                block = sub.block
                if block is None or block.nbytes < n or ws._debug:
                    try:
                        block = self._acquire_slow(ws, sub, frees)
                    except BaseException:  # (an interrupt at its first instruction included) leave sub as it was
                        if sub.owner == me:
                            self._leave(sub)
                            self._drop_if_idle(sub, frees)
                        raise
                block.live += 1
                sub.live += 1
                self._live += 1
                if n > sub.high_water:
                    sub.high_water = n
                    if n > self._high_water:
                        self._high_water = n
                ws._block = block
                ws._sub = sub
                ws.ptr = block.ptr
                ws._state = 1  # with the bookkeeping: Workspace.__enter__ reads it after an interrupt
        finally:
            if frees:  # what a sweep or a growth released, even if this lease failed
                self._free(frees)

    def _nested_error(self, key: Hashable) -> RuntimeError:
        """This thread leases again on a lane / stream it holds (nothing was changed)."""
        if self._lanes:
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

    def _wait_for_owner(self, sub: _Sub, me: int, frees: list) -> None:
        """Another thread holds this lane / stream: wait until it lets go, then take it."""
        sub.waiters += 1
        try:
            while sub.owner is not None:
                sub.cond.wait()
        finally:
            sub.waiters -= 1
        if self._closed:
            if sub.waiters:
                sub.cond.notify_all()
            self._drop_if_idle(sub, frees)
            raise RuntimeError("this arena is closed")
        sub.owner = me

    def _acquire_slow(self, ws: Workspace, sub: _Sub, frees: list) -> _Block:
        """Grow ``sub`` if needed and run the debug checks (on failure the caller leaves ``sub``)."""
        block = self._ensure(sub, ws.nbytes, frees, ws._cap)
        self._check_open()  # close() may have run while the lock was released to allocate
        if ws._debug:
            self._check_overlap(ws.stream, block.ptr, ws.nbytes)
            self._debug_live[id(ws)] = (ws.stream, block.ptr, block.ptr + ws.nbytes)
        return block

    def _release(self, ws: Workspace) -> None:
        """End the lease ``ws`` (lock not held on entry)."""
        if ws._debug:
            try:
                block = ws._block
                if not block.freed:
                    # Poison while this thread still holds the lane, so the next user never sees it half written.
                    self.provider.fill(block.buffer, POISON_BYTE, ws.nbytes, stream=ws._sub.stream)
            except BaseException:
                self._unlease(ws)
                raise
        self._unlease(ws)

    def _unlease(self, ws: Workspace) -> None:
        block, sub = ws._block, ws._sub
        frees: list[tuple[_Block, Any]] = []
        # An interrupt here would leave the lease taken for good (its `with` block is over): finish, then raise it.
        interrupted = None
        try:
            interrupted = _hold(self._lock)
            ws._state = 2  # with the bookkeeping: Workspace.__exit__ retries until it reads this
            block.live -= 1
            sub.live -= 1
            self._live -= 1
            sub.owner = None
            if sub.waiters:
                sub.cond.notify_all()
            if block is not sub.block or sub.orphan or self._closed or ws._debug:
                self._debug_live.pop(id(ws), None)
                if block.live == 0 and block is not sub.block and not block.freed:
                    sub.retired.remove(block)
                    self._retire(sub, block, frees)
                if (sub.orphan or self._closed) and sub.idle() and self._subs.get(sub.key) is sub:
                    self._release_sub(sub, frees, gone=sub.orphan)
        finally:
            try:
                self._lock.release()
            except RuntimeError:  # an interrupt came before the lock was taken: nothing to release
                pass
        if frees:
            self._free(frees)
        if interrupted is not None:
            raise interrupted

    def _free(self, frees: list) -> None:
        """Lock not held."""
        if frees:
            _free_now(self.provider, frees)

    def _shutdown(self) -> None:
        """At interpreter exit: free every buffer, even under live leases; later releases do nothing."""
        if not self._lock.acquire(timeout=1.0):
            return
        frees = []
        try:
            self._closed = True
            for sub in list(self._subs.values()):
                if sub.anchor is not None:
                    sub.anchor.detach()
                    sub.anchor = None
                for block in [sub.block, *sub.retired]:
                    if block is not None and not block.freed:
                        block.freed = True
                        self._frees += 1
                        frees.append((block, None))
                sub.block = None
                sub.retired = []
            self._subs.clear()
        finally:
            self._lock.release()
        self._finalizer.detach()
        _free_now(self.provider, frees, quiet=True)
