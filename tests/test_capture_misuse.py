"""wsarena.capture() and CapturedGraph misused, without a GPU: nested and interleaved captures, blocks left early,
graphs used in the wrong state, bad arguments, threads. Each outcome is a typed error or working behaviour, and
leaves nothing recorded for a capture that is over, no capture begun, and, once every graph is gone, no buffer held.

CuPy is a fake (:class:`FakeCupy`) whose streams capture on a :class:`CaptureWatchingProvider`; where it goes beyond
what test_capture_frees.py's fake does, it follows CuPy 14 (``Graph.launch`` reads the stream's ``ptr``; a graph is
destroyed, its user objects released, when CuPy's object is; ``runtime.streamIsCapturing`` raises a plain
RuntimeError for an invalidated capture) and CUDA (``cudaStreamEndCapture`` of an invalidated capture fails and ends
it; the guess here: the stream leaves capture mode, as CUDA's documentation of the NULL graph it returns says;
``cudaStreamGetCaptureInfo`` gives no id for an invalidated capture).
"""

from __future__ import annotations

import contextlib
import gc
import threading

import pytest

import wsarena
from wsarena.arena import Arena, set_arena
from wsarena.arena.testing import FakeStream
from wsarena.errors import CaptureError

from .capture_helpers import S1, capture_a_lease
from .test_capture_frees import CaptureWatchingProvider, FakeCupy, fake_gpu, sibling

S = 0x60  # the capture stream's handle


class InvalidatingProvider(CaptureWatchingProvider):
    """A capture in ``invalidated`` was broken by an earlier error: the arena is told so, as CupyProvider tells it
    (:func:`wsarena.arena._capture.capture_of`)."""

    def __init__(self):
        super().__init__()
        self.invalidated = set()

    def capture(self, stream):
        if stream in self.invalidated and stream in self.capturing:
            raise CaptureError(f"the capture on stream {stream:#x} was invalidated by an earlier error")
        return super().capture(stream)

    def invalidates(self, stream):
        return stream in self.invalidated


class CupyGraph:
    """CuPy's Graph: ``launch(stream)`` reads ``stream.ptr``; the CUDA graph is destroyed with the object, which
    releases the user objects (pins) it holds."""

    def __init__(self, fake_graph, launches):
        self.fake_graph = fake_graph
        self.launches = launches

    def launch(self, stream=None):
        self.launches.append(stream.ptr)

    def __del__(self):
        self.fake_graph.close()


class Cupy(FakeCupy):
    """:class:`FakeCupy` with CuPy's graphs (:class:`CupyGraph`), ``Stream.from_external`` and invalidated
    captures."""

    def __init__(self, provider):
        super().__init__(provider)
        self.launches = []
        fake, runtime, stream_type = self, self.cuda.runtime, self.cuda.Stream
        begin, end = stream_type.begin_capture, stream_type.end_capture

        def is_capturing(ptr):
            if ptr in provider.invalidated and ptr in provider.capturing:
                raise RuntimeError("the stream was capturing, but an error has invalidated the capture sequence")
            return ptr in provider.capturing

        def begin_capture(self, mode=None):
            if self.ptr in (0, 1):
                raise RuntimeError("cudaErrorStreamCaptureUnsupported")
            begin(self, mode)
            provider.invalidated.discard(self.ptr)

        def end_capture(self):
            invalid = self.ptr in provider.invalidated and self.ptr in provider.capturing
            graph = end(self)
            if invalid:  # ended, and nothing comes of it
                provider.invalidated.discard(self.ptr)
                graph.close()
                raise RuntimeError("cudaErrorStreamCaptureInvalidated: operation failed due to a previous error")
            return CupyGraph(graph, fake.launches)

        def from_external(cls, obj):
            stream = cls(type(obj).__cuda_stream__(obj)[1])
            stream.external = obj
            return stream

        runtime.streamIsCapturing = is_capturing
        stream_type.begin_capture = begin_capture
        stream_type.end_capture = end_capture
        stream_type.from_external = classmethod(from_external)
        stream_type.null = stream_type(0)
        stream_type.ptds = stream_type(2)
        self.cuda.ExternalStream = sibling(stream_type)  # with the methods above


@pytest.fixture
def misuse(monkeypatch):
    """A device arena of device 0 (which holds 1000 bytes on S1: an eager step's) over an InvalidatingProvider, and
    a CuPy that captures on it."""
    provider = InvalidatingProvider()
    with fake_gpu(monkeypatch, provider, Cupy) as (arena, cupy):
        arena.reserve(1000, stream=S1)
        yield provider, arena, cupy


