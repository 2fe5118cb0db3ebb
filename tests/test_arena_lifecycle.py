"""Lifecycle: collected arenas, exited threads and dead streams give their memory back exactly once; exit is clean."""

import collections
import copy
import gc
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import warnings
import weakref
from pathlib import Path

import pytest

import wsarena._config
import wsarena.arena._arena as arena_module
from wsarena.arena import Arena, HostProvider, _lifecycle
from wsarena.arena._stats import aligned_size
from wsarena.arena.streams import ThreadLane
from wsarena.arena.testing import FakeStream, RecordingProvider

from .capture_helpers import S1, freed_on
from .forking import fork
from .interrupts import interrupt_at_check

ROOT = Path(__file__).resolve().parents[1]


def test_a_collected_arena_frees_every_buffer_once():
    provider = RecordingProvider()
    arena = Arena(provider)
    for lane in ("a", "b", "c"):
        with arena.lease(1000, stream=lane):
            pass
    arena.reserve(1 << 20, stream="a")  # a growth: the old "a" buffer is freed at once
    del arena
    gc.collect()
    assert provider.held == []
    assert len(provider.frees) == len(provider.allocations) == 4


def test_a_collected_device_arena_frees_with_no_stream():
    provider = RecordingProvider(device_id=0)
    arena = Arena(provider)
    with arena.lease(10, stream=FakeStream(5)):
        pass
    del arena
    gc.collect()
    assert [stream for _, stream in provider.frees] == [None]


def test_a_closed_arena_is_not_freed_twice_when_collected():
    provider = RecordingProvider()
    arena = Arena(provider)
    arena.reserve(10)
    arena.close()
    del arena
    gc.collect()
    assert len(provider.frees) == 1  # RecordingProvider raises on a second free


@pytest.fixture
def finalizer_runs(monkeypatch):
    """How many times the finalizer of a collected arena ran for each table of buffers (kept: no id is used again).
    Past 20 runs for one table it hands the table on no more: a test that would run it for ever fails, not hangs."""
    runs: collections.Counter[object] = collections.Counter()
    collected = arena_module._collected

    def counting(provider, table):
        runs[table] += 1
        if runs[table] <= 20:
            collected(provider, table)

    monkeypatch.setattr(arena_module, "_collected", counting)  # before any arena of the test is made
    return runs


class NoCurrentStream(RecordingProvider):
    """A device provider whose ``current_stream()`` raises while ``failing``."""

    failing = False

    def current_stream(self):
        if self.failing:
            raise RuntimeError("no current stream")
        return super().current_stream()


def test_a_collected_arena_whose_buffers_cannot_be_freed_now_is_kept_and_freed_later(finalizer_runs):
    """A collected arena's finalizer hands its buffers to a closed arena and closes it, which fails: the provider's
    current_stream(), asked before a free with no stream (would it break a capture?), raises. The finalizer warns once
    and the closed arena is kept: the next stats() of another arena frees the buffer. Once, the closed arena was let
    go, and its own finalizer, which hands the buffers on to another closed arena and closes that, ran at once and
    failed alike, for ever: the program hung where the arena was dropped, printing the error again and again."""
    provider = NoCurrentStream(device_id=0)
    arena = Arena(provider)
    arena.reserve(1000, stream=S1)
    ptr, table = arena._subs[S1].block.ptr, arena._table
    provider.failing = True
    with pytest.warns(RuntimeWarning, match=r"freeing what a collected arena held failed: RuntimeError\(.no current"):
        del arena  # its last reference: collected at once
    assert finalizer_runs[table] == 1 and provider.frees == []
    provider.failing = False
    Arena(provider).stats()
    assert freed_on(provider) == [(ptr, None)] and provider.held == []


