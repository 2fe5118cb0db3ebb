"""A dead stream's handle given to a new stream: the new stream gets a buffer of its own, and the dead stream's is
let go as gone. CUDA gives a destroyed stream's handle to the next stream made, while the dead stream's kernels may
still use its workspace; the provider's ``stream_id`` (``cudaStreamGetId`` on a device) tells the two apart, and a
new wrapper of a live stream (``torch.cuda.current_stream()`` makes one per call) keeps its buffer.

``RecordingProvider.stream_ids`` plays CUDA: a test gives handle 11 to a new stream by changing its id there."""

import gc
import threading
import weakref

import pytest

import wsarena
from wsarena.arena import Arena
from wsarena.arena.testing import FakeStream, RecordingProvider

from .capture_helpers import capture_a_lease, freed_on

H = 11  # the handle the dead stream and the new one share


@pytest.fixture
def provider():
    provider = RecordingProvider(device_id=0)
    provider.stream_ids[H] = 101
    return provider


def dead_stream_leased(arena, nbytes=1000):
    """Lease on a stream object of handle H, then let it die; return the address its buffer had."""
    stream = FakeStream(H)
    with arena.lease(nbytes, stream=stream) as ws:
        ptr = ws.ptr
    del stream, ws
    gc.collect()
    return ptr


def lease_ptr(arena, nbytes, stream):
    with arena.lease(nbytes, stream=stream) as ws:
        return ws.ptr


ADOPT = {  # how the new stream first uses the handle
    "a stream object": lambda arena: lease_ptr(arena, 1000, FakeStream(H)),
    "the raw handle": lambda arena: lease_ptr(arena, 1000, H),
    "a reserve": lambda arena: arena.reserve(1000, stream=FakeStream(H)),
}


@pytest.mark.parametrize("swept", [False, True], ids=["death queued", "death swept"])
@pytest.mark.parametrize("adopt", ADOPT.values(), ids=ADOPT.keys())
def test_a_new_stream_with_a_dead_streams_handle_gets_a_buffer_of_its_own(provider, adopt, swept):
    arena = Arena(provider)
    old = dead_stream_leased(arena)
    if swept:
        arena.stats()  # the arena has seen the death already: a lease's fast path finds the orphan
    provider.stream_ids[H] = 102  # CUDA gave the handle to the next stream made
    adopt(arena)
    assert len(provider.allocations) == 2
    (buffer, stream), = provider.frees
    assert buffer.ptr == old and stream is None  # freed as gone: the provider waits for the device first
    assert arena.stats().streams[H].allocations == 1  # the new stream's sub-arena
    assert lease_ptr(arena, 1000, FakeStream(H)) == provider.allocations[1].ptr  # and it keeps its buffer


def test_a_new_wrapper_of_the_same_live_stream_keeps_its_buffer(provider):
    arena = Arena(provider)
    for _ in range(5):
        dead_stream_leased(arena)  # e.g. torch.cuda.current_stream() builds a new object per call
        assert lease_ptr(arena, 1000, H) == provider.allocations[0].ptr
    assert len(provider.allocations) == 1 and provider.frees == []


def test_a_lease_on_a_watched_stream_asks_no_id(provider):
    """The id is read when a stream object first watches a sub-arena and when an orphan is adopted, never on the
    lease of a stream still watched; nor for the default streams (0, 1, 2), which are never destroyed."""
    arena = Arena(provider)
    stream = FakeStream(H)
    for _ in range(10):
        lease_ptr(arena, 1000, stream)
        lease_ptr(arena, 1000, H)
    assert provider.id_reads == [H]
    for handle in (0, 1, 2):
        lease_ptr(arena, 10, FakeStream(handle))
    assert provider.id_reads == [H]