def assert_left_clean(provider, arena, *graphs):
    """No capture is left begun or recorded, nothing was freed under a capture, and once ``graphs`` are closed a
    trim gives every buffer back."""
    assert provider.capturing == {} and provider.during_capture == []
    assert arena._table.capturing == {}
    for graph in graphs:
        graph.close()
    arena.trim()
    assert provider.held == []
    assert all(not pin.live() for pin in arena._table.captures.values())


def step(arena, stream):
    """The captured step: a lease of the eager step's size on ``stream``."""
    with arena.lease(1000, stream=stream.ptr):
        pass


def free_with_no_stream(arena, handle):
    """Let a buffer go that is freed with no stream (a device synchronisation), which a capture under way delays: a
    dead stream's (on ``handle``), once a new stream's sub-arena (on ``handle + 1``) is made."""
    gone = FakeStream(handle)
    arena.reserve(10, stream=gone)
    del gone
    with arena.lease(10, stream=handle + 1):
        pass


# Nested and interleaved captures


def test_a_capture_block_nested_on_its_own_stream_is_refused_and_the_outer_capture_goes_on(misuse):
    provider, arena, cupy = misuse
    s = cupy.cuda.Stream(S)
    with wsarena.capture(s) as outer:
        with pytest.raises(ValueError, match="captured already"), wsarena.capture(s):
            pass
        step(arena, s)
    assert cupy.modes == [2] and len(outer.graph.fake_graph.pins) == 1
    outer.launch()
    assert cupy.launches == [S]
    assert_left_clean(provider, arena, outer)


@pytest.mark.parametrize("modes", [("relaxed", "relaxed"), ("global", "thread_local"), ("thread_local", "global")])
def test_a_capture_block_nested_on_another_stream_captures_both(misuse, modes):
    provider, arena, cupy = misuse
    s1, s2 = cupy.cuda.Stream(S), cupy.cuda.Stream(S + 1)
    with wsarena.capture(s1, mode=modes[0]) as outer:
        step(arena, s1)
        with wsarena.capture(s2, mode=modes[1]) as inner:
            step(arena, s2)
        assert inner.graph is not None and outer.graph is None
    assert outer.graph.fake_graph is not inner.graph.fake_graph
    assert len(outer.graph.fake_graph.pins) == len(inner.graph.fake_graph.pins) == 1
    assert_left_clean(provider, arena, outer, inner)


def test_a_capture_block_inside_a_capture_begun_by_hand_on_another_stream(misuse):
    provider, arena, cupy = misuse
    by_hand = cupy.cuda.Stream(S + 1)
    by_hand.begin_capture()
    s = cupy.cuda.Stream(S)
    with wsarena.capture(s) as graph:
        step(arena, s)
    assert provider.capturing == {S + 1: by_hand.graph}
    by_hand.end_capture()
    assert_left_clean(provider, arena, graph)


def test_a_capture_begun_by_hand_on_the_blocks_stream_inside_the_block_is_refused(misuse):
    """CUDA refuses to begin a second capture on a stream being captured; the error leaves the block, whose capture
    is ended and discarded."""
    provider, arena, cupy = misuse
    s = cupy.cuda.Stream(S)
    with pytest.raises(RuntimeError, match="capturing already"), wsarena.capture(s) as graph:
        step(arena, s)
        s.begin_capture()
    with pytest.raises(RuntimeError, match="block was left by RuntimeError"):
        graph.launch()
    assert_left_clean(provider, arena, graph)


def test_a_capture_ended_by_hand_inside_the_block_is_a_capture_error_at_its_end(misuse):
    """The block's capture was ended by ``stream.end_capture()`` inside it: the block has no graph, and says so as
    it ends. Once, CuPy's error for ending a capture on a stream not capturing came out of the block."""
    provider, arena, cupy = misuse
    s = cupy.cuda.Stream(S)
    with pytest.raises(CaptureError, match=r"ended inside the block.*: capture again$"), wsarena.capture(s) as graph:
        step(arena, s)
        theirs = s.end_capture()
    with pytest.raises(RuntimeError, match="ended inside the block"):
        graph.launch()
    assert repr(graph) == f"<CapturedGraph on {s!r} (empty)>" and graph.closed
    del theirs  # the graph made by hand, and its pin, go
    assert_left_clean(provider, arena, graph)


