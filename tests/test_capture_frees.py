"""Frees held back while a stream is captured into a CUDA graph, without a GPU: a free on a captured stream would be
recorded into the graph, and one with no stream (a device synchronisation) would break the capture."""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import types
import weakref

import numpy as np
import pytest

import wsarena
import wsarena.arena._arena as arena_module
from wsarena.arena import Arena, _lifecycle, set_arena
from wsarena.arena.testing import FakeStream, RecordingProvider

from .capture_helpers import S1, S2, capture_a_lease, freed, freed_on
from .interrupts import interrupt_at_check, interrupt_at_entry_of

# its interrupting tests collect the garbage of every run: over the heap the suite leaves, minutes (conftest)
pytestmark = pytest.mark.usefixtures("frozen_heap")


class CaptureWatchingProvider(RecordingProvider):
    """Records each free made while its stream (or, with no stream, any stream) is being captured: CUDA would record
    ``cudaFreeAsync`` into the graph instead of freeing, and a device synchronisation would break the capture. Records
    too each stream id read while that stream is being captured: CUDA refuses ``cudaStreamGetId`` then, and in its
    global and thread-local modes the refusal invalidates the capture."""

    def __init__(self):
        super().__init__(device_id=0)
        self.during_capture = []
        self.read_in_capture = []

    def deallocate(self, buffer, *, stream):
        if stream in self.capturing or (stream is None and self.capturing):
            self.during_capture.append((buffer.ptr, stream))
        super().deallocate(buffer, stream=stream)

    def stream_id(self, stream):
        if stream in self.capturing:
            self.read_in_capture.append(stream)
        return super().stream_id(stream)

    def capture_info(self, stream):
        """cuda-bindings' ``cudaStreamGetCaptureInfo(stream)`` (its 7 values) for the captures made here: the status,
        and the id of an active capture, its graph's (which increase with each capture begun, as CUDA's are unique in
        the process). CUDA returns no valid id for another status: 0 here is a guess."""
        from cuda.bindings import runtime as rt

        status = rt.cudaStreamCaptureStatus
        graph = self.capturing.get(stream)
        if graph is None:
            return rt.cudaError_t.cudaSuccess, status.cudaStreamCaptureStatusNone, 0, None, [], [], 0
        if self.invalidates(stream):
            return rt.cudaError_t.cudaSuccess, status.cudaStreamCaptureStatusInvalidated, 0, None, [], [], 0
        return rt.cudaError_t.cudaSuccess, status.cudaStreamCaptureStatusActive, graph.id, graph, [], [], 0

    def invalidates(self, stream):
        """Whether the capture under way on ``stream`` was invalidated by an earlier error (never, here)."""
        return False


def test_a_buffer_is_not_freed_on_its_stream_while_that_stream_is_captured():
    """Capture, grow, release the graph, capture again on the same stream: the buffer the first graph held is let go
    during the second capture, whose first lease looks at the kept buffers. Its free waits for the capture to end.
    Once, it was freed at once on the captured stream (with AsyncProvider a cudaFreeAsync recorded into the new
    graph, to run at every replay)."""
    provider = CaptureWatchingProvider()
    arena = Arena(provider)
    arena.reserve(1000, stream=S1)
    graph, first = capture_a_lease(provider, arena)
    with arena.lease(50_000, stream=S1):  # an eager growth: the pinned buffer is kept aside
        pass
    graph.close()
    again = provider.begin_capture(S1)
    with arena.lease(1000, stream=S1):
        pass
    arena.stats()  # a call of no stream's own, while the capture goes on
    assert provider.during_capture == [] and first not in freed(provider)
    provider.end_capture(again)
    with arena.lease(10, stream=S2):  # the next call after the capture frees it, on its own stream
        pass
    assert (first, S1) in freed_on(provider) and provider.during_capture == []


def test_a_buffer_kept_for_a_graph_is_freed_with_no_stream_once_its_stream_object_died():
    """A stream object dies while a buffer of its stream is kept aside for a graph (outgrown after the capture): its
    stream may be destroyed, so once the graph is gone the buffer is freed with no stream (the provider waits for the
    device), as the stream's other buffers are, even where the next call, on another stream, frees it before the dead
    stream's sub-arena is forgotten. On the handle, it would be freed in the order of whatever stream CUDA gave the
    handle to since."""
    provider = CaptureWatchingProvider()
    arena = Arena(provider)
    with arena.lease(10, stream=S2):  # another stream's sub-arena, there before: its next lease makes none
        pass
    stream = FakeStream(0x70)
    arena.reserve(1000, stream=stream)
    graph, pinned = capture_a_lease(provider, arena, stream=stream)
    with arena.lease(50_000, stream=stream):  # an eager growth: the pinned buffer is kept aside for the graph
        pass
    del stream
    gc.collect()
    graph.close()
    with arena.lease(10, stream=S2):
        pass
    assert (pinned, None) in freed_on(provider) and (pinned, 0x70) not in freed_on(provider)
    assert provider.during_capture == []


def test_nothing_that_would_synchronise_the_device_is_freed_in_a_capture_block():
    """A stream object dies; its buffer is freed with no stream (the provider synchronises the device first) when
    a new sub-arena is made, or by a trim. Inside a capture block (its stream current) either waits until a call
    outside the capture: a synchronisation would break the capture."""
    provider = CaptureWatchingProvider()
    arena = Arena(provider)
    arena.reserve(1000, stream=S1)
    gone = [FakeStream(S2), FakeStream(0x53)]
    for stream in gone:
        arena.reserve(1000, stream=stream)
    del gone, stream
    gc.collect()
    provider.current = S1  # as in `with wsarena.capture(s)`: the capture stream is current
    graph = provider.begin_capture(S1)
    with arena.lease(1000, stream=0x54):  # an eager call on a stream of its own, made inside the capture block
        pass
    arena.trim()
    assert provider.during_capture == [] and [s for _, s in provider.frees] == [0x54]  # not captured: freed
    provider.end_capture(graph)
    arena.trim()
    # S1's too: the first trim forgot S1, whose owner may have destroyed it since the capture ended
    assert [s for _, s in provider.frees] == [0x54, None, None, None] and provider.during_capture == []
    graph.close()


