"""The arena's rules, on host memory: leases, growth, retirement, reserve, trim, cap, failures, lanes."""

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wsarena
from wsarena.arena import Arena, HostProvider, get_arena, reset_arenas, set_arena
from wsarena.arena._arena import POISON_BYTE
from wsarena.arena._stats import aligned_size
from wsarena.arena.streams import thread_lane
from wsarena.arena.testing import RecordingProvider

from .interrupts import interrupt_at_call, interrupt_at_entry_of
from wsarena.errors import ArenaOutOfMemoryError, BackendUnavailableError, WorkspaceCapError


@pytest.fixture
def provider():
    return RecordingProvider()


@pytest.fixture
def arena(provider):
    return Arena(provider)


@pytest.fixture
def device_provider():
    return RecordingProvider(device_id=0)


@pytest.fixture
def device_arena(device_provider):
    return Arena(device_provider)


def snapshot(arena):
    return arena.stats().to_dict()


# ---------------------------------------------------------------------------------------------- basics
def test_lease_gives_an_array_of_exactly_nbytes_over_ptr(arena):
    with arena.lease(1000) as ws:
        assert ws.nbytes == 1000
        assert ws.array.shape == (1000,) and ws.array.dtype == np.uint8
        assert ws.array.__array_interface__["data"][0] == ws.ptr
        ws.array[:] = 7
    assert ws.stream is thread_lane()


def test_lazy_nothing_allocated_before_first_lease(arena, provider):
    assert provider.allocations == []
    assert arena.held_bytes() == 0
    assert arena.stats().capacity_bytes == 0


def test_zero_bytes_is_legal_and_allocates_nothing(arena, provider):
    with arena.lease(0) as ws:
        assert ws.ptr == 0 and ws.nbytes == 0
        assert ws.array.shape == (0,) and ws.array.dtype == np.uint8
        with arena.lease(0, stream=thread_lane()):  # takes nothing, so it may nest
            pass
    assert provider.allocations == []
    assert arena.stats().streams == {}


def test_same_lane_reuses_the_same_bytes(arena, provider):
    with arena.lease(4096) as a:
        pa = a.ptr
    with arena.lease(100) as b:
        assert b.ptr == pa
    assert len(provider.allocations) == 1


def test_different_lanes_get_disjoint_bytes(arena):
    with arena.lease(1000, stream="a") as a, arena.lease(1000, stream="b") as b:
        assert a.ptr + a.nbytes <= b.ptr or b.ptr + b.nbytes <= a.ptr


def test_growth_is_by_the_aligned_request_not_doubling(arena, provider):
    for n in (1000, 1300, 70_000, 70_001):
        with arena.lease(n):
            pass
        assert arena.held_bytes() == aligned_size(max(1000, n))
    assert [b.size for b in provider.allocations] == [1024, 1536, aligned_size(70_000)]
    s = arena.stats()
    assert (s.allocations, s.growths, s.frees) == (3, 2, 2)  # 70_001 fits the aligned 70_000


@pytest.mark.parametrize("n", [1, 255, 256, 257, 4096, 8191, 8192, 10**6, 3 << 20, 64 << 20, (64 << 20) + 1, 10**10])
def test_aligned_size(n):
    size = aligned_size(n)
    assert size >= n and size % 256 == 0
    assert size - n < max(256, n / 16)
    assert size - n < 2 << 20
    assert aligned_size(size) == size


@settings(max_examples=500, deadline=None)
@given(st.integers(1, 1 << 40))
def test_aligned_size_overshoots_by_less_than_its_documented_bound(n):
    size = aligned_size(n)
    assert n <= size < n + min(max(256, n / 16), 2 << 20)
    assert aligned_size(size) == size and aligned_size(n + 1) >= size


def _capacities_in(low, high):
    """The distinct capacities a run of growing requests in (low, high] passes through."""
    count, n = 0, low + 1
    while n <= high:
        n = aligned_size(n) + 1
        count += 1
    return count


def test_growths_per_doubling_are_bounded():
    for k in range(13, 25):  # up to 32 MiB: the step is 1/16 of the request
        assert _capacities_in(1 << k, 2 << k) == 16, k
    for k in range(25, 31):  # above: one capacity per 2 MiB
        assert _capacities_in(1 << k, 2 << k) == (1 << k) // (2 << 20), k
    assert (aligned_size(8193), aligned_size((1 << 20) + 1)) == (8704, (1 << 20) + (1 << 16))


def test_aligned_size_zero():
    assert aligned_size(0) == 0


def test_stats_have_attribute_and_item_access(arena):
    with arena.lease(3000, stream="x"):
        s = arena.stats()
        for name in ("capacity_bytes", "high_water_bytes", "allocations", "growths", "leases", "streams"):
            assert s[name] == getattr(s, name)
        assert s.leases == 1 and s.streams["x"].leases == 1 and s.streams["x"]["capacity_bytes"] == 3072
        assert dict(s)["high_water_bytes"] == 3000
    with pytest.raises(KeyError):
        s["nope"]
    assert arena.stats().leases == 0


def test_reserve_presizes_and_leases_then_do_not_allocate(arena, provider):
    arena.reserve(10_000, stream="s")
    assert arena.held_bytes(stream="s") == aligned_size(10_000)
    with arena.lease(10_000, stream="s"), pytest.raises(RuntimeError, match="already holds"):
        with arena.lease(5, stream="s"):
            pass
    assert len(provider.allocations) == 1
    arena.reserve(0, stream="s")
    arena.reserve(10, stream="s")  # smaller: nothing to do
    assert len(provider.allocations) == 1