@pytest.mark.parametrize("block", ["returns", "raises"])
def test_a_capture_begun_by_hand_after_the_blocks_own_was_ended_is_left_to_its_owner(misuse, block):
    """Inside the block, ``stream.end_capture()`` ends its capture and ``stream.begin_capture()`` begins another, whose
    step leases there. As the block ends (a CaptureError, as for a capture ended inside it) or raises, that capture is
    not the block's: it goes on, and frees with no stream (which would break it) wait for it. Once, the block ended
    it, as its own, and its record went with the block's."""
    provider, arena, cupy = misuse
    s = cupy.cuda.Stream(S)
    ended = pytest.raises(CaptureError, match=r"ended inside the block.*another.*left alone.*: capture again$")
    with ended if block == "returns" else pytest.raises(KeyError), wsarena.capture(s) as graph:
        step(arena, s)
        ours = s.end_capture()
        s.begin_capture()
        theirs = s.graph
        step(arena, s)  # their step
        if block == "raises":
            raise KeyError("the step failed")
    assert provider.capturing == {S: theirs} and cupy.modes == [2, None]
    with pytest.raises(RuntimeError, match="ended inside the block" if block == "returns" else "left by KeyError"):
        graph.launch()
    free_with_no_stream(arena, S + 1)
    assert provider.during_capture == [] and None not in [on for _, on in provider.frees]
    assert s.end_capture().fake_graph is theirs  # by its owner
    free_with_no_stream(arena, S + 3)  # now made: the capture is over (and its record forgotten)
    assert [on for _, on in provider.frees].count(None) == 2
    del ours
    assert_left_clean(provider, arena, graph)


def test_a_capture_invalidated_inside_the_block_is_a_capture_error_at_its_end(misuse):
    """A call that cannot be captured (a synchronization, caught by the user) invalidated the capture, and no
    wsarena call came after it to say so: the block's end does, with what to do. Once, CuPy's error did."""
    provider, arena, cupy = misuse
    s = cupy.cuda.Stream(S)
    with pytest.raises(CaptureError, match="invalidated.*capture again"), wsarena.capture(s) as graph:
        step(arena, s)
        provider.invalidated.add(S)
    with pytest.raises(RuntimeError, match="invalidated"):
        graph.launch()
    assert_left_clean(provider, arena, graph)


def test_a_wsarena_call_after_the_capture_was_invalidated_raises_and_ends_the_capture(misuse):
    provider, arena, cupy = misuse
    s = cupy.cuda.Stream(S)
    with pytest.raises(CaptureError, match="invalidated"), wsarena.capture(s) as graph:
        provider.invalidated.add(S)
        step(arena, s)
    assert graph.closed
    assert_left_clean(provider, arena, graph)


# Blocks left early


def _returns_inside(arena, s):
    with wsarena.capture(s) as graph:
        step(arena, s)
        return graph


def test_a_capture_block_left_by_return_ends_its_capture(misuse):
    provider, arena, cupy = misuse
    graph = _returns_inside(arena, cupy.cuda.Stream(S))
    assert graph.graph is not None and len(graph.graph.fake_graph.pins) == 1
    assert_left_clean(provider, arena, graph)


@pytest.mark.parametrize("how", ["close()", "collected"])
def test_a_generator_closed_inside_its_capture_block_discards_the_capture(misuse, how):
    """GeneratorExit, raised at the ``yield`` inside the block, leaves the block as any exception does."""
    provider, arena, cupy = misuse
    s = cupy.cuda.Stream(S)
    box = {}

    def steps():
        with wsarena.capture(s) as box["graph"]:
            step(arena, s)
            yield
            step(arena, s)

    it = steps()
    next(it)
    assert provider.capturing == {S: s.graph}
    if how == "close()":
        it.close()
    else:
        del it
    with pytest.raises(RuntimeError, match="block was left by GeneratorExit"):
        box["graph"].launch()
    assert_left_clean(provider, arena, box["graph"])


@pytest.mark.parametrize("exc", [KeyboardInterrupt, KeyError])
def test_a_capture_block_left_by_an_exception_discards_its_capture(misuse, exc):
    provider, arena, cupy = misuse
    s = cupy.cuda.Stream(S)
    with pytest.raises(exc), wsarena.capture(s) as graph:
        step(arena, s)
        raise exc("the step failed")
    assert graph.graph is None and "the block failed" in repr(graph)
    assert_left_clean(provider, arena, graph)


# The graph in each state