def test_an_arena_collected_near_the_recursion_limit_frees_its_buffer_later(finalizer_runs, monkeypatch):
    """An arena is dropped at each depth from 40 calls below the recursion limit to the limit, one run each: its
    finalizer, which runs right there, fails with RecursionError at some depths, as it closes the arena it hands the
    buffer to. Every run ends, and the next stats() of another arena, at an ordinary depth, frees the buffer, unless
    the finalizer could not even make that arena (then nothing refers to the buffer but its owner object). Once, the
    finalizer of the arena handed the buffer ran again at once, at the same depth, and failed alike, for ever."""

    def room():  # how many more calls fit below this frame
        try:
            return 1 + room()
        except RecursionError:
            return 0

    def drop_at(depth, holder):
        if depth:
            drop_at(depth - 1, holder)
        else:
            holder.clear()  # the arena's last reference: its finalizer runs here

    # An error that the finalizer lets out, or its warning, is Python's to print, and so is a failure to print it
    # (pytest's own hook fails at that depth)
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: None)
    outcomes = collections.Counter()
    for margin in range(40, 0, -1):
        provider = RecordingProvider(device_id=0)
        holder = [Arena(provider)]
        holder[0].reserve(1000, stream=S1)
        ptr, table = holder[0]._subs[S1].block.ptr, holder[0]._table
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                drop_at(room() - margin, holder)
            except RecursionError:  # before the arena was dropped
                pass
            holder.clear()
        where = f"dropped {margin} calls below the limit"
        assert finalizer_runs[table] <= 2, where  # its own, and that of the arena it handed the buffer to
        made = any(arena._table is table for arena in _lifecycle.device_arenas(0))  # the arena handed the buffer
        Arena(provider).stats()
        if made or provider.frees:
            assert freed_on(provider) == [(ptr, None)] and provider.held == [], where
        outcomes["warned" if caught else "freed" if provider.frees else "lost"] += 1
    assert outcomes["warned"] > 0 and outcomes["freed"] > outcomes["lost"], outcomes


def test_a_collected_arena_frees_through_a_provider_that_the_collector_interrupted_in_its_own_lock():
    """The collector may run at any allocation, a provider's own too: while the test provider records a free under
    its lock, a collection finds another arena of the provider, dropped in a reference cycle, whose finalizer frees
    through the provider in the same thread. Both frees go through. Once, the provider's lock was no reentrant one:
    the thread waited for itself for good."""
    provider = RecordingProvider(device_id=0)
    arena, other = Arena(provider), Arena(provider)
    arena.reserve(1000, stream=S1)
    other.reserve(1000, stream=S1)
    other.cycle = other  # garbage that only the collector finds

    class Collecting(list):
        def append(self, item):  # a collection as the record of a free is made, under the provider's lock
            gc.collect()
            super().append(item)

    gc.disable()  # the test's own collection is the one that finds `other`
    try:
        del other
        provider.frees = Collecting()
        thread = threading.Thread(target=arena.close, daemon=True)  # a thread that waits for good stays behind
        thread.start()
        thread.join(10)
    finally:
        gc.enable()
    assert not thread.is_alive() and len(provider.frees) == 2 and provider.held == []


@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy])
def test_a_copy_is_the_arena_itself_so_no_finalizer_frees_a_copys_lease(arena_kind, copier):
    provider = RecordingProvider(device_id=arena_kind.device_id)
    arena = Arena(provider)
    copied = copier(arena)
    assert copied is arena
    with copied.lease(100, stream=arena_kind.key("x")) as ws:
        ws.array[:] = 7
        del arena  # the original's name: the copy leases on
        gc.collect()
        assert provider.frees == [] and (ws.array == 7).all()


def test_an_arena_cannot_be_pickled():
    with pytest.raises(TypeError, match="cannot be pickled: call wsarena.get_arena"):
        pickle.dumps(Arena(RecordingProvider()))


def test_a_live_lease_keeps_its_arena_alive():
    provider = RecordingProvider()
    ws = Arena(provider).lease(100, stream="x")
    with ws:
        gc.collect()
        ws.array[:] = 1
        assert provider.frees == []
    del ws
    gc.collect()
    assert provider.held == []


def _lease_in_a_thread_that_exits(arena, nbytes, **stream):
    """Lease ``nbytes`` (on ``stream=``, if given) in a thread of its own, which then exits and is collected.
    Returns the key the lease had."""
    keys = []

    def work():
        with arena.lease(nbytes, **stream) as ws:
            keys.append(ws.stream)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    del t
    gc.collect()
    return keys[0]


def test_the_lane_of_an_exited_thread_is_swept():
    provider = RecordingProvider()
    arena = Arena(provider)
    lane = _lease_in_a_thread_that_exits(arena, 5000)
    assert isinstance(lane, ThreadLane)
    assert lane not in arena.stats().streams
    assert provider.held == [] and len(provider.frees) == 1