@pytest.mark.parametrize("debug", ["0", "1"])
def test_a_live_lease_on_the_dead_streams_buffer_is_kept_until_it_ends(provider, monkeypatch, debug):
    """A lease on the raw handle, taken while the dead stream lived, still holds its buffer when the new stream
    comes: the new stream gets other bytes (debug mode's overlap check, which looks at every live lease, stays
    quiet), and the old buffers (the one the lease holds, and the one grown under it) are freed as gone once that
    lease ends, never on the handle, which names the new stream now."""
    monkeypatch.setenv("WSARENA_DEBUG", debug)
    wsarena._config._reset()
    arena = Arena(provider)
    stream = FakeStream(H)
    with arena.lease(1000, stream=stream):
        pass
    held = arena.lease(1000, stream=H)  # watched by `stream`, which it does not keep alive
    held.__enter__()
    held.array[:] = 7
    arena.reserve(5000, stream=H)  # grown under the lease: its buffer is retired until the lease ends
    del stream
    gc.collect()
    provider.stream_ids[H] = 102
    with arena.lease(1000, stream=FakeStream(H)) as ws:
        ws.array[:] = 9
        assert ws.ptr + 1000 <= held.ptr or held.ptr + 1024 <= ws.ptr
    assert (held.array == 7).all()
    assert provider.frees == []  # in use
    old = {held.ptr, provider.allocations[1].ptr}
    held.__exit__(None, None, None)
    assert {buffer.ptr for buffer, _ in provider.frees} == old
    assert [stream for _, stream in provider.frees] == [None, None]
    assert list(arena.stats().streams) == [H] and len(provider.held) == 1


def test_a_buffer_a_graph_holds_is_kept_when_its_dead_streams_handle_is_given_again(provider):
    """Kept for the graph, and counted as the arena's pinned bytes, not as the new stream's. (Once, the new stream
    was said to pin it.)"""
    arena = Arena(provider)
    stream = FakeStream(H)
    arena.reserve(1000, stream=stream)
    graph = provider.begin_capture(H)
    with arena.lease(1000, stream=stream) as ws:  # captured: the graph keeps this address
        pinned = ws.ptr
    provider.end_capture(graph)
    del stream, ws
    gc.collect()
    provider.stream_ids[H] = 102
    assert lease_ptr(arena, 1000, FakeStream(H)) != pinned
    stats = arena.stats()  # the graph holds the dead stream's buffer, not the new stream's
    assert (stats.pinned_bytes, stats.streams[H].pinned_bytes, stats.streams[H].capacity_bytes) == (1024, 0, 1024)
    arena.trim()
    assert pinned in [b.ptr for b in provider.held]  # the graph may be replayed
    graph.close()
    arena.trim()
    assert [(b.ptr, s) for b, s in provider.frees if b.ptr == pinned] == [(pinned, None)]


def test_a_provider_that_cannot_tell_streams_apart_keeps_the_buffer(provider):
    """Without an id (a provider of the user's own, without ``stream_id``) the arena cannot know: as before,
    whoever leases on the handle adopts the orphan."""
    provider.stream_ids.clear()
    arena = Arena(provider)
    old = dead_stream_leased(arena)
    assert lease_ptr(arena, 1000, FakeStream(H)) == old
    assert provider.frees == []


def test_a_dead_streams_lease_that_nothing_can_end_lets_its_buffer_go_when_the_handle_is_given_again(provider):
    """A lease entered by hand and dropped (or cut short by a Ctrl-C) is ended by whoever next wants its lane. Once
    its stream is gone and a new stream has the handle, no one wants that lane again: the new stream's first lease
    ends it and lets the buffer go. Once, it was moved aside under ``GoneStream`` and held its buffer until a trim,
    stats() or close(), which a process may never call."""
    arena = Arena(provider)
    stream = FakeStream(H)
    ws = arena.lease(1000, stream=stream)
    ws.__enter__()  # and never __exit__
    old = ws.ptr
    del ws, stream
    gc.collect()
    provider.stream_ids[H] = 102
    for _ in range(3):  # the new stream's steps
        lease_ptr(arena, 1000, FakeStream(H))
    assert [(buffer.ptr, stream) for buffer, stream in provider.frees] == [(old, None)]
    assert list(arena._subs) == [H] and len(provider.held) == 1


class GatedLarge(RecordingProvider):
    """Allocations of 4 KiB and more wait at a gate."""

    def __init__(self):
        super().__init__(device_id=0)
        self.allocating, self.gate = threading.Event(), threading.Event()

    def allocate(self, size, *, stream):
        if size >= 4096:
            self.allocating.set()
            assert self.gate.wait(10)
        return super().allocate(size, stream=stream)