def test_a_graph_is_launched_and_described_as_its_state_allows(misuse):
    provider, arena, cupy = misuse
    s = cupy.cuda.Stream(S)
    with wsarena.capture(s) as graph:
        step(arena, s)
        assert repr(graph) == f"<CapturedGraph on {s!r} (capturing)>" and graph.closed
        with pytest.raises(RuntimeError, match="capture block has not ended"):
            graph.launch()
        assert cupy.launches == []
    assert repr(graph) == f"<CapturedGraph on {s!r}>" and not graph.closed
    graph.launch()
    graph.launch(S + 1)  # a raw handle
    graph.launch(FakeStream(S + 2))  # an object with __cuda_stream__
    graph.launch(cupy.cuda.Stream(S + 3))
    assert cupy.launches == [S, S + 1, S + 2, S + 3]
    with pytest.raises(TypeError, match="not a CUDA stream"):
        graph.launch("s")
    graph.close()
    graph.close()
    assert repr(graph) == f"<CapturedGraph on {s!r} (closed)>" and graph.closed
    with pytest.raises(RuntimeError, match="closed"):
        graph.launch()
    assert cupy.launches == [S, S + 1, S + 2, S + 3]
    assert_left_clean(provider, arena, graph)


def test_a_graph_closed_inside_its_capture_block_stays_closed(misuse):
    """close() inside the block discards what the block captures: the capture is ended as the block ends, and its
    graph destroyed. Once, the block's end made the closed graph launchable again."""
    provider, arena, cupy = misuse
    s = cupy.cuda.Stream(S)
    with wsarena.capture(s) as graph:
        step(arena, s)
        graph.close()
    assert graph.closed and graph.graph is None
    with pytest.raises(RuntimeError, match="closed"):
        graph.launch()
    assert_left_clean(provider, arena, graph)


# Bad arguments


@pytest.mark.parametrize(("mode", "error", "match"), [
    (0, TypeError, "mode must be a str"),
    (None, TypeError, "mode must be a str"),
    (b"relaxed", TypeError, "mode must be a str"),
    ("RELAXED", ValueError, "mode must be one of"),
    ("cudaStreamCaptureModeRelaxed", ValueError, "mode must be one of"),
])
def test_a_bad_mode_is_refused_before_anything_is_done(misuse, mode, error, match):
    provider, arena, cupy = misuse
    with pytest.raises(error, match=match), wsarena.capture(cupy.cuda.Stream(S), mode=mode):
        pass
    assert cupy.modes == [] and len(provider.allocations) == 1
    assert_left_clean(provider, arena)


class TorchLikeStream:
    cuda_stream = S


@pytest.mark.parametrize("stream", [S, 0, False, TorchLikeStream(), FakeStream(S), "s"])
def test_a_stream_that_is_not_cupys_is_refused_with_how_to_wrap_it(misuse, stream):
    provider, arena, cupy = misuse
    with pytest.raises(TypeError, match=r"cupy.cuda.Stream.*from_external"), wsarena.capture(stream):
        pass
    assert cupy.modes == [] and len(provider.allocations) == 1
    assert_left_clean(provider, arena)


@pytest.mark.parametrize("wrap", ["Stream.from_external", "ExternalStream"])
def test_another_librarys_stream_wrapped_by_cupy_is_captured(misuse, wrap):
    """CuPy 14 has two wrappers of a stream it did not make: Stream.from_external (of a __cuda_stream__ object), and
    ExternalStream (of a raw handle; deprecated, but not a Stream subclass, which capture() once refused)."""
    provider, arena, cupy = misuse
    if wrap == "ExternalStream":
        s = cupy.cuda.ExternalStream(S)
        assert not isinstance(s, cupy.cuda.Stream)
    else:
        s = cupy.cuda.Stream.from_external(FakeStream(S))
    with wsarena.capture(s) as graph:
        step(arena, s)
    assert len(graph.graph.fake_graph.pins) == 1
    assert_left_clean(provider, arena, graph)


def test_a_stream_cuda_refuses_to_answer_about_is_cudas_error_not_captured_already(misuse, monkeypatch):
    """CuPy raises a plain RuntimeError for an invalidated capture, and its CUDARuntimeError (a RuntimeError too) for
    a handle CUDA does not know or a sticky error: only the first means the stream is capturing."""
    provider, arena, cupy = misuse

    class CUDARuntimeError(RuntimeError):
        pass

    def refused(ptr):
        raise CUDARuntimeError("cudaErrorInvalidResourceHandle: invalid resource handle")

    monkeypatch.setattr(cupy.cuda.runtime, "streamIsCapturing", refused)
    with pytest.raises(CUDARuntimeError, match="invalid resource handle"), wsarena.capture(cupy.cuda.Stream(S)):
        pass
    assert cupy.modes == [] and len(provider.allocations) == 1
    assert_left_clean(provider, arena)


