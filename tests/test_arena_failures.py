"""When the provider fails, on either kind of arena: out of memory leaves the arena as it was, other errors pass
through, and a run of the ops can fall back to what the arena holds."""

import pytest

from wsarena.arena import Arena, HostProvider
from wsarena.errors import ArenaOutOfMemoryError

from .arena_helpers import snapshot


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
    assert snapshot(arena) == before
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


# --------------------------------------------------------------------- a provider that breaks its contract
def test_an_object_that_is_no_provider_is_refused():
    with pytest.raises(TypeError, match="MemoryProvider"):
        Arena(object())


def test_a_provider_that_returns_too_little_is_an_error_and_its_buffer_is_freed(arena, provider, key):
    real_allocate = provider.allocate
    provider.allocate = lambda nbytes, *, stream: real_allocate(nbytes // 2, stream=stream)
    with pytest.raises(RuntimeError, match="for a request of 4096 bytes"), arena.lease(4096, stream=key("s")):
        pass
    assert provider.held == [] and arena.stats().capacity_bytes == 0


def test_a_provider_that_returns_nothing_is_an_error_not_a_loop(arena, provider, key):
    provider.allocate = lambda nbytes, *, stream: None
    with pytest.raises(TypeError, match="returned None"), arena.lease(4096, stream=key("s")):
        pass
    assert arena.stats().capacity_bytes == 0