def test_an_exited_threads_per_thread_default_stream_is_swept():
    """Handle 2 is keyed per thread; that thread's exit sweeps it at once, freeing with no stream (it is gone)."""
    provider = RecordingProvider(device_id=0)
    arena = Arena(provider)
    arena.reserve(1000, stream=2)  # this thread's: kept
    assert _lease_in_a_thread_that_exits(arena, 5000, stream=2) not in arena.stats().streams
    assert next(iter(arena.stats().streams.values())).capacity_bytes == 1024
    (buffer, stream), = provider.frees
    assert buffer.size == aligned_size(5000) and stream is None


def test_many_short_threads_leave_nothing_behind():
    provider = RecordingProvider()
    arena = Arena(provider)

    def work(n):
        with arena.lease(n):
            pass

    for i in range(20):
        t = threading.Thread(target=work, args=(100 * (i + 1),))
        t.start()
        t.join()
    gc.collect()
    arena.stats()  # sweeps anything a weakref callback had to leave for later
    assert arena.stats().streams == {}
    assert provider.held == [] and len(provider.frees) == 20


def _arena_with_a_dead_stream(handle):
    """A device arena over a RecordingProvider, holding 1 KiB for ``handle`` from a lease on a stream object of that
    handle that has died since."""
    provider = RecordingProvider(device_id=0)
    arena = Arena(provider)
    with arena.lease(1000, stream=FakeStream(handle)):
        pass
    gc.collect()
    return provider, arena


def test_a_dead_stream_objects_sub_arena_is_swept_when_a_new_stream_appears():
    provider, arena = _arena_with_a_dead_stream(11)
    assert arena.held_bytes(stream=11) == 1024  # not at once: a fresh wrapper for 11 may come next
    with arena.lease(10, stream=12):
        pass
    assert arena.held_bytes(stream=11) == 0 and 11 not in arena.stats().streams
    (buffer, stream), = provider.frees
    assert buffer.size == 1024 and stream is None  # its stream may be gone


def test_a_sweep_frees_even_when_the_lease_that_triggered_it_fails():
    provider, arena = _arena_with_a_dead_stream(11)
    provider.fail_next = 1
    with pytest.raises(MemoryError), arena.lease(10, stream=12):  # sweeps stream 11, then cannot allocate for 12
        pass
    assert provider.held == [] and len(provider.frees) == 1
    assert arena.stats().streams == {}


def test_trim_sweeps_dead_streams():
    _, arena = _arena_with_a_dead_stream(11)
    assert arena.trim() == 1024
    assert arena.stats().streams == {}


def test_fresh_wrappers_for_one_stream_do_not_reallocate(frozen_heap):  # a collection each round
    provider = RecordingProvider(device_id=0)
    arena = Arena(provider)
    for _ in range(10):
        with arena.lease(1000, stream=FakeStream(21)):  # e.g. torch.cuda.current_stream() builds a new object
            pass
        gc.collect()
    assert len(provider.allocations) == 1
    assert provider.frees == []


def test_a_stream_in_use_again_is_not_swept():
    _, arena = _arena_with_a_dead_stream(31)  # orphaned
    keep = FakeStream(31)
    with arena.lease(10, stream=keep):  # adopted again
        pass
    with arena.lease(10, stream=32):  # a new stream sweeps orphans, but 31 is alive again
        pass
    assert arena.held_bytes(stream=31) == 1024


# -------------------------------------------------------------------------------------------- at exit
def run_python(code, **env):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        check=False,  # the tests assert on the exit status, with stderr in the message
    )


HOST_EXIT = """
    import threading, time
    from wsarena.arena import get_arena

    arena = get_arena("cpu")
    ws = arena.lease(1 << 20).__enter__()          # never released
    ws.array[:] = 1
    held = threading.Event()

    def holder():
        with arena.lease(4096, stream="shared"):
            held.set()
            time.sleep(60)

    def waiter():
        held.wait()
        with arena.lease(4096, stream="shared"):  # blocks behind the holder until exit
            pass

    for target in (holder, waiter):
        threading.Thread(target=target, daemon=True).start()
    held.wait()
    print("ok", arena.stats().leases)
"""


@pytest.mark.parametrize("debug", ["0", "1"])
def test_exit_with_live_leases_is_clean(debug):
    result = run_python(HOST_EXIT, WSARENA_DEBUG=debug)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout == "ok 2\n"


