"""One lease per stream at a time, on either kind of arena: a nested lease is refused, other threads wait, and
a buffer outgrown under a live lease is retired until that lease ends."""

import gc
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest

from wsarena.arena import Arena, _arena, _growth, _leases, _sub, _table, _workspace
from wsarena.arena.streams import thread_lane

from .arena_helpers import GatedProvider, snapshot, wait_for_a_waiter


def _in_another_thread(function):
    """``function()`` run by a thread of its own, waited for: its result, or its exception raised here."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(function).result(10)


def _lease_in_another_thread(arena, stream):
    """A thread, started now, that leases ``stream`` and records ``"leased"`` (or the error) in the list returned."""
    outcome = []

    def run():
        try:
            with arena.lease(1024, stream=stream):
                outcome.append("leased")
        except RuntimeError as exc:
            outcome.append(str(exc))

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


# ----------------------------------------------------------------------------------------- nested leases
def test_nested_lease_on_own_stream_is_a_clear_error_and_changes_nothing(arena, provider, arena_kind, key):
    own = thread_lane() if arena_kind.host else provider.current
    with arena.lease(100):
        before = snapshot(arena)
        with pytest.raises(RuntimeError, match=arena_kind.nested_error(own)), arena.lease(100):
            pass
        assert snapshot(arena) == before
        with arena.lease(100, stream=key("inner")):  # another stream is fine
            pass


def test_a_lease_ended_for_want_of_a_holder_reads_as_released_when_its_own_exit_comes(arena, key):
    """What held a lease (the ``__exit__`` a with statement looked up, here by hand) went without running: the arena's
    next look ends the lease, and the lease's own ``__exit__``, called afterwards, finds it ended and marks it
    released, its array no longer usable, where it stayed live."""
    ws = arena.lease(1000, stream=key("a"))
    holder = ws.__exit__
    ws.__enter__()
    del holder
    gc.collect()
    assert arena.stats().leases == 0
    ws.__exit__(None, None, None)
    assert repr(ws).endswith("released>") and arena.stats().leases == 0
    with pytest.raises(RuntimeError, match="inside its lease"):
        _ = ws.array


class _Stream3:
    def __cuda_stream__(self):
        return (0, 3)


@pytest.mark.parametrize("inner", [3, "object", "current"])
def test_device_nested_lease_on_own_stream_is_refused_however_the_stream_is_named(device_arena, device_provider,
                                                                                  inner):
    """A nested lease would get the outer lease's bytes: e.g. a wsarena call inside the caller's own lease on
    the same stream would overwrite the caller's data. It is refused, whatever names the stream."""
    device_provider.current = 3
    inner = {"object": _Stream3(), "current": None}.get(inner, inner)
    with device_arena.lease(1000, stream=3) as outer:
        outer.array[:] = 4
        before = snapshot(device_arena)
        for n in (500, 1 << 20):  # fits, or would grow: refused before anything is allocated
            with (
                pytest.raises(RuntimeError, match="already holds a lease on stream 3"),
                device_arena.lease(n, stream=inner),
            ):
                pass
        assert snapshot(device_arena) == before and len(device_provider.allocations) == 1
        assert (outer.array == 4).all()
        with device_arena.lease(0, stream=inner) as zero:  # zero bytes take nothing: they may nest
            assert zero.ptr == 0
        with device_arena.lease(500, stream=4) as other:  # another stream is fine
            assert other.ptr != outer.ptr
    with device_arena.lease(500, stream=inner) as again:  # released: the stream's bytes are free again
        assert again.ptr == outer.ptr


def test_a_wsarena_call_inside_the_users_lease_on_its_stream_raises(arena, arena_kind, key):
    """The review's case: wsarena's ops lease through run_with_fallback on the caller's stream."""
    from wsarena.algos import run_with_fallback
    from wsarena.backends import Candidate

    ran = []
    with arena.lease(4096, stream=key(5)) as mine:
        mine.array[:] = 1
        with pytest.raises(RuntimeError, match=arena_kind.nested_error(key(5))):
            run_with_fallback(arena, (Candidate("a", 1024),), lambda c, ws: ran.append(ws.ptr),
                              stream=key(5), cap=None)
        assert ran == [] and (mine.array == 1).all()
        run_with_fallback(arena, (Candidate("a", 1024),), lambda c, ws: ran.append(ws.ptr),
                          stream=key(6), cap=None)  # on another stream it runs, on other bytes
    assert len(ran) == 1 and ran[0] != mine.ptr


