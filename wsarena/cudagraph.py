"""Capture a step of wsarena calls into a CUDA graph, and replay it.

::

    step()                                  # once, eagerly: fills the caches and sizes the arena
    with wsarena.capture() as graph:        # a stream of its own, current inside the block
        step()
    for _ in range(n):
        graph.launch()
    graph.close()                           # or drop it: the workspace it pinned is freed once CUDA lets go

A capture stream that holds no workspace starts with a buffer as large as the largest one the device's arena holds
(the eager step's), so the eager step may run on any stream; warm up on the stream you then pass to :func:`capture`
to hold no second buffer. Inside the block every wsarena call is recorded, not run. A call that would have to
search, finalize a plan, create a handle or grow the arena (a ``reserve`` too) raises
:class:`~wsarena.errors.CaptureError` instead (nothing is enqueued); so does a call once the capture was invalidated
by an earlier error. Handles and plans are per thread: warm up on the thread that captures. Each workspace buffer
the graph uses stays allocated, at the same address, until the graph is destroyed, even if the arena grows or is
trimmed meanwhile (:mod:`wsarena.arena._pinning`), and so is each graph-API execution plan it ran kept, even once
evicted from the plan cache (:class:`~wsarena.backends._graph_plans.PlanCache`). The same holds for a capture made
with CuPy's ``stream.begin_capture()`` or ``torch.cuda.graph``: wsarena detects capture from the stream's capture
status.

Replays use the workspace of the stream they were captured on. Launch a graph on that stream (``launch()`` does by
default), or order it with that stream's other work, as for any two uses of one stream's workspace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ._config import get_config
from ._gpu import gpu_unusable_reason
from .errors import BackendUnavailableError

__all__ = ["CapturedGraph", "capture"]

_MODES = ("global", "thread_local", "relaxed")


class CapturedGraph:
    """A CUDA graph recorded by :func:`capture`: :meth:`launch` replays it, :meth:`close` destroys it.

    Attributes
    ----------
    stream : cupy.cuda.Stream
        The stream it was captured on, where :meth:`launch` replays it by default.
    graph : cupy.cuda.Graph or None
        CuPy's graph, once the capture ended (``None`` before, and after :meth:`close`).
    """

    __slots__ = ("graph", "stream")

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.graph: Any = None

    @property
    def closed(self) -> bool:
        return self.graph is None

    def launch(self, stream: Any = None) -> None:
        """Replay the graph on ``stream`` (by default the stream it was captured on; a CuPy stream, a raw handle or
        an object with ``__cuda_stream__``, as wsarena's ``stream=`` takes); returns once enqueued."""
        if self.graph is None:
            raise RuntimeError("this graph is closed, or its capture did not end")
        if stream is None:
            stream = self.stream
        elif type(getattr(stream, "ptr", None)) is not int:  # CuPy's Graph.launch reads a CuPy stream's ptr
            from .arena.streams import cupy_stream, stream_handle

            stream = cupy_stream(stream_handle(stream))
        self.graph.launch(stream)

    def close(self) -> None:
        """Drop the graph (CuPy destroys it once nothing else refers to it); the workspace it pinned is freed in
        stream order by the arena's next trim, stats or growth after CUDA let go of it (and after any capture under
        way on its stream). Idempotent."""
        self.graph = None

    def __repr__(self) -> str:
        return f"<CapturedGraph on {self.stream!r}{' (closed)' if self.graph is None else ''}>"


def seed_workspace(arena: Any, stream: Any) -> None:
    """Give ``stream``, where it holds no workspace, the largest buffer any stream of ``arena`` holds (at most the
    configured cap).

    A capture cannot grow the arena, and the eager warm-up often ran on another stream: without this, the first
    call of the capture would raise :class:`~wsarena.errors.CaptureError` for want of a buffer its step had already
    sized elsewhere. A stream that holds a buffer (its own warm-up's) is left as it is.
    """
    if arena.held_bytes(stream=stream):
        return
    largest = max((s.capacity_bytes for s in arena.stats().streams.values()), default=0)
    cap = get_config().cap_workspace
    if cap is not None:
        largest = min(largest, cap)
    if largest:
        arena.reserve(largest, stream=stream)


def _capturing(runtime: Any, stream: int) -> bool:
    """Whether the stream of handle ``stream`` is capturing, its capture invalidated too (CuPy's RuntimeError)."""
    try:
        return bool(runtime.streamIsCapturing(stream))
    except RuntimeError:
        return True


@contextlib.contextmanager
def capture(stream: Any = None, *, mode: str = "relaxed") -> Iterator[CapturedGraph]:
    """Record the wsarena calls (and any other CUDA work) of the block into a CUDA graph.

    Parameters
    ----------
    stream : cupy.cuda.Stream, optional
        Where to capture; a new non-blocking stream by default. Not the legacy default stream, which CUDA
        cannot capture (the per-thread default stream, ``cupy.cuda.Stream.ptds``, it can), nor one being captured
        already (``ValueError``).
        It is the current CuPy stream inside the block, so calls with ``stream=None`` are captured. Before the
        capture begins, a stream that holds no workspace gets the largest buffer the current device's arena holds.
    mode : ``"global"``, ``"thread_local"`` or ``"relaxed"``
        CUDA's capture mode: which CUDA calls of other threads are refused while the capture is under way.
        ``"relaxed"``, CuPy's own default, lets CuPy's memory pool allocate the block's new arrays.

    Yields
    ------
    CapturedGraph
        Launchable once the block ends. If the block raises, the capture is ended and discarded.

    Raises
    ------
    BackendUnavailableError
        No GPU is usable.
    CaptureError
        (inside the block) A call needed something a capture cannot hold; run the step once before capturing.
    """
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, _MODES))}, not {mode!r}")
    reason = gpu_unusable_reason()
    if reason is not None:
        raise BackendUnavailableError(f"wsarena.capture needs a GPU: {reason}")
    import cupy

    runtime = cupy.cuda.runtime
    if stream is None:
        stream = cupy.cuda.Stream(non_blocking=True)
    elif not isinstance(stream, cupy.cuda.Stream):
        raise TypeError(f"stream must be a cupy.cuda.Stream, not {type(stream).__name__}")
    if stream.ptr in (0, 1):  # the per-thread default stream (2) can be captured; the legacy one cannot
        raise ValueError("the legacy default stream cannot be captured: pass a stream of its own "
                         "(cupy.cuda.Stream()) or the per-thread default stream (cupy.cuda.Stream.ptds)")
    cuda_mode = {
        "global": runtime.streamCaptureModeGlobal,
        "thread_local": runtime.streamCaptureModeThreadLocal,
        "relaxed": runtime.streamCaptureModeRelaxed,
    }[mode]
    if _capturing(runtime, stream.ptr):
        # Refused before anything is recorded: CUDA would refuse to begin a second capture there, and the record
        # and the end of a capture made below are for this block's own
        raise ValueError(f"stream {stream.ptr:#x} is being captured already: end that capture first")
    from .arena._pinning import unwatch_capture, watch_capture
    from .arena._registry import open_arena

    graph = CapturedGraph(stream)
    with stream:
        arena = open_arena(int(cupy.cuda.Device().id))  # none yet: no eager step ran, and the capture will say so
        try:
            if arena is not None:
                # Recorded before the seeding: a trim or an eviction of idle streams in another thread, before the
                # capture's first lease, would free the seeded buffer, which the capture cannot allocate again.
                watch_capture(arena, stream, beginning=True)
                seed_workspace(arena, stream)
            try:
                stream.begin_capture(cuda_mode)
                if arena is not None:
                    # Frees that would synchronise the device wait from now on, not from the step's first lease:
                    # another thread's free breaks a global-mode capture, and a non-blocking stream's capture is not
                    # seen by asking the legacy default stream.
                    watch_capture(arena, stream)
                yield graph
            except BaseException:
                # The capture begun here, if any, is discarded (its pins are released when CUDA destroys it). CUDA is
                # asked whether it began: a Ctrl-C just after begin_capture returned comes before any flag could say.
                with contextlib.suppress(Exception):
                    if _capturing(runtime, stream.ptr):
                        stream.end_capture()
                raise
            else:
                graph.graph = stream.end_capture()
        finally:
            if arena is not None:
                unwatch_capture(arena, stream)  # else recorded until a free with no stream finds the capture over
