"""What ``stream=`` means, for the arena and for the cuDNN backend: one resolution, :func:`resolve_stream`.

A device arena keys its sub-arenas by the raw ``cudaStream_t`` handle (an int). It accepts:

- ``None``: the calling thread's current stream (CuPy's current stream for this thread, which is the
  per-thread default stream when CuPy runs with ``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``);
- a raw handle, a non-negative ``int`` (``0`` is the legacy null stream, ``2`` the per-thread default);
- anything with ``__cuda_stream__()`` returning ``(version, handle)`` (CuPy and cuda.core streams, ...);
- an object with an int ``.ptr`` (older CuPy streams) or ``.cuda_stream`` (PyTorch streams).

One handle names a different stream in each host thread: ``2``, ``cudaStreamPerThread`` (CuPy's
``Stream.ptds``). Keyed by the bare int, two threads would share one sub-arena, hence the same bytes, while
their per-thread streams run concurrently. So on a device arena handle 2, however it is given (the int, a
stream object whose handle is 2, or ``None`` while the current stream is the per-thread default), becomes the
calling thread's :class:`PerThreadStream`: a key of its own, equal only to itself, whose ``handle`` is 2 and
whose sub-arena is swept when the thread exits. The legacy null stream ``0`` (and ``1``, ``cudaStreamLegacy``)
is one stream for every thread and stays one plain key. :func:`stream_handle` always returns the plain int.

A host arena keys its sub-arenas by *lane*: ``None`` is the calling thread's own lane (a :class:`ThreadLane`,
swept when the thread exits) and any other hashable object is a lane key chosen by the caller. A key object that
can be weakly referenced is its own anchor: the table holds it weakly and its lane goes when it dies. A key that
is not equal to itself (``float("nan")``) would make a new lane on every call: it is a ``ValueError``.

Anything else raises ``TypeError`` naming the value.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

from .._lru import LRU
from .._sizes import short_repr

__all__ = [
    "PER_THREAD_DEFAULT_STREAM", "PerThreadStream", "ThreadLane", "core_stream", "cupy_stream", "raw_handle",
    "resolve_stream", "stream_handle", "stream_to_enter", "thread_lane",
]

PER_THREAD_DEFAULT_STREAM = 2  # cudaStreamPerThread: a different stream in each host thread


class ThreadLane:
    """The default CPU lane of one thread: a hashable key that compares by identity.

    The arena sweeps the sub-arena of a thread's lane when the thread exits.
    """

    __slots__ = ("__weakref__", "serial", "thread_name")

    def __init__(self, serial: int, thread_name: str) -> None:
        self.serial = serial
        self.thread_name = thread_name

    def __repr__(self) -> str:
        return f"ThreadLane({self.serial}, {self.thread_name!r})"


class PerThreadStream:
    """Handle 2 (``cudaStreamPerThread``) as seen from one thread: a device arena's key for that stream.

    Equal only to itself (one per thread, made with its lane), so each thread gets its own sub-arena and bytes.
    ``handle`` is 2, which is what providers and CUDA calls receive: it means the *calling* thread's per-thread
    stream. It speaks the stream protocol, so passed back as ``stream=`` it names handle 2 again, in whichever
    thread passes it. A pickle of it is the plain handle 2 (a lane is local to a process).
    """

    __slots__ = ("lane",)
    handle = PER_THREAD_DEFAULT_STREAM

    def __init__(self, lane: ThreadLane) -> None:
        self.lane = lane

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, PER_THREAD_DEFAULT_STREAM)

    def __repr__(self) -> str:
        return f"PerThreadStream({self.lane!r})"

    def __copy__(self) -> PerThreadStream:
        return self

    def __deepcopy__(self, memo: Any) -> PerThreadStream:
        return self

    def __reduce__(self) -> Any:
        return (int, (PER_THREAD_DEFAULT_STREAM,))


class _LaneHolder:
    """Lives in the thread's local storage; it dies when the thread exits, which is what sweeps the lane (and
    the sub-arena of the thread's per-thread default stream)."""

    __slots__ = ("__weakref__", "lane", "ptds")

    def __init__(self, lane: ThreadLane) -> None:
        self.lane = lane
        self.ptds = PerThreadStream(lane)


_serials = itertools.count(1)
_local = threading.local()


def _holder() -> _LaneHolder:
    holder: _LaneHolder | None = getattr(_local, "holder", None)
    if holder is None:
        holder = _local.holder = _LaneHolder(ThreadLane(next(_serials), threading.current_thread().name))
    return holder