def test_a_thread_with_the_id_of_an_exited_holder_waits_for_the_lane(arena, key, monkeypatch):
    """A lease entered by hand in a thread that has exited since (its Workspace handed to another thread to release):
    a new thread that gets the same thread id, as ids of exited threads are reused, waits for the lane like any other
    thread. Once, it was refused with "this thread already holds a lease". Here every thread gets the same id."""
    for module in (_arena, _growth, _leases, _sub, _table, _workspace):  # wherever the arena could ask for a thread id
        monkeypatch.setattr(module, "get_ident", lambda: 12345, raising=False)
    handed = []
    producer = threading.Thread(target=lambda: handed.append(arena.lease(1024, stream=key("shared")).__enter__()))
    producer.start()
    producer.join(10)
    (ws,) = handed
    thread, outcome = _lease_in_another_thread(arena, key("shared"))
    wait_for_a_waiter(arena, key("shared"), timeout=2)  # it waits (or failed at once)
    assert outcome == []
    ws.__exit__(None, None, None)
    thread.join(10)
    assert outcome == ["leased"]


# ----------------------------------------------------------------------------------------- other threads
def test_a_lookup_of_exit_before_a_manual_enter_leaves_the_lease_held(arena, key):
    """``hasattr(ws, "__exit__")`` (inspect, a debugger) before a manual ``__enter__``: the lease is held by ``ws``,
    and other threads wait for it. Once, the throwaway bound method of that lookup held it, and the lease was ended
    as soon as it was entered: another thread got the same bytes while ``ws`` used them."""
    ws = arena.lease(1024, stream=key("shared"))
    assert hasattr(ws, "__exit__")
    ws.__enter__()
    assert arena.stats().leases == 1
    thread, outcome = _lease_in_another_thread(arena, key("shared"))
    wait_for_a_waiter(arena, key("shared"), timeout=2)
    assert outcome == []
    ws.__exit__(None, None, None)
    thread.join(10)
    assert outcome == ["leased"]


def test_another_threads_with_statement_on_the_same_workspace_leaves_the_lease_held(arena, key, monkeypatch):
    """Two with statements on one Workspace, in two threads: the one that looked ``__exit__`` up last (the loser:
    its ``__enter__`` fails, the lease being entered already) does not hold the winner's lease. Once its bound
    method did, and the lease ended with the loser's with statement."""
    real_acquire, theirs = arena._acquire, []

    def acquire(ws):
        if not theirs:  # the other thread's with statement looks __exit__ up just before this one enters
            theirs.append(_in_another_thread(lambda: ws.__exit__))
        real_acquire(ws)

    monkeypatch.setattr(arena, "_acquire", acquire)
    ws = arena.lease(1024, stream=key("shared"))
    with ws:
        with pytest.raises(RuntimeError, match="entered only once"):
            _in_another_thread(ws.__enter__)
        theirs.clear()  # the loser's with statement is over: its bound __exit__ is gone
        assert arena.stats().leases == 1
        thread, outcome = _lease_in_another_thread(arena, key("shared"))
        wait_for_a_waiter(arena, key("shared"), timeout=2)
        assert outcome == []
    thread.join(10)
    assert outcome == ["leased"]


def test_a_lease_on_a_stream_makes_other_threads_wait_until_released(arena, key):
    events = []
    entered = threading.Event()

    def other():
        entered.wait()
        with arena.lease(10, stream=key("lane")):
            events.append("other")

    t = threading.Thread(target=other)
    t.start()
    with arena.lease(10, stream=key("lane")):
        entered.set()
        time.sleep(0.1)
        events.append("main")
    t.join(5)
    assert events == ["main", "other"]


