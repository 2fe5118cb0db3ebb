"""Property-based tests: random leases, releases, reserves, trims, caps and provider failures, in debug mode.

A model tracks what the arena must hold: per lane or stream, the largest request since the last trim (rounded
by aligned_size), and which live lease uses which buffer. After every step the arena's stats, the provider's
records and the live leases' bytes must agree with it.
"""

import gc
import random
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import wsarena
import wsarena._config
from wsarena.arena import Arena, _refusals
from wsarena.arena._arena import POISON_BYTE
from wsarena.arena._stats import aligned_size
from wsarena.arena.testing import RecordingProvider
from wsarena.errors import ArenaOutOfMemoryError, WorkspaceCapError

from .arena_helpers import RefusalClock

KEY = st.integers(0, 2)  # an index into the machine's KEYS (lanes on the host, stream handles on a device)
REFUSAL = 0.01  # seconds of the clock a refusal takes: a wait of 1 s after the second in a row, doubled after each
SIZES = st.one_of(st.integers(0, 5000), st.integers(5000, 300_000), st.sampled_from([1, 256, 257, 8192, 1 << 20]))


class _Live:
    __slots__ = ("generation", "key", "nbytes", "pattern", "ptr", "view", "ws")

    def __init__(self, ws, key, pattern, generation):
        self.ws, self.key, self.nbytes, self.ptr = ws, key, ws.nbytes, ws.ptr
        self.generation = generation  # which of the key's buffers it uses
        self.view = ws.array
        self.pattern = pattern
        self.view[:] = pattern