@pytest.mark.parametrize("how", ["a new stream", "a trim"])
def test_nothing_that_would_synchronise_the_device_is_freed_while_another_thread_captures(how):
    """A capture in CUDA's global mode (PyTorch's default) is broken by a device synchronisation in any thread. While
    another thread captures S1 (its step has leased there), a call of this thread, whose stream and current stream
    are not captured, lets a dead stream's buffer go: its free with no stream waits until the capture is over. Once,
    only the draining call's stream and its thread's current stream were asked."""
    provider = CaptureWatchingProvider()
    arena = Arena(provider)
    arena.reserve(1000, stream=S1)
    gone = FakeStream(S2)
    arena.reserve(1000, stream=gone)
    del gone
    gc.collect()
    graph = provider.begin_capture(S1)  # in the other thread; this thread's current stream (0) is not captured
    with arena.lease(1000, stream=S1):  # the other thread's captured step
        pass
    if how == "a trim":
        arena.trim()
    else:
        with arena.lease(1000, stream=0x54):  # a stream new to the arena: dead streams' sub-arenas go
            pass
    assert provider.during_capture == [] and [s for _, s in provider.frees] == []
    provider.end_capture(graph)
    with arena.lease(10, stream=0x54):  # the next call after the capture frees it
        pass
    assert [s for _, s in provider.frees] == [None] and provider.during_capture == []
    with arena.lease(10, stream=0x54):
        pass
    assert arena._table.capturing == {}  # the capture over was seen, and forgotten: nothing more is asked
    graph.close()


class BlockingCaptureProvider(CaptureWatchingProvider):
    """Plays CUDA while a blocking stream is captured: asked whether the legacy default stream (0) is captured,
    cudaStreamIsCapturing fails with cudaErrorStreamCaptureImplicit, which the arena's capture() raises as a
    CaptureError. ``blocking``: the streams captured so."""

    def __init__(self):
        super().__init__()
        self.blocking = set()

    def capture(self, stream):
        if stream == 0 and self.blocking & set(self.capturing):
            raise wsarena.CaptureError("the legacy default stream (0) cannot be used while another stream of this "
                                       "device is being captured")
        return super().capture(stream)


def test_nothing_that_would_synchronise_the_device_is_freed_while_a_blocking_stream_unknown_to_the_arena_captures():
    """A capture on a blocking stream that the arena never used nor recorded (begun by another library, in another
    thread, no lease there yet) is seen only by asking the legacy default stream, which CUDA refuses then: a dead
    stream's buffer, freed with no stream (a device synchronisation, which would break that capture), waits until the
    capture is over, whatever the calling thread's current stream."""
    provider = BlockingCaptureProvider()
    arena = Arena(provider)
    gone = FakeStream(S2)
    arena.reserve(1000, stream=gone)
    del gone
    gc.collect()
    provider.current = S1  # the calling thread's current stream: its own, not captured
    provider.blocking.add(0x70)
    graph = provider.begin_capture(0x70)
    arena.trim()
    assert provider.during_capture == [] and provider.frees == []
    provider.end_capture(graph)
    arena.trim()
    assert [s for _, s in provider.frees] == [None] and provider.during_capture == []
    graph.close()


class AskedProvider(CaptureWatchingProvider):
    """Records each stream handle the arena asks whether it is captured (CUDA's cudaStreamIsCapturing)."""

    def __init__(self):
        super().__init__()
        self.asked = []

    def capture(self, stream):
        self.asked.append(stream)
        return super().capture(stream)


def test_a_keep_on_a_stream_object_asks_nothing_of_its_handle_once_the_object_is_gone():
    """A keep_with_capture on a stream given as an object (no lease there: a captured call the capture refused)
    records the stream, so that frees with no stream, and what graphs gone kept, wait while its capture may go on.
    Once the object is gone, its owner may have destroyed the stream: the next stats, which asks whether a capture
    is under way before it lets go of what a graph gone kept, asks nothing of that handle, and lets go. Once, the
    record held the handle alone, and CUDA was asked about a stream that may be destroyed (undefined behaviour)."""
    provider = AskedProvider()
    arena = Arena(provider)
    gone = provider.begin_capture(S1)  # a graph gone that kept an array: stats asks about captures before it goes
    assert arena.keep_with_capture([np.empty(8)], stream=S1)
    provider.end_capture(gone)
    gone.close()
    stream = FakeStream(0x70)
    graph = provider.begin_capture(0x70)
    assert arena.keep_with_capture([np.empty(16)], stream=stream)
    provider.end_capture(graph)
    assert 0x70 in arena._table.capturing
    del stream  # its owner destroys the stream
    gc.collect()
    provider.asked.clear()
    assert arena.stats().kept_bytes == 16 * 8  # what the graph gone kept went: no capture under way
    with arena.lease(10, stream=S2):
        pass
    arena.trim()
    assert provider.asked and 0x70 not in provider.asked and 0x70 not in arena._table.capturing
    graph.close()
    assert arena.stats().kept_bytes == 0


def test_a_keep_through_a_stream_object_made_for_it_leaves_the_capture_known_while_the_stream_is_watched():
    """A keep_with_capture through a stream object made for the call (cupy.cuda.ExternalStream(handle), say) on a
    stream whose buffer a live object of the program watches: the wrapper's death shows nothing of the stream, which
    lives on, being captured. Frees with no stream wait for the capture, as they do for a lease's. Once, the keep's
    record went with the wrapper, and a trim during the capture freed a dead stream's buffer with no stream (a device
    synchronisation, which breaks the capture)."""
    provider = CaptureWatchingProvider()
    arena = Arena(provider)
    stream = FakeStream(0x70)
    arena.reserve(1000, stream=stream)  # the program's stream, used before the capture
    gone = FakeStream(0x71)
    arena.reserve(1000, stream=gone)
    del gone  # its buffer is freed with no stream by the next trim
    gc.collect()
    graph = provider.begin_capture(0x70)  # no lease there yet
    assert arena.keep_with_capture([np.empty(8)], stream=FakeStream(0x70))
    gc.collect()
    arena.trim()
    assert provider.during_capture == [] and provider.frees == []
    provider.end_capture(graph)
    arena.trim()  # the dead stream's buffer, and the live one's, trimmed
    assert [s for _, s in provider.frees] == [None, None] and provider.during_capture == []
    graph.close()
    assert arena.stats().kept_bytes == 0


def _a_graph_that_kept_an_array(provider, arena):
    """A graph captured on S1 that kept an array, for the caller to close: once it is gone, what it kept waits for no
    capture under way. Returns the graph and a list that gets, as the array is dropped, what the provider was
    capturing then."""
    dropped = []
    kept = provider.begin_capture(S1)
    array = np.empty(256, np.uint8)
    weakref.finalize(array, lambda: dropped.append(dict(provider.capturing)))
    assert arena.keep_with_capture([array], stream=S1)
    provider.end_capture(kept)
    return kept, dropped