@pytest.mark.parametrize("what", ["lane", "growth"])
def test_a_thread_that_waits_long_queues_one_lock(arena_kind, key, monkeypatch, what):
    """A thread waiting for a lane (or for another thread's growth) rechecks every RECHECK_SECONDS: it queues one lock
    for the whole wait. Once, each recheck queued a fresh lock and left the timed-out one queued (20 a second)."""
    provider = GatedProvider(arena_kind.device_id)
    arena = Arena(provider)
    module = _leases if what == "lane" else _growth
    real_wait, rechecks, waited_long = module.wait, [], threading.Event()

    def wait(waiter):  # the first five waits time out at once; then a real wait
        if len(rechecks) < 5:
            rechecks.append(waiter)
            return
        waited_long.set()
        real_wait(waiter)

    monkeypatch.setattr(module, "wait", wait)
    if what == "lane":
        provider.gate.set()
        holder = arena.lease(4096, stream=key("L")).__enter__()
    else:  # a reserve that allocates until the gate opens
        grower = threading.Thread(target=arena.reserve, args=(4096,), kwargs={"stream": key("L")})
        grower.start()
        assert provider.allocating.wait(10)
    thread, outcome = _lease_in_another_thread(arena, key("L"))
    assert waited_long.wait(10)
    with arena._lock:
        queued = list(arena._subs[key("L")].lane_waiters) + list(arena._subs[key("L")].growth_waiters)
    assert len(queued) == 1 and len(set(map(id, rechecks))) == 1
    if what == "lane":
        holder.__exit__(None, None, None)
    else:
        provider.gate.set()
        grower.join(10)
    thread.join(10)
    assert outcome == ["leased"]


def test_each_thread_has_its_own_default_lane(host_arena):
    ptrs = {}
    barrier = threading.Barrier(3)

    def work(i):
        with host_arena.lease(1000) as ws:
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


def test_growth_under_a_live_lease_retires_in_stream_order(arena, provider, key):
    """reserve() (from any thread) may grow a stream's buffer while a lease uses it: the outgrown buffer is
    retired, stays valid, and is freed on its own stream when that lease ends."""
    with arena.lease(1000, stream=key("s")) as a:
        a.array[:] = 6
        t = threading.Thread(target=arena.reserve, args=(1 << 20,), kwargs={"stream": key("s")})
        t.start()
        t.join(5)
        assert arena.held_bytes(stream=key("s")) == 1 << 20
        assert (a.array == 6).all()  # still valid: the outgrown buffer is retired, not freed
        assert arena.stats().retired_bytes == arena.stats().streams[key("s")].retired_bytes == 1024
        assert provider.frees == []  # the lease still uses it
    (buffer, stream), = provider.frees
    assert buffer.size == 1024 and stream == key("s")  # freed on its own stream, after the work enqueued there
    assert arena.stats().retired_bytes == 0
    with arena.lease(1 << 20, stream=key("s")) as b:
        assert b.ptr != a.ptr
    assert len(provider.allocations) == 2


def test_a_lease_that_ends_while_another_threads_reserve_grows_its_stream_leaves_that_growth_alone(arena_kind, key):
    """Another thread's reserve() grows the stream while a lease uses it, and the lease ends while the provider
    allocates: the reserve's buffer is installed all the same, and the outgrown one, no longer leased, is freed on
    its stream. (Ending a lease ends its own growth, if one was cut short, and no other.)"""
    provider = GatedProvider(device_id=arena_kind.device_id)
    provider.gate.set()
    arena = Arena(provider)
    lease = arena.lease(1000, stream=key("s"))
    lease.__enter__()
    provider.gate.clear()
    provider.allocating.clear()
    grower = threading.Thread(target=arena.reserve, args=(1 << 20,), kwargs={"stream": key("s")})
    grower.start()
    assert provider.allocating.wait(10)
    lease.__exit__(None, None, None)
    provider.gate.set()
    grower.join(10)
    assert arena.held_bytes(stream=key("s")) == 1 << 20
    first, grown = provider.allocations
    assert provider.held == [grown] and provider.frees == [(first, key("s"))]
    with arena.lease(1 << 20, stream=key("s")) as ws:
        assert ws.ptr == grown.ptr and len(provider.allocations) == 2


def test_a_larger_lease_from_another_thread_waits_then_grows(arena, provider, key):
    """Another thread's larger lease on the stream waits for the live lease to end, then grows the buffer; the
    outgrown one, no longer leased, is freed at once on its stream."""
    order = []
    holding = threading.Event()

    def other():
        holding.wait(5)
        with arena.lease(1 << 20, stream=key(3)) as ws:
            order.append(("other", ws.ptr))

    t = threading.Thread(target=other)
    t.start()
    with arena.lease(1000, stream=key(3)) as a:
        holding.set()
        time.sleep(0.1)
        assert arena.held_bytes(stream=key(3)) == 1024 and provider.frees == []
        order.append(("main", a.ptr))
    t.join(5)
    assert [who for who, _ in order] == ["main", "other"] and order[0][1] != order[1][1]
    (buffer, stream), = provider.frees
    assert buffer.size == 1024 and stream == key(3)