class HostArenaMachine(RuleBasedStateMachine):
    DEVICE_ID = None
    KEYS = ("a", "b", "c")

    @initialize()
    def setup(self):
        wsarena._config._reset()
        wsarena.configure(debug=True)
        self.provider = RecordingProvider(device_id=self.DEVICE_ID)
        self.arena = Arena(self.provider)
        self.live = {k: [] for k in self.KEYS}
        self.cap = dict.fromkeys(self.KEYS, 0)  # model capacity per key
        self.largest = dict.fromkeys(self.KEYS, 0)  # largest request since the last trim
        self.on_current = dict.fromkeys(self.KEYS, 0)  # live leases on the current buffer
        self.generation = dict.fromkeys(self.KEYS, 0)  # bumped whenever a key gets a new buffer
        self.allocations = self.growths = self.high_water = 0
        self.stream_high = dict.fromkeys(self.KEYS, 0)  # largest lease per key since its sub-arena appeared
        self.armed = False  # the provider will fail the next allocation, taking REFUSAL seconds of the clock
        self.provider_armed = False
        self.provider.fail = self._provider_fails
        # The record of refusals: the smallest growth refused since one as large was granted or the last trim, the
        # refusals in a row of that size or more, and until when a caller with a fallback is told to wait
        self.refused = self.refusals = 0
        self.until = 0.0
        self.clock = RefusalClock()
        self.real_clock, _refusals.clock = _refusals.clock, self.clock
        self.limit = None  # cap_workspace in force
        self.patterns = iter(range(1, 1 << 30))

    def teardown(self):
        for leases in getattr(self, "live", {}).values():
            for lease in leases:
                lease.ws.__exit__(None, None, None)
        if hasattr(self, "real_clock"):
            _refusals.clock = self.real_clock
        wsarena._config._reset()

    def _provider_fails(self, nbytes):
        if not self.provider_armed:
            return False
        self.provider_armed = False
        self.clock.now += REFUSAL
        return True

    # -------------------------------------------------------------- model helpers
    def _model_key(self, key):
        """The model's key for one of the arena's sub-arena keys."""
        return key

    def _capped(self, n):
        return self.limit is not None and n > self.limit

    def _grow(self, key, n):
        """Model of the arena's growth; returns False where the armed provider makes it fail. The arena remembers
        the smallest growth refused since one as large was granted (``refused``)."""
        if n <= self.cap[key]:
            return True
        size = aligned_size(n)
        if self.armed:
            self.armed = False
            if self.refusals and size < self.refused:
                self.refusals = 0  # a smaller growth: a record of its own
            if not self.refusals:
                self.refused = size
            self.refusals += 1
            wait = min(100 * REFUSAL * 2 ** (self.refusals - 2), 60.0) if self.refusals > 1 else None
            self.until = self.clock.now + wait if wait is not None else 0.0
            return False
        if self.refusals and size >= self.refused:
            self.refused = self.refusals = 0
            self.until = 0.0
        self.allocations += 1
        if self.cap[key]:
            self.growths += 1
        self.cap[key] = size
        self.on_current[key] = 0
        self.generation[key] += 1
        return True

    def _note(self, key, n):
        self.largest[key] = max(self.largest[key], n)

    # ---------------------------------------------------------------------- rules
    def _may_lease(self, key):
        return not self.live[key]

    @rule(k=KEY, n=SIZES)
    def lease(self, k, n):
        key = self.KEYS[k]
        ws = self.arena.lease(n, stream=key) if not self._capped(n) else None
        if ws is None:
            with pytest.raises(WorkspaceCapError):
                self.arena.lease(n, stream=key)
            return
        if n == 0:
            with ws:
                assert ws.ptr == 0 and ws.array.size == 0
            return
        if not self._may_lease(key):
            with pytest.raises(RuntimeError, match="already holds"):
                ws.__enter__()
            return
        if not self._grow(key, n):
            with pytest.raises(ArenaOutOfMemoryError):
                ws.__enter__()
            self._forget_if_empty(key)
            return
        ws.__enter__()
        self._note(key, n)
        self.on_current[key] += 1
        self.high_water = max(self.high_water, n)
        self.stream_high[key] = max(self.stream_high[key], n)
        self.live[key].append(_Live(ws, key, next(self.patterns) % 255, self.generation[key]))

    @precondition(lambda self: any(self.live.values()))
    @rule(data=st.data())
    def release(self, data):
        key = data.draw(st.sampled_from([k for k in self.KEYS if self.live[k]]))
        index = data.draw(st.integers(0, len(self.live[key]) - 1))
        lease = self.live[key].pop(index)
        lease.ws.__exit__(None, None, None)
        assert (lease.view == POISON_BYTE).all()
        if lease.generation == self.generation[key]:
            self.on_current[key] -= 1

    @rule(k=KEY, n=SIZES)
    def reserve(self, k, n):
        key = self.KEYS[k]
        if self._capped(n):
            with pytest.raises(WorkspaceCapError):
                self.arena.reserve(n, stream=key)
        elif self._grow(key, n):
            self.arena.reserve(n, stream=key)
            self._note(key, n)
        else:
            with pytest.raises(ArenaOutOfMemoryError):
                self.arena.reserve(n, stream=key)
            self._forget_if_empty(key)

    def _forget_if_empty(self, key):
        """A failed growth leaves a sub-arena that holds nothing and serves no lease: it is forgotten."""
        if not self.live[key] and self.cap[key] == 0:
            self.stream_high[key] = 0

    @rule()
    def trim(self):
        self.arena.trim()
        self.refused = self.refusals = 0
        self.until = 0.0
        for key in self.KEYS:
            if not self.on_current[key]:
                self.cap[key] = self.largest[key] = 0
            if not self.live[key]:  # its sub-arena holds nothing now and is forgotten, counters with it
                self.stream_high[key] = 0

    @rule()
    def arm_failure(self):
        self.provider_armed = self.armed = True

    @rule(k=KEY, n=st.integers(300_000, 1 << 20))
    def refused_twice(self, k, n):
        """Two refusals in a row (where the lease would grow): what starts a wait."""
        for _ in range(2):
            self.arm_failure()
            self.lease(k, n)

    @rule(seconds=st.sampled_from([0.3, 0.7, 1.1, 2.5, 61.0]))
    def wait(self, seconds):
        self.clock.now += seconds

    @rule(k=KEY, n=st.one_of(SIZES, st.none()), fallback=st.sampled_from([0, 1, 4096, 300_000]))
    def ask_whether_to_defer(self, k, n, fallback):
        key = self.KEYS[k]
        n = self.refused if n is None else n  # None: the growth refused, often what a caller asks again
        held = self.cap[key]
        waiting = self.refusals > 1 and self.clock.now < self.until
        want = n > held >= fallback and waiting and aligned_size(n) >= self.refused
        assert self.arena.defers_growth(n, stream=key, fallback=fallback) == want

    @rule(limit=st.one_of(st.none(), st.integers(0, 400_000)))
    def set_cap(self, limit):
        wsarena.configure(cap_workspace=limit)
        self.limit = limit

    # ------------------------------------------------------------------ invariants
    @invariant()
    def capacity_is_the_largest_request_since_trim(self):
        for key in self.KEYS:
            assert self.cap[key] == aligned_size(self.largest[key])
            assert self.arena.held_bytes(stream=key) == self.cap[key]

    @invariant()
    def stats_agree_with_the_model_and_the_provider(self):
        s = self.arena.stats()
        live = sum(len(v) for v in self.live.values())
        assert s.leases == live == sum(x.leases for x in s.streams.values())
        assert s.capacity_bytes == sum(x.capacity_bytes for x in s.streams.values()) == sum(self.cap.values())
        assert s.retired_bytes == sum(x.retired_bytes for x in s.streams.values())
        assert self.provider.held_bytes == s.capacity_bytes + s.retired_bytes
        assert s.allocations == len(self.provider.allocations) == self.allocations
        assert s.growths == self.growths
        assert s.frees == len(self.provider.frees) == s.allocations - len(self.provider.held)
        assert s.high_water_bytes == self.high_water
        assert s.refused_bytes == self.refused
        assert self.arena.refusing == (self.refusals > 1 and self.clock.now < self.until)
        for key, x in s.streams.items():
            assert x.leases == len(self.live[self._model_key(key)])
            assert x.high_water_bytes == self.stream_high[self._model_key(key)] <= s.high_water_bytes
        listed = {self._model_key(key) for key in s.streams}
        assert all(self.stream_high[key] == 0 for key in self.KEYS if key not in listed)

    @invariant()
    def live_leases_sit_in_held_buffers_and_never_overlap_across_keys(self):
        held = [(b.ptr, b.ptr + b.size) for b in self.provider.held]
        leases = [x for v in self.live.values() for x in v]
        for x in leases:
            assert any(lo <= x.ptr and x.ptr + x.nbytes <= hi for lo, hi in held)
            for y in leases:
                if x.key != y.key:
                    assert x.ptr + x.nbytes <= y.ptr or y.ptr + y.nbytes <= x.ptr

    @invariant()
    def live_bytes_are_untouched(self):
        for leases in self.live.values():
            for x in leases:
                assert (x.view == x.pattern).all()