def _the_capture_ends_and_the_next_trim_lets_go(provider, arena, graph, dropped):
    """``graph``'s capture ends: the next trim drops what the graph gone kept, with no capture under way, and frees
    the dead stream's buffer with no stream; nothing is kept any more."""
    provider.end_capture(graph)
    arena.trim()
    gc.collect()
    assert dropped == [{}] and [s for _, s in provider.frees] == [None] and provider.during_capture == []
    graph.close()
    assert arena.stats().kept_bytes == 0


@pytest.mark.parametrize("given_as", ["the new stream's object", "its raw handle"])
def test_a_keep_on_a_handle_whose_last_keep_was_through_a_stream_object_gone_since_records_the_capture(given_as):
    """A keep through a stream object records the stream with a weak reference to it; the object dies with the stream
    (its owner destroys it), and CUDA gives the handle to a new stream, which a capture that only keeps records on
    (through its object, or its raw handle, as torch's integer). Frees with no stream, and what a graph gone kept,
    wait for that capture, in another thread too. Once, the keep left the record of the dead object in place, which
    says to ask nothing of the handle: the capture went unseen, and another thread's trim dropped what the graph
    gone kept (a cudaFree, with no pool) and freed a dead stream's buffer with no stream, during the capture."""
    provider = CaptureWatchingProvider()
    arena = Arena(provider)
    gone = FakeStream(0x71)
    arena.reserve(1000, stream=gone)
    del gone  # its buffer is freed with no stream by the next trim
    gc.collect()
    kept, dropped = _a_graph_that_kept_an_array(provider, arena)
    stream = FakeStream(0x70)
    graph = provider.begin_capture(0x70)
    assert arena.keep_with_capture([np.empty(16)], stream=stream)
    provider.end_capture(graph)
    graph.close()
    del stream  # its owner destroys the stream
    gc.collect()
    kept.close()  # nothing asked since: the dead object's record is there still
    new = FakeStream(0x70)  # CUDA gave the handle to a new stream
    graph = provider.begin_capture(0x70)
    assert arena.keep_with_capture([np.empty(8)], stream=new if given_as == "the new stream's object" else 0x70)
    thread = threading.Thread(target=arena.trim)
    thread.start()
    thread.join(10)
    gc.collect()
    assert dropped == [] and provider.frees == [] and provider.during_capture == []
    _the_capture_ends_and_the_next_trim_lets_go(provider, arena, graph, dropped)


@pytest.mark.parametrize("given_as", ["the new stream's object", "its raw handle"])
@pytest.mark.parametrize("death_seen", [True, False], ids=["death seen", "death not seen yet"])
def test_a_keep_on_a_handle_whose_buffer_was_watched_by_a_stream_object_dead_since_records_the_capture(
    given_as, death_seen
):
    """The stream object that watched a handle's buffer dies (its owner destroys the stream), and CUDA gives the handle
    to a new stream, which a capture that only keeps records on. A sweep of dead stream objects, and the forgetting
    of their sub-arenas, drop the record of their handles (never asked about again): not the keep's, made after the
    death, whether the arena saw the death before the keep or not. Once, each dropped it, in another thread's trim
    during the capture: the capture went unseen, and the trim freed the dead stream's buffer with no stream (a device
    synchronisation) and dropped what a graph gone kept (a cudaFree, with no pool), during it."""
    provider = CaptureWatchingProvider()
    arena = Arena(provider)
    old = FakeStream(0x70)
    arena.reserve(1000, stream=old)
    if death_seen:
        del old  # its owner destroys the stream: the arena sees it at its next sweep, the keep's below
        gc.collect()
    kept, dropped = _a_graph_that_kept_an_array(provider, arena)
    kept.close()
    if not death_seen:
        del old
        gc.collect()
    new = FakeStream(0x70)  # CUDA gave the handle to a new stream
    graph = provider.begin_capture(0x70)
    assert arena.keep_with_capture([np.empty(8)], stream=new if given_as == "the new stream's object" else 0x70)
    thread = threading.Thread(target=arena.trim)
    thread.start()
    thread.join(10)
    gc.collect()
    assert dropped == [] and provider.during_capture == []
    _the_capture_ends_and_the_next_trim_lets_go(provider, arena, graph, dropped)


def test_whether_a_capture_is_under_way_asks_each_arena_about_each_stream_once(monkeypatch):
    """The let-go of what graphs gone kept asks each arena whether a capture is under way, each through its own
    provider, about the streams that any arena of its device recorded: each arena about each stream once, the records
    read once. Once, each arena read every other's records again, and asked about a stream as many times as arenas
    recorded it, so that the questions grew with the square of the arenas alive (46 of them took a test past its
    timeout). A capture under way that only another arena recorded, in the world of this arena's provider, is still
    seen."""

    class Counting(RecordingProvider):
        def __init__(self):
            super().__init__(device_id=0)
            self.asked = []

        def capture(self, stream):
            self.asked.append(stream)
            return super().capture(stream)

    arenas, graphs = [], []
    monkeypatch.setattr(_lifecycle, "_live_arenas", lambda: list(arenas))
    monkeypatch.setattr(_lifecycle, "_closed_holding", {})
    for i in range(8):
        arena = Arena(Counting())
        for stream in (S1, 0x60 + i):  # a stream every arena recorded, and one of its own
            graphs.append(arena.provider.begin_capture(stream))
            assert arena.keep_with_capture([np.empty(8)], stream=stream)
            arena.provider.end_capture(graphs[-1])  # still recorded: nothing asked since
        arenas.append(arena)
    for arena in arenas:
        arena.provider.asked.clear()
    assert _lifecycle._no_capture_under_way()
    for arena in arenas:
        assert sorted(arena.provider.asked) == sorted([0, S1, *range(0x60, 0x68)])  # each once
        assert arena._table.capturing == {}  # found over, and forgotten
    first, last = arenas[0], arenas[-1]
    graphs.append(first.provider.begin_capture(0x70))
    assert first.keep_with_capture([np.empty(8)], stream=0x70)
    first.provider.end_capture(graphs[-1])
    graph = last.provider.begin_capture(0x70)  # no arena but the first recorded the stream
    assert not _lifecycle._no_capture_under_way()
    last.provider.end_capture(graph)
    assert _lifecycle._no_capture_under_way()
    for graph in graphs:
        graph.close()
    assert first.stats().kept_bytes == 0 and last.stats().kept_bytes == 0  # every arena's let go