def test_a_reserve_that_ends_after_its_dead_streams_handle_was_given_again_lets_its_buffer_go():
    """A reserve on the handle is allocating when the stream dies and a new stream takes the handle: the old
    sub-arena is moved aside while the reserve grows it, and goes (buffers freed with no stream) once the reserve
    ends. Once, it stayed aside with both buffers until a trim or close."""
    provider = GatedLarge()
    provider.stream_ids[H] = 101
    arena = Arena(provider)
    stream = FakeStream(H)
    lease_ptr(arena, 100, stream)
    reserve = threading.Thread(target=arena.reserve, args=(5000,), kwargs={"stream": H})
    reserve.start()
    assert provider.allocating.wait(10)
    del stream
    gc.collect()
    provider.stream_ids[H] = 102
    new = lease_ptr(arena, 100, FakeStream(H))  # the new stream's: the old sub-arena is moved aside
    provider.gate.set()
    reserve.join(10)
    assert not reserve.is_alive()
    assert sorted(buffer.size for buffer, stream in provider.frees if stream is None) == [256, 5120]
    assert [buffer.ptr for buffer in provider.held] == [new] and list(arena._subs) == [H]


def test_a_new_stream_with_a_dead_streams_handle_holds_nothing_before_its_first_lease(provider):
    """held_bytes() answers for the stream the handle names now: a new stream given a dead stream's handle holds
    nothing, as its first lease would find. wsarena.capture() asks so whether to seed its capture stream (a fresh
    stream each time, whose handle CUDA gives again once the previous one is destroyed): once, it was told the dead
    stream's capacity, seeded nothing, and the capture's first lease raised CaptureError."""
    from wsarena.cudagraph import seed_workspace

    arena = Arena(provider)
    lease_ptr(arena, 4000, 0x51)  # the eager step
    dead_stream_leased(arena, 4000)
    assert arena.held_bytes(stream=H) == 4096  # the handle's stream object died: it may be a wrapper of the same stream
    provider.stream_ids[H] = 102
    stream = FakeStream(H)
    assert arena.held_bytes(stream=stream) == 0
    assert [(buffer.size, stream) for buffer, stream in provider.frees] == [(4096, None)]  # let go as gone
    seed_workspace(arena, stream)
    graph = provider.begin_capture(H)
    assert lease_ptr(arena, 4000, stream) == provider.allocations[-1].ptr  # the seed, captured
    provider.end_capture(graph)
    graph.close()


def test_debug_mode_poisons_no_dead_streams_buffer_on_the_handle_given_again(provider):
    """A lease on the dead stream's buffer ends after a new stream took the handle: debug mode's poisoning, a fill in
    stream order, has no stream to be ordered on (the handle names the new stream, whose work is unordered with the
    dead stream's kernels, which may still use the bytes): the bytes are not poisoned. Once, they were filled on the
    handle."""
    arena = Arena(provider)
    stream = FakeStream(H)
    lease_ptr(arena, 1000, stream)
    with wsarena.config(debug=True):
        held = arena.lease(1000, stream=H)
        held.__enter__()
        lease_ptr(arena, 10, 0x51)  # poisoned on its stream, as always
        del stream
        gc.collect()
        provider.stream_ids[H] = 102
        lease_ptr(arena, 1000, FakeStream(H))
        held.__exit__(None, None, None)
    assert [(n, stream) for _, _, n, stream in provider.fills] == [(10, 0x51), (1000, H)]  # the two live streams'
    assert provider.fills[-1][0] != held.ptr


class _NoIdsInCapture(RecordingProvider):
    """Plays CUDA's cudaStreamGetId during a capture: refused, and the refusal invalidates the capture, in every
    capture mode (seen on an H200). The test fails on any such read."""

    def stream_id(self, stream):
        assert not self.capturing, f"stream {stream!r} asked its id while {list(self.capturing)} is being captured"
        return super().stream_id(stream)


@pytest.fixture
def no_ids_in_capture():
    provider = _NoIdsInCapture(device_id=0)
    provider.stream_ids[H] = 101
    return provider


def test_an_orphans_lease_during_a_capture_asks_no_id_and_says_what_to_do(no_ids_in_capture):
    """A stream object made per call died after the last eager use: whether the handle still names its stream cannot
    be asked during the capture. The lease is refused with what to do, and the buffer is kept for a lease after the
    capture, which asks and adopts it."""
    provider = no_ids_in_capture
    arena = Arena(provider)
    old = dead_stream_leased(arena)
    graph = provider.begin_capture(H)
    with pytest.raises(wsarena.CaptureError, match="stream object that lives until the capture ends"):
        lease_ptr(arena, 1000, FakeStream(H))
    assert arena.held_bytes(stream=H) == 1024  # asked no id either: counted as held
    provider.end_capture(graph)
    assert lease_ptr(arena, 1000, FakeStream(H)) == old and len(provider.allocations) == 1