def test_trim_frees_what_no_live_lease_uses(arena, provider):
    with arena.lease(5000, stream="a"):
        with arena.lease(7000, stream="b"):
            pass
        assert arena.trim() == aligned_size(7000)
        assert arena.held_bytes(stream="a") == aligned_size(5000)
        assert arena.held_bytes(stream="b") == 0
    assert arena.trim() == aligned_size(5000)
    assert provider.held == [] and arena.stats().capacity_bytes == 0
    assert dict(arena.stats().streams) == {}  # emptied sub-arenas are forgotten
    with arena.lease(100, stream="a"):  # usable after trim
        pass


def test_a_size_no_host_has_is_out_of_memory_not_a_value_error():
    arena = Arena(HostProvider())
    with pytest.raises(ArenaOutOfMemoryError):
        with arena.lease((1 << 63) - 1):
            pass
    assert arena.stats().capacity_bytes == 0


def test_an_interrupt_during_one_free_still_frees_the_others():
    class Interrupting(RecordingProvider):
        def deallocate(self, buffer, *, stream):
            super().deallocate(buffer, stream=stream)
            if len(self.held) == 2:  # the first of three frees
                raise KeyboardInterrupt

    provider = Interrupting()
    arena = Arena(provider)
    for lane in ("a", "b", "c"):
        arena.reserve(4096, stream=lane)
    with pytest.raises(KeyboardInterrupt):
        arena.trim()
    assert provider.held == [] and arena.stats().capacity_bytes == 0


