"""When the provider fails, on either kind of arena: out of memory leaves the arena as it was, other errors pass
through, and a run of the ops can fall back to what the arena holds."""

import re
import threading

import numpy as np
import pytest

import wsarena
from wsarena.arena import Arena, Buffer, HostProvider
from wsarena.arena._leases import POISON_BYTE
from wsarena.arena._stats import aligned_size
from wsarena.arena.testing import RecordingProvider
from wsarena.errors import ArenaOutOfMemoryError, ProviderError, WsarenaError

from .arena_helpers import Plan, refusing, snapshot


def test_failed_growth_raises_with_numbers_and_keeps_the_old_buffer(arena, provider, key):
    with arena.lease(1000, stream=key("s")) as ws:
        old_ptr = ws.ptr
        ws.array[:] = 3
    before = snapshot(arena)
    provider.fail_next = 1
    with pytest.raises(ArenaOutOfMemoryError) as info, arena.lease(50_000, stream=key("s")):
        pass
    err = info.value
    assert (err.requested, err.held, err.cap) == (50_000, 1024, None)
    assert isinstance(err.__cause__, MemoryError)
    assert snapshot(arena) == {**before, "refused_bytes": aligned_size(50_000)}  # remembered, nothing else
    assert arena.held_bytes(stream=key("s")) == 1024
    with arena.lease(1024, stream=key("s")) as ws:  # the stream was released, the old buffer still there
        assert ws.ptr == old_ptr
    with arena.lease(50_000, stream=key("s")):  # and growth works again
        pass


def test_failed_growth_while_a_lease_is_live_leaves_it_valid(arena, provider, key):
    with arena.lease(1000, stream=key(7)) as outer:
        outer.array[:] = 9
        provider.fail_next = 1
        with pytest.raises(ArenaOutOfMemoryError):
            arena.reserve(100_000, stream=key(7))
        assert (outer.array == 9).all()
        assert arena.stats().leases == 1 and arena.held_bytes(stream=key(7)) == 1024
    assert provider.frees == []
    with arena.lease(100_000, stream=key(7)):  # and growth works again
        pass


def test_failed_first_allocation_leaves_no_trace(arena, provider, key):
    provider.fail_next = 1
    with pytest.raises(ArenaOutOfMemoryError) as info:
        arena.reserve(10, stream=key("new"))
    assert info.value.held == 0
    assert arena.stats().streams == {}


def test_a_size_no_host_has_is_out_of_memory_not_a_value_error():
    arena = Arena(HostProvider())
    with pytest.raises(ArenaOutOfMemoryError), arena.lease((1 << 63) - 1):
        pass
    assert arena.stats().capacity_bytes == 0


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
    with pytest.raises(ArenaOutOfMemoryError), arena.lease(1 << 20):
        pass
    limit = arena.held_bytes()
    with arena.lease(limit) as ws:
        assert ws.nbytes == 4096


# --------------------------------------------------------------------- refusals remembered
@pytest.fixture
def clock(refusal_clock):
    return refusal_clock


def _refused(arena, nbytes, stream):
    with pytest.raises(ArenaOutOfMemoryError), arena.lease(nbytes, stream=stream):
        pass


def test_a_lease_always_asks_and_the_refusal_is_remembered(arena, provider, key, clock):
    asked = refusing(provider, clock, 0.01)
    for _ in range(3):
        _refused(arena, 50_000, key("s"))
    assert len(asked) == 3 and arena.stats().refused_bytes == aligned_size(50_000)
    assert arena.refusing and arena.defers_growth(50_000, stream=key("s"))