@pytest.mark.parametrize("handle", [0, 1])
def test_the_legacy_default_stream_is_refused(misuse, handle):
    provider, arena, cupy = misuse
    stream = cupy.cuda.Stream.null if handle == 0 else cupy.cuda.Stream.from_external(FakeStream(1))
    with pytest.raises(ValueError, match="legacy default stream cannot be captured"), wsarena.capture(stream):
        pass
    assert cupy.modes == [] and len(provider.allocations) == 1
    assert_left_clean(provider, arena)


def test_the_per_thread_default_stream_is_captured(misuse):
    provider, arena, cupy = misuse
    ptds = cupy.cuda.Stream.ptds
    with wsarena.capture(ptds) as graph:
        step(arena, ptds)
    assert len(graph.graph.fake_graph.pins) == 1
    assert_left_clean(provider, arena, graph)


# No arena yet


def test_a_capture_with_no_arena_yet_raises_capture_error_at_its_first_call(misuse):
    """No eager step ran, so the device has no arena: the capture begins, and its first call, which makes the arena
    (``make_device_arena``) and would have to grow it, says to run the step once first."""
    provider, arena, cupy = misuse
    set_arena(0, None)
    s = cupy.cuda.Stream(S)
    with pytest.raises(CaptureError, match="run the step once"), wsarena.capture(s) as graph:
        assert provider.capturing == {S: s.graph}
        set_arena(0, arena)  # what the first call's make_device_arena does
        with arena.lease(1000, stream=S):
            pass
    assert graph.closed and S not in arena.stats().streams
    assert_left_clean(provider, arena, graph)


# Threads and races


def test_two_threads_capture_on_their_own_streams_at_once(misuse):
    provider, arena, cupy = misuse
    both_in, graphs, errors = threading.Barrier(2, timeout=30), {}, []

    def captures(handle):
        try:
            s = cupy.cuda.Stream(handle)
            with wsarena.capture(s) as graphs[handle]:
                both_in.wait()  # each capture under way while the other is
                step(arena, s)
                both_in.wait()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=captures, args=(h,)) for h in (S, S + 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert all(len(graphs[h].graph.fake_graph.pins) == 1 for h in (S, S + 1))
    assert_left_clean(provider, arena, *graphs.values())


@pytest.mark.parametrize("other", ["trims", "leases on one-off streams"])
def test_captures_go_on_while_another_thread_trims_or_evicts_idle_streams(misuse, other):
    """Capture after capture on streams of their own, seeded with the buffer of a first graph's stream (a graph
    keeps it, whatever a trim or an eviction does), while another thread trims or leases on one-off streams: each
    capture keeps its seeded buffer until its step leases it."""
    provider, arena, cupy = misuse
    eager = cupy.cuda.Stream(S1)
    with wsarena.capture(eager) as first:  # on the eager step's stream: its buffer, pinned
        step(arena, eager)
    stop, errors = threading.Event(), []

    def churn():
        handle = 0x1000
        try:
            while not stop.is_set():
                if other == "trims":
                    arena.trim()
                else:
                    handle += 1
                    with arena.lease(100, stream=handle):
                        pass
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=churn)
    thread.start()
    graphs = [first]
    try:
        for i in range(50):
            s = cupy.cuda.Stream(S + i)
            with wsarena.capture(s) as graph:
                step(arena, s)
            graphs.append(graph)
    finally:
        stop.set()
        thread.join(60)
    assert errors == [] and all(len(g.graph.fake_graph.pins) == 1 for g in graphs)
    assert_left_clean(provider, arena, *graphs)


def test_a_capture_begun_on_the_stream_before_the_blocks_own_is_not_ended_by_the_block(misuse, monkeypatch):
    """Another thread begins a capture on the stream between the block's check and its begin_capture: CUDA refuses
    the block's, whose error leaves the other capture alone. Once, the block ended the other capture, as if its own
    had begun."""
    provider, arena, cupy = misuse
    s = cupy.cuda.Stream(S)
    begin = type(s).begin_capture
    theirs = []

    def others_first(self, mode=None):
        theirs.append(provider.begin_capture(self.ptr))
        begin(self, mode)

    monkeypatch.setattr(type(s), "begin_capture", others_first)
    with pytest.raises(RuntimeError, match="capturing already"), wsarena.capture(s):
        pass
    assert provider.capturing == {S: theirs[0]}
    provider.end_capture(theirs[0])
    theirs[0].close()
    assert_left_clean(provider, arena)