def test_a_provider_that_returns_too_little_is_an_error_and_its_buffer_is_freed(arena, provider):
    real_allocate = provider.allocate
    provider.allocate = lambda nbytes, *, stream: real_allocate(nbytes // 2, stream=stream)
    with pytest.raises(RuntimeError, match="for a request of 4096 bytes"):
        with arena.lease(4096, stream="s"):
            pass
    assert provider.held == [] and arena.stats().capacity_bytes == 0


def test_high_water_is_the_largest_lease_and_survives_trim(arena):
    for n in (10, 5000, 20):
        with arena.lease(n):
            pass
    arena.trim()
    assert arena.stats().high_water_bytes == 5000


def test_held_bytes_per_stream(arena):
    arena.reserve(1 << 20, stream=1)
    assert arena.held_bytes(stream=1) == 1 << 20
    assert arena.held_bytes(stream=2) == 0
    assert arena.held_bytes() == 0


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("bad", [-1, 1.5, "12", None, True, [1]])
def test_bad_sizes_raise_naming_the_value_and_change_nothing(arena, bad):
    before = snapshot(arena)
    with pytest.raises((TypeError, ValueError), match=repr(bad).replace("[", r"\[").replace("]", r"\]")):
        arena.lease(bad)
    with pytest.raises((TypeError, ValueError)):
        arena.reserve(bad)
    assert snapshot(arena) == before


def test_numpy_integer_sizes_are_accepted(arena):
    with arena.lease(np.int64(512)) as ws:
        assert ws.nbytes == 512 and type(ws.nbytes) is int


def test_unhashable_lane_key_is_a_type_error(arena):
    with pytest.raises(TypeError, match=r"\[1, 2\]"):
        arena.lease(10, stream=[1, 2])
    with pytest.raises(TypeError):
        arena.held_bytes(stream={})


def test_device_arena_rejects_lane_keys(device_arena):
    before = snapshot(device_arena)
    with pytest.raises(TypeError, match="'lane'"):
        device_arena.lease(10, stream="lane")
    with pytest.raises(ValueError, match="negative"):
        device_arena.lease(10, stream=-3)
    assert snapshot(device_arena) == before


def test_an_object_that_is_no_provider_is_refused():
    with pytest.raises(TypeError, match="MemoryProvider"):
        Arena(object())


def test_a_lease_is_entered_once(arena):
    cm = arena.lease(10)
    with cm:
        pass
    with pytest.raises(RuntimeError, match="once"):
        cm.__enter__()
    with pytest.raises(RuntimeError, match="inside its lease"):
        cm.array


# ------------------------------------------------------------------------------------------------ cap
def test_lease_above_the_cap_raises_with_the_numbers_and_changes_nothing(arena):
    arena.reserve(1000, stream="s")
    before = snapshot(arena)
    with wsarena.config(cap_workspace="2KiB"):
        with pytest.raises(WorkspaceCapError) as info:
            arena.lease(2049, stream="s")
        with pytest.raises(WorkspaceCapError):
            arena.reserve(4096, stream="s")
        assert snapshot(arena) == before
        with arena.lease(2048, stream="s"):  # at the cap is fine
            pass
    err = info.value
    assert isinstance(err, MemoryError)
    assert (err.requested, err.held, err.cap) == (2049, 1024, 2048)


def test_cap_zero_still_allows_zero_byte_leases(arena):
    with wsarena.config(cap_workspace=0):
        with arena.lease(0):
            pass
        with pytest.raises(WorkspaceCapError):
            arena.lease(1)


def test_an_explicit_cap_replaces_the_configured_one(arena):
    with wsarena.config(cap_workspace="1KiB"):
        with arena.lease(4096, stream="s", cap=None) as ws:  # the caller chose under no cap
            assert ws.nbytes == 4096
        with arena.lease(4096, stream="s", cap=4096):
            pass
    with pytest.raises(WorkspaceCapError) as info:
        arena.lease(4097, stream="s", cap=4096)  # configured: no cap
    assert info.value.cap == 4096
    arena.provider.fail_next = 1
    with wsarena.config(cap_workspace="1KiB"), pytest.raises(ArenaOutOfMemoryError) as oom:
        with arena.lease(1 << 20, stream="s", cap=None):
            pass
    assert oom.value.cap is None  # the cap the lease was checked under, not the configured one
    with pytest.raises(TypeError, match="cap must be an int"):
        arena.lease(16, cap="1KiB")
    with arena.lease(16, cap=np.int64(4096)):  # anything operator.index takes, as for nbytes
        pass
    with pytest.raises(ValueError, match="cap cannot be negative"):
        arena.lease(16, cap=-1)


def test_cap_from_the_environment(arena, monkeypatch):
    monkeypatch.setenv("WSARENA_CAP_WORKSPACE", "1KiB")
    wsarena._config._reset()
    with pytest.raises(WorkspaceCapError):
        arena.lease(1025)


# -------------------------------------------------------------------------------- provider failures
def test_failed_growth_raises_with_numbers_and_keeps_the_old_buffer(arena, provider):
    with arena.lease(1000, stream="s") as ws:
        old_ptr = ws.ptr
        ws.array[:] = 3
    before = snapshot(arena)
    provider.fail_next = 1
    with pytest.raises(ArenaOutOfMemoryError) as info:
        with arena.lease(50_000, stream="s"):
            pass
    err = info.value
    assert (err.requested, err.held, err.cap) == (50_000, 1024, None)
    assert isinstance(err.__cause__, MemoryError)
    assert snapshot(arena) == before
    assert arena.held_bytes(stream="s") == 1024
    with arena.lease(1024, stream="s") as ws:  # the lane was released, the old buffer still there
        assert ws.ptr == old_ptr
    with arena.lease(50_000, stream="s"):  # and growth works again
        pass


def test_failed_growth_while_a_lease_is_live_leaves_it_valid(device_arena, device_provider):
    with device_arena.lease(1000, stream=7) as outer:
        outer.array[:] = 9
        device_provider.fail_next = 1
        with pytest.raises(ArenaOutOfMemoryError):
            device_arena.reserve(100_000, stream=7)
        assert (outer.array == 9).all()
        assert device_arena.stats().leases == 1 and device_arena.held_bytes(stream=7) == 1024
    assert device_provider.frees == []
    with device_arena.lease(100_000, stream=7):  # and growth works again
        pass


def test_failed_first_allocation_leaves_no_trace(arena, provider):
    provider.fail_next = 1
    with pytest.raises(ArenaOutOfMemoryError) as info:
        arena.reserve(10, stream="new")
    assert info.value.held == 0
    assert arena.stats().streams == {}


def test_other_provider_errors_pass_through_unchanged(arena, provider):
    def boom(nbytes):
        raise RuntimeError("driver exploded")

    provider.fail = boom
    with pytest.raises(RuntimeError, match="exploded"):
        arena.reserve(10)
    provider.fail = None
    arena.reserve(10)


def test_ops_fallback_contract_held_bytes_after_oom(arena, provider):
    """wsarena.algos.run_with_fallback reads held_bytes after an ArenaOutOfMemoryError and leases within it."""
    arena.reserve(4096)
    provider.fail = lambda n: n > 8192
    with pytest.raises(ArenaOutOfMemoryError):
        with arena.lease(1 << 20):
            pass
    limit = arena.held_bytes()
    with arena.lease(limit) as ws:
        assert ws.nbytes == 4096


# --------------------------------------------------------------------------------------- host lanes
def test_nested_lease_on_own_lane_is_a_clear_error_and_changes_nothing(arena):
    with arena.lease(100):
        before = snapshot(arena)
        with pytest.raises(RuntimeError, match="already holds a lease on CPU lane"):
            with arena.lease(100):
                pass
        assert snapshot(arena) == before
        with arena.lease(100, stream="inner"):  # another lane is fine
            pass


def test_a_lease_on_a_lane_excludes_other_threads_until_released(arena):
    events = []
    entered = threading.Event()

    def other():
        entered.wait()
        with arena.lease(10, stream="lane"):
            events.append("other")

    t = threading.Thread(target=other)
    t.start()
    with arena.lease(10, stream="lane"):
        entered.set()
        time.sleep(0.1)
        events.append("main")
    t.join(5)
    assert events == ["main", "other"]


def test_each_thread_has_its_own_default_lane(arena):
    ptrs = {}
    barrier = threading.Barrier(3)

    def work(i):
        with arena.lease(1000) as ws:
            barrier.wait(5)  # all three leases live at once
            ptrs[i] = (ws.ptr, ws.stream)
            barrier.wait(5)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert len({p for p, _ in ptrs.values()}) == 3
    assert len({s for _, s in ptrs.values()}) == 3


def test_growth_by_reserve_while_another_thread_leases_retires_the_old_buffer(arena, provider):
    with arena.lease(1000, stream="s") as ws:
        ws.array[:] = 5
        t = threading.Thread(target=arena.reserve, args=(1 << 20,), kwargs={"stream": "s"})
        t.start()
        t.join(5)
        assert arena.held_bytes(stream="s") == 1 << 20
        assert (ws.array == 5).all()  # still valid: the outgrown buffer is retired, not freed
        assert arena.stats().retired_bytes == 1024
        assert provider.frees == []
    assert len(provider.frees) == 1 and provider.frees[0][0].size == 1024
    assert arena.stats().retired_bytes == 0


# ------------------------------------------------------------------------------------ device streams
class _Stream3:
    def __cuda_stream__(self):
        return (0, 3)


@pytest.mark.parametrize("inner", [3, "object", "current"])
def test_device_nested_lease_on_own_stream_is_a_clear_error_and_changes_nothing(device_arena, device_provider,
                                                                                inner):
    """A nested lease would get the outer lease's bytes: e.g. a wsarena call inside the caller's own lease on
    the same stream would overwrite the caller's data. It is refused, whatever names the stream."""
    device_provider.current = 3
    inner = {"object": _Stream3(), "current": None}.get(inner, inner)
    with device_arena.lease(1000, stream=3) as outer:
        outer.array[:] = 4
        before = snapshot(device_arena)
        for n in (500, 1 << 20):  # fits, or would grow: refused before anything is allocated
            with pytest.raises(RuntimeError, match="already holds a lease on stream 3"):
                with device_arena.lease(n, stream=inner):
                    pass
        assert snapshot(device_arena) == before and len(device_provider.allocations) == 1
        assert (outer.array == 4).all()
        with device_arena.lease(0, stream=inner) as zero:  # zero bytes take nothing: they may nest
            assert zero.ptr == 0
        with device_arena.lease(500, stream=4) as other:  # another stream is fine
            assert other.ptr != outer.ptr
    with device_arena.lease(500, stream=inner) as again:  # released: the stream's bytes are free again
        assert again.ptr == outer.ptr


def test_device_nested_lease_on_own_per_thread_stream_is_an_error(device_arena):
    with device_arena.lease(1000, stream=2):
        with pytest.raises(RuntimeError, match="already holds a lease on stream PerThreadStream"):
            with device_arena.lease(1000, stream=2):
                pass


def test_device_a_wsarena_call_inside_the_users_lease_on_its_stream_raises(device_arena):
    """The review's case: wsarena's ops lease through run_with_fallback on the caller's stream."""
    from wsarena.algos import run_with_fallback
    from wsarena.backends import Candidate

    ran = []
    with device_arena.lease(4096, stream=5) as mine:
        mine.array[:] = 1
        with pytest.raises(RuntimeError, match="already holds a lease on stream 5"):
            run_with_fallback(device_arena, (Candidate("a", 1024),), lambda c, ws: ran.append(ws.ptr),
                              stream=5, cap=None)
        assert ran == [] and (mine.array == 1).all()
        run_with_fallback(device_arena, (Candidate("a", 1024),), lambda c, ws: ran.append(ws.ptr),
                          stream=6, cap=None)  # on another stream it runs, on other bytes
    assert len(ran) == 1 and ran[0] != mine.ptr


def test_device_growth_under_a_live_lease_retires_in_stream_order(device_arena, device_provider):
    """reserve() (from any thread) may grow a stream's buffer while a lease uses it: the outgrown buffer is
    retired, stays valid, and is freed on its own stream when that lease ends."""
    with device_arena.lease(1000, stream=3) as a:
        a.array[:] = 6
        t = threading.Thread(target=device_arena.reserve, args=(1 << 20,), kwargs={"stream": 3})
        t.start()
        t.join(5)
        assert device_arena.held_bytes(stream=3) == 1 << 20
        assert device_arena.stats().streams[3].retired_bytes == 1024
        assert (a.array == 6).all() and device_provider.frees == []  # the lease still uses it
    (buffer, stream), = device_provider.frees
    assert buffer.size == 1024 and stream == 3  # freed on its own stream, after the work enqueued there
    assert device_arena.stats().retired_bytes == 0
    with device_arena.lease(1 << 20, stream=3) as b:
        assert b.ptr != a.ptr
    assert len(device_provider.allocations) == 2


def test_device_a_larger_lease_from_another_thread_waits_then_grows(device_arena, device_provider):
    """Another thread's larger lease on the stream waits for the live lease to end, then grows the buffer; the
    outgrown one, no longer leased, is freed at once on its stream."""
    order = []
    holding = threading.Event()

    def other():
        holding.wait(5)
        with device_arena.lease(1 << 20, stream=3) as ws:
            order.append(("other", ws.ptr))

    t = threading.Thread(target=other)
    t.start()
    with device_arena.lease(1000, stream=3) as a:
        holding.set()
        time.sleep(0.1)
        assert device_arena.held_bytes(stream=3) == 1024 and device_provider.frees == []
        order.append(("main", a.ptr))
    t.join(5)
    assert [who for who, _ in order] == ["main", "other"] and order[0][1] != order[1][1]
    (buffer, stream), = device_provider.frees
    assert buffer.size == 1024 and stream == 3


def test_device_other_threads_wait_for_a_stream(device_arena):
    order = []
    ready = threading.Event()

    def other():
        ready.wait()
        with device_arena.lease(10, stream=9):
            order.append("other")

    t = threading.Thread(target=other)
    t.start()
    with device_arena.lease(10, stream=9):
        ready.set()
        time.sleep(0.1)
        order.append("main")
    t.join(5)
    assert order == ["main", "other"]


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


def test_device_providers_get_the_plain_handle_2_from_the_keys_own_thread(device_arena, device_provider):
    calls = []
    allocate = device_provider.allocate

    def recording_allocate(nbytes, *, stream):
        calls.append(stream)
        return allocate(nbytes, stream=stream)

    device_provider.allocate = recording_allocate
    with wsarena.config(debug=True):
        with device_arena.lease(1000, stream=2):
            pass
    device_arena.reserve(1 << 20, stream=2)  # growth: the old buffer is freed on this thread's stream 2
    assert calls == [2, 2] and all(type(s) is int for s in calls)
    assert [(s, type(s)) for *_, s in device_provider.fills] == [(2, int)]
    (_, stream), = device_provider.frees
    assert stream == 2 and type(stream) is int
    assert device_arena.held_bytes(stream=2) == 1 << 20
    assert other_thread_held_bytes(device_arena, 2) == 0  # another thread's handle 2 is another sub-arena


def other_thread_held_bytes(arena, stream):
    out = []
    t = threading.Thread(target=lambda: out.append(arena.held_bytes(stream=stream)))
    t.start()
    t.join(5)
    return out[0]


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


# ------------------------------------------------------------------------------------------- debug
def test_debug_poisons_released_bytes(arena, provider):
    with wsarena.config(debug=True):
        with arena.lease(1000) as ws:
            view = ws.array
            view[:] = 1
    assert (view == POISON_BYTE).all()
    assert provider.fills and provider.fills[0][1:3] == (POISON_BYTE, 1000)


def test_debug_off_does_not_poison(arena, provider):
    with arena.lease(100) as ws:
        view = ws.array
        view[:] = 1
    assert (view == 1).all() and provider.fills == []


def test_debug_mode_from_environment(arena, monkeypatch):
    monkeypatch.setenv("WSARENA_DEBUG", "1")
    wsarena._config._reset()
    with arena.lease(64) as ws:
        view = ws.array
    assert (view == POISON_BYTE).all()


class _SameMemoryProvider(HostProvider):
    """A broken provider that hands every stream the same memory."""

    def __init__(self):
        self.memory = np.empty(1 << 20, np.uint8)

    def allocate(self, nbytes, *, stream=None):
        from wsarena.arena import Buffer

        return Buffer(self.memory.__array_interface__["data"][0], nbytes, self.memory[:nbytes])


def test_debug_catches_overlapping_leases_on_different_lanes():
    arena = Arena(_SameMemoryProvider())
    with wsarena.config(debug=True):
        with arena.lease(100, stream="a"):
            with pytest.raises(AssertionError, match="overlaps"):
                with arena.lease(100, stream="b"):
                    pass
            assert arena.stats().leases == 1
        with arena.lease(100, stream="b"):  # no overlap once "a" is released
            pass


# ---------------------------------------------------------------------------------------- registry
def test_get_arena_cpu_is_a_singleton_and_the_top_level_name_maps_here():
    assert get_arena("cpu") is get_arena("cpu") is wsarena.get_arena("CPU")
    assert isinstance(get_arena("cpu").provider, HostProvider)
    assert wsarena.Arena is Arena


def test_a_closed_process_arena_is_replaced_and_the_ops_go_on():
    old = Arena(HostProvider())
    previous = set_arena("cpu", old)
    try:
        old.close()
        with pytest.raises(RuntimeError, match="closed"):
            old.lease(0).__enter__()  # a closed arena refuses even a lease that takes nothing
        x = np.ones((1, 1, 4, 4), np.float32)
        assert wsarena.conv_forward(x, np.ones((1, 1, 3, 3), np.float32)).sum() == 36
        assert get_arena("cpu") is not old and not get_arena("cpu").closed
    finally:
        set_arena("cpu", previous)


@pytest.mark.parametrize("bad", ["tpu", -1, 1.0, True, object()])
def test_get_arena_bad_device(bad):
    with pytest.raises((TypeError, ValueError)):
        get_arena(bad)


def test_set_arena_installs_and_returns_the_old_one():
    mine = Arena(RecordingProvider())
    before = get_arena("cpu")
    old = set_arena("cpu", mine)
    assert old is before
    try:
        assert get_arena("cpu") is mine
    finally:
        assert set_arena("cpu", old) is mine
    assert get_arena("cpu") is old


def test_set_arena_device_works_without_a_gpu():
    fake = Arena(RecordingProvider(device_id=0))
    old = set_arena(0, fake)
    try:
        assert get_arena(0) is fake
    finally:
        set_arena(0, old)


def test_reset_arenas_closes_them():
    mine = Arena(RecordingProvider())
    before = get_arena("cpu")
    old = set_arena("cpu", mine)
    assert old is before
    try:
        reset_arenas()
        assert mine.closed
        with pytest.raises(RuntimeError, match="closed"):
            with mine.lease(1):
                pass
        assert get_arena("cpu") is not mine
    finally:
        set_arena("cpu", old)


@pytest.mark.skipif(wsarena._gpu.gpu_unusable_reason() is None, reason="a GPU is usable here")
def test_device_arena_without_gpu_is_backend_unavailable():
    with pytest.raises(BackendUnavailableError, match="GPU"):
        get_arena()
    old = set_arena(0, None)
    try:
        with pytest.raises(BackendUnavailableError):
            get_arena(0)
    finally:
        if old is not None:
            set_arena(0, old)


def test_close_frees_idle_buffers_now_and_busy_ones_at_release(arena, provider):
    arena.reserve(100, stream="idle")
    with arena.lease(100, stream="busy"):
        arena.close()
        arena.close()  # idempotent
        assert len(provider.frees) == 1
    assert provider.held == []


class _InterruptibleLock:
    """The arena's lock, whose next acquire raises KeyboardInterrupt once armed, instead of acquiring: a blocking
    acquire is interruptible while another thread holds the lock. (An interrupt delivered once it is acquired
    lands inside the ``with`` block, as one at any function entry does: see the test that tries them all.)"""

    def __init__(self):
        self.lock = threading.RLock()
        self.armed = None

    def acquire(self, blocking=True, timeout=-1):
        when, self.armed = self.armed, None
        if when == "before":
            raise KeyboardInterrupt
        return self.lock.acquire(blocking, timeout)

    def release(self):
        self.lock.release()

    def _is_owned(self):  # what threading.Condition asks of its lock
        return self.lock._is_owned()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _interruptible(arena):
    arena._lock = _InterruptibleLock()  # before any stream's condition is made on it
    return arena


def _free_for_others(arena):
    """Whether another thread can take the arena's lock now."""
    got = []
    lock = getattr(arena._lock, "lock", arena._lock)  # the real one, under an _InterruptibleLock
    thread = threading.Thread(target=lambda: got.append(lock.acquire(timeout=5) and lock.release()))
    thread.start()
    thread.join(10)
    return got == [None]


def test_an_interrupt_while_a_release_waits_for_the_lock_still_releases(provider):
    arena = _interruptible(Arena(provider))
    with pytest.raises(KeyboardInterrupt):
        with arena.lease(4096, stream="L"):
            arena._lock.armed = "before"
    assert arena.stats().leases == 0 and _free_for_others(arena)
    with arena.lease(4096, stream="L"):  # not "this thread already holds a lease"
        pass


def test_an_interrupt_while_a_growth_waits_for_the_lock_leaves_the_stream_usable(provider):
    arena = _interruptible(Arena(provider))
    real_allocate = provider.allocate

    def allocate(nbytes, *, stream):
        arena._lock.armed = "before"
        return real_allocate(nbytes, stream=stream)

    provider.allocate = allocate
    with pytest.raises(KeyboardInterrupt):
        with arena.lease(4096, stream="L"):
            pass
    assert arena._subs["L"].growing is None and _free_for_others(arena)
    provider.allocate = real_allocate
    other = threading.Thread(target=lambda: arena.lease(4096, stream="L").__enter__().__exit__())
    other.start()
    other.join(10)
    assert not other.is_alive()
    assert len(provider.held) == 1 and arena.held_bytes(stream="L") == 4096  # the buffer was kept, not leaked


def _in_provider(code):
    return code.co_filename.endswith(("arena/providers.py", "arena/testing.py"))


def _lease_cycle(arena, stream, nbytes):
    with arena.lease(nbytes, stream=stream) as ws:
        ws.array[:1] = 1


@pytest.mark.parametrize("device", [False, True])
@pytest.mark.parametrize("grows", [False, True])
def test_an_interrupt_at_any_function_entry_of_a_lease_leaves_the_arena_consistent(device, grows):
    """Ctrl-C delivered as each Python function of a lease and its release starts (every place CPython runs a
    signal handler but after C calls and at loops), one run each: afterwards the lock is free, no lease is left
    live, every byte held is accounted for, and the stream serves this thread and others again. (The provider's
    own functions are left out: a provider cut short in the middle of a free may lose that buffer, which the
    arena has already let go; the shipped providers' memory then goes back when its owner object is collected.)"""
    stream = 7 if device else "L"
    n = 1
    while True:
        provider = RecordingProvider(device_id=0 if device else None)
        arena = Arena(provider)
        arena.reserve(1024, stream=stream)
        if not interrupt_at_call(n, _lease_cycle, arena, stream, 1 << 20 if grows else 1024, skip=_in_provider):
            break
        counter = f"interrupted at call {n}"
        stats = arena.stats()
        assert stats.leases == 0, counter
        assert provider.held_bytes == stats.capacity_bytes + stats.retired_bytes, counter
        assert _free_for_others(arena), counter
        _lease_cycle(arena, stream, 4096)  # this thread again: not "already holds a lease"
        other = threading.Thread(target=_lease_cycle, args=(arena, stream, 4096))
        other.start()
        other.join(10)
        assert not other.is_alive(), counter
        arena.close()
        assert provider.held == [], counter
        n += 1
    assert n > 10  # it did reach the lease's own code, not only this test's


def test_an_interrupt_at_the_start_of_a_release_is_retried_by_the_with_block(arena, monkeypatch):
    real_end, calls = arena._end, []

    def end(ws):
        calls.append(ws)
        if len(calls) == 1:
            raise KeyboardInterrupt  # before anything was released
        real_end(ws)

    monkeypatch.setattr(arena, "_end", end)
    with pytest.raises(KeyboardInterrupt):
        with arena.lease(4096, stream="L"):
            pass
    assert len(calls) == 2 and arena.stats().leases == 0
    with arena.lease(4096, stream="L"):  # the lane is free again
        pass


def test_an_interrupt_just_after_a_lease_was_taken_gives_it_back(arena, monkeypatch):
    real_acquire = arena._acquire

    def acquire(ws):
        real_acquire(ws)
        raise KeyboardInterrupt  # the lease is taken, the with block never starts

    monkeypatch.setattr(arena, "_acquire", acquire)
    with pytest.raises(KeyboardInterrupt):
        with arena.lease(4096, stream="L"):
            raise AssertionError("the body must not run")
    monkeypatch.undo()
    assert arena.stats().leases == 0
    with arena.lease(4096, stream="L"):
        pass


def test_an_interrupt_as_a_lease_starts_its_growth_leaves_the_stream_free(arena):
    # The lane is already taken when _grow starts
    with interrupt_at_entry_of(Arena._grow), pytest.raises(KeyboardInterrupt, match="_grow"):
        with arena.lease(4096, stream="L"):
            pass
    assert arena._subs.get("L") is None or arena._subs["L"].holder is None
    with arena.lease(4096, stream="L"):  # not "this thread already holds a lease"
        pass


def test_a_workspace_dropped_while_it_holds_its_lane_gives_the_lane_back(arena, provider):
    """The backstop for an interrupt that lands before a release can start (on __exit__'s first instruction):
    the lease ends when its Workspace is dropped."""
    ws = arena.lease(4096, stream="L")
    ws.__enter__()  # and never __exit__, as when Ctrl-C lands on its first instruction
    ws.array[:] = 3
    assert arena.stats().leases == 1
    del ws
    assert arena.stats().leases == 0
    with arena.lease(4096, stream="L") as again:
        assert (again.array == 3).all()  # the same bytes: nothing was freed under the dropped lease
    assert len(provider.allocations) == 1


def test_a_provider_that_returns_nothing_is_an_error_not_a_loop(arena, provider):
    provider.allocate = lambda nbytes, *, stream: None
    with pytest.raises(TypeError, match="returned None"):
        with arena.lease(4096, stream="s"):
            pass
    assert arena.stats().capacity_bytes == 0


class _GatedProvider(RecordingProvider):
    """Allocations wait at a gate, so that a test can close the arena while one is under way."""

    def __init__(self):
        super().__init__()
        self.allocating = threading.Event()
        self.gate = threading.Event()

    def allocate(self, nbytes, *, stream):
        self.allocating.set()
        assert self.gate.wait(10)
        return super().allocate(nbytes, stream=stream)


def test_a_thread_waiting_for_another_threads_growth_is_woken_by_it():
    provider = _GatedProvider()
    arena = Arena(provider)
    first = threading.Thread(target=arena.reserve, args=(1 << 20,), kwargs={"stream": "L"})
    first.start()
    assert provider.allocating.wait(10)
    second = threading.Thread(target=arena.reserve, args=(1 << 20,), kwargs={"stream": "L"})
    second.start()
    deadline = time.monotonic() + 10
    while arena._subs["L"].waiters == 0 and time.monotonic() < deadline:  # the second waits for the growth
        time.sleep(0.001)
    provider.gate.set()
    first.join(10)
    second.join(10)
    assert not first.is_alive() and not second.is_alive()
    assert len(provider.allocations) == 1  # the second found the first's buffer large enough


@pytest.mark.parametrize("call", ["reserve", "lease"])
def test_close_during_a_growth_refuses_it_and_frees_what_it_allocated(call):
    provider = _GatedProvider()
    arena = Arena(provider)
    errors = []

    def grow():
        try:
            if call == "reserve":
                arena.reserve(1 << 20, stream="L")
            else:
                with arena.lease(1 << 20, stream="L"):
                    errors.append("granted")
        except RuntimeError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=grow)
    thread.start()
    assert provider.allocating.wait(10)
    arena.close()
    provider.gate.set()
    thread.join(10)
    assert errors == ["this arena is closed"]
    assert provider.held == [] and arena.stats().capacity_bytes == 0