def test_after_two_refusals_a_caller_with_a_fallback_waits_a_hundred_times_the_refusal(arena, provider, key, clock):
    arena.reserve(8192, stream=key("s"))
    refusing(provider, clock, 0.01)
    _refused(arena, 50_000, key("s"))
    assert not arena.refusing and not arena.defers_growth(50_000, stream=key("s"))  # one refusal costs nothing
    _refused(arena, 50_000, key("s"))  # again: callers with a fallback wait 100 x 10 ms
    assert arena.refusing
    assert arena.defers_growth(50_000, stream=key("s")) and arena.defers_growth(1 << 20, stream=key("t"))
    assert arena.defers_growth(50_000, stream=key("s"), fallback=8192)  # the fallback fits what "s" holds
    assert not arena.defers_growth(50_000, stream=key("t"), fallback=8192)  # "t" holds nothing: it would grow too
    assert not arena.defers_growth(50_000, stream=key("t"), fallback=1)  # even for a single byte
    assert not arena.defers_growth(20_000, stream=key("s"))  # less than was refused: worth asking
    assert not arena.defers_growth(8192, stream=key("s"))  # held already: no growth at all
    clock.now += 0.99
    assert arena.defers_growth(50_000, stream=key("s"))
    clock.now += 0.02
    assert not arena.defers_growth(50_000, stream=key("s"))  # the wait is over: ask
    assert arena.stats().refused_bytes == aligned_size(50_000)


def test_the_wait_is_at_most_a_minute_and_a_grant_as_large_or_trim_forgets(arena, provider, key, clock):
    refusing(provider, clock, 10.0)  # a refusal that takes 10 s (a collection over a huge heap)
    for _ in range(2):
        _refused(arena, 50_000, key("s"))
    clock.now += 59.9
    assert arena.defers_growth(50_000, stream=key("s"))
    clock.now += 0.2
    assert not arena.defers_growth(50_000, stream=key("s"))
    provider.fail = None
    with arena.lease(60_000, stream=key("s")):  # granted, and as large: the refusals are forgotten
        pass
    assert not arena.refusing and arena.stats().refused_bytes == 0
    refusing(provider, clock, 0.01, limit=64 << 10)
    for _ in range(2):
        _refused(arena, 100_000, key("s"))
    assert arena.defers_growth(100_000, stream=key("s"))
    arena.trim()  # what a caller who freed memory of their own may do
    assert not arena.refusing and not arena.defers_growth(100_000, stream=key("s"))
    assert arena.stats().refused_bytes == 0


def test_each_further_refusal_in_a_row_doubles_the_wait(arena, provider, key, clock):
    """What a refusal's own time leaves out (the allocations that refill the pool's dropped cache), and a workspace
    that no device holds, asked for again after each wait: the waits double, up to a minute."""
    refusing(provider, clock, 0.01)  # 10 ms a refusal: waits of 1 s, 2 s, 4 s, ...
    _refused(arena, 50_000, key("s"))
    for wait in (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0):
        _refused(arena, 50_000, key("s"))  # asked once the last wait was over: a lease always asks
        clock.now += wait - 0.02
        assert arena.refusing and arena.defers_growth(50_000, stream=key("s"))
        clock.now += 0.03
        assert not arena.refusing and not arena.defers_growth(50_000, stream=key("s"))


def test_the_buffer_of_a_dead_stream_whose_handle_another_stream_has_is_not_held_for_the_fallback(clock):
    """A lease of the fallback there would need a growth (the new stream's buffer is not the dead one's): no
    deferral, as held_bytes() says 0."""
    import gc

    from wsarena.arena.testing import FakeStream

    provider = RecordingProvider(device_id=0)
    provider.stream_ids[11] = 101
    arena = Arena(provider)
    refusing(provider, clock, 0.01, limit=8192)
    for _ in range(2):
        _refused(arena, 50_000, 5)
    stream = FakeStream(11)
    with arena.lease(8192, stream=stream):
        pass
    assert arena.defers_growth(50_000, stream=11, fallback=8192)
    del stream
    gc.collect()
    provider.stream_ids[11] = 102  # CUDA gave the dead stream's handle to a new stream
    assert not arena.defers_growth(50_000, stream=11, fallback=8192)
    assert arena.held_bytes(stream=11) == 0