def test_a_block_refused_as_another_block_captures_its_stream_leaves_that_capture_its_record(misuse, monkeypatch):
    """Two blocks on one stream in two threads: the second checks that the stream is not captured before the first
    begins its capture, so it records the stream and is refused only by CUDA. The first capture keeps its record:
    frees with no stream (a device synchronisation) wait for it, and its stream object watches the buffer until it is
    over. Once, the refused block dropped the record, and a free with no stream was made during the capture."""
    provider, arena, cupy = misuse
    provider.stream_ids[S] = 1  # the stream's id: its buffer is watched by a stream object, checked when it dies
    eager = cupy.cuda.Stream(S)
    arena.reserve(1000, stream=eager)  # the eager step's, on the stream of the capture
    real, asked = wsarena.cudagraph._capturing, []

    def asked_before_the_first_began(runtime, ptr):
        asked.append(ptr)
        return len(asked) > 1 and real(runtime, ptr)

    first = cupy.cuda.Stream(S)
    with wsarena.capture(first) as graph:
        monkeypatch.setattr(wsarena.cudagraph, "_capturing", asked_before_the_first_began)
        second = cupy.cuda.Stream(S)
        with pytest.raises(RuntimeError, match="capturing already"), wsarena.capture(second):
            pass
        monkeypatch.setattr(wsarena.cudagraph, "_capturing", real)
        assert arena._table.capturing == {S: None}
        del second
        gc.collect()
        free_with_no_stream(arena, 0x700)  # another thread's
        step(arena, first)
    assert len(graph.graph.fake_graph.pins) == 1
    assert_left_clean(provider, arena, graph)


def test_a_block_whose_stream_another_block_began_to_capture_first_leaves_that_capture_alone(misuse, monkeypatch):
    """Two blocks on one stream in two threads: the second seeds and begins its capture between the first's seeding
    and its begin_capture, which CUDA refuses. The second capture keeps its record (frees with no stream wait for it)
    and its stream object goes on watching the buffer, whatever becomes of the first block's stream object. Once, the
    refused block dropped the record, and gave the buffer back to its own stream object, whose death then made the
    second capture's step a CaptureError."""
    provider, arena, cupy = misuse
    provider.stream_ids[S] = 1
    eager = cupy.cuda.Stream(S)
    arena.reserve(1000, stream=eager)
    seed = wsarena.cudagraph.seed_workspace
    second = cupy.cuda.Stream(S)
    blocks = []

    def the_other_block_begins_first(arena_, stream):
        if not blocks:
            blocks.append(wsarena.capture(second))
            blocks.append(blocks[0].__enter__())
        seed(arena_, stream)

    monkeypatch.setattr(wsarena.cudagraph, "seed_workspace", the_other_block_begins_first)
    first = cupy.cuda.Stream(S)
    with pytest.raises(RuntimeError, match="capturing already"), wsarena.capture(first):
        pass
    cm, graph = blocks
    assert arena._table.capturing == {S: None}
    del first
    gc.collect()
    free_with_no_stream(arena, 0x700)
    step(arena, second)
    cm.__exit__(None, None, None)
    assert len(graph.graph.fake_graph.pins) == 1
    assert_left_clean(provider, arena, graph)


def test_an_interrupt_in_the_block_after_the_capture_ended_by_hand_leaves_nothing(misuse):
    provider, arena, cupy = misuse
    s = cupy.cuda.Stream(S)
    with contextlib.suppress(KeyboardInterrupt), wsarena.capture(s) as graph:
        step(arena, s)
        theirs = s.end_capture()
        raise KeyboardInterrupt
    del theirs
    assert graph.closed
    assert_left_clean(provider, arena, graph)


def trim_paused_after_asking(monkeypatch, arena):
    """Another thread's ``arena.trim()``, paused once it asked which streams are seeded for a capture (CUDA is asked,
    without the arena's lock) and before it frees: it goes on when the returned event is set."""
    from wsarena.arena import _pinning

    asked, go_on = threading.Event(), threading.Event()
    real = _pinning.seeded_streams

    def asks_then_waits(arena_):
        seeded = real(arena_)
        asked.set()
        assert go_on.wait(30)
        return seeded

    monkeypatch.setattr(_pinning, "seeded_streams", asks_then_waits)
    trim = threading.Thread(target=arena.trim)
    trim.start()
    assert asked.wait(30)
    return trim, go_on