def test_device_arenas_are_released_at_exit_before_later_atexit_handlers():
    code = """
        import atexit
        from wsarena.arena import Arena
        from wsarena.arena.testing import RecordingProvider

        provider = RecordingProvider(device_id=0)
        # registered first, so it runs last: after the arena's own handler
        atexit.register(lambda: print("freed", len(provider.frees), "held", len(provider.held)))
        arena = Arena(provider)
        outer = arena.lease(100, stream=3).__enter__()       # live at exit
        arena.reserve(1 << 20, stream=3)                     # grew: the leased buffer is retired, live
        other = arena.lease(10, stream=4).__enter__()        # live at exit, on another stream
        print("leases", arena.stats().leases)
    """
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.split("\n")[:2] == ["leases 2", "freed 3 held 0"]


def test_a_later_exit_handler_is_refused_by_a_wsarena_error_that_is_a_runtime_error():
    """An exit handler that runs after wsarena's (registered before the first device arena) and leases from the
    released arena, or reserves, gets ``wsarena.ReleasedAtExitError``: caught by ``WsarenaError``, as the README
    says wsarena's errors are, and by ``ArenaClosedError``, as any closed arena's lease is, and still a
    ``RuntimeError``, as it was."""
    code = """
        import atexit
        import wsarena
        from wsarena.arena import Arena
        from wsarena.arena.testing import RecordingProvider

        def late():
            for ask in (lambda: arena.lease(10, stream=5).__enter__(), lambda: arena.reserve(10, stream=6)):
                try:
                    ask()
                except wsarena.WsarenaError as exc:
                    print(type(exc).__name__, isinstance(exc, wsarena.ArenaClosedError), isinstance(exc, RuntimeError),
                          exc)

        atexit.register(late)  # registered first, so it runs after the arena's own handler
        arena = Arena(RecordingProvider(device_id=0))
        arena.reserve(100, stream=3)
    """
    result = run_python(code)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == "ReleasedAtExitError True True this arena was released at interpreter exit\n" * 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_a_child_forked_while_an_unlisted_closed_arena_is_kept_gives_none_of_its_buffers_to_the_provider(
    monkeypatch
):
    """The finalizer of a collected device arena fails before the closed arena it hands the buffer to is on the list of
    arenas that a forked child starts again: that arena is kept all the same, for the next trim, stats or growth to
    close again. A child forked then starts it again too, before it lets go of the closed arenas kept. Let go as it
    was, its finalizer gave the parent's buffer to the provider: a free through CUDA in the child, which cannot run
    it."""
    provider = RecordingProvider(device_id=0)
    arena = Arena(provider)
    arena.reserve(1000, stream=S1)
    ptr = arena._subs[S1].block.ptr
    track, failing = arena_module.track_arena, [True]

    def failing_once(arena):
        if failing.pop() if failing else False:
            raise RuntimeError("not listed")
        track(arena)

    monkeypatch.setattr(arena_module, "track_arena", failing_once)
    with pytest.warns(RuntimeWarning, match=r"collected arena held failed: RuntimeError\(.not listed"):
        del arena  # its last reference: collected at once
    assert provider.frees == []

    def in_the_child():
        gc.collect()
        return freed_on(provider)

    assert fork(in_the_child)() == []
    Arena(provider).stats()  # in this process, the next stats() frees it
    assert freed_on(provider) == [(ptr, None)] and provider.held == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_a_device_arena_in_a_forked_child_refuses_leases_with_the_error_get_arena_raises_there():
    """In a child forked after CUDA was initialised, a device arena's lease and reserve raise
    ``BackendUnavailableError``, as the README says and as ``get_arena(device)`` does there: a ``WsarenaError`` and a
    ``RuntimeError``. Once, a plain ``RuntimeError``, which a program catching wsarena's errors missed. A host arena
    serves the child."""
    from wsarena.errors import BackendUnavailableError, WsarenaError

    device, host = Arena(RecordingProvider(device_id=0)), Arena(RecordingProvider())
    device.reserve(1000, stream=S1)

    def in_the_child():
        refused = []
        for ask in (lambda: device.lease(10, stream=S1).__enter__(), lambda: device.reserve(10, stream=S1)):
            try:
                ask()
            except WsarenaError as exc:
                refused.append((type(exc) is BackendUnavailableError, isinstance(exc, RuntimeError), str(exc)[:48]))
        with host.lease(10, stream="lane"):
            pass
        return refused

    assert fork(in_the_child)() == [(True, True, "this arena's device memory belongs to the parent")] * 2
    device.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_a_forked_child_keeps_the_parents_device_buffers_and_drops_its_host_buffers():
    """A child starts its arenas again: a device arena's buffers of the parent stay referenced for good (dropped,
    their owners would free the parent's device memory through CUDA, which cannot run in the child), and a host
    arena's copies are dropped (copy-on-write pages of the child's own). (Providers that keep no record of what they
    handed out: the arena alone refers to its buffers.)"""

    class DeviceProvider(HostProvider):  # as a device's provider, over host memory
        device_id = 0

    device, host = Arena(DeviceProvider()), Arena(HostProvider())
    device.reserve(1000, stream=S1)
    host.reserve(1000, stream="lane")
    owners = [weakref.ref(arena._subs[key].block.buffer.owner) for arena, key in ((device, S1), (host, "lane"))]

    def in_the_child():
        gc.collect()
        return [owner() is not None for owner in owners], device.held_bytes(stream=S1), host.held_bytes(stream="lane")

    assert fork(in_the_child)() == ([True, False], 0, 0)
    assert [owner() is not None for owner in owners] == [True, True]  # the parent's own, untouched
    device.close()
    host.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_an_arena_the_collector_finds_in_a_forked_child_before_wsarena_starts_it_again_frees_nothing():
    """An arena in a reference cycle that the parent's collector had not reached yet is collected in a forked child by
    an at-fork hook registered before wsarena's (any hook that allocates may run the collector), so before wsarena
    starts the child's arenas again. Its finalizer runs in the child with the parent's buffers: it gives none of them
    to the provider (a device's free through CUDA, which cannot run there; a host arena's copies are dropped, as when
    the child starts an arena again), and the parent frees each once. Once, the child freed them all."""
    code = """
        import gc, os, sys
        os.register_at_fork(after_in_child=gc.collect)  # before wsarena's own hook, registered as it is imported
        from wsarena.arena import Arena
        from wsarena.arena.testing import RecordingProvider

        gc.disable()  # the parent's collector never reaches the cycles before the fork
        providers = []
        for device, stream in ((None, "a"), (0, 3)):
            provider = RecordingProvider(device_id=device)
            arena = Arena(provider)
            arena.reserve(1000, stream=stream)
            arena.cycle = arena  # only the collector frees it
            providers.append(provider)
        del arena
        sys.stdout.flush()
        if os.fork() == 0:
            gc.collect()
            print("child", [len(p.frees) for p in providers], flush=True)
            sys.exit(0)  # the exit handlers run: they free nothing of the parent's either
        _, status = os.wait()
        gc.collect()
        print("parent", [len(p.frees) for p in providers], os.waitstatus_to_exitcode(status))
    """
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.split("\n")[:2] == ["child [0, 0]", "parent [1, 1] 0"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_a_collected_arenas_finalizer_reads_the_settings_during_the_first_read_after_the_tests_forget_them(
    monkeypatch
):
    """The tests forget the settings (wsarena._config._reset(), which nothing in a program does: a lease reads them
    before an arena records a capture), and the next read reads the environment under the settings' lock. The
    collector may run at any allocation there, and finalize an arena that recorded a capture: its finalizer reads the
    debug setting, to check what it frees, so the environment again, in the same thread, and takes the lock again (a
    finalizer of a program's own that reads the settings in their first read does the same: tests/test_config.py).
    Once, that thread waited for itself for good: a test that configured something after such garbage was made hung.
    In a forked child: a child that hangs is killed."""
    from_env = wsarena._config._from_env

    def collecting():  # the collector, run at an allocation of the read
        gc.collect()
        return from_env()

    def in_the_child():
        provider = RecordingProvider(device_id=0)
        arena = Arena(provider)
        arena.reserve(1000, stream=S1)
        graph = provider.begin_capture(S1)
        with arena.lease(1000, stream=S1):  # the arena records the capture
            pass
        provider.end_capture(graph)
        arena.cycle = arena  # only the collector frees it
        del arena
        wsarena._config._reset()
        monkeypatch.setattr(wsarena._config, "_from_env", collecting)
        return wsarena.configure(cap_workspace="1MiB").cap_workspace, len(_lifecycle._closed_holding) > 0

    assert fork(in_the_child)() == (1 << 20, True)  # the graph holds the buffer: kept for it


def test_what_a_collected_device_arena_left_waiting_is_released_at_exit():
    """A device arena collected during a capture that leased from it hands its buffers to a closed arena that frees
    them once it may: one waits for the capture, one for its graph. At exit, the capture still under way, the exit
    handler frees the first as it frees every device arena's (the graph's buffer stays, for the graph). Once, the
    closed arena was no device arena the handler knew of, and left it to CUDA's teardown."""
    code = """
        import atexit, gc
        from wsarena.arena import Arena
        from wsarena.arena.testing import RecordingProvider

        provider = RecordingProvider(device_id=0)
        # registered first, so it runs last: after the arena's own handler
        atexit.register(lambda: print("freed", len(provider.frees), "held", len(provider.held)))
        arena = Arena(provider)
        arena.reserve(1000, stream=3)
        arena.reserve(1000, stream=4)
        graph = provider.begin_capture(3)
        with arena.lease(1000, stream=3):  # the capture's step: its buffer is the graph's
            pass
        del arena
        gc.collect()
        print("freed", len(provider.frees), "held", len(provider.held))
    """
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.split("\n")[:2] == ["freed 0 held 2", "freed 1 held 1"]


def test_an_arena_made_by_another_thread_while_one_prunes_the_list_of_arenas_is_tracked():
    """Every arena is on the list a forked child starts again from (and that a free with no stream asks for the
    captures of the device), which drops its dead entries as it reaches each power of two. Another thread makes an
    arena at each place a thread switch may come while one thread's new arena prunes the list, one run each: both are
    listed. Once, the pruning thread rebound the list to its pruned copy, and an arena listed meanwhile on the old one
    was lost: a forked child did not start it again (it kept leases and locks of threads gone), and the arenas of its
    device did not see its captures."""
    provider = RecordingProvider(device_id=0)
    n = 1
    while True:
        filler = []
        while not (len(_lifecycle._arenas) >= 64 and len(_lifecycle._arenas) & (len(_lifecycle._arenas) - 1) == 0):
            filler.append(Arena(provider))  # the next arena made prunes the list
        made = []

        def make(made=made):
            made.append(Arena(provider))

        def another_thread():
            thread = threading.Thread(target=make)
            thread.start()
            thread.join(10)

        fired = interrupt_at_check(
            n, make, skip=lambda code: code.co_name not in ("track_arena", "<listcomp>"), instead=another_thread
        )
        assert all(arena in _lifecycle.device_arenas(0) for arena in made + filler), f"switched at check {n}"
        if not fired:
            break
        n += 1
    assert n > 3  # it reached the pruning, not only the call


def test_an_arena_made_while_the_collector_frees_another_prunes_the_list_of_arenas():
    """The list of every arena drops its dead entries as it reaches each power of two. The collector may run at any
    allocation there, and finalize an arena in a reference cycle that held a buffer: the closed arena that frees what
    it held is listed, and the list grows. Here the collector runs at each allocation, and each collection leaves such
    an arena for the next. Once, the list's entries were copied as pairs, which the collector counts: a collection
    during the copy made the new arena (get_arena(), Arena()) raise "dictionary changed size during iteration"."""
    code = """
        import gc
        from wsarena.arena import Arena, HostProvider, _lifecycle

        def garbage():  # its finalizer hands the buffer to a closed arena, which is listed
            arena = Arena(HostProvider())
            arena.reserve(10, stream="lane")
            arena.cycle = arena

        made = []

        def between(phase, info):  # each collection leaves such an arena for the next one
            if phase == "stop" and len(made) < 100:
                made.append(None)
                garbage()

        target = 64
        while target <= len(_lifecycle._arenas):
            target *= 2
        live = [Arena(HostProvider()) for _ in range(target - len(_lifecycle._arenas))]
        gc.collect()
        assert len(_lifecycle._arenas) == target
        gc.callbacks.append(between)
        gc.set_threshold(1)
        _lifecycle.track_arena(live[0])  # as the next arena made is listed: the list is pruned
        gc.set_threshold(700)
        gc.callbacks.remove(between)
        gc.collect()
        print(len(made) > 1, all(any(ref() is arena for ref in _lifecycle._arenas.values()) for arena in live))
    """
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout == "True True\n"


@pytest.mark.gpu
def test_gpu_exit_with_a_live_lease_is_clean():
    code = """
        import cupy
        from wsarena.arena import get_arena

        arena = get_arena(0)
        s = cupy.cuda.Stream(non_blocking=True)
        ws = arena.lease(64 << 20, stream=s).__enter__()
        ws.array.fill(1)
        other = arena.lease(1 << 20).__enter__()
        print("ok", arena.stats().leases)
    """
    result = run_python(code, WSARENA_DEBUG="1")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout == "ok 2\n"
