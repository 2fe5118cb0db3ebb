"""Leases on either kind of arena: what a lease gives, reuse and disjointness, growth, reserve, trim, stats,
the cap, and bad input."""

import copy
import dataclasses
import pickle
from types import MappingProxyType

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wsarena
from wsarena.arena import Arena, ArenaStats, HostProvider
from wsarena.arena._stats import aligned_size
from wsarena.arena.streams import thread_lane
from wsarena.errors import ArenaOutOfMemoryError, WorkspaceCapError

from .arena_helpers import Plan, snapshot


# ---------------------------------------------------------------------------------------------- basics
def test_lease_gives_an_array_of_exactly_nbytes_over_ptr(arena, provider, arena_kind):
    with arena.lease(1000) as ws:
        assert ws.nbytes == 1000
        assert ws.array.shape == (1000,) and ws.array.dtype == np.uint8
        assert ws.array.__array_interface__["data"][0] == ws.ptr
        ws.array[:] = 7
    if arena_kind.host:
        assert ws.stream is thread_lane()
    else:
        assert ws.stream == provider.current


def test_lazy_nothing_allocated_before_first_lease(arena, provider):
    assert provider.allocations == []
    assert arena.held_bytes() == 0
    assert arena.stats().capacity_bytes == 0


def test_zero_bytes_is_legal_and_allocates_nothing(arena, provider, arena_kind):
    own = thread_lane() if arena_kind.host else provider.current
    with arena.lease(0) as ws:
        assert ws.ptr == 0 and ws.nbytes == 0
        assert ws.array.shape == (0,) and ws.array.dtype == np.uint8
        with arena.lease(0, stream=own):  # takes nothing, so it may nest
            pass
    assert provider.allocations == []
    assert arena.stats().streams == {}


def test_a_zero_byte_lease_on_a_device_carries_its_streams_raw_handle(arena, arena_kind):
    """As a lease that takes bytes does: the cuDNN backends bind their handle to it without resolving the call's stream
    again (CuPy's current stream, for None). The per-thread default stream's is 2, a lane's nothing."""
    if arena_kind.host:
        with arena.lease(0) as ws, arena.lease(0, stream="lane") as named:
            assert ws.cuda_stream is None and named.cuda_stream is None
        return
    for stream, raw in ((None, arena.provider.current), (0x77, 0x77), (2, 2), (0, 0)):
        with arena.lease(0, stream=stream) as ws, arena.lease(8, stream=stream) as taking:
            assert ws.cuda_stream == taking.cuda_stream == raw


def test_same_stream_reuses_the_same_bytes(arena, provider):
    with arena.lease(4096) as a:
        pa = a.ptr
    with arena.lease(100) as b:
        assert b.ptr == pa
    assert len(provider.allocations) == 1


def test_different_streams_get_disjoint_bytes(arena, key):
    with arena.lease(1000, stream=key("a")) as a, arena.lease(1000, stream=key("b")) as b:
        assert a.ptr + a.nbytes <= b.ptr or b.ptr + b.nbytes <= a.ptr


def test_a_lease_is_entered_once(arena):
    cm = arena.lease(10)
    with cm:
        pass
    with pytest.raises(RuntimeError, match="once"):
        cm.__enter__()
    with pytest.raises(RuntimeError, match="inside its lease"):
        _ = cm.array


@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy])
def test_a_copy_of_a_lease_is_the_lease_itself(arena, key, copier):
    with arena.lease(100, stream=key("s")) as ws:
        copied = copier(ws)
        copied.__exit__(None, None, None)  # ends the lease itself, not its owner's bytes behind its back
        assert repr(ws).endswith("released>") and arena.stats().leases == 0
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(arena.lease(100))


def test_a_lease_quotes_its_lane_in_part():
    """repr() of a lease quoted its stream whole: 100 kB for a CPU lane keyed by a 100 kB string."""
    arena = Arena(HostProvider())
    with arena.lease(100, stream="k" * 100_000) as ws:
        shown = repr(ws)
    assert len(shown) < 300 and "on stream 'kkk" in shown and shown.endswith(", live>"), shown[:1000]


