"""Lanes are bounded: a lane keyed by an object goes when the object does, a key that is not equal to itself is
refused, and idle lanes of caller-chosen keys beyond ``MAX_IDLE_STREAMS`` are evicted, least recently leased
first."""

import decimal
import gc
import threading

import numpy as np
import pytest

import wsarena
from wsarena.arena import _table

from .reference import ref_conv_forward

X = np.random.default_rng(0).standard_normal((2, 4, 8, 8)).astype(np.float32)
W = np.random.default_rng(1).standard_normal((4, 4, 3, 3)).astype(np.float32)


class Key:
    """A lane key object (weakly referenceable, equal only to itself)."""


def test_a_lane_keyed_by_an_object_goes_when_the_object_does(host_arena, host_provider):
    for _ in range(20):
        with host_arena.lease(4096, stream=Key()) as ws:
            ws.array[:] = 1
    del ws  # a Workspace keeps its stream (here the last key) alive
    gc.collect()
    stats = host_arena.stats()
    assert len(stats.streams) == 0 and stats.capacity_bytes == 0
    assert host_provider.held == []


def test_convolutions_keyed_by_fresh_objects_keep_no_lanes(fresh_arena):
    with wsarena.config(cap_workspace=None):
        for _ in range(20):
            y = wsarena.conv_forward(X, W, padding=1, stream=Key())
    np.testing.assert_allclose(y, ref_conv_forward(X, W, padding=1), rtol=1e-4, atol=1e-4)
    gc.collect()
    assert len(fresh_arena.stats().streams) <= 1  # at most the last one's, swept by the next operation


def test_lanes_of_fresh_keys_that_cannot_be_weakly_referenced_stay_bounded(fresh_arena):
    """A plain ``object()`` per call cannot be weakly referenced, so its lane cannot go with it: the idle limit
    bounds what such keys keep (each used to keep a lane and its buffer until trim())."""
    with wsarena.config(cap_workspace=None):
        for _ in range(2 * _table.MAX_IDLE_STREAMS + 1):
            y = wsarena.conv_forward(X, W, padding=1, stream=object())
    np.testing.assert_allclose(y, ref_conv_forward(X, W, padding=1), rtol=1e-4, atol=1e-4)
    stats = fresh_arena.stats()
    assert 0 < len(stats.streams) <= _table.MAX_IDLE_STREAMS  # the calls did lease a workspace, on their lanes
    assert stats.allocations - stats.frees == len(stats.streams)


def test_a_lane_key_object_finds_its_lane_while_it_lives(host_arena):
    key = frozenset({"layer", 3})
    host_arena.reserve(4096, stream=key)
    assert host_arena.held_bytes(stream=key) == 4096
    assert host_arena.held_bytes(stream=frozenset({"layer", 3})) == 4096  # an equal key is the same lane
    assert host_arena.stats().streams[key].capacity_bytes == 4096
    with host_arena.lease(4096, stream=key):
        other = []
        thread = threading.Thread(target=lambda: other.append(host_arena.lease(0, stream=key).__enter__()))
        thread.start()
        thread.join(10)
    assert host_arena.stats().allocations == 1


@pytest.mark.parametrize("nan", [float("nan"), decimal.Decimal("nan"), np.float64("nan")])
def test_a_key_that_is_not_equal_to_itself_is_refused(host_arena, nan):
    for call in (
        lambda: host_arena.lease(4096, stream=nan),
        lambda: host_arena.reserve(4096, stream=nan),
        lambda: host_arena.held_bytes(stream=nan),
        lambda: wsarena.conv_forward(X, W, stream=nan),
    ):
        with pytest.raises(ValueError, match="stream=.*not equal to itself"):
            call()
    assert host_arena.stats().streams == {}


def test_idle_lanes_beyond_the_limit_are_evicted(host_arena, host_provider):
    """A request id per call: the lanes (and bytes) held stay bounded, at the limit."""
    limit = _table.MAX_IDLE_STREAMS
    for i in range(3 * limit):
        with host_arena.lease(64 << 10, stream=f"request-{i}") as ws:
            ws.array[:] = 1
        # no fewer either: each new key past the limit evicts one lane, the oldest
        assert len(host_arena.stats().streams) == min(i + 1, limit)
    stats = host_arena.stats()
    assert set(stats.streams) == {f"request-{i}" for i in range(2 * limit, 3 * limit)}  # the newest, in any order
    assert host_provider.held_bytes == stats.capacity_bytes == limit * (64 << 10)
    assert stats.allocations - stats.frees == len(host_provider.held)


def test_a_lane_in_steady_use_keeps_its_buffer_while_one_off_keys_come_and_go(host_arena, host_provider, monkeypatch):
    monkeypatch.setattr(_table, "MAX_IDLE_STREAMS", 4)
    for i in range(40):
        with host_arena.lease(4096, stream="steady"):
            pass
        with host_arena.lease(4096, stream=f"one-off-{i}"):
            pass
    assert host_arena.stats().streams["steady"].allocations == 1
    assert len(host_arena.stats().streams) <= 4


def test_per_thread_lanes_are_not_evicted(host_arena, monkeypatch):
    """They are bounded by the live threads, and swept when their thread exits."""
    monkeypatch.setattr(_table, "MAX_IDLE_STREAMS", 2)
    release = threading.Event()
    leased = threading.Barrier(7)

    def worker():
        with host_arena.lease(4096):
            pass
        leased.wait(10)
        release.wait(10)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for thread in threads:
        thread.start()
    leased.wait(10)
    for i in range(10):
        host_arena.reserve(4096, stream=f"key-{i}")
    assert sum(type(k).__name__ == "ThreadLane" for k in host_arena.stats().streams) == 6
    release.set()
    for thread in threads:
        thread.join(10)