def test_a_thread_waiting_for_a_growth_when_the_arena_closes_does_not_grow_it_again():
    provider = _GatedProvider()
    arena = Arena(provider)
    errors = []

    def run(call):
        try:
            call()
        except RuntimeError as exc:
            errors.append(str(exc))

    first = threading.Thread(target=run, args=(lambda: arena.reserve(4096, stream="L"),))
    first.start()
    assert provider.allocating.wait(10)
    second = threading.Thread(target=run, args=(lambda: arena.lease(1 << 20, stream="L").__enter__(),))
    second.start()
    deadline = time.monotonic() + 10
    while arena._subs["L"].waiters == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    arena.close()
    provider.gate.set()
    first.join(10)
    second.join(10)
    assert errors == ["this arena is closed"] * 2
    assert len(provider.allocations) == 1 and provider.held == []


def test_close_during_a_failing_growth_frees_the_old_buffer(arena, provider):
    arena.reserve(4096, stream="L")

    def fail(nbytes):
        arena.close()  # as another thread could while the lock is released to allocate
        return True

    provider.fail = fail
    with pytest.raises(ArenaOutOfMemoryError):
        with arena.lease(1 << 20, stream="L"):
            pass
    assert provider.held == []


def test_close_while_a_thread_waits_for_the_lane_frees_the_lane_after_both(arena, provider):
    waiting, outcome = threading.Event(), []

    def waiter():
        waiting.set()
        try:
            with arena.lease(4096, stream="L"):
                outcome.append("granted")
        except RuntimeError as exc:
            outcome.append(str(exc))

    with arena.lease(4096, stream="L"):
        thread = threading.Thread(target=waiter)
        thread.start()
        assert waiting.wait(10)
        deadline = time.monotonic() + 10
        while arena._subs["L"].waiters == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        arena.close()
    thread.join(10)
    assert outcome == ["this arena is closed"]
    assert provider.held == []