@pytest.mark.parametrize("waiting", ["reserve", "lease"])
def test_a_thread_waiting_for_another_threads_growth_is_woken_by_it(arena_kind, key, monkeypatch, waiting):
    """A reserve() grows the stream's buffer while another thread's reserve() or lease of the stream waits for that
    growth: the growth's end wakes it. Its waits here last until it is woken (10 s at most), not RECHECK_SECONDS,
    whose recheck would find the growth over just as well: a wake-up lost at the growth's end is seen as a wait
    that timed out."""
    provider = GatedProvider(arena_kind.device_id)
    arena = Arena(provider)
    woken = []

    def wait(waiter):
        woken.append(waiter.acquire(True, 10))

    monkeypatch.setattr(_growth, "wait", wait)
    first = threading.Thread(target=arena.reserve, args=(1 << 20,), kwargs={"stream": key("L")})
    first.start()
    assert provider.allocating.wait(10)
    outcome = []

    def second_thread():
        if waiting == "reserve":
            arena.reserve(1 << 20, stream=key("L"))
        else:
            with arena.lease(1 << 20, stream=key("L")):
                pass
        outcome.append(waiting)

    second = threading.Thread(target=second_thread)
    second.start()
    wait_for_a_waiter(arena, key("L"))  # the second waits for the growth
    assert arena._subs[key("L")].growth_waiters
    provider.gate.set()
    first.join(10)
    second.join(20)
    assert not first.is_alive() and not second.is_alive()
    assert outcome == [waiting] and woken == [True]  # one wait, ended by the growth's end
    assert len(provider.allocations) == 1  # the second found the first's buffer large enough


# ----------------------------------------------------------------------------- a growth racing trim() and reserve()
def _after_first(monkeypatch, arena, step, action, *, with_buffer=True):
    """Make the arena run ``action`` in another thread, once, just after its method ``step`` first returns (for
    ``_end_growth``: the first call that ends a growth with a new buffer, unless ``with_buffer`` is false)."""
    real, fired, done = getattr(arena, step), [], []

    def hooked(*args):
        result = real(*args)
        if not fired and (not with_buffer or args[2] is not None):
            fired.append(True)  # before the action, which may run this step again
            done.append(_in_another_thread(action))
        return result

    monkeypatch.setattr(arena, step, hooked)
    return done


def _no_double_free(provider, arena):
    """Every buffer given back exactly once after a trim (a double free warns, from RecordingProvider's check)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        arena.trim()
    assert [str(w.message) for w in caught] == []
    assert provider.held == [] and len(provider.frees) == len(provider.allocations)


@pytest.mark.parametrize("step", ["_end_growth", "_grow"])
def test_a_trim_as_a_lease_grows_leaves_the_lease_its_bytes(arena, provider, key, monkeypatch, step):
    """A trim() from another thread just after a lease's growth installed its buffer (or just after the growth
    returned), and a reserve() of less: the lease is granted the buffer it grew, which the trim leaves alone. Once,
    the lease failed with "this arena is closed" (and its buffer was queued to be freed twice), or was granted the
    reserve's 256 bytes for its 1 MiB."""

    def trim_and_reserve():
        arena.trim()
        arena.reserve(256, stream=key("k"))

    done = _after_first(monkeypatch, arena, step, trim_and_reserve)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with arena.lease(1 << 20, stream=key("k")) as ws:
            assert done == [None]
            assert arena.held_bytes(stream=key("k")) >= ws.nbytes  # its bytes are the buffer the stream holds
            assert arena.stats().leases == 1
    assert [str(w.message) for w in caught] == []
    assert [b.size for b in provider.allocations] == [1 << 20]  # the reserve found it large enough
    _no_double_free(provider, arena)


def test_a_reserve_outgrown_by_another_threads_lease_as_it_ends_returns(arena, provider, key, monkeypatch):
    """A reserve() whose buffer another thread's larger lease outgrows just after the reserve's growth ended: the
    reserve returns. Once, it raised "this arena is closed" on an open arena and queued its buffer (already freed
    by that growth) to be freed again."""

    def lease():
        with arena.lease(1 << 20, stream=key("k")) as ws:
            return ws.nbytes

    done = _after_first(monkeypatch, arena, "_end_growth", lease)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        arena.reserve(4096, stream=key("k"))
    assert done == [1 << 20]
    assert [str(w.message) for w in caught] == []
    assert arena.held_bytes(stream=key("k")) == 1 << 20 and not arena.closed
    _no_double_free(provider, arena)