@pytest.mark.parametrize("block_is", ["seeded", "capturing"])
def test_a_trim_that_asked_before_a_capture_block_began_leaves_its_seeded_buffer(misuse, monkeypatch, block_is):
    """Another thread's trim asks which streams are seeded for a capture (CUDA is asked, without the arena's lock),
    then, before it frees, this thread's capture block records its stream and seeds it (and begins its capture).
    The trim leaves that buffer to the block's step. Once, it freed it, and the step raised CaptureError."""

    provider, arena, cupy = misuse
    trim, go_on = trim_paused_after_asking(monkeypatch, arena)
    s = cupy.cuda.Stream(S)
    seed = wsarena.cudagraph.seed_workspace

    def seed_then_let_the_trim_go_on(arena_, stream):
        seed(arena_, stream)
        if block_is == "seeded":
            go_on.set()
            trim.join(30)

    monkeypatch.setattr(wsarena.cudagraph, "seed_workspace", seed_then_let_the_trim_go_on)
    with wsarena.capture(s) as graph:
        if block_is == "capturing":
            go_on.set()
            trim.join(30)
        step(arena, s)
    assert not trim.is_alive() and len(graph.graph.fake_graph.pins) == 1
    assert_left_clean(provider, arena, graph)


def test_a_trim_that_asked_before_a_stream_was_recorded_again_leaves_the_new_blocks_seeded_buffer(misuse, monkeypatch):
    """The trim asks while the stream is recorded for a capture that is over (its block's end was interrupted before
    the record went), then a new block on that stream records it again, keeps the buffer it holds as its seed and
    begins its capture, before the trim frees. The trim leaves that buffer to the new block's step: the record it
    finds is not the one it asked about. Once, the stream was taken for the one asked about, found over, and the
    step raised CaptureError."""
    from wsarena.arena import _pinning

    from .interrupts import interrupt_at_entry_of

    provider, arena, cupy = misuse
    s = cupy.cuda.Stream(S)
    with pytest.raises(KeyboardInterrupt), interrupt_at_entry_of(_pinning.unwatch_capture), wsarena.capture(s) as first:
        pass  # no lease: the seeded buffer stays on S, pinned to nothing
    assert arena._table.capturing == {S: None} and arena.held_bytes(stream=S) > 0
    trim, go_on = trim_paused_after_asking(monkeypatch, arena)
    with wsarena.capture(s) as graph:  # S holds a buffer already: it is the seed
        go_on.set()
        trim.join(30)
        step(arena, s)
    assert not trim.is_alive() and len(graph.graph.fake_graph.pins) == 1
    assert_left_clean(provider, arena, first, graph)


@pytest.mark.parametrize("block_is", ["seeded", "capturing"])
def test_a_free_that_asked_before_a_stream_was_recorded_again_keeps_the_new_blocks_record(
    misuse, monkeypatch, block_is
):
    """Another thread's free with no stream asks whether the stream of a capture over (its block's end interrupted
    before the record went) is captured, finds it not, and forgets the record; meanwhile a new block on that stream
    recorded it again and kept the buffer it holds as its seed (and began its capture). The record forgotten is the
    old one only: the new block's stays, and a trim then leaves its seed. Once, the new record was forgotten, the
    trim freed the seed, and the step raised CaptureError."""
    from wsarena.arena import _pinning

    from .interrupts import interrupt_at_entry_of

    provider, arena, cupy = misuse
    s = cupy.cuda.Stream(S)
    with pytest.raises(KeyboardInterrupt), interrupt_at_entry_of(_pinning.unwatch_capture), wsarena.capture(s) as first:
        pass
    assert arena._table.capturing == {S: None}
    gone = FakeStream(S + 1)
    arena.reserve(10, stream=gone)
    del gone  # its buffer is freed with no stream once a new stream's sub-arena is made
    asked, go_on = threading.Event(), threading.Event()
    real, frees = _pinning._captured, None

    def answers_then_waits(capture, key):
        answer = real(capture, key)
        if key == S and threading.current_thread() is frees and not asked.is_set():
            asked.set()
            assert go_on.wait(30)

        return answer

    monkeypatch.setattr(_pinning, "_captured", answers_then_waits)

    def leases_on_a_new_stream():
        with arena.lease(10, stream=S + 2):
            pass

    frees = threading.Thread(target=leases_on_a_new_stream)
    seed = wsarena.cudagraph.seed_workspace

    def free_then_trim():
        go_on.set()
        frees.join(30)
        arena.trim()

    def seed_then_free_and_trim(arena_, stream):
        seed(arena_, stream)  # S holds a buffer already: it is the seed
        if block_is == "seeded":
            free_then_trim()

    monkeypatch.setattr(wsarena.cudagraph, "seed_workspace", seed_then_free_and_trim)
    frees.start()
    assert asked.wait(30)
    with wsarena.capture(s) as graph:
        if block_is == "capturing":
            free_then_trim()
        step(arena, s)
    assert not frees.is_alive() and len(graph.graph.fake_graph.pins) == 1
    assert_left_clean(provider, arena, first, graph)