class _Plan:
    def __init__(self, *stream_bytes):
        self.stream_bytes = stream_bytes


def test_reserve_for_a_plan_presizes_its_streams(arena, provider):
    arena.reserve_for(_Plan(aligned_size(100_000)))
    assert arena.held_bytes() == aligned_size(100_000)
    arena.reserve_for(_Plan(4096, 8192), streams=["x", "y"])
    assert (arena.held_bytes(stream="x"), arena.held_bytes(stream="y")) == (4096, 8192)
    with wsarena.config(cap_workspace=100_000):  # the plan's rounded size may sit just above the cap
        arena.reserve_for(_Plan(aligned_size(99_999)), streams=["z"])
    before = len(provider.allocations)
    with arena.lease(100_000), arena.lease(4096, stream="x"):
        pass
    assert len(provider.allocations) == before


@pytest.mark.parametrize(
    ("plan", "streams", "error"),
    [(_Plan(10, 20), None, ValueError), (_Plan(10), ["a", "b"], ValueError), (_Plan(10, 20), ["a", [1]], TypeError),
     (_Plan(-1), None, ValueError)],
)
def test_reserve_for_bad_input_changes_nothing(arena, plan, streams, error):
    with pytest.raises(error):
        arena.reserve_for(plan, streams=streams)
    assert arena.stats().streams == {}