class DeviceArenaMachine(HostArenaMachine):
    """The same model on stream handles: as on lanes, a thread holds one lease per stream (a nested lease there
    raises RuntimeError, zero bytes excepted), so no two live leases ever share bytes."""

    DEVICE_ID = 0
    KEYS = (0, 2, 0x7F00)  # 2: the per-thread default stream, which the arena keys by this (the only) thread

    def _model_key(self, key):
        return getattr(key, "handle", key)  # this thread's key for handle 2 is a key of its own


SETTINGS = settings(
    max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestHostArena = HostArenaMachine.TestCase
TestHostArena.settings = SETTINGS
TestDeviceArena = DeviceArenaMachine.TestCase
TestDeviceArena.settings = SETTINGS


# ------------------------------------------------------------------------------------------- threads
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("lease"), st.sampled_from([None, "a", "b"]), SIZES),
        st.tuples(st.just("reserve"), st.sampled_from([None, "a", "b"]), SIZES),
        st.tuples(st.just("trim"), st.none(), st.none()),
    ),
    max_size=25,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs=st.lists(OPS, min_size=2, max_size=4), seed=st.integers(0, 2**32 - 1))
def test_threads_on_shared_and_own_lanes(programs, seed):
    rng = random.Random(seed)
    lock = threading.Lock()

    def fail(nbytes):
        with lock:
            return rng.random() < 0.15

    provider = RecordingProvider(fail=fail)
    arena = Arena(provider)
    errors = []
    largest = {"a": 0, "b": 0}

    def run(index, program):
        try:
            with wsarena.config(debug=True):
                for op, lane, n in program:
                    try:
                        if op == "lease":
                            with arena.lease(n, stream=lane) as ws:
                                if n:
                                    ws.array[:] = index + 1  # nobody else may write here meanwhile
                                    threading.Event().wait(0)
                                    assert (ws.array == index + 1).all()
                        elif op == "reserve":
                            arena.reserve(n, stream=lane)
                        else:
                            arena.trim()
                        if lane in largest and n:
                            with lock:
                                largest[lane] = max(largest[lane], n)
                    except ArenaOutOfMemoryError as exc:
                        assert exc.requested == n and exc.held < n
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(programs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    del threads
    gc.collect()
    s = arena.stats()
    assert s.leases == 0 and s.retired_bytes == 0
    assert set(s.streams) <= {"a", "b"}  # the threads' own lanes were swept when they exited
    for lane, x in s.streams.items():
        assert x.capacity_bytes <= aligned_size(largest[lane])
    assert provider.held_bytes == s.capacity_bytes
    assert s.frees == len(provider.frees) and s.allocations == len(provider.allocations)
    arena.trim()
    assert provider.held == []