# ---------------------------------------------------------------------------------------------- growth
def test_growth_is_by_the_aligned_request_not_doubling(arena, provider):
    for n in (1000, 1300, 70_000, 70_001):
        with arena.lease(n):
            pass
        assert arena.held_bytes() == aligned_size(max(1000, n))
    assert [b.size for b in provider.allocations] == [1024, 1536, aligned_size(70_000)]
    s = arena.stats()
    assert (s.allocations, s.growths, s.frees) == (3, 2, 2)  # 70_001 fits the aligned 70_000


def test_a_growth_gives_the_outgrown_buffer_back_as_the_lease_begins(arena, provider, key):
    """The buffer a lease's growth outgrows, which no lease uses, goes back to the provider (on its stream) before the
    body runs, not only once the lease ends: a long lease does not hold both."""
    with arena.lease(1000, stream=key("a")):
        pass
    first = provider.allocations[0]
    with arena.lease(5000, stream=key("a")) as ws:
        assert provider.frees == [(first, key("a"))]
        assert provider.held == [provider.allocations[1]] and ws.ptr == provider.allocations[1].ptr


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


# -------------------------------------------------------------------------------- reserve, trim, stats
def test_stats_have_attribute_and_item_access(arena, key):
    with arena.lease(3000, stream=key("x")):
        s = arena.stats()
        for name in ("capacity_bytes", "high_water_bytes", "allocations", "growths", "leases", "streams"):
            assert s[name] == getattr(s, name)
        assert s.leases == 1 and s.streams[key("x")].leases == 1 and s.streams[key("x")]["capacity_bytes"] == 3072
        assert dict(s)["high_water_bytes"] == 3000
    with pytest.raises(KeyError):
        s["nope"]
    assert arena.stats().leases == 0


class _Lane:
    """A lane key object: weakly referenceable, equal only to itself."""


@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy, lambda s: pickle.loads(pickle.dumps(s))],
                         ids=["copy", "deepcopy", "pickle"])
def test_stats_can_be_copied_and_pickled(arena, key, copier):
    with arena.lease(5000, stream=key("a")), arena.lease(100):
        arena.reserve(9000, stream=key("a"))
        stats = arena.stats()
    copied = copier(stats)
    assert type(copied) is ArenaStats and type(copied.streams) is MappingProxyType
    assert copied.to_dict() == stats.to_dict() and copied.to_dict()["retired_bytes"] == 5120


def test_stats_are_keyed_by_the_callers_lane_key_objects(host_arena):
    """stats().streams is keyed by the lane keys the caller passed. Once, a lane key object's entry was keyed by the
    table's weak reference to it (equal to it, but not it: iterating the keys gave weakref objects)."""
    lane = _Lane()
    with host_arena.lease(1024, stream=lane):
        pass
    host_arena.reserve(1024, stream="plain")
    streams = host_arena.stats().streams
    assert set(map(type, streams)) == {_Lane, str}
    assert next(k for k in streams if type(k) is _Lane) is lane and streams[lane].capacity_bytes == 1024


def test_reserve_presizes_and_leases_then_do_not_allocate(arena, provider, key):
    arena.reserve(10_000, stream=key("s"))
    assert arena.held_bytes(stream=key("s")) == aligned_size(10_000)
    with (
        arena.lease(10_000, stream=key("s")),
        pytest.raises(RuntimeError, match="already holds"),
        arena.lease(5, stream=key("s")),
    ):
        pass
    assert len(provider.allocations) == 1
    arena.reserve(0, stream=key("s"))
    arena.reserve(10, stream=key("s"))  # smaller: nothing to do
    assert len(provider.allocations) == 1


def test_reserve_for_a_plan_presizes_its_streams(arena, provider, key):
    arena.reserve_for(Plan(aligned_size(100_000)))
    assert arena.held_bytes() == aligned_size(100_000)
    arena.reserve_for(Plan(4096, 8192), streams=[key("x"), key("y")])
    assert (arena.held_bytes(stream=key("x")), arena.held_bytes(stream=key("y"))) == (4096, 8192)
    # two planned streams on one: its calls run in its order, so it holds the larger of the two, not their sum
    arena.reserve_for(Plan(16384, 12288), streams=[key("w"), key("w")])
    assert arena.held_bytes(stream=key("w")) == 16384
    with wsarena.config(cap_workspace=100_000):  # the plan's rounded size may sit just above the cap
        arena.reserve_for(Plan(aligned_size(99_999)), streams=[key("z")])
    before = len(provider.allocations)
    with arena.lease(100_000), arena.lease(4096, stream=key("x")):
        pass
    assert len(provider.allocations) == before