def test_public_names_are_sorted_and_importable():
    import wsarena.arena as mod

    assert mod.__all__ == sorted(mod.__all__)
    for name in mod.__all__:
        assert getattr(mod, name) is not None


def test_importing_the_arena_does_not_import_cupy_or_cuda_bindings():
    import subprocess
    import sys

    code = "import sys, wsarena.arena; wsarena.arena.get_arena('cpu').reserve(1); " \
           "print(sorted(m for m in ('cupy', 'cuda.bindings') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_cupy_provider_reports_a_failed_cudamalloc_as_out_of_memory(monkeypatch):
    """Without a pool (cupy.cuda.set_allocator(None)) CuPy raises cudaMalloc's CUDARuntimeError, not a MemoryError."""
    import contextlib

    import cupy

    from wsarena.arena import CupyProvider, providers
    from wsarena.errors import ArenaOutOfMemoryError

    def fails_with(exc):
        def alloc(nbytes):
            raise exc

        return alloc

    monkeypatch.setattr(cupy.cuda, "Device", lambda device: contextlib.nullcontext())  # no GPU here
    monkeypatch.setattr(providers, "cupy_stream", lambda handle: contextlib.nullcontext())
    provider = CupyProvider(0)
    monkeypatch.setattr(cupy.cuda, "alloc", fails_with(cupy.cuda.runtime.CUDARuntimeError(2)))
    with pytest.raises(MemoryError, match="cudaMalloc of 4096 bytes"):
        provider.allocate(4096, stream=7)
    arena = Arena(provider)
    with pytest.raises(ArenaOutOfMemoryError), arena.lease(4096, stream=7):
        pass
    assert arena.held_bytes(stream=7) == 0
    monkeypatch.setattr(cupy.cuda, "alloc", fails_with(OverflowError("size_t")))
    with pytest.raises(MemoryError):
        provider.allocate(2**70, stream=7)
    monkeypatch.setattr(cupy.cuda, "alloc", fails_with(cupy.cuda.runtime.CUDARuntimeError(700)))
    with pytest.raises(cupy.cuda.runtime.CUDARuntimeError):  # an illegal address is not a memory shortage
        provider.allocate(4096, stream=7)


