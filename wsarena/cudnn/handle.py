"""cuDNN handles, one per (device, host thread), created on first use.

A ``cudnnHandle_t`` is not safe for concurrent use by several host threads, and ``cudnnCreate`` binds it to the
CUDA device current at that moment; hence one handle per thread and device. **The caller must make ``device``
current** (e.g. ``with cupy.cuda.Device(device):``) before the first :func:`get_handle` of a thread; when
cuda-python can tell which device is current and it is another one, :func:`get_handle` raises ``ValueError``
instead of binding the handle to the wrong device.

All handles are destroyed by an ``atexit`` hook, which runs before the CUDA runtime tears its contexts down; the
garbage-collection finalizers (a thread that ended, :func:`close_all_handles`) do nothing at shutdown. The handle of a
thread that ended is destroyed by the next creation of a handle, or at exit, not as the thread ends: ``cudnnDestroy``
synchronizes the device, which would invalidate a CUDA graph capture in CUDA's global mode that another thread may
have under way then; and a creation destroys them only where no capture that an arena knows of is under way
(:func:`ask_before_destroying`: the question the cuDNN backends give), else they wait for a later one. A CUDA graph
that captured calls on a handle keeps it (its pin: the backend's ``_bound_handle``) until CUDA has destroyed the graph.
A forked child forgets the parent's handles, destroying none (CUDA cannot run there).
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import os
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from .. import _forksafe
from .._gpu import gpu_unusable_reason
from ._errors import CudnnGpuUnavailableError, check, status_message
from ._owned import Owned
from ._prototypes import call, function

__all__ = ["Handle", "ask_before_destroying", "close_all_handles", "get_handle", "has_handle", "on_close_all"]


def _destroy(handle: int, device: int) -> None:
    """``cudnnDestroy`` with the handle's device current: it synchronizes the current device, and the handle's
    work runs on its own (the caller, at exit or in a finalizer, may have another one current)."""
    current = _current_device()
    if current is None or current == device:
        call("cudnnDestroy", handle, context=f"device {device}")
        return
    _set_device(device)
    try:
        call("cudnnDestroy", handle, context=f"device {device}")
    finally:
        _set_device(current)


def _destroy_quietly(handle: int, device: int) -> None:
    """Destroy a handle whose owner (a finished thread) is gone; warn, never raise."""
    try:
        _destroy(handle, device)
    except Exception as exc:  # noqa: BLE001
        warnings.warn(f"wsarena.cudnn: cudnnDestroy failed: {exc}", ResourceWarning, stacklevel=1)


# (handle, device) of the handles whose owner is gone, destroyed by the next creation or at exit (module docstring).
# A deque: its appends and pops need no lock, and the finalizer may run in a thread that holds _lock.
_orphans: collections.deque[tuple[int, int]] = collections.deque()


def _orphan(handle: int, device: int) -> None:
    """Finalizer of a handle whose owner is gone (the thread that ended, in which it runs): queue it."""
    _orphans.append((handle, device))


# Whether no CUDA graph capture that wsarena knows of is under way, in any thread: the arenas' question
# (wsarena.arena._lifecycle._no_capture_under_way), which the cuDNN backends give (this layer imports no arena). Empty:
# none given, a creation destroys the orphans.
_no_capture: list[Callable[[], bool]] = []


def ask_before_destroying(no_capture_under_way: Callable[[], bool]) -> None:
    """Have a creation destroy the handles of threads that ended only where ``no_capture_under_way()`` says so; while
    a capture is under way they stay queued, for the next creation where none is, or :func:`close_all_handles`."""
    _no_capture[:] = [no_capture_under_way]


def _destroy_orphans(ask: bool = False) -> None:
    """Destroy the queued handles of threads that ended; with ``ask``, none while a capture is under way."""
    if ask and _orphans and _no_capture and not _no_capture[0]():
        return
    while True:
        try:
            handle, device = _orphans.popleft()
        except IndexError:
            return
        _destroy_quietly(handle, device)


def _current_device() -> int | None:
    """The calling thread's current CUDA device (cuda.core's ``Device()``), or ``None`` when it cannot be asked
    (no driver, no GPU)."""
    try:
        from cuda.core import Device

        return int(Device().device_id)
    except Exception:  # noqa: BLE001 - only a consistency check; cudnnCreate reports the real problem
        return None


def _set_device(device: int) -> None:
    """Make ``device`` (its primary context) current for the calling thread, as ``cudaSetDevice`` does."""
    from cuda.core import Device

    Device(device).set_current()


class Handle(Owned):
    """An owned ``cudnnHandle_t`` for one device, used by one host thread. Get it from :func:`get_handle`.

    Attributes
    ----------
    device : int
        The CUDA device ordinal it was created on.
    thread_id : int
        ``threading.get_ident()`` of the thread it belongs to.
    """

    __slots__ = ("__weakref__", "_finalizer", "_handle", "_stream", "device", "thread_id")

    def __init__(self, device: int) -> None:
        self.device = int(device)
        self.thread_id = threading.get_ident()
        raw = ctypes.c_void_p()
        status = function("cudnnCreate")(ctypes.byref(raw))
        if status != 0:
            reason = gpu_unusable_reason()
            if reason is not None:
                detail = status_message(status, "cudnnCreate", f"device {self.device}")
                raise CudnnGpuUnavailableError(
                    status,
                    f"cannot create a cuDNN handle for device {self.device}: no usable GPU ({reason}); {detail}",
                    "cudnnCreate",
                    f"device {self.device}",
                )
            check(status, "cudnnCreate", f"device {self.device}")
        self._handle: int = raw.value or 0
        self._stream: int | None = None  # what cudnnSetStream was last given; None = cuDNN's default
        self._finalizer = weakref.finalize(self, _orphan, self._handle, self.device)
        self._finalizer.atexit = False  # the atexit hook below destroys live handles itself, in time

    @property
    def stream(self) -> int:
        """The ``cudaStream_t`` this handle enqueues on, as last set by :meth:`set_stream` (0 by default)."""
        return self._stream or 0

    def set_stream(self, stream_ptr: int) -> None:
        """Bind the handle to a raw ``cudaStream_t`` (``cudnnSetStream``); nothing is called if already bound."""
        stream_ptr = int(stream_ptr)
        if stream_ptr == self._stream:
            return
        call("cudnnSetStream", self, stream_ptr, context=f"device {self.device}, stream {stream_ptr:#x}")
        self._stream = stream_ptr

    def get_stream(self) -> int:
        """Ask cuDNN which stream the handle is bound to (``cudnnGetStream``)."""
        stream = ctypes.c_void_p()
        call("cudnnGetStream", self, ctypes.byref(stream))
        return stream.value or 0

    def close(self) -> None:
        """Destroy the handle now (``cudnnDestroy``, which synchronizes the device); later calls do nothing."""
        if self._finalizer.detach() is not None:
            _forget(self)
            _destroy(self._handle, self.device)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self._handle:#x}"
        return f"<cuDNN Handle device={self.device} thread={self.thread_id} {state}>"


_tls = threading.local()  # .handles: dict[device, Handle] of the calling thread
_lock = _forksafe.lock()  # guards _live and _atexit_registered
_live: weakref.WeakSet[Handle] = weakref.WeakSet()
_atexit_registered = False


def _forget(handle: Handle) -> None:
    handles = getattr(_tls, "handles", None)
    if handles is not None and handles.get(handle.device) is handle:
        del handles[handle.device]
    with _lock:
        _live.discard(handle)


def _after_fork_in_child() -> None:
    """In a forked child: the parent's handles (live ones, and those of threads that ended) are the parent's, and
    CUDA cannot run here. They are forgotten, none destroyed: the child's first get_handle() creates its own, and its
    exit destroys only those."""
    _orphans.clear()
    for handle in list(_live):
        handle._finalizer.detach()  # closed: has_handle() is False, close() does nothing
    _live.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


_create_lock = _forksafe.lock()  # held around the process's first cudnnCreate
_created = False


def _create(device: int) -> Handle:
    """A new handle. NVIDIA's thread-safety notes ask for one synchronous cudnnCreate before threads create their
    own handles concurrently: the first creation in the process is made alone, under a lock."""
    global _created
    if _created:
        return Handle(device)
    with _create_lock:
        handle = Handle(device)
        _created = True
    return handle


def has_handle(device: int) -> bool:
    """Whether the calling thread has a live handle for ``device`` already (:func:`get_handle` would create none)."""
    handle = getattr(_tls, "handles", {}).get(int(device))
    return handle is not None and not handle.closed


def get_handle(device: int) -> Handle:
    """The calling thread's cuDNN handle for ``device``, created with ``cudnnCreate`` on first request.

    The caller must have made ``device`` the current CUDA device (module docstring).

    Raises
    ------
    CudnnGpuUnavailableError
        ``cudnnCreate`` failed and no GPU is usable; the message gives the reason.
    CudnnNotFoundError
        libcudnn cannot be loaded.
    ValueError
        ``device`` is not the current CUDA device.
    """
    global _atexit_registered
    device = int(device)
    handles = getattr(_tls, "handles", None)
    if handles is None:
        handles = _tls.handles = {}
    handle = handles.get(device)
    if handle is not None and not handle.closed:
        return handle
    current = _current_device()
    if current is not None and current != device:
        raise ValueError(f"device {device} is not the current CUDA device ({current}); make it current first")
    _destroy_orphans(ask=True)
    handle = _create(device)
    handles[device] = handle
    with _lock:
        _live.add(handle)
        if not _atexit_registered:
            atexit.register(close_all_handles)
            _atexit_registered = True
    return handle


_before_close: list[weakref.WeakMethod] = []  # what must go before the handles (cached execution plans)


def on_close_all(method: Any) -> None:
    """Have :func:`close_all_handles` call the bound ``method`` first (while its object lives): the graph API's
    execution plans are destroyed before the handles they were built with, and before the CUDA context."""
    with _lock:
        _before_close.append(weakref.WeakMethod(method))


def close_all_handles() -> None:
    """Destroy every live handle of every thread, and those of threads that ended (registered with ``atexit``; also
    usable by tests).

    What :func:`on_close_all` registered runs first. Errors are turned into warnings: this runs at exit, where
    raising helps nobody.
    """
    with _lock:
        hooks = [ref() for ref in _before_close]
        # a generator, not a list comprehension, for the lock: wsarena.arena._interrupts, rule 8
        _before_close[:] = list(ref for ref in _before_close if ref() is not None)  # noqa: C400
    for hook in hooks:
        if hook is not None:
            try:
                hook()
            except Exception as exc:  # noqa: BLE001
                warnings.warn(f"wsarena.cudnn: closing cached plans failed: {exc}", ResourceWarning, stacklevel=1)
    with _lock:
        handles = list(_live)
    for handle in handles:
        try:
            handle.close()
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"wsarena.cudnn: closing {handle!r} failed: {exc}", ResourceWarning, stacklevel=1)
    _destroy_orphans()
