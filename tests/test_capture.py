"""CUDA graph capture without a GPU: the pinning rules and the CaptureError cases, with a provider whose capture
status the test controls (wsarena.arena.testing.FakeGraph holds the arena's pins as a CUDA graph holds user objects,
and runs their C destructors when closed)."""

from __future__ import annotations

import ctypes
import gc
import inspect
import os
import pickle
import sys
import warnings
import weakref

import numpy as np
import pytest

import wsarena
from tests.reference import ref_conv_forward
from wsarena.algos import run_with_fallback
from wsarena.arena import Arena, Buffer, HostProvider, _lifecycle, _pinning, set_arena
from wsarena.arena._pins import GraphPin
from wsarena.arena.testing import FakeStream, RecordingProvider
from wsarena.backends import Candidate

from .capture_helpers import S1, S2, capture_a_lease, freed, freed_on
from .forking import fork


@pytest.fixture
def device():
    provider = RecordingProvider(device_id=0)
    return provider, Arena(provider)


def test_a_lease_during_capture_uses_the_streams_buffer_and_pins_it(device):
    provider, arena = device
    with arena.lease(1000, stream=S1) as ws:
        eager = ws.ptr
    graph = provider.begin_capture(S1)
    assert arena.capturing(stream=S1) and not arena.capturing(stream=S2)
    with arena.lease(1000, stream=S1) as ws:
        assert ws.ptr == eager  # the address the captured kernel keeps
    with arena.lease(600, stream=S1) as ws:
        assert ws.ptr == eager
    provider.end_capture(graph)
    assert len(graph.pins) == 1  # one pin per graph, however many leases it captured
    stats = arena.stats()
    assert stats.streams[S1].pinned_bytes == stats.streams[S1].capacity_bytes == stats.pinned_bytes > 0
    assert len(provider.allocations) == 1


def test_stats_count_what_pins_keep_apart_from_the_buffers_they_pin(device):
    """kept_bytes: the arrays kept for the graphs of this arena's pins that exist, from a capture's first keep (under
    way too), over the streams a graph captured; pinned_bytes stays the workspace buffers'. Another arena of the device
    counts what its own pins keep. 0 once the graphs are destroyed."""
    provider, arena = device
    other = Arena(provider)
    a, b, c = np.empty(1000, np.uint8), np.empty(300, np.float64), np.empty(7, np.int32)
    arena.reserve(1000, stream=S1)
    graph = provider.begin_capture(S1, S2)  # one graph, forked to two streams
    with arena.lease(1000, stream=S1):
        pass
    assert arena.keep_with_capture([a], stream=S1) and arena.keep_with_capture([b], stream=S2)
    assert other.keep_with_capture([c], stream=S1)
    assert arena.stats().kept_bytes == 1000 + 300 * 8
    provider.end_capture(graph)
    later = provider.begin_capture(S2)
    assert arena.keep_with_capture([c], stream=S2)
    provider.end_capture(later)
    stats = arena.stats()
    assert (stats.kept_bytes, other.stats().kept_bytes) == (1000 + 300 * 8 + 7 * 4, 7 * 4)
    assert stats.pinned_bytes == stats.streams[S1].capacity_bytes == arena.held_bytes(stream=S1) > 0
    graph.close()
    assert (arena.stats().kept_bytes, other.stats().kept_bytes) == (7 * 4, 0)
    later.close()
    assert arena.stats().kept_bytes == 0


def test_a_lease_carries_the_pin_of_the_graph_being_captured_zero_bytes_too(device):
    """What a call ties to its graph (the graph API's plan) it finds on the lease: the graph's one pin, on a lease
    of no bytes as on one that takes bytes; nothing outside a capture."""
    provider, arena = device
    with arena.lease(1000, stream=S1) as ws, arena.lease(0, stream=S1) as empty:
        assert ws.pin is None and empty.pin is None
    graph = provider.begin_capture(S1)
    with arena.lease(0, stream=S1) as empty:
        pin = empty.pin
        assert pin is not None and pin.live() and empty.ptr == 0
    with arena.lease(1000, stream=S1) as ws:
        assert ws.pin is pin
    provider.end_capture(graph)
    assert len(graph.pins) == 1
    with arena.lease(0, stream=S1) as empty:
        assert empty.pin is None
    graph.close()
    assert not pin.live()


def test_growth_while_pinned_keeps_the_old_buffer_until_the_graph_is_released(device):
    provider, arena = device
    arena.reserve(1000, stream=S1)
    graph, pinned = capture_a_lease(provider, arena)
    pinned_size = arena.held_bytes(stream=S1)
    with arena.lease(50_000, stream=S1) as ws:  # an eager call grows the stream's buffer
        assert ws.ptr != pinned
    stats = arena.stats()
    assert stats.streams[S1].pinned_bytes == pinned_size and stats.pinned_bytes == pinned_size
    arena.trim()  # frees the grown buffer, and the stream's sub-arena with it
    assert pinned not in freed(provider) and pinned in [b.ptr for b in provider.held]
    assert arena.stats().pinned_bytes == pinned_size
    graph.close()
    arena.trim()
    # With no stream: the trim forgot the stream's sub-arena, and the handle's owner may have destroyed it since (while
    # the sub-arena lives, in stream order: the tests below)
    assert (pinned, None) in freed_on(provider)
    assert arena.stats().pinned_bytes == 0


def test_the_release_is_noticed_by_the_next_growth_without_a_trim(device):
    provider, arena = device
    arena.reserve(1000, stream=S1)
    graph, _ = capture_a_lease(provider, arena)
    with arena.lease(50_000, stream=S1):
        pass
    graph.close()
    arena.reserve(10, stream=S2)  # any slow path of the arena looks at the kept buffers
    assert len(provider.frees) == 1 and provider.frees[0][1] == S1


def test_a_growth_on_the_same_stream_frees_what_a_released_graph_held(device):
    """CapturedGraph.close() says a graph's buffers are freed by the arena's next trim, stats or growth once CUDA let
    go of them: a growth on the lease's own stream too (no new stream, nothing else that looks at kept buffers).
    Once, a loop of eager calls, growing or not, kept the released buffer for good."""
    provider, arena = device
    arena.reserve(1000, stream=S1)
    graph, pinned = capture_a_lease(provider, arena)
    with arena.lease(50_000, stream=S1):  # an eager growth: the pinned buffer is kept aside
        pass
    graph.close()
    with arena.lease(100_000, stream=S1):  # the next growth
        pass
    assert (pinned, S1) in freed_on(provider)


def test_a_kept_buffer_of_a_stream_gone_since_is_not_freed_on_that_stream(device):
    """A pinned buffer kept aside recorded the stream to free it on. The stream object dies (the stream may be
    destroyed, its handle reused) before the graph does: the buffer is freed with no stream, as the stream's current
    buffer is. Once, it was freed on the dead handle (with AsyncProvider, cudaFreeAsync on a destroyed stream)."""
    provider, arena = device
    stream = FakeStream(S1)
    arena.reserve(1000, stream=stream)
    graph, pinned = capture_a_lease(provider, arena, stream=stream)
    with arena.lease(50_000, stream=stream):  # an eager growth: the pinned buffer is kept aside
        pass
    del stream
    gc.collect()
    arena.trim()  # the stream is gone: its current buffer is freed, with no stream
    graph.close()
    arena.trim()
    assert len(provider.frees) == 2 and provider.held == []
    assert [s for _, s in provider.frees] == [None, None] and pinned in freed(provider)