def test_a_stream_object_that_lives_over_the_capture_adopts_the_orphan_before_it_begins(no_ids_in_capture):
    """wsarena.capture() watches its stream before the capture begins: the orphaned buffer is adopted then, its
    stream asked while it may be, and the capture's leases through new wrappers of the stream take it."""
    from wsarena.arena._pinning import watch_capture

    provider = no_ids_in_capture
    arena = Arena(provider)
    old = dead_stream_leased(arena)
    reads = len(provider.id_reads)
    stream = FakeStream(H)  # the block's stream object
    watch_capture(arena, stream, beginning=True)
    assert provider.id_reads[reads:] == [H]
    graph = provider.begin_capture(H)
    assert lease_ptr(arena, 1000, FakeStream(H)) == old
    provider.end_capture(graph)
    graph.close()


def test_a_dead_streams_growth_that_no_one_can_end_ends_when_another_stream_takes_the_handle(provider):
    """A reserve on the dead stream's sub-arena was cut short (a Ctrl-C) and left its growth to no one: the lease of
    the stream CUDA gave the handle to ends that growth, and the dead stream's buffer is freed then, with no stream,
    not left held until a trim, stats or close looks."""
    arena = Arena(provider)
    old = dead_stream_leased(arena)
    arena.stats()  # the death is seen: an orphan
    owner = FakeStream(H)  # stands for the reserve's owner, gone
    arena._subs[H].growing = weakref.ref(owner)  # as a reserve cut short leaves it
    del owner
    provider.stream_ids[H] = 102  # a new stream has handle H
    assert lease_ptr(arena, 500, FakeStream(H)) != old
    assert freed_on(provider) == [(old, None)] and len(provider.held) == 1


def test_a_dead_streams_buffer_kept_for_a_graph_is_not_counted_as_the_new_streams_of_its_handle(provider):
    """A buffer of the dead stream's that a graph holds, kept aside (outgrown after the capture), goes with the dead
    stream's sub-arena when the stream CUDA gave the handle to first leases: the new stream's stats count no bytes of
    it as pinned, the arena's do until the graph is gone, and it is then freed with no stream."""
    arena = Arena(provider)
    stream = FakeStream(H)
    arena.reserve(1000, stream=stream)
    graph, pinned = capture_a_lease(provider, arena, stream=stream)
    with arena.lease(50_000, stream=stream):  # an eager growth: the pinned buffer is kept aside for the graph
        pass
    del stream
    gc.collect()
    assert arena.stats().streams[H].pinned_bytes == 1024  # the death is seen: an orphan, whose bytes these are
    provider.stream_ids[H] = 102  # a new stream has handle H
    lease_ptr(arena, 500, FakeStream(H))
    stats = arena.stats()
    assert stats.streams[H].pinned_bytes == 0 and stats.pinned_bytes == 1024
    graph.close()
    arena.trim()
    assert (pinned, None) in freed_on(provider) and (pinned, H) not in freed_on(provider)


def test_a_capture_block_ends_well_where_its_streams_sub_arena_was_forgotten_meanwhile(no_ids_in_capture):
    """The end of a wsarena.capture() block gives the watch of its stream's buffer back to the object that watched it
    before: where the sub-arena was forgotten meanwhile (the arena closed during the block), there is none to give
    back, and the block ends as any other."""
    from wsarena.arena._pinning import unwatch_capture, watch_capture

    provider = no_ids_in_capture
    arena = Arena(provider)
    user = FakeStream(H)
    lease_ptr(arena, 1000, user)
    block = FakeStream(H)  # the block's stream object, made for it
    watch_capture(arena, block, beginning=True)
    graph = provider.begin_capture(H)
    provider.end_capture(graph)
    arena.close()
    assert arena.stats().streams == {}
    unwatch_capture(arena, block)
    assert arena._table.rewatched == {} and provider.held == []
    graph.close()


