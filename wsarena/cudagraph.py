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
to hold no second buffer. Inside the block every wsarena call on its stream is recorded, not run: one with
``stream=None`` too, unless its operands are PyTorch tensors, which run on PyTorch's current stream (the block makes
its stream CuPy's current one, not PyTorch's; capture a PyTorch step with ``torch.cuda.graph``). A call that would
have to search, finalize a plan, create a handle or grow the arena (a ``reserve`` too) raises
:class:`~wsarena.errors.CaptureError` instead (nothing is enqueued); so does a call once the capture was invalidated
by an earlier error. Handles and plans are per thread: warm up on the thread that captures. Each workspace buffer
the graph uses stays allocated, at the same address, until the graph is destroyed, even if the arena grows or is
trimmed meanwhile (:mod:`wsarena.arena._pinning`), and so is each graph-API execution plan it ran kept, even once
evicted from the plan cache (:class:`~wsarena.backends._graph_plans.PlanCache`), and what a call allocated during the
capture, even once dropped: its copies of operands that are not C-contiguous, a result made without ``out=``
(:meth:`~wsarena.arena.Arena.keep_with_capture`; under CuPy's ``MemoryAsyncPool`` the graph allocates and frees
them itself). The same holds for a capture made
with CuPy's ``stream.begin_capture()`` or ``torch.cuda.graph``: wsarena detects capture from the stream's capture
status.

Replays use the workspace of the stream they were captured on. Launch a graph on that stream (``launch()`` does by
default), or order it with that stream's other work, as for any two uses of one stream's workspace.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from typing import Any

from ._config import get_config
from ._gpu import gpu_unusable_reason
from ._sizes import short_repr
from .arena._capture import capture_of
from .arena.streams import cupy_stream, stream_handle
from .errors import BackendUnavailableError, CaptureError

__all__ = ["CapturedGraph", "capture"]

_MODES = ("global", "thread_local", "relaxed")


class _State(enum.Enum):
    """Where a :class:`CapturedGraph` stands; each value is what its ``repr`` says while it has no graph."""

    CAPTURING = "capturing"  # its block has not ended
    CAPTURED = "captured"  # it holds its graph
    RAISED = "empty: the block failed"  # the block raised: its capture was discarded
    NOT_ENDED = "empty"  # the block returned, but its capture could not be ended into a graph
    CLOSED = "closed"


_NOT_OVER = "its capture block has not ended yet (launch it once the `with wsarena.capture()` block is over)"


class CapturedGraph:
    """A CUDA graph recorded by :func:`capture`: :meth:`launch` replays it, :meth:`close` destroys it.

    Attributes
    ----------
    stream : cupy.cuda.Stream
        The stream it was captured on, where :meth:`launch` replays it by default.
    graph : cupy.cuda.Graph or None
        CuPy's graph, once the capture ended (``None`` before, after :meth:`close`, and when the block raised or its
        capture could not be ended: :meth:`launch` says which).
    """

    __slots__ = ("_reason", "_state", "graph", "stream")

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.graph: Any = None
        self._state = _State.CAPTURING
        self._reason = _NOT_OVER  # while graph is None: why, as launch() says it

    @property
    def closed(self) -> bool:
        """Whether there is no graph to launch (yet, or any more)."""
        return self.graph is None

    def launch(self, stream: Any = None) -> None:
        """Replay the graph on ``stream`` (by default the stream it was captured on; a CuPy stream, a raw handle or
        an object with ``__cuda_stream__``, as wsarena's ``stream=`` takes); returns once enqueued.

        Raises :class:`~wsarena.errors.CaptureError` (a ``RuntimeError``) saying why when there is no graph: its
        capture block has not ended, it raised, its capture could not be ended, or the graph is closed."""
        graph = self.graph
        if graph is None:
            raise CaptureError(f"cannot launch this graph: {self._reason}")
        if stream is None:
            stream = self.stream
        elif type(getattr(stream, "ptr", None)) is not int:  # CuPy's Graph.launch reads a CuPy stream's ptr
            stream = cupy_stream(stream_handle(stream))
        graph.launch(stream)

    def close(self) -> None:
        """Drop the graph (CuPy destroys it once nothing else refers to it); the workspace it pinned is freed in
        stream order by the arena's next trim, stats or growth after CUDA let go of it (any arena's, where that one
        is closed; and after any capture under way on its stream), and what its calls kept is let go by the next one
        with no capture under way (what CuPy's memory pool takes back, by a later capture's first call too). Inside
        its capture block, the capture is discarded as the block ends. Idempotent."""
        self.graph = None
        self._state, self._reason = _State.CLOSED, "it is closed"

    def _failed(self, state: _State, why: str) -> None:
        """The capture block left no graph (``state``: RAISED or NOT_ENDED), for the reason ``why``, unless it was
        closed, or another reason given, first."""
        if self._state is _State.CAPTURING:
            self._state, self._reason = state, why

    def _captured(self, graph: Any) -> None:
        """The capture block's graph, kept unless it was closed inside the block (then dropped: CuPy destroys it,
        and CUDA releases what it pinned)."""
        if self._state is not _State.CLOSED:
            self.graph, self._state = graph, _State.CAPTURED

    def __repr__(self) -> str:
        if self.graph is not None:
            return f"<CapturedGraph on {self.stream!r}>"
        return f"<CapturedGraph on {self.stream!r} ({self._state.value})>"