def test_whether_a_capture_is_under_way_asks_nothing_about_a_kept_stream_once_its_object_is_gone(monkeypatch):
    """A keep through a stream object records the stream with a weak reference to it: once the object is gone (its
    owner destroys the stream with it), CUDA is asked nothing more about the handle. The question whether a capture
    is under way reads the streams each device's arenas recorded before asking any arena: the objects of those it
    read live until it has asked, so that none dies in between (another thread lets go of it) and is asked about after.
    Once, an arena asked after another had let go of the object: its own record, found gone, was dropped, and the
    handle, read earlier for the device, asked about all the same."""
    destroyed = set()  # the handles whose stream the owner destroyed (its object died)

    class Destroying(RecordingProvider):
        def __init__(self):
            super().__init__(device_id=0)
            self.after = []  # the handles asked about once their streams were destroyed
            self.on_question = None

        def capture(self, stream):
            if stream in destroyed:
                self.after.append(stream)
            answer = super().capture(stream)
            if self.on_question is not None:
                self.on_question(stream)
            return answer

    arenas = [Arena(Destroying()), Arena(Destroying())]
    monkeypatch.setattr(_lifecycle, "_live_arenas", lambda: list(arenas))
    monkeypatch.setattr(_lifecycle, "_closed_holding", {})
    first, second = arenas
    held = [FakeStream(0x70)]
    weakref.finalize(held[0], destroyed.add, 0x70)
    graph = second.provider.begin_capture(0x70)
    assert second.keep_with_capture([np.empty(8)], stream=held[0])
    second.provider.end_capture(graph)
    # another thread lets go of the stream object while the first arena asks about its handle
    first.provider.on_question = lambda stream: held.clear() if stream == 0x70 else None
    assert _lifecycle._no_capture_under_way()
    gc.collect()
    assert destroyed == {0x70}
    assert first.provider.after == [] and second.provider.after == []
    assert _lifecycle._no_capture_under_way()  # and never again
    assert first.provider.after == [] and second.provider.after == []
    graph.close()
    assert second.stats().kept_bytes == 0


def sibling(stream_type):
    """A class with ``stream_type``'s methods but not a subclass of it: CuPy's ExternalStream beside its Stream."""
    methods = {k: v for k, v in vars(stream_type).items() if k not in ("__dict__", "__weakref__")}
    return type("ExternalStream", (), methods)


class CUDARuntimeError(RuntimeError):
    """CuPy's error for a CUDA call that failed, with CUDA's status."""

    def __init__(self, status):
        super().__init__(f"CUDA error {status}")
        self.status = status


class FakeCupy:
    """What :func:`wsarena.capture` uses of CuPy, without CUDA: its streams begin and end captures on a
    :class:`CaptureWatchingProvider`. ``with stream:`` changes no current stream the provider answers with, so the
    arena's calls made inside the block stand for another thread's."""

    def __init__(self, provider):
        fake = self

        class Stream:
            def __init__(self, ptr):
                self.ptr = ptr
                self.graph = None

            def __enter__(self):
                return self

            def __exit__(self, *exc_info):
                pass

            def begin_capture(self, mode):
                if self.ptr in provider.capturing:
                    raise RuntimeError("cudaErrorIllegalState: the stream is capturing already")
                fake.modes.append(mode)
                self.graph = provider.begin_capture(self.ptr)

            def end_capture(self):  # whatever capture is under way on the stream, as CUDA ends it
                graph = provider.capturing.get(self.ptr)
                if graph is None:
                    raise RuntimeError("cudaErrorIllegalState: the stream is not capturing")
                return provider.end_capture(graph)

        self.modes = []
        runtime = types.SimpleNamespace(streamCaptureModeGlobal=0, streamCaptureModeThreadLocal=1,
                                        streamCaptureModeRelaxed=2, streamIsCapturing=provider.capturing.__contains__,
                                        CUDARuntimeError=CUDARuntimeError)
        self.cuda = types.SimpleNamespace(Stream=Stream, ExternalStream=sibling(Stream), runtime=runtime,
                                          Device=lambda: types.SimpleNamespace(id=0))


def as_cuda(monkeypatch, provider, cupy):
    """``cupy`` (a :class:`FakeCupy`) as the module ``cupy``, and cuda-bindings' capture query answered by
    ``provider``: what :func:`wsarena.capture` asks CUDA through."""
    from cuda.bindings import runtime as rt

    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(rt, "cudaStreamGetCaptureInfo", provider.capture_info)


@pytest.fixture
def captures(monkeypatch):
    """A device arena of device 0 over a CaptureWatchingProvider, and a CuPy that captures on it."""
    provider = CaptureWatchingProvider()
    with fake_gpu(monkeypatch, provider, FakeCupy) as (arena, cupy):
        yield provider, arena, cupy


@contextlib.contextmanager
def fake_gpu(monkeypatch, provider, cupy_type):
    """Device 0's arena, over ``provider``, and ``cupy_type(provider)`` as the module ``cupy``, for the block:
    what :func:`wsarena.capture` runs on without a GPU (at most 4 idle streams kept, to see them evicted)."""
    from wsarena import cudagraph
    from wsarena.arena import _table

    arena = Arena(provider)
    cupy = cupy_type(provider)
    monkeypatch.setattr(cudagraph, "gpu_unusable_reason", lambda: None)
    as_cuda(monkeypatch, provider, cupy)
    monkeypatch.setattr(_table, "MAX_IDLE_STREAMS", 4)
    previous = set_arena(0, arena)
    try:
        yield arena, cupy
    finally:
        set_arena(0, previous)


def test_frees_wait_for_a_global_capture_from_its_beginning_not_from_its_first_lease(captures):
    """wsarena.capture(mode="global") on a non-blocking stream of its own: until the step's first lease there, no
    question the arena asks sees the capture (not the legacy default stream's, which answers for blocking streams
    only), yet another thread's free with no stream, which synchronises the device, would break it. It waits; and the
    stream's seeded buffer is not evicted as idle before the step leases it. Once, the free was made at once."""
    provider, arena, cupy = captures
    arena.reserve(1000, stream=S1)  # the eager step's
    gone = FakeStream(S2)
    arena.reserve(1000, stream=gone)
    stream = cupy.cuda.Stream(0x60)
    with wsarena.capture(stream, mode="global") as graph:
        del gone  # another thread's stream, gone
        gc.collect()
        for handle in range(0x100, 0x108):  # other threads' calls: the dead stream's buffer goes, with no stream;
            # and one-off streams, idle ones evicted
            with arena.lease(100, stream=handle):
                pass
        assert provider.during_capture == [] and S2 not in [s for _, s in provider.frees]
        with arena.lease(1000, stream=0x60):  # the captured step, from the buffer seeded before the capture began
            pass
    assert cupy.modes == [0] and provider.during_capture == []
    arena.trim()  # the capture is over: the free waits no more
    assert None in [s for _, s in provider.frees] and provider.during_capture == []
    assert len(graph.graph.pins) == 1
    graph.graph.close()