def test_a_refusal_of_a_smaller_growth_starts_a_record_of_its_own(arena, provider, key, clock):
    refusing(provider, clock, 0.01, limit=0)
    for _ in range(5):
        _refused(arena, 1 << 20, key("s"))
    _refused(arena, 10_000, key("t"))  # once, at a peak: it costs nothing later
    assert arena.stats().refused_bytes == aligned_size(10_000)
    assert not arena.refusing and not arena.defers_growth(10_000, stream=key("t"))


def test_no_growth_is_deferred_on_a_stream_being_captured(clock):
    from .capture_helpers import S1

    provider = RecordingProvider(device_id=0)
    arena = Arena(provider)
    refusing(provider, clock, 0.01)
    for _ in range(2):
        _refused(arena, 50_000, S1)
    assert arena.defers_growth(50_000, stream=S1)
    graph = provider.begin_capture(S1)
    assert not arena.defers_growth(50_000, stream=S1)  # a capture grows nothing: it says so itself
    provider.end_capture(graph)
    assert arena.defers_growth(50_000, stream=S1)


def test_defers_growth_checks_its_arguments(arena, key):
    with pytest.raises(ValueError, match="nbytes"):
        arena.defers_growth(-1, stream=key("s"))
    with pytest.raises(TypeError, match="fallback"):
        arena.defers_growth(10, stream=key("s"), fallback="4")


# --------------------------------------------------------------------- a provider that breaks its contract
class _AllocateOnly:
    device_id = None

    def allocate(self, size, *, stream):
        return HostProvider().allocate(size, stream=stream)


@pytest.mark.parametrize("provider", [object(), _AllocateOnly()], ids=["nothing", "no deallocate"])
def test_an_object_that_is_no_provider_is_refused(provider):
    with pytest.raises(TypeError, match="MemoryProvider"):
        Arena(provider)


@pytest.mark.parametrize(("device_id", "error"), [
    ("cpu", TypeError), ("0", TypeError), (True, TypeError), (0.0, TypeError), (-1, ValueError),
])
def test_a_provider_whose_device_id_is_no_ordinal_is_refused(device_id, error):
    with pytest.raises(error, match="provider.device_id"):
        Arena(RecordingProvider(device_id=device_id))


def assert_provider_error(caught):
    """What a provider that broke its contract makes the arena raise: a ``ProviderError``, caught by
    ``WsarenaError`` as what a program meets as it runs is (the README's Bad input), and a ``RuntimeError`` as it was.
    Once, a plain ``RuntimeError``."""
    assert type(caught.value) is ProviderError
    assert isinstance(caught.value, WsarenaError) and isinstance(caught.value, RuntimeError)