@pytest.mark.parametrize("forgotten_by", ["close", "a trim after a growth"])
def test_a_kept_buffer_of_a_stream_forgotten_then_gone_is_not_freed_on_that_stream(device, forgotten_by):
    """A stream's sub-arena is forgotten while a graph holds its buffer (kept aside for the graph): the arena stops
    watching the stream object then, and its death goes unseen. The stream dies (destroyed, its handle given to the
    next stream made) before the graph does: the buffer is freed with no stream once the graph is gone. Once, it kept
    the handle it was kept with, and was freed on it (with AsyncProvider, cudaFreeAsync on a destroyed stream)."""
    provider, arena = device
    stream = FakeStream(S1)
    provider.stream_ids[S1] = 1
    arena.reserve(1000, stream=stream)
    graph, pinned = capture_a_lease(provider, arena, stream=stream)
    if forgotten_by == "close":
        arena.close()  # the pinned buffer is kept for its graph, the sub-arena forgotten
    else:
        with arena.lease(50_000, stream=stream):  # an eager growth: the pinned buffer is kept aside
            pass
        arena.trim()  # frees the current buffer on its stream, which holds nothing more: forgotten
    assert arena.stats().streams == {} and pinned not in freed(provider)
    del stream
    provider.stream_ids[S1] = 2  # the next stream made has its handle
    gc.collect()
    graph.close()
    Arena(provider).stats()  # frees what closed arenas held; trims nothing of its own
    arena.trim()
    assert (pinned, None) in freed_on(provider) and provider.held == []


@pytest.mark.parametrize("forgotten_by", ["close", "a trim after a growth"])
def test_a_kept_buffer_of_a_raw_handle_forgotten_is_not_freed_on_that_handle(device, forgotten_by):
    """As above, for a stream given as a raw handle (as wsarena.torch gives PyTorch's streams): no object shows the
    arena whether the stream lives. Once its sub-arena is forgotten, nothing of the arena uses the stream: its owner may
    destroy it, and CUDA give the handle to the next stream made, before the graph goes. The buffer kept for the graph
    is freed with no stream then. Once, it was freed on the handle (with AsyncProvider, cudaFreeAsync on a destroyed
    stream, or on another one, in whose order the buffer's last kernels are not)."""
    provider, arena = device
    provider.stream_ids[S1] = 1
    arena.reserve(1000, stream=S1)
    graph, pinned = capture_a_lease(provider, arena)
    if forgotten_by == "close":
        arena.close()
    else:
        with arena.lease(50_000, stream=S1):  # an eager growth: the pinned buffer is kept aside
            pass
        arena.trim()
    assert arena.stats().streams == {} and pinned not in freed(provider)
    provider.stream_ids[S1] = 2  # the stream destroyed, its handle the next stream's
    graph.close()
    Arena(provider).stats()
    arena.trim()
    assert (pinned, None) in freed_on(provider) and provider.held == []


def test_trim_and_close_keep_a_pinned_buffer_current_or_kept(device):
    provider, arena = device
    arena.reserve(4096, stream=S1)
    graph, pinned = capture_a_lease(provider, arena, 4096)
    assert arena.trim() == 0
    assert arena.held_bytes(stream=S1) > 0  # still the stream's buffer: eager calls and captures go on using it
    with arena.lease(4096, stream=S1) as ws:
        assert ws.ptr == pinned
    arena.close()
    assert provider.frees == [] and arena.stats().pinned_bytes >= 4096
    graph.close()
    arena.trim()
    assert freed(provider) == [pinned] and provider.held == []


def test_every_graph_must_be_released(device):
    provider, arena = device
    arena.reserve(1000, stream=S1)
    graphs = []
    for _ in range(2):
        graph, pinned = capture_a_lease(provider, arena)
        graphs.append(graph)
    with arena.lease(9000, stream=S1):
        pass
    graphs[0].close()
    arena.trim()
    assert pinned not in freed(provider)  # the second graph still holds it
    graphs[1].close()
    arena.trim()
    assert pinned in freed(provider) and provider.held == []


def test_growth_during_capture_is_a_capture_error_and_changes_nothing(device):
    provider, arena = device
    graph = provider.begin_capture(S1)
    with pytest.raises(wsarena.CaptureError, match=r"it holds 0 B there.*reserve_for\(plan\)"), \
            arena.lease(1000, stream=S1):
        pass
    assert provider.allocations == [] and arena.stats().streams == {}
    provider.end_capture(graph)
    arena.reserve(512, stream=S1)
    graph = provider.begin_capture(S1)
    with pytest.raises(wsarena.CaptureError, match="it holds 512 B") as refused, arena.lease(1000, stream=S1):
        pass
    assert refused.value.stream == S1  # the stream it would have grown, for the caller (run_with_fallback's warning)
    assert pickle.loads(pickle.dumps(refused.value)).stream == S1
    with arena.lease(512, stream=S1):  # the lane is free again, and a lease that fits is captured
        pass
    provider.end_capture(graph)
    assert len(provider.allocations) == 1 and arena.stats().streams[S1].leases == 0


def test_two_streams_in_one_capture_keep_disjoint_pinned_buffers(device):
    provider, arena = device
    for stream in (S1, S2):
        arena.reserve(2048, stream=stream)
    graph = provider.begin_capture(S1, S2)  # forked to S2 through an event, as CUDA allows
    with arena.lease(2048, stream=S1) as a, arena.lease(2048, stream=S2) as b:
        assert a.ptr + 2048 <= b.ptr or b.ptr + 2048 <= a.ptr
    provider.end_capture(graph)
    stats = arena.stats()
    assert stats.streams[S1].pinned_bytes > 0 and stats.streams[S2].pinned_bytes > 0
    assert len(graph.pins) == 1


def test_debug_mode_refuses_to_free_a_pinned_buffer(device):
    provider, arena = device
    arena.reserve(1000, stream=S1)
    graph, _ = capture_a_lease(provider, arena)
    sub = arena._subs[S1]
    arena._to_free.append((sub.block.buffer, S1))  # what a bookkeeping mistake would queue
    with wsarena.config(debug=True), pytest.raises(AssertionError, match="graph that captured it still exists"):
        arena.trim()
    arena._to_free.clear()
    graph.close()
    with wsarena.config(debug=True):
        arena.trim()
    assert len(provider.frees) == 1


class _LongBuffers(HostProvider):
    """Host memory in buffers whose repr is 100 kB long."""

    def allocate(self, size, *, stream):
        buffer = super().allocate(size, stream=stream)
        return _LongBuffer(buffer.ptr, buffer.size, buffer.owner)