@pytest.mark.parametrize("how", ["a trim", "idle streams evicted", "a free with no stream, then a trim"])
def test_the_seeded_buffer_outlasts_another_threads_trim_before_the_capture_begins(captures, monkeypatch, how):
    """Between the seeding of wsarena.capture's stream and the beginning of its capture, another thread's trim (or
    its calls on one-off streams, which evict idle ones) once freed the seeded buffer: the captured step, which
    cannot allocate, raised CaptureError."""
    provider, arena, cupy = captures
    arena.reserve(1000, stream=S1)  # the eager step's, on another stream
    stream = cupy.cuda.Stream(0x60)
    begin = type(stream).begin_capture

    def others_first(self, mode):
        if how == "idle streams evicted":
            for handle in range(0x100, 0x108):
                with arena.lease(100, stream=handle):
                    pass
        else:
            if how != "a trim":  # a dead stream's buffer, freed with no stream: the free asks about captures first
                gone = FakeStream(S2)
                arena.reserve(1000, stream=gone)
                del gone
                gc.collect()
                with arena.lease(100, stream=0x54):
                    pass
                assert S2 not in [s for _, s in provider.frees] and None in [s for _, s in provider.frees]
            arena.trim()
        begin(self, mode)

    monkeypatch.setattr(type(stream), "begin_capture", others_first)
    with wsarena.capture(stream) as graph, arena.lease(1000, stream=0x60) as ws:
        seeded = ws.ptr
    assert [b.ptr for b in provider.allocations if b.ptr == seeded] == [seeded]  # the seed, allocated once
    stats = arena.stats().streams[0x60]
    assert stats.pinned_bytes == stats.capacity_bytes > 0 and arena._table.capturing == {}
    graph.graph.close()


def test_a_seeding_that_fails_begins_no_capture_and_leaves_nothing_recorded(captures):
    provider, arena, cupy = captures
    arena.reserve(1000, stream=S1)
    provider.fail_next = 1
    with pytest.raises(wsarena.ArenaOutOfMemoryError), wsarena.capture(cupy.cuda.Stream(0x60)):
        pass
    assert cupy.modes == [] and arena._table.capturing == {}
    arena.trim()
    assert arena.stats().capacity_bytes == 0


@pytest.mark.parametrize("trigger", ["stats", "trim", "growth"])
@pytest.mark.parametrize(
    "known_by", ["a lease", "a keep", "another arena's lease", "a capture block", "a capture block that raises"]
)
def test_what_a_graph_gone_kept_is_not_dropped_while_a_capture_is_under_way(captures, known_by, trigger):
    """An array a graph kept goes once CUDA has destroyed the graph, but dropping it may free its device memory
    (cudaFree, where the allocator keeps no pool), which a capture forbids (in CUDA's global mode, from any thread).
    While a capture that an arena knows of is under way (one that leased, or kept, from this arena or another of the
    device, or a wsarena.capture block's, before any lease), the trim, stats or growth of an arena, in the thread that
    captures or another, leaves it; the first one after the capture lets go of it, and so does the end of the block,
    one that raised too. Once, any of them dropped it at once; and a block that raised skipped its let-go."""
    provider, arena, cupy = captures
    other = Arena(provider)  # another arena of device 0
    for stream in (S1, S2, 0x60):  # every stream holds its buffer already: the block seeds nothing
        arena.reserve(1000, stream=stream)
    other.reserve(1000, stream=S2)
    dropped = []  # what the provider captured as each kept array was dropped

    def kept_array():
        array = np.empty(256, np.uint8)
        weakref.finalize(array, lambda: dropped.append(dict(provider.capturing)))
        return array

    gone = provider.begin_capture(S1)
    assert arena.keep_with_capture([kept_array()], stream=S1)
    provider.end_capture(gone)
    gone.close()  # its arrays wait for the next trim, stats or growth
    assert arena.stats().kept_bytes == 0 and dropped == [{}]
    gone = provider.begin_capture(S1)
    assert arena.keep_with_capture([kept_array(), kept_array()], stream=S1)
    provider.end_capture(gone)
    gone.close()

    sizes = iter(range(50_000, 1 << 20, 50_000))

    def look():
        if trigger == "growth":
            arena.reserve(next(sizes), stream=0x70)  # grows the buffer
        else:
            getattr(arena, trigger)()

    if known_by in ("a capture block", "a capture block that raises"):
        with contextlib.suppress(KeyError), wsarena.capture(cupy.cuda.Stream(0x60)):
            look()
            gc.collect()
            assert dropped == [{}]
            if known_by == "a capture block that raises":
                raise KeyError("the step failed")
        gc.collect()  # the block's end let them go, its capture over (discarded, where it raised)
        assert dropped == [{}] * 3 and provider.capturing == {}
        return
    graph = provider.begin_capture(S2)
    if known_by == "a lease":
        with arena.lease(1000, stream=S2):
            pass
    elif known_by == "a keep":
        assert arena.keep_with_capture([np.empty(8)], stream=S2)
    else:
        with other.lease(1000, stream=S2):
            pass
    look()
    thread = threading.Thread(target=look)
    thread.start()
    thread.join(10)
    gc.collect()
    assert dropped == [{}] and arena.stats().kept_bytes == 512 + (8 * 8 if known_by == "a keep" else 0)
    provider.end_capture(graph)
    look()
    gc.collect()
    assert dropped == [{}] * 3 and provider.during_capture == []
    graph.close()


def test_a_block_that_raised_and_could_not_end_its_capture_lets_go_of_nothing_a_graph_gone_kept(captures, monkeypatch):
    """A block that raised, whose capture CUDA refused to end (still under way, as far as it can be told), skips the
    let-go of what graphs gone kept: dropping it may free device memory, which the capture forbids. The first trim
    after the capture ended lets go of it."""
    provider, arena, cupy = captures
    for stream in (S1, 0x60):  # the block seeds nothing
        arena.reserve(1000, stream=stream)
    dropped = []  # what the provider captured as the kept array was dropped
    array = np.empty(256, np.uint8)
    weakref.finalize(array, lambda: dropped.append(dict(provider.capturing)))
    gone = provider.begin_capture(S1)
    assert arena.keep_with_capture([array], stream=S1)
    provider.end_capture(gone)
    gone.close()  # its array waits for the next trim, stats or growth
    del array
    stream = cupy.cuda.Stream(0x60)

    def refused(self):
        raise CUDARuntimeError(700)

    monkeypatch.setattr(type(stream), "end_capture", refused)
    with pytest.raises(KeyError), wsarena.capture(stream):
        raise KeyError("the step failed")
    gc.collect()
    assert dropped == [] and 0x60 in provider.capturing
    provider.end_capture(provider.capturing[0x60])
    arena.trim()
    gc.collect()
    assert dropped == [{}]