def test_a_provider_that_returns_too_little_is_an_error_and_its_buffer_is_freed(arena, provider, key):
    real_allocate = provider.allocate
    provider.allocate = lambda nbytes, *, stream: real_allocate(nbytes // 2, stream=stream)
    with pytest.raises(RuntimeError, match="for a request of 4096 bytes") as caught, arena.lease(4096, stream=key("s")):
        pass
    assert_provider_error(caught)
    assert provider.held == [] and arena.stats().capacity_bytes == 0


def test_a_provider_that_raises_stop_iteration_is_named_not_an_index_error(arena, provider, key):
    pool = iter([])  # a provider drawing buffers from an exhausted pool with next()
    provider.allocate = lambda nbytes, *, stream: next(pool)
    with pytest.raises(RuntimeError, match="allocate raised StopIteration for a request of 4096 bytes") as caught:
        arena.reserve(4096, stream=key("s"))
    assert_provider_error(caught)
    assert arena.stats().capacity_bytes == 0
    del provider.allocate
    arena.reserve(4096, stream=key("s"))


def test_a_provider_that_returns_nothing_is_an_error_not_a_loop(arena, provider, key):
    provider.allocate = lambda nbytes, *, stream: None
    with pytest.raises(TypeError, match="returned None"), arena.lease(4096, stream=key("s")):
        pass
    assert arena.stats().capacity_bytes == 0


class _HandsOutAgain(HostProvider):
    """Host memory, but once ``again`` is set each buffer is ``again(first, fresh)``: ``first``, the first buffer it
    handed out, and ``fresh``, the one it would have (a pool whose books are wrong, or one two threads use unlocked)."""

    def __init__(self):
        self.first = None
        self.again = None

    def allocate(self, size, *, stream=None):
        fresh = super().allocate(size, stream=stream)
        if self.first is None:
            self.first = fresh
        elif self.again is not None:
            return self.again(self.first, fresh)
        return fresh


@pytest.mark.parametrize("debug", [False, True], ids=["", "debug"])
@pytest.mark.parametrize("again", [
    pytest.param(lambda first, fresh: first, id="the same buffer"),  # given back, it would free the one held
    pytest.param(lambda first, fresh: Buffer(first.ptr, fresh.size, fresh.owner), id="the same address"),
    pytest.param(lambda first, fresh: Buffer(first.ptr + 1000, fresh.size, fresh.owner), id="its last bytes"),
    pytest.param(lambda first, fresh: Buffer(first.ptr - 100, fresh.size, fresh.owner), id="its first bytes"),
])
@pytest.mark.parametrize("grows", ["another stream", "the same stream"])
def test_a_buffer_that_overlaps_one_the_arena_holds_is_refused_in_any_mode(arena_kind, key, grows, again, debug):
    """A provider that hands out memory the arena holds (on any stream: a growth's old buffer is freed only once the
    new one is in place) would have two leases share bytes. Only debug mode saw it, and only once two leases were
    live at once: otherwise each stream wrote over the other's workspace. Refused as it would be installed: the
    arena keeps what it held, and the new buffer goes back to the provider, unless it is the very one held (a free of
    that would free the held one: the provider records it as a double free)."""
    upstream = _HandsOutAgain()
    provider = RecordingProvider(upstream, device_id=arena_kind.device_id)
    arena = Arena(provider)
    with wsarena.config(debug=debug):
        with arena.lease(1024, stream=key("a")) as ws:
            ws.array[:] = 7
        before = snapshot(arena)
        upstream.again = again
        other, n = (key("b"), 1024) if grows == "another stream" else (key("a"), 5000)
        where = "that stream" if grows == "the same stream" else f"stream {key('a')!r}"
        message = (rf"allocate returned Buffer\(ptr=0x[0-9a-f]+, size={aligned_size(n)}\) for stream {other!r}, whose "
                   rf"bytes overlap Buffer\(ptr={upstream.first.ptr:#x}, size=1024\), which the arena holds for "
                   rf"{re.escape(where)}: the provider handed out memory that is in use")
        if n > 1024 and again(upstream.first, Buffer(0, 0)) is upstream.first:  # the buffer held, too small for n
            message = rf"returned Buffer\(ptr={upstream.first.ptr:#x}, size=1024\) for a request of {aligned_size(n)}"
        with pytest.raises(RuntimeError, match=message) as caught, arena.lease(n, stream=other):
            pass
        assert_provider_error(caught)
        assert snapshot(arena) == before
        handed_again = provider.allocations[-1]
        assert [buffer for buffer, _ in provider.frees] == ([] if handed_again is upstream.first else [handed_again])
        upstream.again = None
        with arena.lease(1024, stream=key("a")) as ws:
            assert ws.ptr == upstream.first.ptr and (ws.array == (POISON_BYTE if debug else 7)).all()
        with arena.lease(n, stream=other) as ws:
            assert ws.ptr != upstream.first.ptr
    arena.close()
    assert provider.held == []


class _Returning(HostProvider):
    """Hands out what ``wrap(buffer)`` makes of each host buffer; records what the arena gives back."""

    def __init__(self, wrap, device_id=None):
        self.wrap = wrap
        self.device_id = device_id
        self.given_back = []

    def allocate(self, size, *, stream):
        return self.wrap(super().allocate(size, stream=stream))

    def deallocate(self, buffer, *, stream):
        self.given_back.append(buffer)


@pytest.mark.parametrize("wrap", [
    pytest.param(lambda b: b.owner, id="the array"),
    pytest.param(lambda b: b.ptr, id="the address"),
    pytest.param(lambda b: Buffer(b.ptr, float(b.size), b.owner), id="a float size"),
    pytest.param(lambda b: Buffer(None, b.size, b.owner), id="no address"),
])
@pytest.mark.parametrize("device_id", [None, 0])
def test_a_provider_that_returns_no_buffer_is_a_type_error_and_what_it_returned_is_given_back(wrap, device_id):
    provider = _Returning(wrap, device_id)
    arena = Arena(provider)
    with pytest.raises(TypeError, match="allocate returned .* for a request of 4096 bytes, where a Buffer with an int"):
        arena.reserve(4096, stream=5)
    assert arena.stats().capacity_bytes == 0 and len(provider.given_back) == 1


def test_a_buffer_of_numpy_integers_gives_int_sizes_and_addresses():
    provider = _Returning(lambda b: Buffer(np.uint64(b.ptr), np.int64(b.size), b.owner))
    arena = Arena(provider)
    with arena.lease(1000) as ws:
        assert type(ws.ptr) is int and ws.ptr > 0
    stats = arena.stats()
    assert type(stats.capacity_bytes) is int and stats.capacity_bytes == 1024
    assert all(type(s.capacity_bytes) is int for s in stats.streams.values())
    assert repr(arena).endswith("1 stream(s), 1 KiB>")


class _Unprintable(Exception):
    def __str__(self):
        raise ValueError("no message")


@pytest.mark.parametrize("raised", [_Unprintable(), MemoryError()], ids=["str() fails", "no message"])
def test_a_failed_free_warns_naming_the_error_whatever_its_message(arena, provider, key, raised):
    real_deallocate = provider.deallocate

    def deallocate(buffer, *, stream):
        real_deallocate(buffer, stream=stream)
        raise raised

    provider.deallocate = deallocate
    for stream in "abc":
        arena.reserve(1000, stream=key(stream))
    name = type(raised).__name__
    freed = rf"freeing Buffer\(ptr=0x[0-9a-f]+, size=1024\) failed: {name}\(\)$"
    with pytest.warns(RuntimeWarning, match=freed), arena.lease(5000, stream=key("a")):  # frees the outgrown one
        pass
    with pytest.warns(RuntimeWarning, match=name):
        arena.trim()
    arena.reserve(1000, stream=key("b"))
    with pytest.warns(RuntimeWarning, match=name):
        arena.close()
    assert provider.held == [] and arena.stats().frees == 5


@pytest.mark.parametrize("outer", ["lease", "reserve"])
@pytest.mark.parametrize("inner", ["lease", "reserve", "reserve_for"])
def test_a_provider_that_asks_for_the_stream_it_is_growing_is_refused_not_a_hang(arena, provider, key, outer, inner):
    stream = key("s")
    asks = {
        "lease": lambda: arena.lease(100, stream=stream).__enter__(),
        "reserve": lambda: arena.reserve(50_000, stream=stream),
        "reserve_for": lambda: arena.reserve_for(Plan(50_000), streams=[stream]),
    }
    real_allocate = provider.allocate
    errors = []

    def allocate(nbytes, *, stream):
        provider.allocate = real_allocate
        try:
            asks[inner]()
        except RuntimeError as exc:
            errors.append(exc)
            raise
        return real_allocate(nbytes, stream=stream)

    def grow():
        with pytest.raises(RuntimeError):
            if outer == "lease":
                arena.lease(1000, stream=stream).__enter__()
            else:
                arena.reserve(1000, stream=stream)

    provider.allocate = allocate
    thread = threading.Thread(target=grow, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the growth waits for itself"
    # a lease inside a lease is the nested lease's error; anything else is this thread's own growth
    assert len(errors) == 1 and ("already holds a lease" if (outer, inner) == ("lease", "lease") else
                                 "this thread is growing the workspace") in str(errors[0])
    # the nested lease is the caller's misuse, a plain RuntimeError; the provider's request a ProviderError
    assert type(errors[0]) is (RuntimeError if (outer, inner) == ("lease", "lease") else ProviderError)
    with arena.lease(5000, stream=stream):
        assert arena.stats().leases == 1
    assert arena.stats().allocations == 1 and len(provider.held) == 1


class _LongRepr(HostProvider):
    """Host memory from a provider whose repr, and that of each buffer it hands out once ``wrong`` is set, is 100 kB
    long: a pool whose repr lists its blocks. ``wrong(first, fresh)`` makes what it returns of the first buffer it
    handed out and the one it would have."""

    def __init__(self, device_id):
        self.device_id = device_id
        self.first = None
        self.wrong = None

    def allocate(self, size, *, stream):
        fresh = super().allocate(size, stream=stream)
        self.first = self.first or fresh
        return fresh if self.wrong is None else self.wrong(self.first, fresh)

    def deallocate(self, buffer, *, stream):
        pass  # NumPy's memory goes with its last reference

    def __repr__(self):
        return "LongRepr(" + "p" * 100_000 + ")"


class _LongBuffer(Buffer):
    def __repr__(self):
        return "LongBuffer(" + "b" * 100_000 + ")"


def _ask_again(arena, stream):
    def allocate(first, fresh):
        arena.reserve(1 << 20, stream=stream)  # waits for the growth it is part of

    return allocate


@pytest.mark.parametrize(("wrong", "error"), [
    pytest.param(lambda first, fresh: _LongBuffer(fresh.ptr, 16, fresh.owner), RuntimeError, id="too small"),
    pytest.param(lambda first, fresh: _LongBuffer(first.ptr, fresh.size, fresh.owner), RuntimeError, id="overlapping"),
    pytest.param(lambda first, fresh: list(range(10**5)), TypeError, id="no buffer"),
    pytest.param(lambda first, fresh: None, TypeError, id="none"),
    pytest.param(lambda first, fresh: next(iter([])), RuntimeError, id="stop iteration"),
    pytest.param("ask again", RuntimeError, id="asks the arena again"),
])
def test_a_growth_error_quotes_the_provider_and_what_it_returned_in_part(arena_kind, key, wrong, error):
    """The errors of a growth quoted the provider and the buffer it returned whole (repr()), and the lane keys: a
    provider or buffer whose repr is 100 kB gave an error line as long."""
    provider = _LongRepr(arena_kind.device_id)
    arena = Arena(provider)
    arena.reserve(1000, stream=key("a"))
    provider.wrong = _ask_again(arena, key("b")) if wrong == "ask again" else wrong
    with pytest.raises(error) as raised:
        arena.reserve(5000, stream=key("b"))
    message = str(raised.value)
    assert len(message) < 600 and "LongRepr(ppp" in message, message[:1000]
    provider.wrong = None
    arena.reserve(5000, stream=key("b"))


def test_a_failed_free_warns_quoting_the_error_in_part(arena, provider, key):
    """The warning of a failed free copied the provider's exception text whole: a message that lists a pool's blocks
    gave a warning line as long."""
    real_deallocate = provider.deallocate

    def deallocate(buffer, *, stream):
        real_deallocate(buffer, stream=stream)
        raise RuntimeError("the pool's blocks: " + "x" * 100_000)

    provider.deallocate = deallocate
    arena.reserve(1000, stream=key("a"))
    with pytest.warns(RuntimeWarning, match="failed: RuntimeError") as warned:
        arena.trim()
    message = str(warned[0].message)
    assert len(message) < 300 and "the pool's blocks: xxx" in message, message[:1000]


def test_an_arena_quotes_its_provider_in_part(arena_kind, key):
    """repr() of an arena quoted its provider's repr whole: 100 kB for a pool whose repr lists its blocks."""
    arena = Arena(_LongRepr(arena_kind.device_id))
    arena.reserve(1000, stream=key("a"))
    shown = repr(arena)
    assert len(shown) < 300 and shown.startswith("<Arena LongRepr(ppp"), shown[:1000]
    assert shown.endswith(": 1 stream(s), 1 KiB>"), shown[-200:]