def thread_lane() -> ThreadLane:
    """The calling thread's default CPU lane (what ``stream=None`` means on the host arena)."""
    return _holder().lane


def raw_handle(key: Hashable) -> Hashable:
    """The raw handle a sub-arena key stands for: a :class:`PerThreadStream`'s handle (2), else the key itself."""
    return key.handle if type(key) is PerThreadStream else key


def own_per_thread_stream() -> PerThreadStream | None:
    """The calling thread's :class:`PerThreadStream`, or ``None`` if it has none yet (none is made here)."""
    holder: _LaneHolder | None = getattr(_local, "holder", None)
    return holder.ptds if holder is not None else None


def is_own_stream(key: Hashable) -> bool:
    """Whether the raw handle of ``key`` means the same stream in the calling thread as in the key's own thread:
    always, except for another thread's :class:`PerThreadStream`."""
    return type(key) is not PerThreadStream or key is own_per_thread_stream()


def _handle_of(stream: Any) -> int | None:
    """The raw handle of a stream object, or ``None`` if ``stream`` is not one."""
    proto = getattr(type(stream), "__cuda_stream__", None)
    if proto is not None:
        try:
            _version, handle = proto(stream)
        except (TypeError, ValueError):
            raise TypeError(f"stream={short_repr(stream)}: __cuda_stream__() must return a (version, handle) "
                            "pair") from None
        return _check_handle(stream, handle)
    for attr in ("ptr", "cuda_stream"):  # CuPy streams, PyTorch streams
        handle = getattr(stream, attr, None)
        if isinstance(handle, int) and not isinstance(handle, bool):
            return _check_handle(stream, handle)
    return None


def _check_handle(stream: Any, handle: Any) -> int:
    """``handle`` as a plain non-negative ``int``."""
    if type(handle) is not int:
        try:
            handle = int(handle)  # cuda.core hands out handle objects that convert with int()
        except (TypeError, ValueError):
            raise TypeError(f"stream={short_repr(stream)}: its handle {short_repr(handle)} is not an integer") from None
    if handle < 0:
        raise ValueError(f"stream={short_repr(stream)}: a stream handle cannot be negative ({short_repr(handle)})")
    return int(handle)


def _anchor_of(stream: Any) -> Any:
    """``stream`` if it can be weakly referenced (its death sweeps the sub-arena), else ``None``."""
    try:
        weakref.ref(stream)
    except TypeError:
        return None
    return stream


def resolve_stream(
    stream: Any, *, lanes: bool, current: Callable[[], Any] | None = None
) -> tuple[Hashable, Any]:
    """Normalise ``stream`` to ``(key, anchor)``.

    Parameters
    ----------
    stream
        What the caller passed as ``stream=``.
    lanes : bool
        ``True`` on a host arena (any hashable is a lane key), ``False`` on a device arena.
    current : callable, optional
        Device arenas: returns the calling thread's current stream (an object or a raw handle), used for
        ``None``.

    Returns
    -------
    key : hashable
        The sub-arena key: the raw ``int`` handle on a device arena (for handle 2, the calling thread's
        :class:`PerThreadStream`), the lane on a host arena.
    anchor : object or None
        An object whose death means the stream (or the thread of a default lane or per-thread stream) is gone,
        or ``None`` when that cannot be known (raw ints, lane keys that cannot be weakly referenced). A lane key
        object is its own anchor.
    """
    kind = type(stream)
    # The common cases first: this runs once per convolution call.
    if kind is int and (lanes or (stream >= 0 and stream != PER_THREAD_DEFAULT_STREAM)):
        return stream, None
    if lanes:
        if stream is None:
            holder = _holder()
            return holder.lane, holder
        if kind is str:
            return stream, None
        try:
            hash(stream)
        except TypeError:
            raise TypeError(f"stream={short_repr(stream)} is not a lane key: a CPU lane key must be hashable") from None
        if not stream == stream:  # noqa: PLR0124 - NaN and the like
            raise ValueError(
                f"stream={short_repr(stream)} is not a lane key: it is not equal to itself, so every call would make a "
                "new lane"
            )
        if kind.__weakrefoffset__ and kind is not ThreadLane:  # a key object: its lane goes when it does
            return stream, stream
        return stream, None
    handle, anchor = _device_handle(stream, current)
    if handle == PER_THREAD_DEFAULT_STREAM:  # a different stream in each thread: key it by the thread
        holder = _holder()
        return holder.ptds, holder
    return handle, anchor


