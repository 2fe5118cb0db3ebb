"""Memory providers: where an arena's buffers come from.

Every provider implements the small :class:`MemoryProvider` protocol. The arena calls ``allocate`` when a
sub-arena grows and ``free`` when a buffer is outgrown, trimmed or swept, always with the sub-arena's stream
(``stream=None`` on ``free`` means that stream may no longer exist). Providers never see leases; the arena
decides when a buffer is no longer used.

========================  ======================================================================
:class:`HostProvider`     NumPy ``uint8`` arrays, for the CPU backend and for tests.
:class:`CupyProvider`     device memory through ``cupy.cuda.alloc`` under the sub-arena's stream, so it
                          comes from (and goes back to) whatever allocator the user set for CuPy,
                          by default CuPy's stream-aware memory pool.
:class:`AsyncProvider`    stream-ordered ``cudaMallocAsync`` / ``cudaFreeAsync`` through cuda-bindings.
========================  ======================================================================

A provider signals "out of memory" by raising ``MemoryError`` (or a subclass); the arena turns that into
:class:`~wsarena.errors.ArenaOutOfMemoryError`. Any other exception passes through unchanged. CuPy and
cuda-bindings are imported only when a device provider is created.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["AsyncProvider", "Buffer", "CupyProvider", "HostProvider", "MemoryProvider"]


class Buffer:
    """One allocation: its address, its size and the object that owns the memory.

    Attributes
    ----------
    ptr : int
        Address of the first byte (host or device).
    nbytes : int
        Size in bytes.
    handle : object
        What keeps the memory alive (a NumPy array, a CuPy ``MemoryPointer``, or ``None`` for raw pointers);
        set to ``None`` by the provider's ``free``.
    """

    __slots__ = ("ptr", "nbytes", "handle")

    def __init__(self, ptr: int, nbytes: int, handle: Any = None) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.handle = handle

    def __repr__(self) -> str:
        return f"Buffer(ptr={self.ptr:#x}, nbytes={self.nbytes})"


@runtime_checkable
class MemoryProvider(Protocol):
    """What an :class:`~wsarena.arena.Arena` needs from its memory.

    Attributes
    ----------
    kind : str
        ``"host"``: sub-arenas are CPU lanes (any hashable key). ``"device"``: sub-arenas are CUDA streams
        (raw handles; the per-thread default stream, handle 2, is one sub-arena per thread). Either way a lease
        excludes other threads from its lane or stream and may not nest.
    device : int or None
        CUDA device ordinal, ``None`` for host memory.
    """

    kind: str
    device: int | None

    def allocate(self, nbytes: int, *, stream: Any) -> Buffer:
        """Return a new buffer of exactly ``nbytes`` (> 0) usable in stream order on ``stream``."""

    def free(self, buffer: Buffer, *, stream: Any) -> None:
        """Release ``buffer`` after the work already enqueued on ``stream``; ``None``: the stream may be gone."""

    def as_array(self, buffer: Buffer, nbytes: int) -> Any:
        """A 1-D ``uint8`` array over the first ``nbytes`` of ``buffer`` (NumPy on the host, CuPy on a device)."""

    def fill(self, buffer: Buffer, value: int, nbytes: int, *, stream: Any) -> None:
        """Set the first ``nbytes`` of ``buffer`` to the byte ``value``, in stream order (debug poisoning)."""


class HostProvider:
    """Host memory from NumPy (``numpy.empty(n, uint8)``); the CPU backend's provider.

    ``free`` drops the arena's reference; NumPy returns the memory once no view of it remains.
    """

    kind = "host"
    device = None

    def allocate(self, nbytes: int, *, stream: Any = None) -> Buffer:
        try:
            array = np.empty(nbytes, dtype=np.uint8)
        except ValueError as exc:  # NumPy's "maximum allowed dimension exceeded": no host has it either
            raise MemoryError(f"{nbytes} bytes cannot be allocated on the host") from exc
        return Buffer(array.__array_interface__["data"][0], nbytes, array)

    def free(self, buffer: Buffer, *, stream: Any = None) -> None:
        buffer.handle = None

    def as_array(self, buffer: Buffer | None, nbytes: int) -> np.ndarray:
        if buffer is None or nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        return buffer.handle[:nbytes]

    def fill(self, buffer: Buffer, value: int, nbytes: int, *, stream: Any = None) -> None:
        buffer.handle[:nbytes] = value

    def __repr__(self) -> str:
        return "HostProvider()"


_CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation


def _current_device() -> int:
    import cupy

    return int(cupy.cuda.runtime.getDevice())


class _Handle:
    """A raw stream handle dressed in the stream protocol, so CuPy can wrap it."""

    __slots__ = ("handle",)

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


class _DeviceProvider:
    """What the two device providers share: the device, CuPy arrays over the buffers, the current stream."""

    kind = "device"

    def __init__(self, device: int | None = None) -> None:
        import cupy  # noqa: F401 - fail here, with CuPy's own error, rather than in the middle of a lease

        self.device = _current_device() if device is None else int(device)

    def current_stream(self) -> Any:
        """CuPy's current stream for the calling thread on this provider's device."""
        import cupy

        return cupy.cuda.get_current_stream(self.device)

    def _cupy_stream(self, handle: int) -> Any:
        import cupy

        if handle == 0:
            return cupy.cuda.Stream.null
        return cupy.cuda.Stream.from_external(_Handle(handle))

    def _memptr(self, buffer: Buffer) -> Any:
        import cupy

        mem = cupy.cuda.UnownedMemory(buffer.ptr, buffer.nbytes, buffer, self.device)
        return cupy.cuda.MemoryPointer(mem, 0)

    def as_array(self, buffer: Buffer | None, nbytes: int) -> Any:
        import cupy

        with cupy.cuda.Device(self.device):
            if buffer is None or nbytes == 0:
                return cupy.empty(0, dtype=cupy.uint8)
            return cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=self._memptr(buffer))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device})"


class CupyProvider(_DeviceProvider):
    """Device memory from ``cupy.cuda.alloc``, allocated under the sub-arena's stream.

    The memory comes from CuPy's current allocator, by default its stream-aware ``MemoryPool``, so the arena
    shares the pool with the user's arrays instead of fragmenting the device beside it. The pool files a block
    under the stream it was allocated on and hands it out again only to that stream, which is what makes
    ``free`` stream-ordered; an allocator that calls ``cudaFree`` directly synchronises instead.

    Parameters
    ----------
    device : int, optional
        CUDA device ordinal; the current device by default.
    """

    def allocate(self, nbytes: int, *, stream: int) -> Buffer:
        import cupy

        try:
            with cupy.cuda.Device(self.device), self._cupy_stream(stream):
                memptr = cupy.cuda.alloc(nbytes)  # the pools' OutOfMemoryError is a MemoryError
        except cupy.cuda.runtime.CUDARuntimeError as exc:  # no pool (set_allocator(None)): cudaMalloc's own error
            if exc.status != _CUDA_ERROR_MEMORY_ALLOCATION:
                raise
            raise MemoryError(f"cudaMalloc of {nbytes} bytes failed on device {self.device}: {exc}") from exc
        except OverflowError as exc:  # beyond size_t: no device has it
            raise MemoryError(f"{nbytes} bytes cannot be allocated on device {self.device}") from exc
        return Buffer(int(memptr.ptr), nbytes, memptr)

    def free(self, buffer: Buffer, *, stream: int | None) -> None:
        import cupy

        if stream is None and isinstance(getattr(buffer.handle, "mem", None), cupy.cuda.memory.MemoryAsync):
            # The stream may be gone or belong to another thread. The default pool files the block under the
            # stream it was allocated on either way, but memory from MemoryAsyncPool is freed with cudaFreeAsync
            # on this thread's current stream, maybe before the owner's work ends: wait for the device first.
            with cupy.cuda.Device(self.device):
                cupy.cuda.runtime.deviceSynchronize()
        buffer.handle = None  # back to the pool, under the stream it was allocated on

    def as_array(self, buffer: Buffer | None, nbytes: int) -> Any:
        import cupy

        if buffer is None or nbytes == 0:
            return super().as_array(None, 0)
        with cupy.cuda.Device(self.device):
            return cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=buffer.handle)

    def fill(self, buffer: Buffer, value: int, nbytes: int, *, stream: int) -> None:
        import cupy

        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.memsetAsync(buffer.ptr, value, nbytes, stream)


class AsyncProvider(_DeviceProvider):
    """Stream-ordered device memory: ``cudaMallocAsync`` / ``cudaFreeAsync`` from the device's default pool.

    The free is enqueued on the sub-arena's stream, after the work already there. When the stream may be
    gone (sweeping, shutdown) the device is synchronised and the memory freed with ``cudaFree``. To go through
    CuPy's stream-ordered pool instead, set ``cupy.cuda.set_allocator(cupy.cuda.MemoryAsyncPool().malloc)``
    and use :class:`CupyProvider`.

    Parameters
    ----------
    device : int, optional
        CUDA device ordinal; the current device by default.
    """

    def __init__(self, device: int | None = None) -> None:
        super().__init__(device)
        from cuda.bindings import runtime

        self._rt = runtime

    def _check(self, result: Any, what: str) -> Any:
        err, *values = result if isinstance(result, tuple) else (result,)
        rt = self._rt
        if err != rt.cudaError_t.cudaSuccess:
            # The runtime also keeps the error as its "last error": clear it, or another library's next launch
            # check (PyTorch's calls cudaGetLastError) would report this failure as its own.
            rt.cudaGetLastError()
            if err == rt.cudaError_t.cudaErrorMemoryAllocation:
                raise MemoryError(f"{what}: cudaErrorMemoryAllocation on device {self.device}")
            raise RuntimeError(f"{what} failed on device {self.device}: {err.name}")
        return values[0] if values else None

    def _on_device(self) -> int:
        rt = self._rt
        previous = self._check(rt.cudaGetDevice(), "cudaGetDevice")
        if previous != self.device:
            self._check(rt.cudaSetDevice(self.device), "cudaSetDevice")
        return previous

    def allocate(self, nbytes: int, *, stream: int) -> Buffer:
        rt = self._rt
        previous = self._on_device()
        try:
            ptr = self._check(rt.cudaMallocAsync(nbytes, stream), "cudaMallocAsync")
        finally:
            if previous != self.device:
                rt.cudaSetDevice(previous)
        return Buffer(int(ptr), nbytes, None)

    def free(self, buffer: Buffer, *, stream: int | None) -> None:
        rt = self._rt
        previous = self._on_device()
        try:
            if stream is None:
                self._check(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
                self._check(rt.cudaFree(buffer.ptr), "cudaFree")
            else:
                self._check(rt.cudaFreeAsync(buffer.ptr, stream), "cudaFreeAsync")
        finally:
            if previous != self.device:
                rt.cudaSetDevice(previous)

    def fill(self, buffer: Buffer, value: int, nbytes: int, *, stream: int) -> None:
        rt = self._rt
        previous = self._on_device()
        try:
            self._check(rt.cudaMemsetAsync(buffer.ptr, value, nbytes, stream), "cudaMemsetAsync")
        finally:
            if previous != self.device:
                rt.cudaSetDevice(previous)
