"""How a device arena keys its sub-arenas: by CUDA stream handle, ``None`` as the current stream, and the
per-thread default stream (handle 2) as a stream of each thread's own. On host memory, no GPU needed."""

import threading

import pytest

import wsarena
from wsarena.arena import Arena
from wsarena.arena._stats import aligned_size
from wsarena.arena.testing import RecordingProvider

from .arena_helpers import snapshot
from .capture_helpers import freed_on


def test_device_arena_rejects_lane_keys(device_arena):
    before = snapshot(device_arena)
    with pytest.raises(TypeError, match="'lane'"):
        device_arena.lease(10, stream="lane")
    with pytest.raises(ValueError, match="negative"):
        device_arena.lease(10, stream=-3)
    assert snapshot(device_arena) == before


def test_device_none_is_the_providers_current_stream(device_arena, device_provider):
    device_provider.current = 42
    with device_arena.lease(10) as ws:
        assert ws.stream == 42


def test_device_stream_objects_key_by_handle(device_arena):
    class S:
        def __cuda_stream__(self):
            return (0, 77)

    with device_arena.lease(10, stream=S()) as ws:
        assert ws.stream == 77
    assert device_arena.held_bytes(stream=77) == 256


def test_device_legacy_null_stream_stays_one_key_for_every_thread(device_arena, device_provider):
    ptrs = []

    def work():
        with device_arena.lease(1000, stream=0) as ws:
            ptrs.append((ws.ptr, ws.stream))

    for _ in range(2):
        t = threading.Thread(target=work)
        t.start()
        t.join(5)
    assert ptrs[0] == ptrs[1] and type(ptrs[0][1]) is int
    assert len(device_provider.allocations) == 1


# ---------------------------------------------------------------------- the per-thread default stream
class _Ptds:
    """CuPy's ``Stream.ptds`` as far as the arena can tell: a stream object whose handle is 2."""

    ptr = 2


@pytest.mark.parametrize("how", ["int", "object", "current"])
def test_device_per_thread_default_stream_is_a_sub_arena_per_thread(device_arena, device_provider, how):
    """Handle 2 is a different stream in each thread: two threads there never get the same bytes, even one
    after the other (the first thread's kernels may still run on its own stream)."""
    device_provider.current = _Ptds()
    stream = {"int": 2, "object": _Ptds(), "current": None}[how]
    first_done, second_done = threading.Event(), threading.Event()
    seen = {}

    def first():
        with device_arena.lease(1000, stream=stream) as ws:
            seen["first"] = (ws.ptr, ws.stream)
        first_done.set()
        second_done.wait(5)  # still alive (its stream too) while the second thread leases

    t = threading.Thread(target=first)
    t.start()
    first_done.wait(5)
    with device_arena.lease(1000, stream=stream) as ws:
        seen["second"] = (ws.ptr, ws.stream)
        assert device_arena.stats().streams[ws.stream].leases == 1
    second_done.set()
    t.join(5)
    (p1, k1), (p2, k2) = seen["first"], seen["second"]
    assert p1 + 1000 <= p2 or p2 + 1000 <= p1
    assert k1 != k2 and k1.handle == k2.handle == 2
    assert len(device_provider.allocations) == 2


def test_device_nested_lease_on_own_per_thread_stream_is_an_error(device_arena):
    with (
        device_arena.lease(1000, stream=2),
        pytest.raises(RuntimeError, match="already holds a lease on stream PerThreadStream"),
        device_arena.lease(1000, stream=2),
    ):
        pass


def test_device_per_thread_default_stream_leases_do_not_wait_for_each_other(device_arena):
    both_live = threading.Barrier(2)
    ptrs = []

    def work():
        with device_arena.lease(4096, stream=2) as ws:
            ptrs.append(ws.ptr)
            both_live.wait(5)  # raises BrokenBarrierError if one thread waits for the other's lease

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not both_live.broken and len(set(ptrs)) == 2


def _other_thread_held_bytes(arena, stream):
    out = []
    t = threading.Thread(target=lambda: out.append(arena.held_bytes(stream=stream)))
    t.start()
    t.join(5)
    return out[0]