class _LongBuffer(Buffer):
    __slots__ = ()

    def __repr__(self):
        return "LongBuffer(" + "b" * 100_000 + ")"


def test_debug_mode_quotes_a_pinned_buffer_in_part():
    """Debug mode's error for a pinned buffer queued to be freed quoted the buffer's repr whole: 100 kB for one whose
    repr lists a pool's blocks."""
    provider = RecordingProvider(_LongBuffers(), device_id=0)
    arena = Arena(provider)
    arena.reserve(1000, stream=S1)
    graph, _ = capture_a_lease(provider, arena)
    arena._to_free.append((arena._subs[S1].block.buffer, S1))  # what a bookkeeping mistake would queue
    with wsarena.config(debug=True), pytest.raises(AssertionError, match="graph that captured it") as raised:
        arena.trim()
    message = str(raised.value)
    assert len(message) < 300 and "LongBuffer(bbb" in message, message[:1000]
    arena._to_free.clear()
    graph.close()


def test_debug_mode_sees_a_pinned_buffer_queued_after_the_arena_lost_track_of_it(device):
    """A bookkeeping mistake that frees a pinned buffer detaches it from its sub-arena first: debug mode must know
    it from the graph's pin, not from where the arena keeps it. Once, it looked only at the buffers the sub-arenas
    and the kept list still held, so it never saw such a buffer."""
    provider, arena = device
    arena.reserve(1000, stream=S1)
    graph, _ = capture_a_lease(provider, arena)
    sub = arena._subs[S1]
    block, sub.block = sub.block, None  # what a mistake in a trim or a sweep would do, then queue it
    arena._to_free.append((block.buffer, S1))
    with wsarena.config(debug=True), pytest.raises(AssertionError, match="graph that captured it still exists"):
        arena.trim()
    assert provider.frees == []
    graph.close()
    with wsarena.config(debug=True):
        arena.trim()
    assert freed(provider) == [block.ptr]


def test_debug_mode_checks_the_queue_while_another_thread_drains_it(device):
    """Debug mode reads the queue of buffers to free under the arena's lock, but other threads drain it without the
    lock. A drain that takes an entry while the check reads the queue (played here by a trace function, where the
    interpreter may switch threads) must not break the check. Once, it raised 'deque mutated during iteration' out
    of whatever call was giving buffers back."""
    provider, arena = device
    arena.reserve(1000, stream=S1)
    graph, _ = capture_a_lease(provider, arena)  # a capture is known: debug mode checks the queue
    for stream in (S2, 0x53):
        arena.reserve(1000, stream=stream)
        sub = arena._subs[stream]
        block, sub.block = sub.block, None  # let go, as a trim would
        block.freed = True
        arena._to_free.append((block.buffer, stream))
    code = _pinning.check_unpinned.__code__
    lines, first = inspect.getsourcelines(_pinning.check_unpinned)
    inside = first + next(i for i, line in enumerate(lines) if "if id(buffer) in pinned" in line)
    drained = []

    def trace(frame, event, arg):
        if frame.f_code is not code:
            return None
        if event == "line" and frame.f_lineno == inside and not drained:
            drained.append(arena._to_free.popleft())  # another thread's drain
            provider.deallocate(drained[0][0], stream=drained[0][1])
        return trace

    sys.settrace(trace)
    try:
        with wsarena.config(debug=True):
            arena._give_back()
    finally:
        sys.settrace(None)
    assert drained and len(provider.frees) == 2 and list(arena._to_free) == []
    graph.close()