def seed_workspace(arena: Any, stream: Any) -> None:
    """Give ``stream``, where it holds no workspace, the largest buffer any stream of ``arena`` holds (at most the
    configured cap).

    A capture cannot grow the arena, and the eager warm-up often ran on another stream: without this, the first
    call of the capture would raise :class:`~wsarena.errors.CaptureError` for want of a buffer its step had already
    sized elsewhere. A stream that holds a buffer (its own warm-up's) is left as it is.
    """
    if arena.held_bytes(stream=stream):
        return
    largest = largest_workspace(arena)
    if largest:
        arena.reserve(largest, stream=stream)


def largest_workspace(arena: Any) -> int:
    """The largest buffer any stream of ``arena`` holds, at most the configured cap: what a step's capture on
    another stream needs there (the eager step's largest workspace)."""
    largest = max((s.capacity_bytes for s in arena.stats().streams.values()), default=0)
    cap = get_config().cap_workspace
    return largest if cap is None else min(largest, cap)


def _capturing(runtime: Any, stream: int) -> bool:
    """Whether the stream of handle ``stream`` is capturing, its capture invalidated too (CuPy's plain
    RuntimeError). CUDA's other refusals (CuPy's CUDARuntimeError: a bad handle, a sticky error) are raised."""
    try:
        return bool(runtime.streamIsCapturing(stream))
    except RuntimeError as exc:
        if type(exc) is not RuntimeError:
            raise
        return True


def _capture_id(stream: int) -> int | None:
    """The id CUDA gave the capture under way on the stream of handle ``stream`` (unique in the process), or ``None``:
    none is, or it was invalidated (CUDA gives an invalidated capture no id)."""
    try:
        capture = capture_of(stream)
    except CaptureError:  # invalidated (the other case, the legacy default stream, is refused before a block begins)
        return None
    return None if capture is None else capture.id


def _another(stream: int, own: int | None) -> bool:
    """Whether the capture under way on the stream of handle ``stream`` is another than the one of id ``own``: CUDA
    gives it another id. Where that cannot be told (``own`` was not read, or the capture was invalidated: it has no
    id), it is taken to be ``own``'s."""
    if own is None:
        return False
    now = _capture_id(stream)
    return now is not None and now != own