@pytest.mark.parametrize("block", ["leases elsewhere", "raises"])
def test_the_stream_of_a_capture_block_is_not_watched_once_the_block_is_over(captures, block):
    """wsarena.capture records its stream as captured from its beginning, before any lease there. The block leases
    no workspace there (its step ran on another stream, or failed first): once it is over, no free waits for that
    capture, and the stream's seeded buffer is evicted as idle. Once, the stream stayed recorded until a free with no
    stream came: its buffer kept for good, and CUDA then asked about a handle whose stream may be destroyed."""
    provider, arena, cupy = captures
    arena.reserve(1000, stream=S1)
    stream = cupy.cuda.Stream(0x60)
    with contextlib.suppress(KeyError), wsarena.capture(stream):  # seeds 0x60 with S1's 1000 bytes
        with arena.lease(100, stream=0x61):  # another thread's call, not captured
            pass
        if block == "raises":
            raise KeyError("the step failed")
    assert arena._table.capturing == {}
    for handle in range(0x100, 0x108):  # one-off streams: idle ones evicted
        with arena.lease(100, stream=handle):
            pass
    assert 0x60 not in arena.stats().streams and provider.during_capture == []


@pytest.mark.parametrize("trim_in", ["this thread", "another thread"])
def test_a_trim_before_the_first_lease_of_a_capture_block_leaves_the_seeded_buffer(captures, trim_in):
    """wsarena.capture gives its stream, before the capture begins, the largest buffer the arena holds: a capture
    cannot grow the arena. A trim inside the block before the step's first lease there (that buffer idle, not yet
    pinned to the graph) leaves it to the step, whose lease gets it; the trim frees what is not captured. Once, the
    trim let the seeded buffer go (its free held back until the capture ended) and the first lease of the captured
    step raised CaptureError for want of a buffer."""
    provider, arena, cupy = captures
    arena.reserve(1000, stream=S1)  # the eager step's, on another stream
    eager = provider.allocations[-1].ptr
    stream = cupy.cuda.Stream(0x60)
    with wsarena.capture(stream) as graph:
        seeded = provider.allocations[-1].ptr
        if trim_in == "this thread":
            arena.trim()
        else:
            other = threading.Thread(target=arena.trim)
            other.start()
            other.join(10)
        with arena.lease(1000, stream=0x60) as ws:  # the captured step
            assert ws.ptr == seeded
    assert freed(provider) == [eager] and provider.during_capture == []
    assert len(graph.graph.pins) == 1
    graph.graph.close()
    arena.trim()  # the graph is gone: its buffer goes too
    assert provider.held == []


def test_a_trim_after_a_capture_block_whose_end_was_interrupted_frees_the_seeded_buffer(captures):
    """A Ctrl-C as a wsarena.capture block ends, once its capture is over but before the arena stops watching its
    stream, leaves the stream recorded as seeded for a capture that will never lease there. The capture is over, no
    graph holds the buffer, and a trim frees it. Once, the trim kept it for as long as the stale record stayed."""
    from wsarena.arena._pinning import unwatch_capture

    provider, arena, cupy = captures
    arena.reserve(1000, stream=S1)  # the eager step's, on another stream
    stream = cupy.cuda.Stream(0x60)
    interrupted = pytest.raises(KeyboardInterrupt)
    with interrupted, interrupt_at_entry_of(unwatch_capture), wsarena.capture(stream) as graph:
        pass  # no lease there: the seeded buffer is pinned to nothing
    assert not arena.capturing(stream=0x60) and graph.graph is not None  # the capture ended
    assert len(provider.held) == 2  # the eager step's buffer and the one seeded on the captured stream
    held = provider.held_bytes
    assert arena.trim() == held
    assert provider.held == [] and provider.during_capture == []


def test_a_capture_block_on_a_stream_captured_already_is_refused_and_leaves_that_capture_alone(captures):
    """A stream another capture is recording (PyTorch's, say, whose step leased there) is refused before anything is
    recorded or ended. Once, the block recorded the stream as beginning, over the other capture's record, then
    ended that capture (begin_capture having failed) and dropped its record."""
    provider, arena, cupy = captures
    arena.reserve(1000, stream=0x60)
    other = provider.begin_capture(0x60)
    with arena.lease(1000, stream=0x60):  # the other capture's step
        pass
    recorded = dict(arena._table.capturing)
    with pytest.raises(ValueError, match="captured already"), wsarena.capture(cupy.cuda.Stream(0x60)):
        pass
    assert provider.capturing == {0x60: other} and arena._table.capturing == recorded and cupy.modes == []
    provider.end_capture(other)
    other.close()


def _captured_step(arena, stream, kept):
    # The block's context manager outlives the run, as a user's `cm = wsarena.capture(s)` does: a Ctrl-C that leaves
    # the block with its capture begun and no __exit__ to come is not hidden by the object's collection, which would
    # discard the capture.
    kept.append(wsarena.capture(stream))
    with kept[-1], arena.lease(1000, stream=stream.ptr):
        pass


def _not_the_arenas(code):
    """Checks left out: the provider's own code (a free cut short there may lose its buffer, which the arena has let
    go already) and the test doubles'."""
    return code.co_filename.replace("\\", "/").endswith(("arena/providers.py", "arena/testing.py"))