class _FailingResource:
    """A cuda.core memory resource whose allocations fail with the error cuda.core raises for a CUresult."""

    def __init__(self, result):
        self.result = result
        self.calls = 0

    def allocate(self, size, *, stream):
        self.calls += 1
        raise RuntimeError(f"{self.result}: from a fake resource")  # cuda.core's CUDAError names the CUresult


@pytest.mark.parametrize(("result", "raised"), [("CUDA_ERROR_OUT_OF_MEMORY", MemoryError),
                                                 ("CUDA_ERROR_INVALID_VALUE", RuntimeError)])
def test_async_provider_reports_a_resource_out_of_memory_as_memory_error(monkeypatch, result, raised):
    import contextlib

    import cupy

    from wsarena.arena import AsyncProvider, providers

    monkeypatch.setattr(cupy.cuda, "Device", lambda device: contextlib.nullcontext())  # no GPU here
    monkeypatch.setattr(providers, "_core_stream", lambda handle: handle)
    provider = AsyncProvider(0, resource=_FailingResource(result))
    with pytest.raises(raised, match=result) as info:
        provider.allocate(1 << 20, stream=0)
    assert provider.resource.calls == 1
    assert raised is MemoryError or not isinstance(info.value, MemoryError)  # only a shortage is a MemoryError
