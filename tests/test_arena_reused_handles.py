"""A dead stream's handle given to a new stream: the new stream gets a buffer of its own, and the dead stream's is
let go as gone. CUDA gives a destroyed stream's handle to the next stream made, while the dead stream's kernels may
still use its workspace; the provider's ``stream_id`` (``cudaStreamGetId`` on a device) tells the two apart, and a
new wrapper of a live stream (``torch.cuda.current_stream()`` makes one per call) keeps its buffer.

``RecordingProvider.stream_ids`` plays CUDA: a test gives handle 11 to a new stream by changing its id there."""

import gc

import pytest

import wsarena
from wsarena.arena import Arena
from wsarena.arena.testing import RecordingProvider

H = 11  # the handle the dead stream and the new one share


class Stream:
    """A stream object as CuPy hands them out: weakly referenceable, with __cuda_stream__; the arena watches it die."""

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


@pytest.fixture
def provider():
    provider = RecordingProvider(device_id=0)
    provider.stream_ids[H] = 101
    return provider


def dead_stream_leased(arena, nbytes=1000):
    """Lease on a stream object of handle H, then let it die; return the address its buffer had."""
    stream = Stream(H)
    with arena.lease(nbytes, stream=stream) as ws:
        ptr = ws.ptr
    del stream, ws
    gc.collect()
    return ptr


def lease_ptr(arena, nbytes, stream):
    with arena.lease(nbytes, stream=stream) as ws:
        return ws.ptr


ADOPT = {  # how the new stream first uses the handle
    "a stream object": lambda arena: lease_ptr(arena, 1000, Stream(H)),
    "the raw handle": lambda arena: lease_ptr(arena, 1000, H),
    "a reserve": lambda arena: arena.reserve(1000, stream=Stream(H)),
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
    assert lease_ptr(arena, 1000, Stream(H)) == provider.allocations[1].ptr  # and it keeps its buffer


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
    stream = Stream(H)
    for _ in range(10):
        lease_ptr(arena, 1000, stream)
        lease_ptr(arena, 1000, H)
    assert provider.id_reads == [H]
    for handle in (0, 1, 2):
        lease_ptr(arena, 10, Stream(handle))
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
    stream = Stream(H)
    with arena.lease(1000, stream=stream):
        pass
    held = arena.lease(1000, stream=H)  # watched by `stream`, which it does not keep alive
    held.__enter__()
    held.array[:] = 7
    arena.reserve(5000, stream=H)  # grown under the lease: its buffer is retired until the lease ends
    del stream
    gc.collect()
    provider.stream_ids[H] = 102
    with arena.lease(1000, stream=Stream(H)) as ws:
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
    arena = Arena(provider)
    stream = Stream(H)
    arena.reserve(1000, stream=stream)
    graph = provider.begin_capture(H)
    with arena.lease(1000, stream=stream) as ws:  # captured: the graph keeps this address
        pinned = ws.ptr
    provider.end_capture(graph)
    del stream, ws
    gc.collect()
    provider.stream_ids[H] = 102
    assert lease_ptr(arena, 1000, Stream(H)) != pinned
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
    assert lease_ptr(arena, 1000, Stream(H)) == old
    assert provider.frees == []