@pytest.mark.parametrize(
    ("var", "key", "junk", "good"),
    [("WSARENA_CAP_WORKSPACE", "cap_workspace", "junk", "1MiB"), ("WSARENA_ALGO_SEARCH", "algo_search", "fast",
      "exhaustive"), ("WSARENA_DEBUG", "debug", "maybe", False)],
)
def test_an_invalid_variable_a_config_block_replaced_is_no_error_of_a_free(device, monkeypatch, var, key, junk, good):
    """A program whose environment holds an invalid variable works inside config() blocks that replace it. What
    frees the buffers of an arena that recorded a capture, later and outside the blocks (a trim, stats, the collected
    arena's finalizer, a growth), reads the debug setting alone (to check what it frees) and raises nothing: its
    variable, if it is the invalid one, counts as off. Once, they read every setting, as get_config() does: trim and
    stats raised the variable's ValueError, and the finalizer warned and kept the buffers."""
    monkeypatch.setenv(var, junk)
    wsarena._config._reset()
    provider, arena = device
    collected = Arena(provider)
    graphs = []
    for each in (arena, collected):
        with wsarena.config(**{key: good}):
            each.reserve(1000, stream=S1)
            graphs.append(capture_a_lease(provider, each)[0])  # the graph holds the S1 buffer
            each.reserve(1000, stream=S2)
    with pytest.raises(ValueError, match=var):  # outside the blocks, reading the settings is the variable's error
        wsarena.get_config()
    arena.stats()
    assert arena.trim() == 1024 and freed_on(provider) == [(provider.allocations[1].ptr, S2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del collected, each
        gc.collect()  # its finalizer frees its S2 buffer (with no stream), and keeps the one its graph holds
    assert freed_on(provider)[1:] == [(provider.allocations[3].ptr, None)]
    for graph in graphs:
        graph.close()
    assert arena.trim() == 1024  # and what the collected arena's heir kept goes, as each trim frees it
    assert provider.held == []


def test_a_reserve_that_would_grow_a_captured_stream_is_a_capture_error(device):
    """A reserve cannot be captured any more than a lease's growth (an allocation on the captured stream would be
    recorded into the graph, or break it): CaptureError, and nothing allocated or left behind. Once, it grew."""
    provider, arena = device
    graph = provider.begin_capture(S1)
    with pytest.raises(wsarena.CaptureError, match="a reserve of 1000 B on stream 81 during CUDA graph capture"):
        arena.reserve(1000, stream=S1)
    plan = type("Plan", (), {"stream_bytes": [4096]})()
    with pytest.raises(wsarena.CaptureError, match="it holds 0 B there"):
        arena.reserve_for(plan, streams=[S1])
    assert provider.allocations == [] and arena.stats().streams == {}
    arena.reserve(1000, stream=S2)  # another stream, not captured, grows
    provider.end_capture(graph)
    arena.reserve(1000, stream=S1)
    graph = provider.begin_capture(S1)
    arena.reserve(500, stream=S1)  # it holds enough: nothing to grow, nothing refused
    arena.reserve_for(type("Plan", (), {"stream_bytes": [1000]})(), streams=[S1])
    provider.end_capture(graph)
    assert len(provider.allocations) == 2


def test_a_pin_is_collected_with_no_python_code_run():
    """The collector may drop a pin anywhere, and a Ctrl-C that lands in Python code it runs then is lost (printed as
    unraisable, the pin's semaphore never freed): collecting a pin runs none. Once, a ``weakref.finalize`` freed the
    semaphore there."""
    from wsarena.arena import _pins

    gc.collect()  # other tests' pins go now: one collected once this pin is made would be listed with it
    pin = GraphPin()
    address = pin.address
    called = []

    def profile(frame, event, arg):
        if event == "call":
            called.append(frame.f_code.co_qualname)

    sys.setprofile(profile)
    try:
        del pin
    finally:
        sys.setprofile(None)
    assert called == []
    assert [ref.state[0] for ref in _pins._collected] == [address]
    destroy = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    destroy(GraphPin.destroy)(address)  # its graph goes: the next look frees the semaphore
    _pins.free_posted()
    assert address not in _pins._held and address not in _pins._unposted and not _pins._collected


def test_a_pins_semaphore_is_freed_only_once_cuda_has_posted_it(monkeypatch):
    """CUDA may run a graph's destructor (sem_post) after the pin is gone, and at exit after the interpreter freed
    its objects: the semaphore is memory of libc's, freed only once CUDA posted it."""
    from wsarena.arena import _pins

    gc.collect()  # other tests' pins go now, not under the patch below
    _pins.free_posted()
    frees = []
    monkeypatch.setattr(_pins, "_free", frees.append)  # never freed for real here: these are test pins
    monkeypatch.setattr(_pins, "_unposted", {})  # those of other tests' pins are theirs
    destroy = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    held = GraphPin()
    address = held.address
    del held
    gc.collect()
    assert frees == []  # a graph may still post it
    destroy(GraphPin.destroy)(address)  # the graph goes after its pin: writes memory that is still there
    posted = GraphPin()  # making a pin frees those dropped before CUDA posted them, once it has
    assert frees == [address]
    destroy(posted.destroy)(posted.address)
    assert not posted.live()
    address = posted.address
    del posted
    gc.collect()
    assert frees[1:] == []  # collected: its semaphore waits for the next look, which frees it as CUDA posted it
    _pins.free_posted()
    assert frees[1:] == [address]


def test_a_pin_dropped_before_its_address_was_read_has_its_semaphore_freed(monkeypatch):
    """A Ctrl-C just after a pin is made, before the graph is given its address, drops it: no graph will ever post
    it, so its semaphore is freed at the next look, unposted. Once, it waited for a post for good, and each later
    look checked it again."""
    from wsarena.arena import _pins

    gc.collect()  # other tests' pins go now, not under the patch below
    _pins.free_posted()
    frees = []
    monkeypatch.setattr(_pins, "_free", frees.append)  # never freed for real here: these are test pins
    monkeypatch.setattr(_pins, "_unposted", {})  # those of other tests' pins are theirs
    dropped, handed = GraphPin(), GraphPin()
    dropped_at = dropped._state[0]
    handed_at = handed.address  # what a capture's retain reads: the graph may post it
    del dropped, handed
    gc.collect()
    _pins.free_posted()
    assert frees == [dropped_at] and list(_pins._unposted) == [handed_at]


def test_a_collected_arena_frees_what_a_graph_held_once_the_graph_is_gone():
    """An arena collected without close() (set_arena() replaced it, say) hands what it held to a closed arena over the
    same buffers, kept as a closed arena is while a graph holds some of them; the collected arena itself stays gone.
    What no graph holds is freed at once, the graph's buffer once the graph is gone, at the next trim, stats or growth
    of any arena: each with no stream, as the streams of a collected arena may be gone with it. Once, the graph's
    buffer was abandoned, and never freed even once the graph was gone."""
    provider = RecordingProvider(device_id=0)
    arena = Arena(provider)
    arena.reserve(1000, stream=S1)
    graph, pinned = capture_a_lease(provider, arena)
    arena.reserve(5000, stream=S2)
    unpinned = arena._subs[S2].block.ptr
    collected = weakref.ref(arena)
    del arena
    gc.collect()
    assert collected() is None
    assert freed_on(provider) == [(unpinned, None)]
    other = Arena(provider)
    other.stats()
    assert freed_on(provider) == [(unpinned, None)]  # the graph may be replayed
    graph.close()
    other.stats()
    assert freed_on(provider) == [(unpinned, None), (pinned, None)] and provider.held == []


def test_a_collected_arenas_free_with_no_stream_waits_for_a_capture_it_knew():
    """An arena collected while a capture that leased from it goes on: what it held is freed with no stream (the
    provider synchronises the device first), which would break the capture, so that free waits until the capture is
    over. Once, the collected arena's finalizer freed everything at once, capture or not."""
    provider = RecordingProvider(device_id=0)
    arena = Arena(provider)
    arena.reserve(1000, stream=S1)
    arena.reserve(1000, stream=S2)
    unpinned = arena._subs[S2].block.ptr
    graph = provider.begin_capture(S1)
    with arena.lease(1000, stream=S1) as ws:  # the capture's step
        pinned = ws.ptr
    del arena, ws
    gc.collect()
    other = Arena(provider)
    other.stats()
    assert provider.frees == []
    provider.end_capture(graph)
    other.stats()
    assert freed_on(provider) == [(unpinned, None)]
    graph.close()
    other.stats()
    assert freed_on(provider) == [(unpinned, None), (pinned, None)] and provider.held == []


def test_a_buffer_outgrown_while_a_graph_held_it_is_freed_on_its_stream_and_counted_once_the_graph_is_gone():
    """The buffer kept for a graph after its stream outgrew it goes once the graph is gone: on its stream, which the
    live arena still serves, and counted in the stats' frees as any free is."""
    provider = RecordingProvider(device_id=0)
    arena = Arena(provider)
    arena.reserve(1000, stream=S1)
    graph, pinned = capture_a_lease(provider, arena)
    arena.reserve(5000, stream=S1)  # outgrows the pinned buffer, which is kept for the graph
    before = arena.stats()
    assert (before.frees, before.pinned_bytes, provider.frees) == (0, 1024, [])
    graph.close()
    after = arena.stats()
    assert (after.frees, after.pinned_bytes, freed_on(provider)) == (1, 0, [(pinned, S1)])


def test_a_collected_arena_frees_a_buffer_it_outgrew_while_a_graph_held_it_with_no_stream():
    """A buffer outgrown while a graph held it is kept for the graph, with its stream; then the arena is collected,
    and its streams may be gone with it: once the graph is gone, that buffer is freed with no stream, as the collected
    arena's other buffers are, not on a stream that may have been destroyed (or whose handle another has now)."""
    provider = RecordingProvider(device_id=0)
    arena = Arena(provider)
    arena.reserve(1000, stream=S1)
    graph, pinned = capture_a_lease(provider, arena)
    arena.reserve(5000, stream=S1)  # outgrows the pinned buffer, which is kept for the graph
    grown = arena._subs[S1].block.ptr
    assert provider.frees == [] and arena.stats().pinned_bytes == 1024
    del arena
    gc.collect()
    successor = Arena(provider)
    successor.stats()
    assert freed_on(provider) == [(grown, None)]  # the graph may still be replayed
    graph.close()
    successor.stats()
    assert freed_on(provider) == [(grown, None), (pinned, None)] and provider.held == []


@pytest.mark.parametrize("trigger", ["stats", "trim", "growth"])
def test_a_closed_arena_nothing_refers_to_frees_what_a_graph_held_once_the_graph_is_gone(trigger):
    """get_arena() replaces a closed arena, and nothing refers to the closed one then: the buffers its graphs held
    were never freed (collected, it abandons them, for the graphs' sake). The closed arena is kept while it holds
    them, and frees each once its graph is gone, at the next trim, stats or growth of any arena: with no stream, as the
    close forgot the stream, whose owner may have destroyed it since (a buffer no graph held, on its stream at once)."""
    provider = RecordingProvider(device_id=0)
    arena = Arena(provider)
    arena.reserve(1000, stream=S1)
    graph, pinned = capture_a_lease(provider, arena)
    arena.reserve(5000, stream=S2)
    unpinned = arena._subs[S2].block.ptr
    arena.close()
    closed = weakref.ref(arena)
    del arena
    successor = Arena(provider)  # what get_arena() makes in its place
    gc.collect()
    successor.trim()
    successor.stats()
    assert freed_on(provider) == [(unpinned, S2)] and closed() is not None  # the graph may still be replayed
    graph.close()
    {"stats": successor.stats, "trim": successor.trim, "growth": lambda: successor.reserve(1000, stream=S1)}[trigger]()
    assert freed_on(provider) == [(unpinned, S2), (pinned, None)]
    assert provider.held == ([successor._subs[S1].block.buffer] if trigger == "growth" else [])
    gc.collect()
    assert closed() is None  # holding nothing more, it is let go


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
@pytest.mark.parametrize("let_go", ["closed", "collected"])
def test_a_child_forked_while_a_closed_arena_is_kept_gives_none_of_its_buffers_to_the_provider(let_go):
    """A closed arena that only the closed arenas still holding something keep alive (one closed, or the one a
    collected arena handed its buffers to), whose graph is gone but whose buffer no trim, stats or growth freed yet: a
    forked child lets go of it only once it has started again, as every arena does in a child. Let go first, it was
    collected with the parent's buffers, and its finalizer gave them to the provider: a device's free through CUDA in
    the child, which cannot run it."""
    provider = RecordingProvider(device_id=0)
    arena = Arena(provider)
    arena.reserve(1000, stream=S1)
    graph, pinned = capture_a_lease(provider, arena)
    if let_go == "closed":
        arena.close()
    del arena
    gc.collect()
    graph.close()
    [kept] = [held for held in _lifecycle._closed_holding.values() if held.provider is provider]
    closed = weakref.ref(kept)
    del kept
    assert provider.frees == []

    def in_the_child():
        gc.collect()
        return freed(provider), closed() is None

    assert fork(in_the_child)() == ([], True)
    Arena(provider).stats()  # in this process, the next stats() frees it
    assert freed_on(provider) == [(pinned, None)]  # closed or collected, its stream forgotten


def test_a_closed_arenas_free_with_no_stream_waits_for_a_capture_another_arena_of_the_device_knows():
    """What a closed arena held for a graph of a stream that is gone is freed with no stream (a device
    synchronisation) once the graph is gone: not while a capture goes on that only the arena made in its place knows
    of (one on a non-blocking stream, which no question through the legacy default stream sees)."""
    provider = RecordingProvider(device_id=0)
    arena = Arena(provider)
    stream = FakeStream(0x61)
    provider.stream_ids[0x61] = 1
    arena.reserve(1000, stream=stream)
    graph, pinned = capture_a_lease(provider, arena, stream=stream)
    del stream  # its stream is gone: the buffer is freed with no stream
    gc.collect()
    arena.close()
    del arena
    successor = Arena(provider)
    successor.reserve(1000, stream=S2)
    capture = provider.begin_capture(S2)
    with successor.lease(1000, stream=S2):  # the capture is the successor's: the closed arena never saw it
        pass
    graph.close()
    successor.stats()
    assert provider.frees == []
    provider.end_capture(capture)
    successor.stats()
    assert freed_on(provider) == [(pinned, None)]
    capture.close()


@pytest.mark.parametrize("given_as", ["a raw handle", "a stream object"])
def test_a_closed_arenas_free_with_no_stream_waits_for_a_capture_that_leased_from_it(given_as):
    """The arena is closed while a capture that leased from it goes on (on S2). The buffer a finished graph held on S1
    is freed with no stream once that graph is gone (the close forgot S1, whose owner may destroy it): not while the
    capture on S2 goes on, which a device synchronisation would break. Once, the close forgot the record of that
    capture with S2's sub-arena, and the free came during it."""
    provider = RecordingProvider(device_id=0)
    arena = Arena(provider)
    stream = S1 if given_as == "a raw handle" else FakeStream(S1)
    arena.reserve(1000, stream=stream)
    arena.reserve(1000, stream=S2)
    graph, pinned = capture_a_lease(provider, arena, stream=stream)
    with arena.lease(50_000, stream=stream):  # an eager growth: the pinned buffer is kept aside
        pass
    capture = provider.begin_capture(S2)
    with arena.lease(1000, stream=S2):  # the capture's step
        pass
    arena.close()
    graph.close()
    Arena(provider).stats()  # frees what the closed arena may
    assert pinned not in freed(provider)
    provider.end_capture(capture)
    Arena(provider).stats()
    assert (pinned, None) in freed_on(provider)
    capture.close()
    Arena(provider).stats()
    assert provider.held == []


def test_a_graph_pin_is_live_until_its_c_destructor_runs():
    pin = GraphPin()
    assert pin.live() and pin.live()
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(pin.destroy)(pin.address)  # what CUDA runs when it destroys a graph
    assert not pin.live() and pin.released


@pytest.fixture
def cpu_conv():
    """The CPU backend's arena over a RecordingProvider, and a small convolution's operands."""
    provider = RecordingProvider()
    previous = set_arena("cpu", Arena(provider))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    yield provider, x, w
    set_arena("cpu", previous)


def assert_captured_call_is_right(provider, x, w, eager, **kw):
    """Capture the call on lane "lane" after its eager one: nothing is allocated, the lane's buffer is pinned, and the
    result is the float64 reference's."""
    allocated = len(provider.allocations)
    graph = provider.begin_capture("lane")
    out = np.empty_like(eager)
    wsarena.conv_forward(x, w, padding=1, stream="lane", out=out, **kw)
    provider.end_capture(graph)
    assert len(provider.allocations) == allocated and len(graph.pins) == 1
    want = ref_conv_forward(x.astype(np.float64), w.astype(np.float64), padding=1)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)  # float32 against float64
    graph.close()


def test_a_first_call_during_capture_raises_before_anything_runs(cpu_conv):
    provider, x, w = cpu_conv
    graph = provider.begin_capture("lane")
    with pytest.raises(wsarena.CaptureError, match="run the step once before capturing"):
        wsarena.conv_forward(x, w, padding=1, stream="lane")
    assert provider.allocations == []
    provider.end_capture(graph)
    eager = wsarena.conv_forward(x, w, padding=1, stream="lane", algo="gemm_batch")
    assert_captured_call_is_right(provider, x, w, eager, algo="gemm_batch")


@pytest.mark.parametrize(("change", "settings"), [
    ({"cap_workspace": 4096}, "(cap_workspace 4 KiB, algo_search heuristic)"),
    ({"cap_workspace": 4000}, "(cap_workspace 4000 B, algo_search heuristic)"),  # format_size's 3.91 KiB is refused
    ({"algo_search": "exhaustive"}, "(cap_workspace none, algo_search exhaustive)"),
])
def test_a_capture_under_settings_changed_since_the_eager_step_says_so(cpu_conv, change, settings):
    """A configure() between the eager step and a captured call: the shape was run, but its algorithm was chosen under
    other settings, and cannot be chosen during the capture. The CaptureError names the settings in force and says to
    run the step under them; once, it called the call the first of its shape, which the user knew it was not. Under
    the step's settings again, the capture runs."""
    provider, x, w = cpu_conv
    eager = wsarena.conv_forward(x, w, padding=1, stream="lane")
    graph = provider.begin_capture("lane")
    with wsarena.config(**change), pytest.raises(wsarena.CaptureError) as refused:
        wsarena.conv_forward(x, w, padding=1, stream="lane")
    provider.end_capture(graph)
    graph.close()
    assert f"under the settings in force {settings}" in str(refused.value)
    shown = settings.removeprefix("(cap_workspace ").partition(",")[0]  # as cap_workspace takes it back
    assert (None if shown == "none" else wsarena.parse_size(shown)) == change.get("cap_workspace")
    assert "before capturing, under the same settings (a configure() since the eager step" in str(refused.value)
    assert_captured_call_is_right(provider, x, w, eager)


@pytest.mark.filterwarnings("ignore::wsarena.errors.MemoryFallbackWarning")  # the eager search is cut short on purpose
def test_a_capture_after_a_search_cut_short_by_memory_runs_the_ranking_it_kept(cpu_conv, monkeypatch,
                                                                                  refusal_clock):
    """An exhaustive search that memory cut short in the eager step is kept (searched again once memory allows): a
    capture runs its choice, with no search and no CaptureError, and the next eager call with memory searches."""
    from wsarena.backends._cpu_backend import CpuBackend

    from .arena_helpers import refusing

    provider, x, w = cpu_conv
    searched = []
    real_measure = CpuBackend.measure
    monkeypatch.setattr(CpuBackend, "measure", lambda self, *a: searched.append(len(a[-2])) or real_measure(self, *a))
    wsarena.configure(algo_search="exhaustive")
    refusing(provider, refusal_clock, 0.01, limit=8192)  # the two largest forward algorithms need 13.5 KiB
    for _ in range(4):
        eager = wsarena.conv_forward(x, w, padding=1, stream="lane")
    assert searched == [1, 2]  # what the lane held, then what it could grow to: the third and fourth were served
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_captured_call_is_right(provider, x, w, eager)
    assert searched == [1, 2]
    provider.fail = None  # memory is there now, but refused twice in a row, it is not asked for within 1 s
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    assert searched == [1, 2]
    refusal_clock.now += 1.01
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    assert searched == [1, 2, 4]  # asked, granted, and all four timed
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    assert searched == [1, 2, 4]


@pytest.mark.parametrize("search", ["heuristic", "exhaustive"])
def test_a_capture_after_calls_memory_kept_from_ranking_every_candidate_runs_their_ranking(cpu_conv, monkeypatch,
                                                                                          search):
    """Eager calls whose backend memory kept from ranking a candidate (PartlyRanked: cuDNN could not allocate what
    finalizing its plan takes) each rank again; a capture, which cannot, runs the last ranking, asking the backend
    nothing, and the next eager call ranks again, keeping the full ranking. The capture raised CaptureError, calling
    the call the first of its shape, to be run once before capturing, which it had been."""
    from wsarena.backends import PartlyRanked
    from wsarena.backends._cpu_backend import CpuBackend

    provider, x, w = cpu_conv
    ranked, short = [], [True]
    real_candidates = CpuBackend.candidates

    def candidates(self, pass_, geom):
        cands = real_candidates(self, pass_, geom)
        ranked.append(pass_)
        if short:
            raise PartlyRanked(cands[1:]) from MemoryError("no memory for the first one's plan")
        return cands

    monkeypatch.setattr(CpuBackend, "candidates", candidates)
    wsarena.configure(algo_search=search)
    for _ in range(2):
        eager = wsarena.conv_forward(x, w, padding=1, stream="lane")
    assert len(ranked) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_captured_call_is_right(provider, x, w, eager)
    assert len(ranked) == 2
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    assert len(ranked) == 3
    short.clear()
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    assert len(ranked) == 4


def test_a_capture_after_calls_whose_search_timed_nothing_runs_the_heuristic_order(cpu_conv, monkeypatch):
    """Eager calls whose exhaustive search could time nothing (here every timing out of memory of its own) run the
    heuristic order, each searching again; a capture, which cannot search, runs that order too, searching nothing, and
    is right (against float64, 1e-4). The capture raised CaptureError, calling the call the first of its shape, to be
    run once before capturing, which it had been."""
    from wsarena.backends._cpu_backend import CpuBackend

    provider, x, w = cpu_conv
    searched = []

    def measure(self, *args):
        searched.append(1)
        raise MemoryError("no memory for the search's temporaries")

    monkeypatch.setattr(CpuBackend, "measure", measure)
    wsarena.configure(algo_search="exhaustive")
    with pytest.warns(wsarena.MemoryFallbackWarning, match="could not time any algorithm"):
        eager = wsarena.conv_forward(x, w, padding=1, stream="lane")
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    tried = len(searched)
    assert tried >= 2  # searched again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_captured_call_is_right(provider, x, w, eager)
    assert len(searched) == tried
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    assert len(searched) > tried  # an eager call searches again


def test_capture_without_a_gpu_is_a_backend_error_and_checks_its_mode(monkeypatch):
    """On any machine: no GPU is made to look usable (a GPU machine's capture would succeed)."""
    from wsarena import cudagraph

    monkeypatch.setattr(cudagraph, "gpu_unusable_reason", lambda: "the CUDA driver sees no device")
    with pytest.raises(ValueError, match="mode must be one of"), wsarena.capture(mode="loose"):
        pass
    with pytest.raises(wsarena.BackendUnavailableError, match="needs a GPU: the CUDA driver sees no device"), \
            wsarena.capture():
        pass


class _Graph:  # CuPy's Graph.launch(stream), without a GPU
    def __init__(self):
        self.launched = []

    def launch(self, stream=None):
        self.launched.append(stream.ptr)


def test_a_captured_graph_is_launched_on_any_stream_that_stream_takes():
    """CapturedGraph.launch(stream) takes what every stream= of wsarena takes (a raw handle, an object with
    __cuda_stream__ such as a PyTorch or cuda.core stream), not only a CuPy stream: CuPy's Graph.launch reads the
    stream's ``ptr``, which the others lack (an AttributeError once)."""
    import cupy

    from wsarena.cudagraph import CapturedGraph

    captured = CapturedGraph(cupy.cuda.Stream.from_external(FakeStream(S1)))
    captured.graph = _Graph()
    captured.launch()
    captured.launch(S2)
    captured.launch(FakeStream(0x53))
    captured.launch(captured.stream)
    assert captured.graph.launched == [S1, S2, 0x53, S1]


def test_a_graph_with_none_to_launch_raises_a_capture_error_saying_why():
    """``launch()`` of a graph whose block has not ended, raised, or which is closed raises ``wsarena.CaptureError``:
    caught by ``WsarenaError``, as what a program meets as it runs is (the README's Bad input), and a
    ``RuntimeError``, as it was. Once, a plain ``RuntimeError``."""
    from wsarena.cudagraph import _NOT_OVER, CapturedGraph, _State

    def launched(graph):
        with pytest.raises(wsarena.WsarenaError) as caught:
            graph.launch()
        assert type(caught.value) is wsarena.CaptureError and isinstance(caught.value, RuntimeError)
        return str(caught.value)

    graph = CapturedGraph(FakeStream(S1))
    assert launched(graph) == f"cannot launch this graph: {_NOT_OVER}"
    graph._failed(_State.RAISED, "its block was left by KeyError")
    assert launched(graph) == "cannot launch this graph: its block was left by KeyError"
    graph = CapturedGraph(FakeStream(S1))
    graph._captured(_Graph())
    graph.close()
    assert launched(graph) == "cannot launch this graph: it is closed"


def test_a_launch_wraps_a_stream_for_cupy_over_the_kept_cuda_core_object(monkeypatch):
    """A launch on a stream that is no CuPy stream gives CuPy's Graph.launch a CuPy object made for the launch, over
    cuda.core's object for the handle, which is made once and kept by handle (the one keep the ops' calls share),
    whatever device is current, a launch on another handle meanwhile too; a CuPy stream goes as it is."""
    import cupy

    from wsarena.arena import streams
    from wsarena.cudagraph import CapturedGraph

    wrapped, given = [], []
    from_handle = streams._from_handle
    monkeypatch.setattr(streams, "_from_handle", lambda handle: wrapped.append(handle) or from_handle(handle))

    class Graph(_Graph):
        def launch(self, stream=None):
            given.append(stream)
            super().launch(stream)

    captured = CapturedGraph(cupy.cuda.Stream.from_external(FakeStream(S1)))
    captured.graph = Graph()
    for stream in (S2, S2, FakeStream(S2), captured.stream, 0x53, S2):
        captured.launch(stream)
    assert wrapped == [S2, 0x53] and captured.graph.launched == [S2, S2, S2, S1, 0x53, S2]
    assert given[3] is captured.stream and all(isinstance(stream, cupy.cuda.Stream) for stream in given)
    assert len(set(map(id, given))) == len(given)  # all alive here: one object each


def test_the_capture_stream_starts_with_the_largest_buffer_the_warm_up_left(device):
    from wsarena.cudagraph import seed_workspace

    provider, arena = device
    with arena.lease(3000, stream=S1):  # the eager step, on another stream
        pass
    with arena.lease(1000, stream=S1):
        pass
    seed_workspace(arena, S2)  # what wsarena.capture() does before the capture begins
    graph = provider.begin_capture(S2)
    with arena.lease(3000, stream=S2) as ws:  # the step's largest call fits, and is captured
        assert ws.nbytes == 3000
    provider.end_capture(graph)
    held = arena.stats().streams
    assert held[S2].capacity_bytes == held[S1].capacity_bytes and held[S2].pinned_bytes == held[S2].capacity_bytes
    arena.reserve(8000, stream=S1)
    seed_workspace(arena, S2)  # S2 holds a buffer (a warm-up's on it): left as it is
    assert len(provider.allocations) == 3 and arena.stats().streams[S2].capacity_bytes < 8000


def test_the_seeded_capture_workspace_stays_within_the_configured_cap(device):
    from wsarena.cudagraph import seed_workspace

    _, arena = device
    arena.reserve(1 << 20, stream=S1)
    with wsarena.config(cap_workspace=4096):
        seed_workspace(arena, S2)
    assert arena.stats().streams[S2].capacity_bytes < 1 << 20
    fresh = Arena(RecordingProvider(device_id=0))
    seed_workspace(fresh, S1)  # an arena that holds nothing seeds nothing
    assert fresh.stats().streams == {}


def test_a_capture_takes_the_algorithm_the_eager_step_fell_back_to(device):
    """The eager step's first algorithm could not grow the arena (out of memory), so the step ran the next one, which
    the stream's buffer holds. A capture of the step runs that one too, from the same buffer. Once, the capture
    raised CaptureError on the first, whose growth it cannot hold."""
    provider, arena = device
    arena.reserve(3000, stream=S1)  # an earlier call's
    provider.fail = lambda n: n > 4096
    cands = (Candidate("big", 50_000), Candidate("small", 3000), Candidate("none", 0))
    ran = []

    def run(cand, ws):
        ran.append((cand.algo, ws.ptr))

    assert run_with_fallback(arena, cands, run, stream=S1, cap=None).algo == "small"
    graph = provider.begin_capture(S1)
    with pytest.warns(wsarena.CaptureFallbackWarning, match="captured small .* in place of the first choice, big"):
        assert run_with_fallback(arena, cands, run, stream=S1, cap=None).algo == "small"
    provider.end_capture(graph)
    assert ran[0] == ran[1] and len(graph.pins) == 1 and len(provider.allocations) == 1
    graph.close()


def test_a_capture_no_held_buffer_serves_is_a_capture_error_and_the_runs_own_stops_the_fallback(device):
    """Only when no candidate fits the stream's buffer is the capture a CaptureError (not an out-of-memory error); a
    CaptureError the run itself raises (a handle it would create) is not a reason to try another algorithm."""
    provider, arena = device
    arena.reserve(1000, stream=S1)
    cands = (Candidate("big", 50_000), Candidate("medium", 20_000))
    graph = provider.begin_capture(S1)
    with pytest.raises(wsarena.CaptureError, match="needs the arena to grow"):
        run_with_fallback(arena, cands, lambda c, ws: None, stream=S1, cap=None)
    ran = []

    def refuse(cand, ws):
        ran.append(cand.algo)
        raise wsarena.CaptureError("this call would create a cuDNN handle")

    with pytest.raises(wsarena.CaptureError, match="create a cuDNN handle"):
        run_with_fallback(arena, (Candidate("small", 500), Candidate("none", 0)), refuse, stream=S1, cap=None)
    provider.end_capture(graph)
    assert ran == ["small"] and len(provider.allocations) == 1 and arena.stats().streams[S1].leases == 0
    graph.close()


@pytest.mark.filterwarnings("ignore::wsarena.errors.MemoryFallbackWarning")  # the eager call falls back on purpose
def test_a_captured_convolution_runs_the_algorithm_its_eager_call_fell_back_to(cpu_conv):
    """The same through the ops, on the CPU backend: the eager call's first algorithm could not grow the lane's
    buffer, the second ran; the captured call runs the second too and gives the same result."""
    provider, x, w = cpu_conv
    wsarena.get_arena("cpu").reserve(6912, stream="lane")  # gemm_per_image's workspace; gemm_batch needs twice
    provider.fail = lambda n: n > 8192
    eager = wsarena.conv_forward(x, w, padding=1, stream="lane")
    with pytest.warns(wsarena.CaptureFallbackWarning, match="captured gemm_per_image .* first choice, gemm_batch"):
        assert_captured_call_is_right(provider, x, w, eager)


def test_a_capture_on_a_stream_its_warm_up_did_not_size_runs_what_fits_and_says_so_once(cpu_conv):
    """The warm-up ran on another stream (as torch.cuda.make_graphed_callables does, and torch.cuda.graph without
    stream=): the capture's stream holds no workspace, so each call runs what needs none, with a warning once per
    stream that names both algorithms and what to do. Done as it says, the capture runs the first choice."""
    provider, x, w = cpu_conv
    eager = wsarena.conv_forward(x, w, padding=1, stream="warm-up")
    arena = wsarena.get_arena("cpu")
    graph = provider.begin_capture("lane")
    out, again = np.empty_like(eager), np.empty_like(eager)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wsarena.conv_forward(x, w, padding=1, stream="lane", out=out)
        wsarena.conv_forward(x, w, padding=1, stream="lane", out=again)  # once per stream
    provider.end_capture(graph)
    assert [w.category for w in caught] == [wsarena.CaptureFallbackWarning]
    assert caught[0].filename == __file__  # at the caller's line
    message = str(caught[0].message)
    assert "captured implicit_gemm (0 B of workspace) in place of the first choice, gemm_batch (13.5 KiB)" in message
    assert "stream 'lane' holds 0 B" in message and "arena.reserve(arena.stats().high_water_bytes" in message
    want = ref_conv_forward(x.astype(np.float64), w.astype(np.float64), padding=1)
    for result in (out, again):
        np.testing.assert_allclose(result, want, rtol=1e-4, atol=1e-4)  # float32 against float64
    graph.close()

    arena.reserve(arena.stats().high_water_bytes, stream="other lane")
    graph = provider.begin_capture("other lane")
    with warnings.catch_warnings():
        warnings.simplefilter("error", wsarena.CaptureFallbackWarning)
        wsarena.conv_forward(x, w, padding=1, stream="other lane", out=out)
    provider.end_capture(graph)
    streams = arena.stats().streams
    assert streams["other lane"].high_water_bytes == streams["warm-up"].high_water_bytes == 13824  # gemm_batch's
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    graph.close()


def test_eviction_of_idle_streams_never_drops_a_buffer_a_capture_under_way_pinned(device, monkeypatch):
    """Idle sub-arenas of caller-chosen keys beyond MAX_IDLE_STREAMS are evicted. A captured stream is idle between
    the capture's leases, and its buffer, pinned, could not be freed anyway: it is not evicted, and the capture's
    next lease there gets the same bytes. Once, it was forgotten: the next lease found no buffer (CaptureError), and
    frees with no stream stopped waiting for the capture."""
    from wsarena.arena import _table

    monkeypatch.setattr(_table, "MAX_IDLE_STREAMS", 4)
    provider, arena = device
    arena.reserve(1000, stream=S1)
    graph = provider.begin_capture(S1)
    with arena.lease(1000, stream=S1) as ws:
        pinned = ws.ptr
    for handle in range(0x100, 0x110):  # one-off streams of other threads, not captured
        with arena.lease(100, stream=handle):
            pass
    with arena.lease(1000, stream=S1) as ws:  # the capture goes on
        assert ws.ptr == pinned
    assert S1 in arena._table.capturing and pinned not in freed(provider)
    provider.end_capture(graph)
    gone = FakeStream(0x53)
    arena.reserve(100, stream=gone)
    del gone
    gc.collect()
    arena.trim()  # frees the dead stream's buffer with no stream: the capture is seen over, and forgotten
    assert arena._table.capturing == {}
    for handle in range(0x200, 0x210):
        with arena.lease(100, stream=handle):
            pass
    assert len(arena.stats().streams) <= 5  # the others were evicted as before (the pinned one counted apart)
    allocated = len(provider.allocations)
    with arena.lease(1000, stream=S1) as ws:  # the graph holds the buffer: it stayed the stream's own
        assert ws.ptr == pinned
    assert len(provider.allocations) == allocated
    graph.close()


def test_a_stream_whose_capture_ended_and_whose_graph_is_gone_is_evicted_as_idle(device, monkeypatch):
    """A capture leased on S1, ended, and its graph was released: S1, idle, is evicted as any one-off stream is, though
    no free with no stream (whose question found a capture over) came since. Once, it was kept with its buffer until
    such a free: for good, in a program whose streams are raw handles."""
    from wsarena.arena import _table

    monkeypatch.setattr(_table, "MAX_IDLE_STREAMS", 4)
    provider, arena = device
    arena.reserve(1000, stream=S1)
    graph, captured = capture_a_lease(provider, arena)
    graph.close()
    for handle in range(0x100, 0x110):  # one-off streams
        with arena.lease(100, stream=handle):
            pass
    assert S1 not in arena.stats().streams and (captured, S1) in freed_on(provider)


def test_a_spare_pins_semaphore_is_freed_once_cuda_has_posted_it(device, monkeypatch):
    """Two first leases of one capture (two threads, on two streams forked into it) may each make a pin and hand it to
    the graph: one is recorded, the other, the spare, is held by the graph alone. Its semaphore is freed once CUDA
    has posted it (the graph is gone), by the arena's close, never before. Once, it was never freed."""
    from wsarena.arena import _pins

    gc.collect()  # other tests' pins go now, not under the patch below
    _pins.free_posted()
    frees = []
    monkeypatch.setattr(_pins, "_free", frees.append)  # never freed for real here: these are test pins
    monkeypatch.setattr(_pins, "_unposted", {})  # those of other tests' pins are theirs
    provider, arena = device
    for stream in (S1, S2):
        arena.reserve(1000, stream=stream)
    graph = provider.begin_capture(S1, S2)
    retain, made = graph.retain, []

    def racing_retain(pin):
        retain(pin)
        made.append(pin.address)
        if len(made) == 1:  # the other thread's first lease, before this one's pin is recorded
            with arena.lease(1000, stream=S2):
                pass

    graph.retain = racing_retain
    with arena.lease(1000, stream=S1):
        pass
    provider.end_capture(graph)
    assert len(made) == len(graph.pins) == 2
    gc.collect()
    arena.close()
    assert frees == []  # the graph may still post either
    graph.close()
    arena.close()
    gc.collect()
    assert sorted(frees) == sorted(made)
