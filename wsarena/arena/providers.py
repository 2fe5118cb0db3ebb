"""Memory providers: where an arena's buffers come from.

A provider is shaped like cuda.core's ``MemoryResource``: ``allocate(size, *, stream)`` returns a
:class:`Buffer`, ``deallocate(buffer, *, stream)`` gives it back in stream order, and ``device_id`` says whose
memory it is (``None``: the host's, whose sub-arenas are CPU lanes). Two more methods serve the workspace itself:
``as_array`` (the array the cpu backend computes on) and ``fill`` (debug poisoning), which a provider of leases
alone may leave out (:func:`missing_method` says what needs them where called); a device provider also has
``capture(stream)``, the CUDA graph capture under way on a stream (or ``None``), for leases taken during capture,
and ``stream_id(stream)``, CUDA's id of the stream a live handle names (or ``None``: unknown, as for a provider
without the method), which tells a new stream given a dead stream's handle from the dead one. The arena calls
``allocate`` when a sub-arena grows and ``deallocate`` when a buffer is outgrown, trimmed or swept, always with the
sub-arena's stream (``stream=None`` on ``deallocate`` means that stream may no longer exist: a device provider waits
for the device first). Providers never see leases.
Like RAPIDS RMM's adaptors, a provider may wrap an *upstream* one (``wsarena.arena.testing.RecordingProvider``).

========================  ======================================================================
:class:`HostProvider`     NumPy ``uint8`` arrays, for the CPU backend and for tests.
:class:`CupyProvider`     device memory through ``cupy.cuda.alloc`` under the sub-arena's stream, so it
                          comes from (and goes back to) whatever allocator the user set for CuPy,
                          by default CuPy's stream-aware memory pool.
:class:`AsyncProvider`    stream-ordered device memory from a cuda.core memory resource, by default
                          ``DeviceMemoryResource`` (the device's ``cudaMallocAsync`` pool).
:class:`TorchProvider`    device memory from PyTorch's caching allocator on the sub-arena's stream,
                          so that PyTorch's tensors and the workspace share one pool.
========================  ======================================================================

A provider signals "out of memory" by raising ``MemoryError`` (or a subclass); the arena turns that into
:class:`~wsarena.errors.ArenaOutOfMemoryError`. Any other exception passes through unchanged, but for a
``StopIteration``, which becomes a :class:`~wsarena.errors.ProviderError` saying so (a ``RuntimeError``, as it is
out of a generator). CuPy and cuda.core (and PyTorch) are imported only when a device provider is created.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from .._sizes import format_size, short_repr
from ..errors import BackendUnavailableError
from ._capture import capture_of
from ._scopes import _OnDeviceEntered
from .streams import PER_THREAD_DEFAULT_STREAM, cupy_stream

__all__ = ["AsyncProvider", "Buffer", "CupyProvider", "HostProvider", "MemoryProvider", "TorchProvider"]


class Buffer:
    """One allocation: its address, its size and the object that owns the memory.

    Attributes
    ----------
    ptr : int
        Address of the first byte (host or device).
    size : int
        Size in bytes.
    owner : object
        What keeps the memory alive (a NumPy array, a CuPy ``MemoryPointer``, a cuda.core ``Buffer``, or
        ``None`` for raw pointers); set to ``None`` by the provider's ``deallocate``.
    """

    __slots__ = ("owner", "ptr", "size")

    def __init__(self, ptr: int, size: int, owner: Any = None) -> None:
        self.ptr = ptr
        self.size = size
        self.owner = owner

    def __repr__(self) -> str:
        return f"Buffer(ptr={self.ptr:#x}, size={self.size})"


@runtime_checkable
class MemoryProvider(Protocol):
    """What an :class:`~wsarena.arena.Arena` needs from its memory.

    Attributes
    ----------
    device_id : int or None
        The CUDA device ordinal, or ``None`` for host memory. A host arena's sub-arenas are CPU lanes (any
        hashable key); a device arena's are CUDA streams (raw handles; the per-thread default stream, handle 2,
        is one sub-arena per thread). Either way a lease excludes other threads from its lane or stream and may
        not nest.

    Notes
    -----
    The arena calls its provider without holding its own lock, from whichever thread grows a sub-arena or frees a
    buffer (a lease's, a finalizer's): several threads at once, for different streams. A provider must be
    thread-safe, and its ``allocate`` must not ask the arena for the stream it allocates for
    (:class:`~wsarena.errors.ProviderError`; a lease there while a lease grows it is a nested lease, a
    ``RuntimeError``).
    A collected arena's finalizer frees through the provider wherever the garbage collector runs, which may be in
    the middle of the provider's own methods in the same thread: a lock the provider holds while it allocates Python
    objects must be reentrant (``threading.RLock``), as CuPy's pool's is. A device provider that makes another CUDA
    device current (``with cupy.cuda.Device(...)``, PyTorch's device guard) makes the one it found current again before
    it returns: the ops call it with the operands' device current, which they asked once as the call began and take
    to be current until it ends, and restore only where they switched to it.
    """

    device_id: int | None

    def allocate(self, size: int, *, stream: Any) -> Buffer:
        """Return a new :class:`Buffer` (an int ``ptr`` and ``size``) of at least ``size`` (> 0) bytes, usable in
        stream order on ``stream``."""

    def deallocate(self, buffer: Buffer, *, stream: Any) -> None:
        """Release ``buffer`` after the work already enqueued on ``stream``; ``None``: the stream may be gone."""

    def as_array(self, buffer: Buffer | None, nbytes: int) -> Any:
        """A 1-D ``uint8`` array over the first ``nbytes`` of ``buffer`` (NumPy on the host, CuPy on a device): what
        ``ws.array`` gives, which the cpu backend computes on. A provider of leases alone may leave it out."""

    def fill(self, buffer: Buffer, value: int, nbytes: int, *, stream: Any) -> None:
        """Set the first ``nbytes`` of ``buffer`` to the byte ``value``, in stream order (debug poisoning). A provider
        of leases alone may leave it out, if debug mode is not used."""


# What needs each of the methods that a provider of leases alone (device_id, allocate, deallocate) may leave out
_NEEDED_FOR = {
    "as_array": ("ws.array (the array the cpu backend computes on)", "as_array(buffer, nbytes)"),
    "fill": ("debug mode (it poisons released workspace bytes)", "fill(buffer, value, nbytes, *, stream)"),
}


def missing_method(provider: Any, name: str) -> BackendUnavailableError:
    """The error of a call that needs ``provider``'s method ``name``, ``"as_array"`` or ``"fill"``, where it has none:
    :class:`~wsarena.arena.Arena` does not require them, since a provider of leases alone serves ``arena.lease()``
    and the cudnn backend (which computes on ``ws.ptr``). It names the method and what needs it."""
    user, signature = _NEEDED_FOR[name]
    return BackendUnavailableError(
        f"{user} needs the arena's provider to have {signature}, and {type(provider).__name__} has not: a provider "
        "of leases alone serves arena.lease() and the cudnn backend, not this (wsarena.arena.MemoryProvider)"
    )


class HostProvider:
    """Host memory from NumPy (``numpy.empty(n, uint8)``); the CPU backend's provider.

    ``deallocate`` drops the arena's reference; NumPy returns the memory once no view of it remains.
    """

    device_id = None

    def allocate(self, size: int, *, stream: Any = None) -> Buffer:
        try:
            array = np.empty(size, dtype=np.uint8)
        except ValueError as exc:  # NumPy's "maximum allowed dimension exceeded": no host has it either
            raise MemoryError(f"{format_size(size)} cannot be allocated on the host") from exc  # str() refuses it
        return Buffer(array.__array_interface__["data"][0], size, array)

    def deallocate(self, buffer: Buffer, *, stream: Any = None) -> None:
        buffer.owner = None

    def as_array(self, buffer: Buffer | None, nbytes: int) -> np.ndarray:
        if buffer is None or nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        array: np.ndarray = buffer.owner[:nbytes]
        return array

    def fill(self, buffer: Buffer, value: int, nbytes: int, *, stream: Any = None) -> None:
        buffer.owner[:nbytes] = value

    def __repr__(self) -> str:
        return "HostProvider()"


class _DeviceProvider:
    """What the device providers share: the device, CuPy arrays over the buffers, memset for poisoning."""

    def __init__(self, device: int | None = None) -> None:
        import cupy  # fail here, with CuPy's own error, rather than in the middle of a lease

        self.device_id: int = int(cupy.cuda.Device().id) if device is None else int(device)

    def _on_device(self) -> Any:
        """CuPy's ``Device`` of this provider's device, entered for a block whatever is current, so that leaving it
        makes the device found current again, and left as it was where entering it is refused or interrupted (a
        plain ``with`` left CuPy's device stack an entry that the next ``Device``'s exit made current)."""
        import cupy

        return _OnDeviceEntered(cupy.cuda, cupy.cuda.Device(self.device_id), None)

    def current_stream(self) -> Any:
        """CuPy's current stream for the calling thread on this provider's device."""
        import cupy

        return cupy.cuda.get_current_stream(self.device_id)

    def as_array(self, buffer: Buffer | None, nbytes: int) -> Any:
        import cupy

        with self._on_device():
            if buffer is None or nbytes == 0:
                return cupy.empty(0, dtype=cupy.uint8)
            memory = cupy.cuda.UnownedMemory(buffer.ptr, buffer.size, buffer, self.device_id)
            return cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))

    def fill(self, buffer: Buffer, value: int, nbytes: int, *, stream: int) -> None:
        import cupy

        with self._on_device():
            cupy.cuda.runtime.memsetAsync(buffer.ptr, value, nbytes, stream)

    def capture(self, stream: int) -> Any:
        """The CUDA graph capture under way on ``stream``, or ``None`` (:mod:`wsarena.arena._capture`)."""
        return capture_of(stream)

    def stream_id(self, stream: int) -> int | None:
        """CUDA's id of the stream that the live handle ``stream`` names (``cudaStreamGetId``: unique for the life of
        the process, where a handle is given again to the next stream made once its stream is destroyed), or
        ``None`` if CUDA refuses to tell."""
        from cuda.bindings import runtime as rt

        # Never asked of a stream being captured (the arena sees to it): CUDA refuses cudaStreamGetId there
        # (cudaErrorStreamCaptureUnsupported) and the refusal invalidates the capture, in relaxed mode too (seen on an
        # H200 with the CUDA 13.0 driver).
        err, stream_id = rt.cudaStreamGetId(stream)
        return None if int(err) else int(stream_id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device_id})"


_CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation


class CupyProvider(_DeviceProvider):
    """Device memory from ``cupy.cuda.alloc``, allocated under the sub-arena's stream.

    The memory comes from CuPy's current allocator, by default its stream-aware ``MemoryPool``, so the arena
    shares the pool with the user's arrays instead of fragmenting the device beside it. ``deallocate`` drops the
    last reference to a block with the sub-arena's stream current, so that either pool frees it after the work
    enqueued there: the default pool files the block under the stream it was allocated on and hands it out again
    only to that stream; ``MemoryAsyncPool`` frees it with ``cudaFreeAsync`` on the stream object it was allocated
    under while that lives (CuPy's own, for the default streams), else on the current stream, as for any other stream,
    whose object is made for the allocation and dies with it. An allocator that calls ``cudaFree`` directly
    synchronises instead. When the stream may be gone the device is synchronised first.

    Parameters
    ----------
    device : int, optional
        CUDA device ordinal; the current device by default.
    """

    def allocate(self, size: int, *, stream: int) -> Buffer:
        import cupy

        try:
            with self._on_device(), cupy_stream(stream):
                memptr = cupy.cuda.alloc(size)  # the pools' OutOfMemoryError is a MemoryError
        except cupy.cuda.runtime.CUDARuntimeError as exc:  # no pool (set_allocator(None)): cudaMalloc's own error
            if exc.status != _CUDA_ERROR_MEMORY_ALLOCATION:
                raise
            raise MemoryError(f"cudaMalloc of {size} bytes failed on device {self.device_id}: {exc}") from exc
        except OverflowError as exc:  # beyond size_t: no device has it
            raise MemoryError(f"{format_size(size)} cannot be allocated on device {self.device_id}") from exc
        return Buffer(int(memptr.ptr), size, memptr)

    def deallocate(self, buffer: Buffer, *, stream: int | None) -> None:
        import cupy

        with self._on_device():
            if stream is None:
                # The stream may be gone or belong to another thread: wait for the device first. The default pool
                # files the block under the handle it was allocated on, and CUDA gives a destroyed stream's handle to
                # the next stream made, to which the pool would hand the block while the dead stream's work may still
                # use it; MemoryAsyncPool frees on this thread's current stream, unordered with the owner's.
                cupy.cuda.runtime.deviceSynchronize()
                buffer.owner = None
            else:
                with cupy_stream(stream):  # MemoryAsyncPool frees on the current stream
                    buffer.owner = None


class AsyncProvider(_DeviceProvider):
    """Stream-ordered device memory from a cuda.core memory resource (``allocate(size, *, stream)``).

    By default the device's ``DeviceMemoryResource``, cuda.core's pool over ``cudaMallocAsync``: the free is
    enqueued on the sub-arena's stream, after the work already there. When the stream may be gone (sweeping,
    shutdown) the device is synchronised first and the free goes on the legacy default stream.

    Parameters
    ----------
    device : int, optional
        CUDA device ordinal; the current device by default.
    resource : cuda.core.MemoryResource, optional
        Another upstream resource of that device (a ``DeviceMemoryResource`` with options of your own, say).
    """

    def __init__(self, device: int | None = None, resource: Any = None) -> None:
        super().__init__(device)
        if resource is None:
            from cuda.core import DeviceMemoryResource

            resource = DeviceMemoryResource(self.device_id)
        self.resource = resource

    def allocate(self, size: int, *, stream: int) -> Buffer:
        with self._on_device():
            try:
                owner = self.resource.allocate(size, stream=_core_stream(stream))
            except Exception as exc:
                if "OUT_OF_MEMORY" in str(exc):  # cuda.core's CUDAError names the driver's CUresult
                    raise MemoryError(f"{short_repr(self.resource)} could not allocate {size} bytes: {exc}") from exc
                raise
        return Buffer(int(owner.handle), size, owner)

    def deallocate(self, buffer: Buffer, *, stream: int | None) -> None:
        import cupy

        if buffer.owner is None:  # freed already
            return
        with self._on_device():
            if stream is None:
                cupy.cuda.runtime.deviceSynchronize()
                stream = 0
            on = _core_stream(stream)
            # Taken off the buffer only now, as TorchProvider's pointer is: one that failed or was interrupted before
            # leaves the buffer holding its block for a later deallocate, where cuda.core's collection of the owner
            # freed it unsynchronised, on the stream it was allocated on, which may be gone, and a later deallocate
            # then called close() on None
            owner, buffer.owner = buffer.owner, None
            owner.close(on)


class TorchProvider(_DeviceProvider):
    """Device memory from PyTorch's caching allocator (``torch.cuda.caching_allocator_alloc``) on the sub-arena's
    stream.

    PyTorch files a block under the stream it was allocated on and hands it out again only to that stream, so
    ``caching_allocator_delete`` is stream-ordered, as CuPy's pool is. The arena's buffers count in
    ``torch.cuda.memory_allocated()`` and are given back to PyTorch's pool, not to the device, when freed.
    When the stream may be gone the device is synchronised first. Each is done within CuPy's ``Device``, which sets
    the device it found current again as it leaves: PyTorch's device guard may restore a device that has no CUDA
    context yet only in its own records, leaving CUDA's current device the allocator's (the provider protocol's
    notes say why the ops need it back).

    Parameters
    ----------
    device : int, optional
        CUDA device ordinal; the current device by default.
    """

    def allocate(self, size: int, *, stream: int) -> Buffer:
        import torch

        try:
            with self._on_device():
                ptr = torch.cuda.caching_allocator_alloc(size, device=self.device_id, stream=int(stream))
        except torch.cuda.OutOfMemoryError as exc:  # a RuntimeError; the arena wants a MemoryError
            raise MemoryError(f"PyTorch's caching allocator could not allocate {size} bytes: {exc}") from exc
        return Buffer(int(ptr), size, int(ptr))

    def deallocate(self, buffer: Buffer, *, stream: int | None) -> None:
        import torch

        if buffer.owner is None:  # freed already
            return
        with self._on_device():
            if stream is None:
                torch.cuda.synchronize(self.device_id)
            # Taken off the buffer only now, in one statement before the free: one that failed or was interrupted
            # before it leaves the buffer holding its block for a later deallocate (a bare pointer, which nothing
            # frees as it is collected), and one after it finds nothing to free twice
            ptr, buffer.owner = buffer.owner, None
            if ptr is not None:
                torch.cuda.caching_allocator_delete(ptr)


def _core_stream(handle: int) -> Any:
    """cuda.core's stream object for a raw handle (memory resources take stream objects)."""
    from cuda.core import LEGACY_DEFAULT_STREAM, Stream
    from cuda.core import PER_THREAD_DEFAULT_STREAM as CORE_PTDS

    if handle == 0:
        return LEGACY_DEFAULT_STREAM
    if handle == PER_THREAD_DEFAULT_STREAM:
        return CORE_PTDS
    return Stream.from_handle(handle)