@pytest.mark.parametrize("orphan", [False, True], ids=["no sub-arena", "an orphan's"])
def test_the_watch_of_a_capture_begun_asks_no_id_and_makes_no_sub_arena(no_ids_in_capture, orphan):
    """wsarena.capture() watches its stream again once its capture has begun (not beginning): that watch records the
    stream alone. It asks CUDA no id, which would invalidate the capture, not even to adopt the buffer of a dead
    stream object of the handle, and makes the arena no sub-arena."""
    from wsarena.arena._pinning import unwatch_capture, watch_capture

    provider = no_ids_in_capture
    arena = Arena(provider)
    old = dead_stream_leased(arena) if orphan else None
    reads = len(provider.id_reads)
    stream = FakeStream(H)  # the block's stream object
    graph = provider.begin_capture(H)
    watch_capture(arena, stream)
    assert provider.id_reads[reads:] == [] and arena.held_bytes(stream=H) == (1024 if orphan else 0)
    provider.end_capture(graph)
    unwatch_capture(arena, stream)
    assert list(arena.stats().streams) == ([H] if orphan else [])
    assert [buffer.ptr for buffer in provider.allocations] == ([old] if orphan else [])
    graph.close()


def test_a_stream_objects_first_lease_during_a_capture_asks_no_id_and_the_first_after_it_does(no_ids_in_capture):
    """A buffer reserved through the raw handle (no stream object to watch), then leased during a capture through a
    stream object: the stream's id is left unread, and the object unwatched until its first lease after the
    capture, which reads the id. Watched from the capture on, the object's death would leave an orphan with no id,
    which the next stream given its handle would adopt, dead stream's buffer and all."""
    provider = no_ids_in_capture
    arena = Arena(provider)
    arena.reserve(1000, stream=H)
    graph = provider.begin_capture(H)
    stream = FakeStream(H)
    ptr = lease_ptr(arena, 1000, stream)
    provider.end_capture(graph)
    reads = len(provider.id_reads)
    assert lease_ptr(arena, 1000, stream) == ptr
    assert provider.id_reads[reads:] == [H]
    del stream
    gc.collect()
    provider.stream_ids[H] = 102  # CUDA gave the handle to the next stream made
    assert lease_ptr(arena, 1000, FakeStream(H)) != ptr and provider.frees == []  # the graph still holds it
    graph.close()
    arena.trim()
    assert (ptr, None) in [(buffer.ptr, on) for buffer, on in provider.frees]  # let go as gone, once the graph is


def test_held_bytes_reads_no_id_of_a_stream_whose_object_dies_while_it_looks(no_ids_in_capture, monkeypatch):
    """A watched stream (its id read) being captured: held_bytes asks CUDA nothing about it, and its object may die,
    and the death be swept, between the look and the count (here the collector runs just after the look): the
    orphan it becomes is not asked its id during the capture either, but counted as held."""
    from wsarena.arena import _table

    provider = no_ids_in_capture
    arena = Arena(provider)
    streams = [FakeStream(H)]
    ptr = lease_ptr(arena, 1000, streams[0])
    graph = provider.begin_capture(H)
    looked = _table._Table.unchecked

    def unchecked(self, sub):
        answer = looked(self, sub)
        if streams:  # the stream object's last reference goes, and the collector runs, just after the look
            streams.clear()
            gc.collect()
        return answer

    monkeypatch.setattr(_table._Table, "unchecked", unchecked)
    assert arena.held_bytes(stream=H) == 1024
    provider.end_capture(graph)
    monkeypatch.undo()
    assert lease_ptr(arena, 1000, FakeStream(H)) == ptr  # the same stream: adopted after the capture
    graph.close()


def test_the_capture_blocks_stream_object_watches_the_buffer_in_place_of_another_that_dies_during_it(
        no_ids_in_capture):
    """wsarena.capture() watches its stream before the capture begins, in place of another live object of the same
    stream watching its buffer: that one may die during the capture, which would leave an orphan whose id the
    capture's next lease could not ask (a CaptureError telling the user what wsarena.capture does itself)."""
    from wsarena.arena._pinning import watch_capture

    provider = no_ids_in_capture
    arena = Arena(provider)
    other = FakeStream(H)
    ptr = lease_ptr(arena, 1000, other)
    stream = FakeStream(H)  # the block's stream object
    watch_capture(arena, stream, beginning=True)
    graph = provider.begin_capture(H)
    del other
    gc.collect()
    assert lease_ptr(arena, 1000, stream) == ptr
    provider.end_capture(graph)
    graph.close()


def test_a_reserve_on_an_orphan_during_a_capture_asks_no_id_and_says_what_to_do(no_ids_in_capture):
    provider = no_ids_in_capture
    arena = Arena(provider)
    old = dead_stream_leased(arena)
    graph = provider.begin_capture(H)
    with pytest.raises(wsarena.CaptureError, match="stream object that lives until the capture ends"):
        arena.reserve(1000, stream=FakeStream(H))
    provider.end_capture(graph)
    assert lease_ptr(arena, 1000, FakeStream(H)) == old and len(provider.allocations) == 1


