"""Providers for tests: one that records every call and fails on demand, on host memory.

``RecordingProvider(device_id=0)`` behaves as a device provider (sub-arenas keyed by raw stream handles,
handle 2 per thread) while handing out host memory, so the device rules are tested without a GPU.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

from ._pins import HOST_FN
from .providers import Buffer, HostProvider, missing_method

__all__ = ["FakeGraph", "FakeStream", "RecordingProvider"]

_UPSTREAMS: Any = object()  # device_id=: the upstream's


class FakeGraph:
    """A CUDA graph being captured (or captured) on a :class:`RecordingProvider`'s stream, without CUDA.

    It holds the pins the arena hands it as a CUDA graph holds user objects: ``pins`` lists each one's destructor and
    its argument, not the pin itself, which the arena may drop while the graph lives on. :meth:`close` runs each
    destructor through its C function pointer, as CUDA does when it destroys the graph."""

    _ids = itertools.count(1)

    def __init__(self) -> None:
        self.id = next(self._ids)
        self.pins: list[tuple[int, int]] = []  # (destroy, address) of each pin retained
        self.closed = False

    def retain(self, pin: Any) -> None:
        self.pins.append((pin.destroy, pin.address))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for destroy, address in self.pins:
                HOST_FN(destroy)(address)


class FakeStream:
    """A stream object as CuPy and other libraries hand them out, without CUDA: weakly referenceable, with
    ``__cuda_stream__`` naming the raw ``handle``. The arena watches such an object die (the stream is gone)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


class RecordingProvider:
    """Wraps ``upstream`` (a :class:`HostProvider` by default), records calls, and fails when told to.

    Parameters
    ----------
    upstream : MemoryProvider, optional
        Where the memory really comes from.
    device_id : int or None, optional
        What the arena should treat it as (``None``: host memory, CPU lanes; an int: a device, CUDA streams);
        the upstream's by default.
    fail : callable, optional
        ``fail(nbytes) -> bool``; ``True`` makes that allocation raise ``MemoryError``.

    Attributes
    ----------
    allocations : list of Buffer
        Every buffer handed out, in order.
    frees : list of (Buffer, stream)
        Every deallocation, with the stream it was given.
    fail_next : int
        Make that many of the next allocations fail (counts down).
    current : object
        What ``current_stream()`` returns for a device provider (a raw handle or a stream object).
    capturing : dict
        Stream (raw handle or lane key) to the :class:`FakeGraph` being captured on it: ``capture(stream)``
        returns it, as a device provider returns the CUDA capture under way (:meth:`begin_capture`).
    stream_ids : dict
        Raw handle to the id of the stream it names now: ``stream_id(handle)`` returns it (``None`` for a handle
        not in it: unknown), as a device provider returns ``cudaStreamGetId``'s. A test gives a dead stream's
        handle to a new stream by changing its id here.
    id_reads : list
        Every handle ``stream_id`` was asked about, in order.
    """

    def __init__(
        self, upstream: Any = None, *, device_id: Any = _UPSTREAMS, fail: Callable[[int], bool] | None = None
    ) -> None:
        self.upstream = upstream if upstream is not None else HostProvider()
        self.device_id = self.upstream.device_id if device_id is _UPSTREAMS else device_id
        self.fail = fail
        self.fail_next = 0
        self.current: Any = 0
        self.capturing: dict[Any, FakeGraph] = {}
        self.stream_ids: dict[Any, int] = {}
        self.id_reads: list[Any] = []
        self.allocations: list[Buffer] = []
        self.frees: list[tuple[Buffer, Any]] = []
        self.fills: list[tuple[int, int, int, Any]] = []
        self._held: dict[int, Buffer] = {}
        # Guards the records: arenas call providers from many threads, and a collected arena's finalizer frees through
        # the provider wherever the collector runs, in this lock too (an allocation under it): reentrant
        self._lock = threading.RLock()

    def allocate(self, size: int, *, stream: Any) -> Buffer:
        if size <= 0:
            raise AssertionError(f"the arena asked for {size} bytes")
        with self._lock:
            failing = self.fail_next > 0
            if failing:
                self.fail_next -= 1
        if failing or (self.fail is not None and self.fail(size)):
            raise MemoryError(f"RecordingProvider: refused {size} bytes")
        buffer = self.upstream.allocate(size, stream=stream)
        with self._lock:
            self.allocations.append(buffer)
            self._held[id(buffer)] = buffer
        return buffer

    def deallocate(self, buffer: Buffer, *, stream: Any) -> None:
        with self._lock:
            if self._held.pop(id(buffer), None) is None:
                raise AssertionError(f"{buffer!r} freed twice, or never allocated here")
            self.frees.append((buffer, stream))
        self.upstream.deallocate(buffer, stream=stream)

    def as_array(self, buffer: Buffer | None, nbytes: int) -> Any:
        return self._upstreams("as_array")(buffer, nbytes)

    def fill(self, buffer: Buffer, value: int, nbytes: int, *, stream: Any) -> None:
        fill = self._upstreams("fill")
        with self._lock:
            self.fills.append((buffer.ptr, value, nbytes, stream))
        fill(buffer, value, nbytes, stream=stream)

    def _upstreams(self, name: str) -> Any:
        """The upstream's method ``name``, ``"as_array"`` or ``"fill"``; over a provider of leases alone, which may
        leave them out, the error the arena gives for one (:func:`~wsarena.arena.providers.missing_method`)."""
        method = getattr(self.upstream, name, None)
        if method is None:
            raise missing_method(self.upstream, name)
        return method

    def current_stream(self) -> Any:
        return self.current

    def capture(self, stream: Any) -> FakeGraph | None:
        return self.capturing.get(stream) if self.capturing else None

    def stream_id(self, stream: Any) -> int | None:
        with self._lock:
            self.id_reads.append(stream)
        return self.stream_ids.get(stream)

    def begin_capture(self, *streams: Any) -> FakeGraph:
        """Start capturing ``streams`` (several: a capture forked to them through events) into a new graph."""
        graph = FakeGraph()
        for stream in streams:
            self.capturing[stream] = graph
        return graph

    def end_capture(self, graph: FakeGraph) -> FakeGraph:
        for stream in [s for s, g in self.capturing.items() if g is graph]:
            del self.capturing[stream]
        return graph

    @property
    def held(self) -> list[Buffer]:
        """Buffers allocated and not yet freed."""
        with self._lock:
            return list(self._held.values())

    @property
    def held_bytes(self) -> int:
        return sum(b.size for b in self.held)

    def __repr__(self) -> str:
        return f"RecordingProvider({self.upstream!r}, device_id={self.device_id!r})"
