"""Whether a CUDA stream is being captured into a graph, and handing a pin to the graph being captured.

The device providers' ``capture(stream)`` (:mod:`wsarena.arena.providers`) and the cuDNN backends' checks before
creating a handle or finalizing a plan come here. CuPy answers the per-lease question (a C call); cuda-bindings
gives the capture's id and graph, asked only while a capture is under way.
"""

from __future__ import annotations

from typing import Any

from ..errors import CaptureError, CudaError

__all__ = ["CURRENT", "CudaCapture", "capture_of", "refuse_in_capture"]

_CAPTURE_IMPLICIT = 906  # cudaErrorStreamCaptureImplicit
_NONE, _ACTIVE = 0, 1  # cudaStreamCaptureStatusNone, cudaStreamCaptureStatusActive

CURRENT: Any = object()  # refuse_in_capture(stream=CURRENT): CuPy's current stream of the calling thread


class CudaCapture:
    """The capture under way on a stream: its sequence ``id`` (unique in the process) and the ``graph`` it records
    into."""

    __slots__ = ("graph", "id")

    def __init__(self, capture_id: int, graph: Any) -> None:
        self.id = capture_id
        self.graph = graph

    def retain(self, pin: Any) -> None:
        """Make the graph hold ``pin`` until CUDA destroys it (and every executable graph made from it): a user
        object whose destructor is ``pin.destroy(pin.address)``, its one reference moved to the graph."""
        from cuda.bindings import runtime as rt

        err, obj = rt.cudaUserObjectCreate(
            pin.address, rt.cudaHostFn_t(pin.destroy), 1, rt.cudaUserObjectFlags.cudaUserObjectNoDestructorSync
        )
        if int(err):
            pin.never_held()  # CUDA never had it: it reads as released, and its semaphore is freed with it
            _check(err, "cudaUserObjectCreate")
        (err,) = rt.cudaGraphRetainUserObject(
            self.graph, obj, 1, rt.cudaUserObjectRetainFlags.cudaGraphUserObjectMove
        )
        if int(err):
            rt.cudaUserObjectRelease(obj, 1)  # runs the destructor: the pin reads as released, never held
            _check(err, "cudaGraphRetainUserObject")


def capture_of(stream: int) -> CudaCapture | None:
    """The capture under way on ``stream`` (a raw handle), or ``None``.

    Raises :class:`CaptureError` when using ``stream`` would break a capture under way (the legacy default stream
    while another stream of the device is captured), or when the capture on it was invalidated.
    """
    import cupy

    runtime = cupy.cuda.runtime
    try:
        if not runtime.streamIsCapturing(stream):
            return None
    except runtime.CUDARuntimeError as exc:
        if exc.status != _CAPTURE_IMPLICIT:
            raise
        raise CaptureError(
            "the legacy default stream (0) cannot be used while another stream of this device is being captured "
            "into a CUDA graph: pass the capturing stream (stream=...)"
        ) from None
    except RuntimeError as exc:
        # CuPy raises a plain RuntimeError for cudaStreamCaptureStatusInvalidated: asked again below.
        refused: RuntimeError | None = exc
    else:
        refused = None
    from cuda.bindings import runtime as rt

    err, status, capture_id, graph, *_ = rt.cudaStreamGetCaptureInfo(stream)
    _check(err, "cudaStreamGetCaptureInfo")
    if int(status) == _ACTIVE:
        return CudaCapture(int(capture_id), graph)
    if int(status) == _NONE:  # not an invalidated capture after all (or it ended meanwhile)
        if refused is not None:
            raise refused
        return None
    raise CaptureError(
        f"the capture on stream {stream:#x} was invalidated by an earlier error (a call that cannot be captured, "
        "such as a synchronization, was made during it): end it (stream.end_capture()) and capture again"
    ) from None


def refuse_in_capture(stream: Any, what: str) -> None:
    """Raise :class:`CaptureError` if ``stream`` (a raw handle, or :data:`CURRENT`: CuPy's current stream of the
    calling thread) is being captured: ``what`` (a handle, a plan) cannot be."""
    if stream is CURRENT:
        from .streams import stream_handle

        stream = stream_handle(None)
    if capture_of(stream) is not None:
        raise CaptureError(
            f"this call would {what} while stream {stream:#x} is being captured into a CUDA graph, which the "
            "capture cannot hold: run the step once before capturing (on this thread)"
        )


def _check(err: Any, call: str) -> None:
    if int(err):
        from cuda.bindings import runtime as rt

        _, name = rt.cudaGetErrorName(err)
        raise CudaError(f"{call} failed: {name.decode() if isinstance(name, bytes) else name}")