def test_an_interrupt_at_any_check_of_a_capture_block_leaves_no_capture_begun_and_loses_no_buffer(monkeypatch):
    """Ctrl-C at every place CPython runs a signal handler in wsarena's code of a capture block (its seeding, the
    beginning of its capture, the watch of its stream, the captured step's lease, the end), one run each: afterwards
    the stream is not capturing, nothing was freed during a capture, the arena keeps no record of the stream but, at
    most, that of a capture over, and once the graph is gone a trim frees every buffer. Once, a Ctrl-C just after
    begin_capture returned, before the block that ends a capture it interrupts, left the stream capturing for good,
    and its seeded buffer held back behind that capture."""
    from wsarena import cudagraph
    from wsarena.arena._pinning import BEGINNING

    monkeypatch.setattr(cudagraph, "gpu_unusable_reason", lambda: None)
    n = 1
    while True:
        provider = CaptureWatchingProvider()
        arena = Arena(provider)
        cupy = FakeCupy(provider)
        as_cuda(monkeypatch, provider, cupy)
        arena.reserve(1000, stream=S1)  # the eager step's, on another stream: the capture's is seeded
        stream = cupy.cuda.Stream(0x60)
        previous = set_arena(0, arena)
        gc.collect()  # earlier garbage is not collected in the traced run (its finalizers would get the interrupt)
        kept = []
        try:
            fired = interrupt_at_check(n, _captured_step, arena, stream, kept, skip=_not_the_arenas)
        finally:
            set_arena(0, previous)
        where = f"interrupted at check {n}"
        assert provider.capturing == {} and provider.during_capture == [], where
        # At most the record of a capture over (an end cut short before it went), which a trim finds over
        assert BEGINNING not in arena._table.capturing.values(), where
        if stream.graph is not None:  # CuPy's graph, dropped by the block or not: destroyed once collected
            stream.graph.close()
        arena.trim()
        assert provider.held == [], where
        del kept
        if not fired:
            break
        n += 1
    assert n > 30  # it reached the capture's own code and the lease's, not only the seeding


def _hold_back_a_buffer(provider, arena, stream):
    """Capture ``stream`` (a stream object on handle S1), let an eager growth keep the pinned buffer aside, release the
    graph, and capture S1 again: the buffer is let go during the second capture, and its free on S1 held back. Returns
    its address and the graph."""
    arena.reserve(1000, stream=stream)  # the arena begins to watch the stream: reads its id, 1
    graph, first = capture_a_lease(provider, arena, stream=stream)
    with arena.lease(50_000, stream=stream):
        pass
    graph.close()
    again, _ = capture_a_lease(provider, arena, stream=stream)
    assert first not in freed(provider)
    return first, again


@pytest.fixture
def watched():
    """A device arena over a CaptureWatchingProvider, and a stream object on S1 whose id is 1."""
    provider = CaptureWatchingProvider()
    provider.stream_ids[S1] = 1
    return provider, Arena(provider), FakeStream(S1)


def test_a_buffer_held_back_on_a_captured_stream_is_not_freed_on_a_new_stream_given_its_handle(watched):
    """The free of a buffer held back while its stream was captured keeps that stream's handle. The stream is
    destroyed, and CUDA gives the handle to a new stream, before the next call: the buffer is freed with no stream
    (after the device is idle, as a dead stream's are), not in the new stream's order, where the dead stream's work
    would not be waited for. Once, it was freed on the handle, in the new stream's order."""
    provider, arena, stream = watched
    first, graph = _hold_back_a_buffer(provider, arena, stream)
    provider.stream_ids[S1] = 2  # S1 is destroyed, and its handle names a new stream now
    with arena.lease(10, stream=S2):  # the next call
        pass
    assert (first, None) in freed_on(provider) and provider.during_capture == []
    assert arena._table.held_back == {}
    graph.close()


def test_a_buffer_held_back_on_a_stream_that_lives_on_is_freed_in_its_order(watched):
    provider, arena, stream = watched
    first, graph = _hold_back_a_buffer(provider, arena, stream)
    with arena.lease(10, stream=S2):
        pass
    assert (first, S1) in freed_on(provider) and provider.during_capture == []
    graph.close()


@pytest.mark.parametrize("handle_names", ["the same stream", "a new stream"])
def test_a_buffer_held_back_waits_while_its_handle_is_captured_again_and_no_stream_id_is_read_then(
    watched, handle_names
):
    """The handle is captured again before the next call: by its own stream, or by a new stream given it. The buffer
    waits until that capture is over: a free on the handle would be recorded into the graph, and one with no stream
    (the new stream's case) would break the capture. CUDA refuses cudaStreamGetId on a stream being captured, and in
    its global and thread-local modes (PyTorch's default is global) the refusal invalidates the capture: the buffer is
    matched with the id the arena read when it began to watch the stream, and the handle's id is read only once no
    capture is under way on it. Once, the id was read as the buffer was held back, and at each call while the handle
    was captured again."""
    provider, arena, stream = watched
    first, graph = _hold_back_a_buffer(provider, arena, stream)
    if handle_names == "a new stream":
        provider.stream_ids[S1] = 2
    new = provider.begin_capture(S1)
    with arena.lease(10, stream=S2):
        pass
    assert first not in freed(provider)
    provider.end_capture(new)
    with arena.lease(10, stream=S2):
        pass
    stream_of_free = S1 if handle_names == "the same stream" else None
    assert (first, stream_of_free) in freed_on(provider) and provider.during_capture == []
    assert provider.read_in_capture == []
    graph.close()


@pytest.mark.parametrize("drained_by", ["a new lease", "the end of a lease taken before"])
def test_a_buffer_held_back_on_a_stream_whose_object_died_is_freed_with_no_stream_and_no_question(drained_by):
    """The stream object dies after the capture, before the next call: CuPy destroys its stream with it, and CUDA may
    give the handle to the next stream made, in whose order the buffer would then be freed (CuPy's pool files it under
    the handle). It is freed with no stream, as the stream's other buffers are, and CUDA is asked nothing about the
    handle, which may name no stream (cudaStreamGetId and cudaStreamIsCapturing read through it). Once, its id was
    read, found the same, and the buffer freed on the dead stream's handle."""
    provider = CaptureWatchingProvider()
    provider.stream_ids[S1] = 1
    arena = Arena(provider)
    stream = FakeStream(S1)
    lease = arena.lease(10, stream=S2)
    if drained_by != "a new lease":
        lease.__enter__()  # before the buffer is held back: its end is the first call after the stream dies
    first, graph = _hold_back_a_buffer(provider, arena, stream)
    reads = len(provider.id_reads)
    del stream
    gc.collect()
    if drained_by == "a new lease":
        with lease:
            pass
    else:
        lease.__exit__(None, None, None)  # no new sub-arena, so no sweep, before the queue is drained
    assert (first, None) in freed_on(provider) and provider.during_capture == []
    assert S1 not in provider.id_reads[reads:]
    graph.close()