@contextlib.contextmanager
def capture(stream: Any = None, *, mode: str = "relaxed") -> Iterator[CapturedGraph]:
    """Record the wsarena calls (and any other CUDA work) of the block into a CUDA graph.

    Parameters
    ----------
    stream : cupy.cuda.Stream or cupy.cuda.ExternalStream, optional
        Where to capture; a new non-blocking stream by default. Not the legacy default stream, which CUDA
        cannot capture (the per-thread default stream, ``cupy.cuda.Stream.ptds``, it can), nor one being captured
        already (``ValueError``).
        It is the current CuPy stream inside the block, so calls with ``stream=None`` are captured, except those on
        PyTorch tensors: they run on PyTorch's current stream, which the block does not change, and are not
        captured. Before the capture begins, a stream that holds no workspace gets the largest buffer the current
        device's arena holds.
    mode : ``"global"``, ``"thread_local"`` or ``"relaxed"``
        CUDA's capture mode: which CUDA calls of other threads are refused while the capture is under way.
        ``"relaxed"``, CuPy's own default, lets CuPy's memory pool allocate the block's new arrays.

    Yields
    ------
    CapturedGraph
        Launchable once the block ends. If the block raises, the capture is ended and discarded (and so it is if
        the graph is closed inside the block).

    Raises
    ------
    TypeError, ValueError
        A bad ``stream`` or ``mode``, or a stream that cannot be captured now (see above); nothing was done.
    BackendUnavailableError
        No GPU is usable.
    ArenaOutOfMemoryError
        The stream holds no workspace, and the buffer it is given before the capture begins could not be allocated;
        no capture was begun. Run the eager step on that stream, which then holds its own.
    CaptureError
        (inside the block) A call needed something a capture cannot hold; run the step once before capturing.
        (as the block ends) Its capture could not be ended into a graph: an error inside the block invalidated it,
        or it was ended there (``stream.end_capture()``). A capture begun on the stream since (another id) is left
        alone, as the block ends or raises: its owner ends it.
    """
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a str, one of {', '.join(map(repr, _MODES))}, not {type(mode).__name__}")
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, _MODES))}, not {short_repr(mode)}")
    reason = gpu_unusable_reason()
    if reason is not None:
        raise BackendUnavailableError(f"wsarena.capture needs a GPU: {reason}")
    import cupy

    runtime = cupy.cuda.runtime
    if stream is None:
        stream = cupy.cuda.Stream(non_blocking=True)
    elif not isinstance(stream, (cupy.cuda.Stream, cupy.cuda.ExternalStream)):
        raise TypeError(f"stream must be a CuPy stream (another library's: cupy.cuda.Stream.from_external(stream); "
                        f"a raw handle: cupy.cuda.ExternalStream(handle)), not {type(stream).__name__}")
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
    from .arena._lifecycle import release_closed
    from .arena._pinning import recorded_for_another, unwatch_capture, watch_capture
    from .arena._registry import open_arena

    graph = CapturedGraph(stream)
    own = None  # the id of the block's capture, once read
    mark = None  # what watch_capture returned
    another = False  # whether its stream captures for another, found as the block ends
    over = False  # whether the block's capture is over (ended or discarded, or none begun), found as the block ends
    try:
        with stream:
            arena = open_arena(int(cupy.cuda.Device().id))  # none yet: no eager step ran, and the capture will say so
            try:
                if arena is not None:
                    # Recorded before the seeding: a trim or an eviction of idle streams in another thread, before the
                    # capture's first lease, would free the seeded buffer, which the capture cannot allocate again.
                    mark = watch_capture(arena, stream, beginning=True)
                    seed_workspace(arena, stream)
                refused = False
                try:
                    try:
                        stream.begin_capture(cuda_mode)
                    except Exception:
                        # CUDA refused: no capture of this block's to end. One under way there is another's (begun in
                        # another thread since the check above), which the block must leave alone.
                        refused = True
                        raise
                    # Read first: the block ends no capture but this one (it may be ended inside the block and another
                    # begun). Until it is read, a capture on the stream is this one, begun just now.
                    own = _capture_id(stream.ptr)
                    if arena is not None:
                        # Frees that would synchronise the device wait from now on, not from the step's first lease:
                        # another thread's free breaks a global-mode capture, and a non-blocking stream's capture is not
                        # seen by asking the legacy default stream.
                        watch_capture(arena, stream)
                    yield graph
                    _end(runtime, stream, graph, own)  # in the try: a Ctrl-C before its capture ended discards it
                    over = True
                except BaseException as exc:
                    # The capture begun here, if any, is discarded (its pins are released when CUDA destroys it). CUDA
                    # is asked whether it began: a Ctrl-C just after begin_capture returned comes before any flag could
                    # say.
                    why = f"its capture block was left by {type(exc).__name__}, and its capture was discarded"
                    graph._failed(_State.RAISED, f"{why}: capture again")
                    with contextlib.suppress(Exception):
                        if refused:
                            # One under way is another's, begun since the check above: another block's (in another
                            # thread) keeps the stream's record, which frees with no stream wait for.
                            another = (arena is not None and mark is not None and recorded_for_another(arena, mark)
                                       and _capturing(runtime, stream.ptr))
                        elif _capturing(runtime, stream.ptr):
                            another = _another(stream.ptr, own)
                            if not another:
                                stream.end_capture()
                        over = True  # another's under way keeps its record: the let-go below waits for it
                    raise
            finally:
                # Else recorded until a free with no stream finds the capture over. Another's capture under way keeps
                # the record (its lease's, or the block's): frees with no stream, which would break it, wait for it.
                if arena is not None:
                    unwatch_capture(arena, stream, over=not another)
    except BaseException:
        if over:
            with contextlib.suppress(Exception):  # the block's own exception is the one raised
                release_closed()
        raise
    # What graphs destroyed since kept, which waited for captures under way to end, goes now that this one is over,
    # whether or not the block raised (unless another is under way, or its capture could not be found ended): a
    # program that captures again and again holds what the graphs alive keep.
    release_closed()


def _end(runtime: Any, stream: Any, graph: CapturedGraph, own: int | None) -> None:
    """End the capture of ``graph``'s block, which returned, its id ``own``: ``graph`` gets CuPy's graph, unless it
    was closed inside the block (the capture is discarded). Raises :class:`CaptureError` if there is no capture of
    the block's to end (one under way with another id is left alone), or CUDA could not end it into an executable
    graph (an invalidated capture is ended all the same)."""
    ptr = stream.ptr
    by_hand = f"the capture on stream {ptr:#x} was ended inside the block (stream.end_capture())"
    if not _capturing(runtime, ptr):
        why = by_hand
    elif _another(ptr, own):
        why = f"{by_hand}, and another begun there, which is left alone"
    else:
        why = ""
    if why:
        graph._failed(_State.NOT_ENDED, f"{why}: capture again")
        raise CaptureError(f"{why}, so the block has no graph: capture again")
    try:
        ended = stream.end_capture()
    except RuntimeError as exc:
        why = (f"the capture on stream {ptr:#x} could not be ended into a graph ({exc}): an error inside the block "
               "invalidated it (a call that cannot be captured, such as a synchronization), work forked to another "
               "stream was not joined back, or CUDA could not instantiate the graph")
        graph._failed(_State.NOT_ENDED, f"{why}: capture again")
        raise CaptureError(f"{why}; capture again") from exc
    graph._captured(ended)
