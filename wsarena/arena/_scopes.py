"""CuPy's ``Device`` and a stream made current for a block, as one scope that leaves what it entered on every path.

CuPy's ``Device`` pushes the device it finds on its thread's stack before it sets its own, and ``with`` runs no
``__exit__`` for an ``__enter__`` that raised: a device that ``cudaSetDevice`` refuses (an ordinal CUDA lacks, one
in use by another process in exclusive mode) left an entry there that the next ``Device``'s exit made current, in
place of the one that ``Device`` found. :class:`_OnDevice` (the cuDNN backend's scope around an op, where its device is
not current already) and :class:`_OnDeviceEntered` (around code of other libraries: wsarena._interop's, the device
providers') leave it, and a stream they entered, where entering either raises, a Ctrl-C on the heels of a step
included. A ``Device`` whose ``cudaGetDevice`` raised, before its push (an error of an earlier asynchronous launch,
which CUDA reports through any call), pushed nothing and is not left: leaving it popped the entry of an enclosing
``Device``, which then went back to another device, or raised IndexError on an empty stack in place of CUDA's error.
A stream tied to no device whose ``cudaGetDevice`` raised as CuPy made it current, after its push, is left though it
is not current: left on CuPy's stack, its entry was taken by the next exit of an enclosing stream, which stayed current.
"""

from __future__ import annotations

import threading
from typing import Any

# .device: the CUDA device an op's context (_OnDevice, the cuDNN backend's context()) made current in this thread, for
# the block; absent or None outside one
_within = threading.local()


def _raised_in(error: BaseException, name: str) -> bool:
    """Whether ``error`` came out of a function named ``name``, whose frame is then on its traceback (Cython records
    CuPy's own, named with their module and class: ``cupy_backends.cuda.api.runtime.getDevice``). It tells how far a
    CuPy ``__enter__`` that raised got: ``Device``'s asks ``cudaGetDevice``, pushes the answer, then calls
    ``cudaSetDevice`` where its own device differs (``cupy/cuda/device.pyx``), so it pushed unless the error came out
    of ``getDevice``; a stream's asks the device (``check_stream_device_match``), pushes the stream, then makes it
    current (``set_current_stream``, which asks the device again for a stream tied to none: ``stream.pyx``), so an
    error out of that left it pushed, though not current. Read on the error path alone: the calls that succeed pay
    nothing for it."""
    frame = error.__traceback__
    while frame is not None:
        if frame.tb_frame.f_code.co_name.rpartition(".")[2] == name:
            return True
        frame = frame.tb_next
    return False


class _OnDevice:
    """Make a CuPy device current, then enter a CuPy stream on it (``stream``: ``None`` for none); leave both, in
    reverse order, and the device current before as it was.

    The device is entered only where it is not current: CuPy's ``Device`` asks ``cudaGetDevice`` as it enters and
    calls ``cudaSetDevice`` as it leaves, even where nothing changed, and this asks once, or not at all within a
    scope of its kind on the same device (:mod:`wsarena._interop`'s, around the ops' on operands of PyTorch).
    Within the block the backends' ``_device()`` answers with it in this thread (what ``device_key()``, ``arena()``
    and the handle ask each call), as nothing the ops run there leaves another device current (a provider may not
    either: :class:`~wsarena.arena.providers.MemoryProvider`'s notes)."""

    __slots__ = ("cuda", "device", "entered", "outer", "stream")

    def __init__(self, cuda: Any, device: Any, stream: Any) -> None:
        self.cuda = cuda  # cupy.cuda
        self.device = device
        self.stream = stream
        self.entered: Any = None
        self.outer: int | None = None

    def __enter__(self) -> None:
        # No __exit__ runs for an __enter__ that raised, and a Ctrl-C lands as a call returns (never as one starts):
        # what was entered by then is left here. CuPy's Device pushes the device it goes back to before it sets its
        # own, so it is recorded before it is entered, and unrecorded where it raised before its push (_raised_in); a
        # stream is left where it is CuPy's current one after, which it was not before (the backend's context()
        # enters none that is), or was pushed before it could be made current.
        outer = self.outer = getattr(_within, "device", None)
        cuda, device, stream = self.cuda, self.device, self.stream
        try:
            # an enclosing scope of this thread's made the device current (wsarena._interop's, around the ops'): it is
            # current still, as within the block nothing leaves another current
            if outer != device.id and cuda.runtime.getDevice() != device.id:
                self.entered = device
                try:
                    device.__enter__()
                except BaseException as error:
                    if _raised_in(error, "getDevice"):  # before its push
                        self.entered = None
                    raise
            _within.device = device.id
            if stream is not None:
                stream.__enter__()
        except BaseException as error:
            self._unwind(error)
            raise

    def _unwind(self, error: BaseException) -> None:
        """Leave what an ``__enter__`` that raised ``error`` had entered, as its ``__exit__`` would have: the stream
        where it is current, or where it was pushed before it could be made current (:func:`_raised_in`; left on
        CuPy's stack, the next exit of an enclosing stream took its entry and left that stream current)."""
        _within.device = self.outer
        entered, self.entered = self.entered, None
        stream = self.stream
        try:
            if stream is not None and (self.cuda.get_current_stream(self.device.id) is stream
                                       or _raised_in(error, "set_current_stream")):
                stream.__exit__(None, None, None)
        finally:
            if entered is not None:
                entered.__exit__(None, None, None)

    def __exit__(self, *exc: object) -> None:
        _within.device = self.outer
        try:
            if self.stream is not None:
                self.stream.__exit__(*exc)
        finally:
            entered, self.entered = self.entered, None
            if entered is not None:
                entered.__exit__(*exc)


class _OnDeviceEntered(_OnDevice):
    """:class:`_OnDevice` for a block where another library's code runs (wsarena._interop's, around the views of
    that library's operands and its import of the result; the device providers', around PyTorch's allocator or
    CuPy's pool): CuPy's ``Device`` is entered whether or not its device is current, so that leaving it sets the
    device it found current again whatever that code did, and the block's device is not recorded for the backends,
    which ask CUDA within it (an enclosing scope's record, of a call this one runs within, is unset for the block).
    Device and stream are one scope, left as :class:`_OnDevice`'s are where the ``__enter__`` raises."""

    __slots__ = ()

    def __enter__(self) -> None:
        self.outer = getattr(_within, "device", None)
        try:
            _within.device = None
            self.entered = device = self.device  # recorded before it is entered, and unrecorded, as in _OnDevice
            try:
                device.__enter__()
            except BaseException as error:
                if _raised_in(error, "getDevice"):
                    self.entered = None
                raise
            if self.stream is not None:
                self.stream.__enter__()
        except BaseException as error:
            self._unwind(error)
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            if self.stream is not None:
                # The stream's device current again for CuPy to leave it: CuPy makes the stream it goes back to
                # (its null stream, one tied to no device) the current one of the device current then, which that
                # code may have changed, and the stream left would stay the current one of its own device
                self.cuda.runtime.setDevice(self.device.id)
        finally:
            super().__exit__(*exc)