def test_device_providers_get_the_plain_handle_2_from_the_keys_own_thread(device_arena, device_provider):
    calls = []
    allocate = device_provider.allocate

    def recording_allocate(nbytes, *, stream):
        calls.append(stream)
        return allocate(nbytes, stream=stream)

    device_provider.allocate = recording_allocate
    with wsarena.config(debug=True), device_arena.lease(1000, stream=2):
        pass
    device_arena.reserve(1 << 20, stream=2)  # growth: the old buffer is freed on this thread's stream 2
    assert calls == [2, 2] and all(type(s) is int for s in calls)
    assert [(s, type(s)) for *_, s in device_provider.fills] == [(2, int)]
    (_, stream), = device_provider.frees
    assert stream == 2 and type(stream) is int
    assert device_arena.held_bytes(stream=2) == 1 << 20
    assert _other_thread_held_bytes(device_arena, 2) == 0  # another thread's handle 2 is another sub-arena


def test_device_another_threads_trim_frees_a_per_thread_buffer_with_no_stream(device_arena, device_provider):
    """Handle 2 would name the trimming thread's own stream, not the owner's: it must not be used there."""
    device_arena.reserve(1000, stream=2)
    t = threading.Thread(target=device_arena.trim)
    t.start()
    t.join(5)
    (buffer, stream), = device_provider.frees
    assert buffer.size == 1024 and stream is None
    device_arena.reserve(1000, stream=2)
    device_arena.trim()  # by the owner itself: on its stream 2
    assert device_provider.frees[1][1] == 2


class _DrainHeldInOwner(RecordingProvider):
    """Holds the owner thread, once ``armed``, as its drain of the queue first asks about a capture (nothing is taken
    off the queue yet), until another thread has drained the queue. Records which thread asked about which stream."""

    def __init__(self):
        super().__init__(device_id=0)
        self.owner = None
        self.armed = False
        self.arm_at_allocation = None  # armed by the allocation of that many bytes
        self.waiting, self.drained = threading.Event(), threading.Event()
        self.asked = []  # (thread name, stream) of every capture question

    def allocate(self, size, *, stream):
        buffer = super().allocate(size, stream=stream)
        self.armed = self.armed or size == self.arm_at_allocation  # the growth's question came before it
        return buffer

    def capture(self, stream):
        self.asked.append((threading.current_thread().name, stream))
        if self.armed and threading.current_thread() is self.owner:
            self.armed = False
            self.waiting.set()
            assert self.drained.wait(30)
        return super().capture(stream)


@pytest.mark.parametrize("let_go_by", ["a growth", "a trim"])
def test_device_a_per_thread_buffer_another_thread_drains_is_freed_with_no_stream(let_go_by):
    """A thread lets go of a buffer of its per-thread default stream (outgrown, or trimmed) and another thread's call
    drains the queue first. Handle 2 names the draining thread's own per-thread stream, which nothing orders after
    the owner's work: the free is made with no stream (the provider waits for the device), and the draining thread
    asks nothing about handle 2. The owner's own drain still frees on its handle 2. Once, the queued entry carried
    handle 2 and the draining thread freed it on its own per-thread stream, having asked whether that was captured."""
    provider = _DrainHeldInOwner()
    arena = Arena(provider)
    box = {}

    def owner():
        arena.reserve(1000, stream=2)
        box["first"] = provider.allocations[-1].ptr
        if let_go_by == "a growth":
            provider.arm_at_allocation = aligned_size(50_000)
            arena.reserve(50_000, stream=2)  # the outgrown buffer is queued as the growth ends
        else:
            provider.armed = True
            arena.trim()
        arena.reserve(200_000, stream=2)
        arena.trim()  # let go and drained by the owner itself

    thread = provider.owner = threading.Thread(target=owner, name="owner")
    thread.start()
    try:
        assert provider.waiting.wait(30)
        asked = len(provider.asked)
        arena.stats()  # this thread drains the queue
        assert [stream for _, stream in freed_on(provider)] == [None]
        assert freed_on(provider)[0][0] == box["first"]
        assert ("MainThread", 2) not in provider.asked[asked:]
    finally:
        provider.drained.set()
        thread.join(30)
    later = [stream for _, stream in freed_on(provider)[1:]]
    assert later and all(type(stream) is int and stream == 2 for stream in later)
    assert provider.held == []


def test_device_debug_sees_no_overlap_between_threads_on_handle_2(device_arena):
    errors = []
    both_live = threading.Barrier(2)

    def work():
        try:
            with wsarena.config(debug=True), device_arena.lease(1000, stream=2):
                both_live.wait(5)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert errors == []