def test_reserve_for_refuses_a_plan_for_the_backend_the_arena_does_not_serve(arena_kind, arena, key):
    layers = [wsarena.ConvLayer("c", (1, 8, 16, 16), (8, 8, 3, 3), padding=(1, 1))]
    mine = wsarena.plan(layers, backend="cpu")
    other = dataclasses.replace(mine, backend="cudnn", stream_bytes=(1 << 30,))  # as a deviceless plan for a GPU
    if not arena_kind.host:
        mine, other = dataclasses.replace(mine, backend="cudnn"), dataclasses.replace(other, backend="cpu")
    serves = mine.backend
    with pytest.raises(ValueError, match=f"the plan is for the {other.backend} backend .* serves the {serves} backend"):
        arena.reserve_for(other)
    assert arena.stats().streams == {}
    arena.reserve_for(mine)
    assert arena.held_bytes() == mine.held_bytes > 0


@pytest.mark.parametrize(
    ("plan", "streams", "error"),
    [(Plan(10, 20), None, ValueError), (Plan(10), ["a", "b"], ValueError), (Plan(10, 20), ["a", [1]], TypeError),
     (Plan(-1), None, ValueError)],
)
def test_reserve_for_bad_input_changes_nothing(arena, key, plan, streams, error):
    if streams is not None:  # the names of streams as this kind keys them; [1] is no key on either
        streams = [key(s) if isinstance(s, str) else s for s in streams]
    with pytest.raises(error):
        arena.reserve_for(plan, streams=streams)
    assert arena.stats().streams == {}


def test_trim_frees_what_no_live_lease_uses(arena, provider, key):
    with arena.lease(5000, stream=key("a")):
        with arena.lease(7000, stream=key("b")):
            pass
        assert arena.trim() == aligned_size(7000)
        assert arena.held_bytes(stream=key("a")) == aligned_size(5000)
        assert arena.held_bytes(stream=key("b")) == 0
    assert arena.trim() == aligned_size(5000)
    assert provider.held == [] and arena.stats().capacity_bytes == 0
    assert dict(arena.stats().streams) == {}  # emptied sub-arenas are forgotten
    with arena.lease(100, stream=key("a")):  # usable after trim
        pass


def test_high_water_is_the_largest_lease_and_survives_trim(arena):
    for n in (10, 5000, 20):
        with arena.lease(n):
            pass
    arena.trim()
    assert arena.stats().high_water_bytes == 5000


def test_held_bytes_per_stream(arena, key):
    arena.reserve(1 << 20, stream=key(1))
    assert arena.held_bytes(stream=key(1)) == 1 << 20
    assert arena.held_bytes(stream=key(2)) == 0
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


def test_unhashable_stream_key_is_a_type_error(arena):
    with pytest.raises(TypeError, match=r"\[1, 2\]"):
        arena.lease(10, stream=[1, 2])
    with pytest.raises(TypeError):
        arena.held_bytes(stream={})


# ------------------------------------------------------------------------------------------------ cap
def test_lease_above_the_cap_raises_with_the_numbers_and_changes_nothing(arena, key):
    arena.reserve(1000, stream=key("s"))
    before = snapshot(arena)
    with wsarena.config(cap_workspace="2KiB"):
        with pytest.raises(WorkspaceCapError) as info:
            arena.lease(2049, stream=key("s"))
        with pytest.raises(WorkspaceCapError):
            arena.reserve(4096, stream=key("s"))
        assert snapshot(arena) == before
        with arena.lease(2048, stream=key("s")):  # at the cap is fine
            pass
    err = info.value
    assert isinstance(err, MemoryError)
    assert (err.requested, err.held, err.cap) == (2049, 1024, 2048)