def test_a_free_that_found_a_capture_over_keeps_the_record_of_the_next_capture_on_its_stream(misuse, monkeypatch):
    """Another thread asks, before a free with no stream, whether the capture that leased on S is over, finds it so,
    and forgets its record; meanwhile a new capture on S (begun by hand, as PyTorch's) leased there, recording S
    afresh. That record stays, and the next free with no stream waits for the new capture. Once, it was forgotten,
    and the free synchronised the device under the capture."""
    from wsarena.arena import _pinning

    provider, arena, _ = misuse
    arena.reserve(1000, stream=S)
    old, _ = capture_a_lease(provider, arena, stream=S)  # over, its graph alive: S stays recorded with its pin
    asked, go_on, real = threading.Event(), threading.Event(), _pinning._captured

    def answers_then_waits(capture, key):
        answer = real(capture, key)
        if key == S and threading.current_thread() is not main and not asked.is_set():
            asked.set()
            assert go_on.wait(30)
        return answer

    main = threading.current_thread()
    monkeypatch.setattr(_pinning, "_captured", answers_then_waits)
    frees = threading.Thread(target=_pinning._capture_under_way, args=(arena, None))
    frees.start()
    assert asked.wait(30)
    new = provider.begin_capture(S)
    with arena.lease(1000, stream=S):  # the new capture's step: its record of S
        pass
    go_on.set()
    frees.join(30)
    gone = FakeStream(S + 1)
    arena.reserve(10, stream=gone)
    del gone
    with arena.lease(10, stream=S + 2):  # a new stream: the dead one's buffer is let go, to be freed with no stream
        pass
    assert provider.during_capture == []
    provider.end_capture(new)
    arena.trim()
    assert provider.during_capture == []
    assert_left_clean(provider, arena, old, new)


# The same on a GPU: CUDA's and CuPy's own answers, which the fakes above stand for


@pytest.fixture
def gpu_arena():
    import cupy

    from wsarena.arena import CupyProvider

    device = cupy.cuda.Device().id
    made = Arena(CupyProvider(device))
    previous = set_arena(device, made)
    yield cupy, made
    set_arena(device, previous)
    made.close()


def _conv_operands(cupy):
    """x, w and out= of a small forward convolution (padding 1) on the GPU."""
    return (cupy.ones((4, 16, 32, 32), cupy.float32), cupy.ones((16, 16, 3, 3), cupy.float32),
            cupy.empty((4, 16, 32, 32), cupy.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["invalidated", "ended by hand"])
def test_a_capture_the_block_cannot_end_is_a_capture_error_on_a_gpu(gpu_arena, how):
    cupy, arena = gpu_arena
    x, w, y = _conv_operands(cupy)
    with cupy.cuda.Stream(non_blocking=True) as s:
        wsarena.conv_forward(x, w, padding=1, out=y)
        match = "invalidated.*capture again" if how == "invalidated" else "ended inside the block"
        with pytest.raises(CaptureError, match=match), wsarena.capture(s) as graph:
            wsarena.conv_forward(x, w, padding=1, out=y)
            if how == "invalidated":
                with pytest.raises(cupy.cuda.runtime.CUDARuntimeError):
                    s.synchronize()  # cannot be captured: CUDA invalidates the capture
            else:
                theirs = s.end_capture()
        assert not s.is_capturing() and graph.closed
        with pytest.raises(RuntimeError, match="capture again"):
            graph.launch()
        if how != "invalidated":
            del theirs
        with wsarena.capture(s) as again:  # the stream captures again
            wsarena.conv_forward(x, w, padding=1, out=y)
        again.launch()
        s.synchronize()
    assert arena._table.capturing == {} and arena.stats().leases == 0


@pytest.mark.gpu
def test_a_capture_begun_by_hand_after_the_blocks_own_was_ended_is_left_alone_on_a_gpu(gpu_arena):
    """CUDA gives the capture begun by hand another id than the block's: the block leaves it to its owner."""
    cupy, arena = gpu_arena
    x, w, y = _conv_operands(cupy)
    with cupy.cuda.Stream(non_blocking=True) as s:
        wsarena.conv_forward(x, w, padding=1, out=y)
        expected = pytest.raises(CaptureError, match="another begun there, which is left alone")
        with expected, wsarena.capture(s) as graph:
            wsarena.conv_forward(x, w, padding=1, out=y)
            ours = s.end_capture()
            s.begin_capture()
            wsarena.conv_forward(x, w, padding=1, out=y)  # their step
        assert s.is_capturing() and graph.closed
        theirs = s.end_capture()  # by its owner, into a graph that launches
        theirs.launch(s)
        s.synchronize()
        del ours, theirs
    assert arena.stats().leases == 0