@pytest.mark.parametrize("given_as", ["a raw handle", "a stream object"])
@pytest.mark.parametrize("forgotten_by", ["a trim", "close"])
def test_a_buffer_held_back_whose_stream_was_forgotten_is_freed_with_no_stream(given_as, forgotten_by):
    """The stream's owner captures it with no lease of the arena there (a step of its own), and a trim or a close lets
    the stream's buffer go and forgets the stream meanwhile: the free, on the captured stream, is held back. Nothing of
    the arena uses the stream from then on: once the capture is over, its owner may destroy it and CUDA give its handle
    to the next stream made. The buffer is freed with no stream once no capture is under way on the handle, as a
    forgotten stream's buffers that graphs held are. Once, it was freed on the handle, in the new stream's order (that
    of a stream object too, whose sub-arena was forgotten before the drain held the buffer back)."""
    provider = CaptureWatchingProvider()
    provider.stream_ids[S1] = 1
    arena = Arena(provider)
    stream = S1 if given_as == "a raw handle" else FakeStream(S1)
    arena.reserve(1000, stream=stream)
    first = arena._subs[S1].block.ptr
    graph = provider.begin_capture(S1)
    if forgotten_by == "a trim":
        arena.trim()
    else:
        arena.close()
    assert arena.stats().streams == {} and first not in freed(provider)  # a call while the capture goes on: it waits
    provider.end_capture(graph)
    del stream
    gc.collect()
    provider.stream_ids[S1] = 2  # S1 is destroyed, and its handle names a new stream now
    arena.stats()  # the next call
    assert (first, None) in freed_on(provider) and provider.during_capture == [] and provider.read_in_capture == []
    assert provider.held == [] and arena._table.held_back == {}
    graph.close()


@pytest.mark.parametrize("given_as", ["a raw handle", "a stream object"])
def test_a_buffer_held_back_when_its_arena_is_collected_is_freed_with_no_stream(given_as):
    """An arena is collected while a capture goes on: the free of a buffer let go during the capture, on the captured
    stream, is held back, and the closed arena the collected one hands its buffers to frees it once the capture is
    over. As its other buffers, it is freed with no stream: the stream may be gone with the arena (its owner destroyed
    it, and CUDA gave its handle to the next stream made), whether it was given as a raw handle or through an object.
    Once, a raw handle's was freed on that handle, which the arena had never watched."""
    provider = CaptureWatchingProvider()
    provider.stream_ids[S1] = 1
    arena = Arena(provider)
    stream = S1 if given_as == "a raw handle" else FakeStream(S1)
    arena.reserve(1000, stream=stream)
    graph, first = capture_a_lease(provider, arena, stream=stream)
    with arena.lease(50_000, stream=stream):  # an eager growth: the pinned buffer is kept aside
        pass
    graph.close()
    again = provider.begin_capture(S1)
    with arena.lease(1000, stream=stream):  # its free, on S1, is held back for the capture
        pass
    del arena
    gc.collect()
    assert first not in freed(provider)
    provider.end_capture(again)
    provider.stream_ids[S1] = 2  # S1 is destroyed, and its handle names a new stream now
    Arena(provider).stats()  # frees what closed arenas held
    assert (first, None) in freed_on(provider) and provider.during_capture == []
    again.close()


def test_a_buffer_a_graph_held_on_another_threads_per_thread_stream_is_freed_with_no_stream():
    """A thread captures a lease on its per-thread default stream (handle 2), then outgrows that buffer eagerly: the
    graph's buffer is kept aside. Once the graph is gone, another thread's call frees it. Handle 2 names the calling
    thread's own per-thread stream, which is not ordered with the owner's: the free is made with no stream (the
    provider waits for the device), as every other buffer of another thread's per-thread stream is. Once, the kept
    buffer kept the handle it was kept with, 2, and was freed in the order of the wrong stream."""
    provider = RecordingProvider(device_id=0)
    arena = Arena(provider)
    kept, done, box = threading.Event(), threading.Event(), {}

    def owner():
        arena.reserve(1000, stream=2)
        box["graph"], box["pinned"] = capture_a_lease(provider, arena, stream=2)
        with arena.lease(50_000, stream=2):  # an eager growth: the pinned buffer is kept aside
            pass
        kept.set()
        done.wait(60)  # the owner lives on: its stream is not gone

    thread = threading.Thread(target=owner)
    thread.start()
    try:
        assert kept.wait(60)
        box["graph"].close()
        arena.stats()  # this thread lets go of what graphs no longer hold
        assert (box["pinned"], None) in freed_on(provider)
    finally:
        done.set()
        thread.join(60)


@pytest.mark.parametrize("put_back", ["after close()", "as close() decides"])
def test_a_close_while_another_threads_drain_holds_back_a_buffer_keeps_the_arena_until_it_is_freed(
    monkeypatch, put_back
):
    """Another thread's trim drains the queue: it takes off the buffer of a stream being captured (set aside) and frees
    the next one, and only then puts the first back. A close() in between sees the queue empty. The closed arena is
    kept all the same, and that buffer is freed by the next stats() of any arena once the capture is over (with no
    stream: the trim forgot S1, whose owner may have destroyed it since). Once, close() decided whether to keep the
    arena after letting go of its lock, from what it saw then: the buffer was never freed while the arena lived (and,
    collected, its finalizer freed it at once, capture or not)."""

    class GatedFrees(RecordingProvider):
        def __init__(self):
            super().__init__(device_id=0)
            self.freeing, self.gate = threading.Event(), threading.Event()

        def deallocate(self, buffer, *, stream):
            if stream == S2:
                self.freeing.set()
                assert self.gate.wait(10)
            super().deallocate(buffer, stream=stream)

    provider = GatedFrees()
    arena = Arena(provider)
    arena.reserve(1000, stream=S1)
    arena.reserve(1000, stream=S2)
    held_back, other = arena._subs[S1].block.ptr, arena._subs[S2].block.ptr
    graph = provider.begin_capture(S1)  # begun elsewhere: no lease of it came here
    trim = threading.Thread(target=arena.trim)
    if put_back == "as close() decides":
        keep = arena_module.keep_while_holding

        def deciding(arena, holding):
            if threading.current_thread() is not trim:  # this thread's close(), not the trim's release_closed()
                provider.gate.set()
                trim.join(0.5)  # the drain puts the buffer back and keeps the arena, unless close() holds the lock
            keep(arena, holding)

        monkeypatch.setattr(arena_module, "keep_while_holding", deciding)
    trim.start()
    try:
        assert provider.freeing.wait(10)  # S1's buffer set aside, S2's being freed
        arena.close()
    finally:
        provider.gate.set()
        trim.join(10)
    assert freed_on(provider) == [(other, S2)]
    successor = Arena(provider)
    successor.stats()
    assert freed_on(provider) == [(other, S2)]  # the capture goes on
    provider.end_capture(graph)
    successor.stats()
    assert freed_on(provider) == [(other, S2), (held_back, None)]
    graph.close()