@pytest.mark.parametrize(("cap", "shown", "requested"), [
    (4000, "4000 B", "4 KiB"), ((1 << 20) - 1, "1048575 B", "1 MiB"), (3584, "3.5 KiB", "3.625 KiB"),
    (2048, "2 KiB", "2.125 KiB"),  # format_size's "2 KiB" for 2049 would be the very cap that refused it
])
def test_a_cap_error_names_the_cap_as_cap_workspace_takes_it_back(arena, cap, shown, requested):
    """The cap exactly: format_size's "3.91 KiB" for 4000 bytes is no whole number of bytes, which cap_workspace
    refuses, and its "1 MiB" for 1048575 is a larger cap. The request as a cap that admits it (rounded up to an
    eighth of its unit); the size held is there to read."""
    with wsarena.config(cap_workspace=cap), pytest.raises(WorkspaceCapError) as info:
        arena.lease(cap + 1)
    assert str(info.value).startswith(f"a workspace of {requested} on stream ")
    assert str(info.value).endswith(f"(requested {requested}, held 0 B, cap {shown})")
    assert wsarena.parse_size(shown) == cap
    with wsarena.config(cap_workspace=requested), arena.lease(cap + 1):
        pass


def test_cap_zero_still_allows_zero_byte_leases(arena):
    with wsarena.config(cap_workspace=0):
        with arena.lease(0):
            pass
        with pytest.raises(WorkspaceCapError):
            arena.lease(1)


def test_an_explicit_cap_replaces_the_configured_one(arena, key):
    with wsarena.config(cap_workspace="1KiB"):
        with arena.lease(4096, stream=key("s"), cap=None) as ws:  # the caller chose under no cap
            assert ws.nbytes == 4096
        with arena.lease(4096, stream=key("s"), cap=4096):
            pass
    with pytest.raises(WorkspaceCapError) as info:
        arena.lease(4097, stream=key("s"), cap=4096)  # configured: no cap
    assert info.value.cap == 4096
    arena.provider.fail_next = 1
    with (
        wsarena.config(cap_workspace="1KiB"),
        pytest.raises(ArenaOutOfMemoryError) as oom,
        arena.lease(1 << 20, stream=key("s"), cap=None),
    ):
        pass
    assert oom.value.cap is None  # the cap the lease was checked under, not the configured one
    with pytest.raises(TypeError, match=r"^cap must be an int, in bytes, or None for no cap, not '1KiB'$"):
        arena.lease(16, cap="1KiB")  # (the message said "an int", as if None were refused too)
    with arena.lease(16, cap=np.int64(4096)):  # anything operator.index takes, as for nbytes
        pass
    with pytest.raises(ValueError, match="cap cannot be negative"):
        arena.lease(16, cap=-1)


def test_cap_from_the_environment(arena, monkeypatch):
    monkeypatch.setenv("WSARENA_CAP_WORKSPACE", "1KiB")
    wsarena._config._reset()
    with pytest.raises(WorkspaceCapError):
        arena.lease(1025)


def test_each_stream_counts_its_own_allocations_and_growths(arena, key):
    """A stream's statistics count the buffers it was given and how many of them replaced one, as the arena's
    totals do for all streams: stream a grew once (1000 bytes, then 5000), stream b never."""
    for n in (1000, 5000, 3000):
        with arena.lease(n, stream=key("a")):
            pass
    with arena.lease(100, stream=key("b")):
        pass
    s = arena.stats()
    a, b = s.streams[key("a")], s.streams[key("b")]
    assert (a.allocations, a.growths) == (2, 1)
    assert (b.allocations, b.growths) == (1, 0)
    assert (s.allocations, s.growths) == (3, 1)


def test_a_trim_under_a_lease_keeps_the_buffer_a_reserve_outgrew_until_the_lease_ends(arena, provider, key):
    """reserve() grows a stream's buffer under a live lease: the leased buffer is retired, and a trim meanwhile lets
    go of the new, unused one alone. Once the lease ends, the retired one goes too."""
    with arena.lease(5000, stream=key("a")):
        arena.reserve(20_000, stream=key("a"))
        assert sorted(b.size for b in provider.held) == [aligned_size(5000), aligned_size(20_000)]
        assert arena.trim() == aligned_size(20_000)
        assert [b.size for b in provider.held] == [aligned_size(5000)]
        assert arena.stats().retired_bytes == aligned_size(5000)
    arena.trim()
    assert provider.held == [] and arena.stats().retired_bytes == 0