def test_held_bytes_of_an_orphan_on_a_stream_cuda_will_not_answer_for_asks_no_id(no_ids_in_capture, monkeypatch):
    """Where CUDA refuses to say whether the stream is captured (an invalidated capture: a CaptureError), its id is not
    asked either: the orphan's buffer is counted as held."""
    provider = no_ids_in_capture
    arena = Arena(provider)
    dead_stream_leased(arena)
    graph = provider.begin_capture(H)

    def refused(stream):
        raise wsarena.CaptureError(f"the capture on stream {stream:#x} was invalidated")

    monkeypatch.setattr(arena, "_capture", refused)
    assert arena.held_bytes(stream=H) == 1024
    provider.end_capture(graph)


def test_a_live_stream_object_watches_its_buffer_again_once_a_capture_blocks_own_object_is_gone(no_ids_in_capture):
    """The block's stream object watches the buffer only while the block lasts: made for one capture, it dies after
    it, and the user's own object, still alive, watches the buffer again. A later capture begun elsewhere
    (torch.cuda.graph, CuPy's begin_capture) leasing through the user's object is then served, not refused as an
    orphan's lease."""
    from wsarena.arena._pinning import unwatch_capture, watch_capture

    provider = no_ids_in_capture
    arena = Arena(provider)
    user = FakeStream(H)
    ptr = lease_ptr(arena, 1000, user)
    block = FakeStream(H)  # the block's stream object, made for it
    watch_capture(arena, block, beginning=True)
    graph = provider.begin_capture(H)
    assert lease_ptr(arena, 1000, block) == ptr
    provider.end_capture(graph)
    unwatch_capture(arena, block)
    del block
    gc.collect()
    later = provider.begin_capture(H)
    assert lease_ptr(arena, 1000, user) == ptr
    provider.end_capture(later)
    graph.close()
    later.close()


def test_a_watcher_that_dies_as_the_capture_blocks_object_takes_its_place_orphans_nothing(
        no_ids_in_capture, monkeypatch):
    """The object watching the buffer dies (the collector runs) just before the block's stream object takes its place:
    its death, swept later, is not the buffer's any more, and the capture's lease is served."""
    from wsarena.arena import _table
    from wsarena.arena._pinning import unwatch_capture, watch_capture

    provider = no_ids_in_capture
    arena = Arena(provider)
    others = [FakeStream(H)]
    ptr = lease_ptr(arena, 1000, others[0])
    rewatch = _table._Table.rewatch

    def dying_first(self, sub, anchor):
        others.clear()
        gc.collect()  # its death queued, not yet swept
        return rewatch(self, sub, anchor)

    monkeypatch.setattr(_table._Table, "rewatch", dying_first)
    block = FakeStream(H)
    watch_capture(arena, block, beginning=True)
    graph = provider.begin_capture(H)
    assert lease_ptr(arena, 1000, block) == ptr
    provider.end_capture(graph)
    unwatch_capture(arena, block)
    graph.close()


def test_close_frees_a_dead_streams_buffer_with_no_stream(provider):
    """The stream object died and no call has looked at the arena since: close() frees its buffer with no stream (the
    provider waits for the device), not on its handle, which may name another stream by now."""
    arena = Arena(provider)
    ptr = dead_stream_leased(arena)
    assert provider.frees == []  # its death is queued, not yet seen
    arena.close()
    assert freed_on(provider) == [(ptr, None)] and provider.held == []


def test_a_buffer_kept_for_a_graph_is_freed_with_no_stream_once_its_stream_died(provider):
    """A buffer outgrown while a graph held it is kept for the graph with its stream; the stream object dies, then the
    graph goes: the buffer is freed with no stream, as the dead stream's other buffers are, not on its handle."""
    arena = Arena(provider)
    stream = FakeStream(H)
    arena.reserve(1000, stream=stream)
    graph, pinned = capture_a_lease(provider, arena, stream=stream)
    arena.reserve(5000, stream=stream)  # outgrows the pinned buffer, which is kept for the graph
    grown = arena._subs[H].block.ptr
    del stream
    gc.collect()
    graph.close()
    arena.trim()
    assert sorted(freed_on(provider)) == sorted([(grown, None), (pinned, None)]) and provider.held == []