def _device_handle(stream: Any, current: Callable[[], Any] | None) -> tuple[int, Any]:
    """The plain ``int`` handle of a device ``stream=`` argument, and the anchor of a stream object."""
    given = stream
    if stream is None:
        if current is None:
            raise TypeError("stream=None needs the current stream, and this arena's provider has none")
        stream = current()
    if isinstance(stream, int) and not isinstance(stream, bool):
        return _check_handle(stream, stream), None
    handle = _handle_of(stream)
    if handle is None:
        shown = short_repr(stream)
        what = f"stream={shown}" if given is not None else f"stream=None: the provider's current stream, {shown},"
        raise TypeError(
            f"{what} is not a CUDA stream: expected None, a raw cudaStream_t int, a CuPy stream or an object with "
            "__cuda_stream__()"
        )
    return handle, _anchor_of(stream)


def _cupy_current() -> Any:
    import cupy

    return cupy.cuda.get_current_stream()


def stream_handle(stream: Any = None) -> int:
    """The raw ``cudaStream_t`` handle (an ``int``) for a ``stream=`` argument, for calls such as cudnnSetStream.

    ``None`` is CuPy's current stream for the calling thread (this imports CuPy). Always a plain ``int``: the
    per-thread default stream is ``2`` here, not an arena's :class:`PerThreadStream` key. Raises ``TypeError``
    for anything that is not a stream and ``ValueError`` for a negative handle.
    """
    return _device_handle(stream, _cupy_current)[0]


def cupy_stream(handle: int) -> Any:
    """CuPy's stream object for a raw ``cudaStream_t``, which it does not own.

    The null and per-thread default streams are CuPy's own objects; any other handle gets a new CuPy object each call,
    over cuda.core's object for the handle (:func:`core_stream`), through the stream protocol. CuPy ties it to no
    device (its ``device_id`` is -1: the device current where it is entered).

    New, because CuPy's stream-ordered allocator (``MemoryAsyncPool``) frees an array on the stream object current
    when it was allocated while that object lives, else on the stream current when it is freed: an object kept from
    call to call would outlive the call's stream, and an array made in the call would be freed on a handle its owner
    may have destroyed. One made for a call dies with it: what the call frees inside it goes on the call's stream,
    and what it returns on the stream current when it is freed, as for any stream object its owner dropped.
    """
    import cupy

    if handle == 0:
        return cupy.cuda.Stream.null
    if handle == PER_THREAD_DEFAULT_STREAM:
        return cupy.cuda.Stream.ptds
    return cupy.cuda.Stream.from_external(core_stream(handle))


def stream_to_enter(cuda: Any, stream: Any, ordinal: int) -> Any:
    """The CuPy stream to enter on CUDA device ``ordinal`` for ``stream`` (a ``stream=`` argument, not ``None``), in
    the cuDNN backend's scope and wsarena._interop's, whose ``cupy.cuda`` is ``cuda``: ``None`` where it is CuPy's
    current stream there already (the caller's ``with stream:``, or wsarena._interop's around the ops on the operands
    of another library), which entering would ask the current device up to three times; a CuPy stream as it is
    given; else a CuPy object of the call's own, which dies with it (:func:`cupy_stream` says why), a raw handle
    checked first (a negative one is refused)."""
    own = isinstance(stream, cuda.Stream)
    raw = type(stream) is int
    handle = stream.ptr if own else stream if raw else stream_handle(stream)
    if handle == cuda.get_current_stream(ordinal).ptr:
        return None
    return stream if own else cupy_stream(stream_handle(stream) if raw else handle)


def _from_handle(handle: int) -> Any:
    from cuda.core import Stream

    return Stream.from_handle(handle)


KEPT_STREAMS = 16  # cuda.core's objects core_stream keeps, by handle: a program's side streams, used in turn
_kept: LRU[Any] = LRU(KEPT_STREAMS)


def core_stream(handle: int) -> Any:
    """cuda.core's ``Stream.from_handle(handle)``, kept by handle for the next calls (the :data:`KEPT_STREAMS` used
    last).

    It makes a class a call, 5 to 9 us (bench/RESULTS.md), where CuPy's ``Stream.from_external`` over it takes some
    0.4 us. It holds nothing but the handle, which it does not own, and CuPy asks it for nothing else
    (``__cuda_stream__``), so the same handle makes an equal one, even where the stream was destroyed and CUDA gave
    its handle to another, on any device. It is never a current stream, so no array refers to it.
    """
    made = _kept.lookup(handle)  # a hit, every call's case, makes no closure
    return made if made is not None else _kept.get(handle, lambda: _from_handle(handle))


def forget_kept_stream() -> None:
    """Drop the stream objects :func:`core_stream` keeps (the tests' fresh process)."""
    _kept.clear()
