"""What a convolution captured into a CUDA graph allocates besides its workspace (the copies of operands that are not
C-contiguous, a result made without out=) stays allocated as long as the graph, as its workspace does: CuPy's
MemoryPool hands a block freed when the call returns (or when its caller drops the result) to the next allocation on
that stream, which every replay would then overwrite, or read from. Without a GPU: the CPU backend over a provider
whose capture status the test sets (wsarena.arena.testing), as tests/test_capture.py does."""

from __future__ import annotations

import gc
import itertools
import os
import re
import types
import weakref

import numpy as np
import pytest

import wsarena
from tests.reference import ref_conv_forward
from wsarena import ops
from wsarena._sizes import short_repr
from wsarena.arena import Arena, _lifecycle, _pins, set_arena
from wsarena.arena._pins import GraphPin
from wsarena.arena.testing import RecordingProvider
from wsarena.backends._cpu_backend import CpuBackend

from .forking import fork
from .interrupts import from_a_frame_of, interrupt_at_check, within_a_frame_of

TOL = {"rtol": 1e-4, "atol": 1e-4}  # float32 against the float64 reference


@pytest.fixture
def provider():
    """The CPU backend's arena over a RecordingProvider, whose lanes the test captures."""
    provider = RecordingProvider()
    previous = set_arena("cpu", Arena(provider))
    yield provider
    set_arena("cpu", previous)


@pytest.fixture
def freed(monkeypatch):
    """What the ops make, logged as each is freed: "copy" (an operand's C-contiguous copy) or "result"."""
    log = []
    copy_of, new_output = ops._copy, ops._new_output

    def copy(array):
        made = copy_of(array)
        weakref.finalize(made, log.append, "copy")
        return made

    def output(record, empty):
        made = new_output(record, empty)
        weakref.finalize(made, log.append, "result")
        return made

    monkeypatch.setattr(ops, "_copy", copy)
    monkeypatch.setattr(ops, "_new_output", output)
    return log


def strided_operands():
    """x, a view of every other pixel, and w in Fortran order: each copied for a call."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 16, 16)).astype(np.float32)[:, :, ::2, ::2]
    w = np.asfortranarray(rng.standard_normal((4, 3, 3, 3)).astype(np.float32))
    return x, w


def reference(x, w):
    return ref_conv_forward(x.astype(np.float64), w.astype(np.float64), padding=1)


@pytest.mark.parametrize("release", ["trim", "stats"])
@pytest.mark.parametrize("given_out", [False, True], ids=["new", "out"])
def test_what_a_captured_call_allocated_lives_until_its_graph_is_gone(provider, freed, given_out, release):
    """The copies of the operands, and the result made without out= (dropped by its caller, as an intermediate of a
    captured step is), stay until the graph is gone, and go with the arena's next trim or stats after that, as the
    workspace the graph pinned does. An eager call's go as it returns. Once, a captured call's copies went as it
    returned, and its result when dropped, while the graph's kernels kept writing and reading them."""
    x, w = strided_operands()
    wsarena.conv_forward(x, w, padding=1, stream="lane")  # eager: chooses and sizes the lane's buffer
    gc.collect()
    assert freed == ["copy", "copy", "result"]
    freed.clear()
    arena = wsarena.get_arena("cpu")
    out = np.empty(reference(x, w).shape, np.float32) if given_out else None
    graph = provider.begin_capture("lane")
    y = wsarena.conv_forward(x, w, padding=1, stream="lane", out=out)
    provider.end_capture(graph)
    np.testing.assert_allclose(y, reference(x, w), **TOL)
    del y
    gc.collect()
    arena.trim()
    arena.stats()
    assert freed == []  # every replay writes and reads them
    graph.close()
    gc.collect()
    assert freed == []  # until the arena looks
    getattr(arena, release)()
    gc.collect()
    assert sorted(freed) == ["copy", "copy"] + ([] if given_out else ["result"])


def test_what_graphs_gone_kept_is_let_go_once_no_capture_is_under_way(provider, freed, monkeypatch):
    """What graphs gone kept, where dropping it may free device memory at once (cudaFree, with an allocator that keeps
    no pool: the backend says so here of its host arrays), goes with the first trim, stats or growth once no capture
    is under way: not with the keep, trim, stats or growth of one under way (on the lane that stands for a device's
    stream here), which a cudaFree would break. Once, the first keep of a capture let go of what graphs gone since
    had kept, and so did a trim, stats or growth during a capture."""
    monkeypatch.setattr(CpuBackend, "frees_when_dropped", lambda self, array: True)
    x, w = strided_operands()
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    arena = wsarena.get_arena("cpu")
    for _ in range(2):
        graph = provider.begin_capture("lane")
        wsarena.conv_forward(x, w, padding=1, stream="lane")
        provider.end_capture(graph)
        graph.close()  # no trim, stats or growth since
    gc.collect()
    freed.clear()
    one = made_bytes(x, w, False)
    last = provider.begin_capture("lane")
    wsarena.conv_forward(x, w, padding=1, stream="lane")  # its keep
    arena.trim()
    assert arena.stats().kept_bytes == 3 * one
    wsarena.conv_forward(x, w[:, :, :1, :1], stream="another lane")  # an eager call, which grows its lane's buffer
    gc.collect()
    assert sorted(freed) == ["copy", "copy", "result"]  # the eager call's own
    freed.clear()
    provider.end_capture(last)
    assert arena.stats().kept_bytes == one
    gc.collect()
    assert sorted(freed) == ["copy"] * 4 + ["result"] * 2  # the two closed graphs' calls'
    last.close()
    assert arena.stats().kept_bytes == 0


def test_what_graphs_gone_kept_that_frees_device_memory_goes_with_the_next_eager_call(provider, freed, monkeypatch):
    """A program that captures again and again with no pool (cupy.cuda.set_allocator(None): dropping an array frees
    its device memory, cudaFree, as the backend says here of its host arrays), with CuPy's stream.begin_capture, no
    capture block and no trim, stats or growth, but eager calls between captures: each eager call looks at one pin of
    those that keep so, in turn, and lets go of what graphs gone since kept where that one was posted, once no capture
    is under way; within as many eager calls as there are graphs keeping (each call looks here, not one in
    _pins.LOOK_EVERY). An eager call during a capture lets go of nothing. Once, it was kept until a trim, stats or
    growth: every captured call's copies and result, for good."""
    monkeypatch.setattr(CpuBackend, "frees_when_dropped", lambda self, array: True)
    monkeypatch.setattr(_pins, "_looks", itertools.repeat(True))
    x, w = strided_operands()
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    arena = wsarena.get_arena("cpu")
    one = made_bytes(x, w, False)
    arena.reserve(1000, stream="another lane")
    alive = provider.begin_capture("lane")  # a graph that lives on, keeping its call's
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    provider.end_capture(alive)
    gc.collect()
    freed.clear()
    for n in range(4):
        graph = provider.begin_capture("lane")
        wsarena.conv_forward(x, w, padding=1, stream="lane")
        provider.end_capture(graph)
        graph.close()
        during = provider.begin_capture("another lane")  # another capture under way, that leased: nothing goes
        with arena.lease(100, stream="another lane"):
            pass
        for _ in range(3):
            wsarena.conv_forward(x, w, padding=1, stream="lane")
        provider.end_capture(during)
        gc.collect()
        assert freed.count("copy") == 6 and arena._table.kept_arrays.nbytes == 2 * one, n  # the eager calls' own
        freed.clear()
        for _ in range(2):  # two graphs keep: the one gone is looked at within two calls
            wsarena.conv_forward(x, w, padding=1, stream="lane")
        gc.collect()
        assert sorted(freed) == ["copy"] * 6 + ["result"] * 3, n  # the two calls' own, and the graph gone's
        assert arena._table.kept_arrays.nbytes == one, n
        freed.clear()
        during.close()
    alive.close()
    assert arena.stats().kept_bytes == 0


def test_one_eager_lease_in_look_every_looks_at_a_graph_that_keeps_what_may_free_device_memory(provider, monkeypatch):
    """While a graph alive keeps what may free device memory as it goes, an eager lease in _pins.LOOK_EVERY asks
    whether it was destroyed (sem_getvalue, a third of a bare lease), not every lease; the let-go waits that many more
    calls at most."""
    monkeypatch.setattr(CpuBackend, "frees_when_dropped", lambda self, array: True)
    x, w = strided_operands()
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    arena = wsarena.get_arena("cpu")
    graph = provider.begin_capture("lane")
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    provider.end_capture(graph)
    asked = []
    live = GraphPin.live
    monkeypatch.setattr(GraphPin, "live", lambda pin: asked.append(pin) or live(pin))
    for _ in range(10 * _pins.LOOK_EVERY):
        with arena.lease(100, stream="lane"):
            pass
    assert len(asked) == 10 and _pins.LOOK_EVERY > 1
    graph.close()
    gc.collect()
    for _ in range(_pins.LOOK_EVERY):
        with arena.lease(100, stream="lane"):
            pass
    assert arena._table.kept_arrays.nbytes == 0  # let go within LOOK_EVERY calls of one graph keeping
    assert arena.stats().kept_bytes == 0


def test_what_graphs_gone_kept_that_frees_nothing_goes_with_the_next_capture_that_keeps(provider, freed):
    """A program that captures again and again (with CuPy's stream.begin_capture, or torch.cuda.graph: no capture
    block, and no trim, stats or growth between captures) holds what the graphs alive keep, not what every graph ever
    kept, where dropping it frees no device memory at once (host memory here, a block of CuPy's MemoryPool on a GPU):
    the first keep of each capture lets go of what graphs gone since kept, during that capture. Once, it waited for a
    trim, stats or growth with no capture under way: every captured call's copies and result, for good."""
    x, w = strided_operands()
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    arena = wsarena.get_arena("cpu")
    one = made_bytes(x, w, False)
    gc.collect()
    freed.clear()
    for n in range(4):
        graph = provider.begin_capture("lane")
        wsarena.conv_forward(x, w, padding=1, stream="lane")
        gc.collect()
        assert sorted(freed) == (["copy", "copy", "result"] if n else []), n  # the graph gone before it's
        assert arena._table.kept_arrays.nbytes == one, n
        freed.clear()
        provider.end_capture(graph)
        graph.close()  # no trim, stats or growth since
    assert arena.stats().kept_bytes == 0


@pytest.mark.usefixtures("frozen_heap")  # a run each: the garbage of the last collected before the next
@pytest.mark.parametrize("gone_kept", ["a program's array", "a captured call's"])
def test_an_interrupt_at_any_check_of_a_captured_calls_keep_keeps_what_the_call_made(provider, freed, gone_kept):
    """A captured call keeps its operands' copies and its result while the graph exists, a graph destroyed before it
    waiting to have what it kept let go (a program's array, which may free device memory as it goes), or let go by
    the call's keep (a captured call's copies and result, host memory here). Ctrl-C at every check from the first
    instruction of the call's keep (ops._keep_with_capture, which the call runs to completion) to the call's return,
    one run each: the copies and the result live until the graph is destroyed, counted once, and what the graph gone
    kept is let go once, by the keep or by the next stats(). Once, the pin's first keep let go of what graphs gone
    since had kept first, and an interrupt there lost the call's copies and result, which the graph's kernels write
    and read at every replay."""
    x, w = strided_operands()
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    arena = wsarena.get_arena("cpu")
    gone_made = [] if gone_kept == "a program's array" else ["copy", "copy", "result"]
    n = 1
    while True:
        gone = provider.begin_capture("lane")
        if gone_made:
            wsarena.conv_forward(x, w, padding=1, stream="lane")
        else:
            arena.keep_with_capture([np.empty(100, np.uint8)], stream="lane")
        provider.end_capture(gone)
        gone.close()
        graph = provider.begin_capture("lane")
        gc.collect()
        freed.clear()
        after = from_a_frame_of(ops._keep_with_capture)
        fired = interrupt_at_check(n, lambda: wsarena.conv_forward(x, w, padding=1, stream="lane"), after=after)
        gc.collect()
        where = f"interrupted at check {n}"
        assert freed in ([], gone_made), where  # the graph gone's, if the keep let go of them
        provider.end_capture(graph)
        assert arena.stats().kept_bytes == made_bytes(x, w, False), where
        gc.collect()
        assert sorted(freed) == gone_made, where
        freed.clear()
        graph.close()
        arena.stats()
        gc.collect()
        assert sorted(freed) == ["copy", "copy", "result"], where
        if not fired:
            break
        n += 1
    assert n > 30  # it reached the count, not only the keep's first step


@pytest.mark.usefixtures("frozen_heap")  # a run each: the garbage of the last collected before the next
def test_an_interrupt_as_a_captured_call_copies_its_operands_loses_no_copy(provider, freed):
    """Ctrl-C at every check of a captured call's copying of its operands (ops._made_contiguous and what it calls),
    one run each: each copy made, whose kernel the graph holds, lives until the graph is destroyed. Once, a Ctrl-C as
    a copy returned, before it was stored where the call keeps what it made, lost it: freed as the call unwound while
    every replay writes it."""
    x, w = strided_operands()
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    arena = wsarena.get_arena("cpu")
    n = 1
    while True:
        graph = provider.begin_capture("lane")
        gc.collect()
        freed.clear()
        call = lambda: wsarena.conv_forward(x, w, padding=1, stream="lane")
        fired = interrupt_at_check(n, call, after=within_a_frame_of(ops._made_contiguous))
        provider.end_capture(graph)
        gc.collect()
        where = f"interrupted at check {n}"
        assert "copy" not in freed, where  # the result goes where no kernel of the call was captured
        made = 2 if not fired else len(arena._table.kept_arrays.owners)
        graph.close()
        arena.stats()
        gc.collect()
        assert freed.count("copy") == made, where
        if not fired:
            break
        n += 1
    assert n > 3  # it reached the copies


def made_bytes(x, w, given_out):
    """The bytes a call on ``x`` and ``w`` (strided_operands()) allocates: a copy of each, and the result unless
    given."""
    return x.size * x.itemsize + w.nbytes + (0 if given_out else reference(x, w).size * np.dtype(np.float32).itemsize)


@pytest.mark.parametrize("given_out", [False, True], ids=["new", "out"])
def test_stats_count_what_captured_calls_keep_while_their_graphs_exist(provider, freed, given_out):
    """arena.stats().kept_bytes: what the calls of graphs that exist allocated, each capture's (a step captured twice
    keeps its allocations twice), apart from the workspace (pinned_bytes); 0 once the graphs are destroyed, and what
    they kept let go. Once, stats() said nothing of it."""
    x, w = strided_operands()
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    arena = wsarena.get_arena("cpu")
    assert arena.stats().kept_bytes == 0  # an eager call keeps nothing
    gc.collect()
    freed.clear()
    one = made_bytes(x, w, given_out)
    out = np.empty(reference(x, w).shape, np.float32) if given_out else None
    graphs = []
    for n in (1, 2):
        graph = provider.begin_capture("lane")
        wsarena.conv_forward(x, w, padding=1, stream="lane", out=out)
        provider.end_capture(graph)
        graphs.append(graph)
        stats = arena.stats()
        assert stats.kept_bytes == n * one and stats.to_dict()["kept_bytes"] == n * one
        assert stats.pinned_bytes == stats.streams["lane"].capacity_bytes > 0  # the workspace alone
    graphs[0].close()
    assert arena.stats().kept_bytes == one
    arena.trim()
    assert arena.stats().kept_bytes == one
    graphs[1].close()
    assert arena.stats().kept_bytes == 0
    gc.collect()
    assert len(freed) == 2 * (2 if given_out else 3)


def test_kept_bytes_count_each_memory_kept_once(provider):
    """Views of one array, kept by one graph or several, count as the array that owns their memory, once: kept, a
    view keeps all of it. An object with no nbytes counts nothing."""
    arena = wsarena.get_arena("cpu")
    base = np.empty((4, 256), np.float32)
    other = np.empty(100, np.uint8)
    first = provider.begin_capture("lane")
    arena.keep_with_capture([base, base[1:], base.T, base[::2][1:], other[:10], object()], stream="lane")
    provider.end_capture(first)
    second = provider.begin_capture("lane")
    arena.keep_with_capture([base[0]], stream="lane")
    provider.end_capture(second)
    assert arena.stats().kept_bytes == 4 * 256 * 4 + 100
    first.close()
    assert arena.stats().kept_bytes == 4 * 256 * 4
    second.close()
    assert arena.stats().kept_bytes == 0


def test_kept_bytes_taken_off_twice_for_a_pin_still_count_what_another_pin_keeps():
    """uncount() is idempotent, as let_go_kept() run again after an interrupt, or by two callers at once, needs: a
    pin's second uncount takes nothing off the memory another pin still keeps."""
    tally = _pins.KeptBytes()
    shared, own = np.empty(1000, np.uint8), np.empty(24, np.uint8)
    first, second = GraphPin(tally), GraphPin(tally)
    tally.count(first, [shared, own])
    tally.count(first, [shared[1:]])  # counted once, as kept again after an interrupt
    tally.count(second, [shared[10:]])
    assert tally.nbytes == 1024
    tally.uncount(first)
    tally.uncount(first)
    assert tally.nbytes == 1000 and [entry[2] is shared for entry in tally.owners.values()] == [True]
    tally.uncount(second)
    assert tally.nbytes == 0 and tally.owners == {}


def test_what_no_pin_counts_any_more_is_dropped_after_the_tally_lets_go_of_its_lock():
    """An owner the tally held the last reference to is dropped once uncount() has let go of the lock: its free may
    run any code (an array's, CUDA's cudaFree), which must not run under wsarena's lock."""
    tally = _pins.KeptBytes()
    pin = GraphPin(tally)
    under_lock = []

    class Owner:
        nbytes = 8

        def __del__(self):
            under_lock.append(tally.lock._is_owned())

    tally.count(pin, [Owner(), Owner(), Owner()])
    assert tally.nbytes == 24 and under_lock == []
    tally.uncount(pin)
    assert tally.nbytes == 0 and under_lock == [False, False, False]


def test_a_pin_says_released_once_it_was_seen_posted():
    """GraphPin.released, and its repr, say whether live() saw CUDA run the destructor: not when it is made, nor once
    its address is read (given to a graph), nor once it is posted and live() has not looked yet."""
    pin = GraphPin()
    assert pin.released is False and repr(pin) == "GraphPin(live)"
    assert pin.address and pin.live() and pin.released is False and repr(pin) == "GraphPin(live)"
    pin.never_held()  # posts it, as CUDA does when it destroys the graph
    assert pin.released is False
    assert not pin.live() and pin.released is True and repr(pin) == "GraphPin(released)"


@pytest.mark.parametrize("ends", ["closed", "collected"])
def test_a_closed_or_collected_arena_counts_what_its_graphs_keep(provider, freed, ends):
    """A closed arena's stats, and those of the heir of a collected one (the closed arena that frees what it held),
    count what its pins keep while their graphs exist, and nothing once they are gone; the arena made in its place
    counts none of it."""
    x, w = strided_operands()
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    gc.collect()
    freed.clear()
    graph = provider.begin_capture("lane")
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    provider.end_capture(graph)
    arena = wsarena.get_arena("cpu")
    set_arena("cpu", Arena(RecordingProvider()))
    if ends == "closed":
        arena.close()
    else:
        del arena
        gc.collect()
        (arena,) = [a for a in _lifecycle._closed_holding.values() if a.provider is provider]
    assert arena.closed and arena.stats().kept_bytes == made_bytes(x, w, False)
    assert wsarena.get_arena("cpu").stats().kept_bytes == 0
    graph.close()
    assert arena.stats().kept_bytes == 0
    gc.collect()
    assert sorted(freed) == ["copy", "copy", "result"]


def test_a_first_call_during_capture_makes_no_copy_before_it_raises(provider, freed, monkeypatch):
    """A call whose algorithm cannot be chosen during a capture raises CaptureError before anything is enqueued: no
    copy of its operands either, whose copying kernel the graph would run. Once, the copies came first."""
    copies = []
    copy_of = ops._copy

    def counted(array):
        made = copy_of(array)
        copies.append(made.shape)
        return made

    monkeypatch.setattr(ops, "_copy", counted)
    x, w = strided_operands()
    graph = provider.begin_capture("lane")
    with pytest.raises(wsarena.CaptureError, match="run the step once before capturing"):
        wsarena.conv_forward(x, w, padding=1, stream="lane")
    provider.end_capture(graph)
    gc.collect()
    assert copies == [] and freed == ["result"]  # allocated, never written
    graph.close()
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    assert copies == [x.shape, w.shape]


def test_copies_a_call_made_before_its_capture_refused_it_live_until_the_graph_is_gone(provider, freed):
    """A call whose lease the capture refuses (its forced algorithm needs the arena to grow) has enqueued the copies of
    its operands: they stay with the graph as a call's that ran do. Its result, never written, goes."""
    x, w = strided_operands()
    wsarena.conv_forward(x, w, padding=1, stream="lane", algo="implicit_gemm")  # the lane holds no workspace
    gc.collect()
    freed.clear()
    graph = provider.begin_capture("lane")
    with pytest.raises(wsarena.CaptureError, match="needs the arena to grow"):
        wsarena.conv_forward(x, w, padding=1, stream="lane", algo="gemm_batch")
    provider.end_capture(graph)
    gc.collect()
    assert freed == ["result"]
    graph.close()
    wsarena.get_arena("cpu").trim()
    gc.collect()
    assert sorted(freed) == ["copy", "copy", "result"]


def test_a_captured_zero_batch_gradient_of_the_filters_keeps_its_result(provider, freed):
    """A batch of no images writes dw's zeros, with no workspace: the result, made without out=, stays with the graph
    too."""
    x = np.empty((0, 3, 8, 8), np.float32)
    dy = np.empty((0, 4, 8, 8), np.float32)
    graph = provider.begin_capture("lane")
    dw = wsarena.conv_backward_filter(x, dy, (4, 3, 3, 3), padding=1, stream="lane")
    provider.end_capture(graph)
    assert not dw.any()
    del dw
    gc.collect()
    assert freed == []
    graph.close()
    wsarena.get_arena("cpu").stats()
    gc.collect()
    assert freed == ["result"]


def test_memory_the_graph_allocated_itself_is_not_kept(provider, freed, monkeypatch):
    """Arrays the backend says the graph allocated (CuPy's MemoryAsyncPool, whose allocation during a capture is a node
    of the graph, and its free too) go as they would without a capture: kept past it, the graph would hold an
    allocation it never frees, which CUDA refuses to launch again until it is freed."""
    monkeypatch.setattr(CpuBackend, "graph_allocated", lambda self, array: True)
    x, w = strided_operands()
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    gc.collect()
    freed.clear()
    graph = provider.begin_capture("lane")
    y = wsarena.conv_forward(x, w, padding=1, stream="lane")
    provider.end_capture(graph)
    np.testing.assert_allclose(y, reference(x, w), **TOL)
    del y
    gc.collect()
    assert sorted(freed) == ["copy", "copy", "result"]
    graph.close()


def test_the_cudnn_backend_says_which_arrays_a_graph_allocated():
    """CuPy's MemoryAsyncPool's arrays (MemoryAsync, a view's too) are the graph's own when made during a capture;
    those of CuPy's MemoryPool (PooledMemory) and of plain cudaMalloc (Memory) are not. No GPU needed: the memory
    objects are made empty."""
    from cupy.cuda import memory

    from wsarena.backends._cudnn_backend import CudnnBackend

    backend = CudnnBackend()

    def array(kind):
        return types.SimpleNamespace(data=memory.MemoryPointer(kind.__new__(kind), 0))

    assert backend.graph_allocated(array(memory.MemoryAsync))
    assert not backend.graph_allocated(array(memory.PooledMemory))
    assert not backend.graph_allocated(array(memory.Memory))


def test_the_cudnn_backend_says_which_arrays_free_device_memory_as_they_are_dropped():
    """A block of CuPy's MemoryPool (PooledMemory, a view's too) goes back to the pool as it is dropped, which a
    capture under way allows; plain cudaMalloc's memory (Memory, set_allocator(None)) is freed at once (cudaFree,
    which a capture forbids), and so may any other (MemoryAsync, UnownedMemory: another library's allocator). No GPU
    needed: the memory objects are made empty."""
    from cupy.cuda import memory

    from wsarena.backends._cudnn_backend import CudnnBackend

    backend = CudnnBackend()

    def array(kind):
        return types.SimpleNamespace(data=memory.MemoryPointer(kind.__new__(kind), 0))

    assert not backend.frees_when_dropped(array(memory.PooledMemory))
    assert backend.frees_when_dropped(array(memory.Memory))
    assert backend.frees_when_dropped(array(memory.MemoryAsync))
    assert backend.frees_when_dropped(array(memory.UnownedMemory))


def test_an_arena_keeps_arrays_for_the_graph_being_captured_on_a_stream(provider):
    """keep_with_capture keeps a program's own arrays while the graph being captured on the stream exists, and says
    whether it is being captured; a stream not captured, or whose capture an earlier error invalidated (it becomes no
    graph), keeps nothing. The answer is a bool, as annotated."""
    arena = wsarena.get_arena("cpu")
    arrays = [np.empty(8) for _ in range(3)]
    gone = [weakref.ref(array) for array in arrays]
    graph = provider.begin_capture("lane")
    assert arena.keep_with_capture(arrays[:1], stream="lane") is True
    assert arena.keep_with_capture(arrays[1:2], stream="other lane") is False

    def invalidated(stream):
        raise wsarena.CaptureError(f"the capture on {stream!r} was invalidated")

    refusing = RecordingProvider()
    refusing.capture = invalidated
    assert Arena(refusing).keep_with_capture(arrays[2:], stream="lane") is False
    provider.end_capture(graph)
    del arrays
    gc.collect()
    assert [ref() is None for ref in gone] == [False, True, True]
    graph.close()
    arena.stats()
    gc.collect()
    assert gone[0]() is None


def test_keep_with_capture_refuses_one_array_or_no_collection_before_it_keeps_anything(provider):
    """One array, or an object that is no collection, is a TypeError before a pin is made for the capture: one array
    iterated would be kept as its rows, a view each."""
    arena = wsarena.get_arena("cpu")
    graph = provider.begin_capture("lane")
    with pytest.raises(TypeError, match=r"a collection of arrays, not one: \[array\("):
        arena.keep_with_capture(np.empty((4, 8)), stream="lane")
    with pytest.raises(TypeError, match=r"^keep_with_capture\(\)'s objects must be a collection of arrays, not 7$"):
        arena.keep_with_capture(7, stream="lane")  # type: ignore[arg-type]
    assert arena.stats().pinned_bytes == 0 and not arena._table.captures  # no pin was made for the capture
    provider.end_capture(graph)
    graph.close()


@pytest.mark.parametrize("objects", ["lane", b"ab", bytearray(b"ab")], ids=["str", "bytes", "bytearray"])
def test_keep_with_capture_refuses_text_or_binary_data_as_its_objects(provider, objects):
    """Text or binary data is no collection of arrays: "lane" (a stream given in place of the arrays) was kept as its
    characters on the stream captured, and said nothing on another (the calling thread's default), where the
    program's arrays, not given, were not kept either."""
    arena = wsarena.get_arena("cpu")
    graph = provider.begin_capture("lane")
    says = (rf"^keep_with_capture\(\)'s objects must be a collection of arrays, not {re.escape(short_repr(objects))} "
            r"\(a stream, or a CPU lane, goes as stream=\)$")
    for stream in ("lane", None):
        with pytest.raises(TypeError, match=says):
            arena.keep_with_capture(objects, stream=stream)  # type: ignore[arg-type]
    assert arena.stats().pinned_bytes == 0 and not arena._table.captures  # no pin was made for the capture
    provider.end_capture(graph)
    graph.close()
    with pytest.raises(TypeError, match=says):  # outside a capture too, as any other object of the wrong type
        arena.keep_with_capture(objects)  # type: ignore[arg-type]


def test_keep_with_capture_names_objects_of_the_wrong_type_outside_a_capture_too():
    """Python's own "'int' object is not iterable" named no argument."""
    with pytest.raises(TypeError, match=r"^keep_with_capture\(\)'s objects must be a collection of arrays, not 3$"):
        wsarena.get_arena("cpu").keep_with_capture(3)  # type: ignore[arg-type]


def test_a_pin_keeps_objects_until_cuda_posts_it(monkeypatch):
    """GraphPin.keep holds objects while the pin is live; let_go_kept drops them once CUDA ran its destructor, and
    only where it is told that no capture is under way."""
    monkeypatch.setattr(_pins, "_keeping", {})
    pin = GraphPin()
    kept = np.empty(4)
    gone = weakref.ref(kept)
    pin.keep([kept])
    del kept
    _pins.let_go_kept(lambda: True)
    gc.collect()
    assert gone() is not None
    pin.never_held()  # posts it, as CUDA does when it destroys the graph
    asked = []
    _pins.let_go_kept(lambda: asked.append(True) or False)  # a capture is under way
    gc.collect()
    assert asked and gone() is not None
    _pins.let_go_kept(lambda: True)
    gc.collect()
    assert gone() is None and _pins._keeping == {}


class _Unreadable:
    """An array-like object of a program's whose ``base`` or ``nbytes`` property raises (``nbytes`` is read as an
    integer through ``__index__``, which may raise too)."""

    def __init__(self, nbytes, base=None, fails=()):
        self._nbytes, self._base, self.fails = nbytes, base, fails

    @property
    def base(self):
        if "base" in self.fails:
            raise RuntimeError("base: not today")
        return self._base

    @property
    def nbytes(self):
        if "nbytes" in self.fails:
            raise ValueError("nbytes: not today")
        return self._nbytes


class _BadIndex:
    def __index__(self):
        raise OverflowError("no index")


def test_stats_count_kept_objects_whose_size_cannot_be_read_and_never_raise(provider):
    """stats() never raises for what a program kept: an object whose base cannot be read counts as its own owner
    (its nbytes), one whose nbytes cannot be read (the property raises, or its value's __index__ does) counts 0, and
    a view whose base's nbytes cannot be read counts as its own. Each is kept all the same. Once, stats() read them
    and raised the property's error."""
    arena = wsarena.get_arena("cpu")
    objects = [
        _Unreadable(100, fails=("base",)),
        _Unreadable(200, fails=("nbytes",)),
        _Unreadable(8, base=_Unreadable(1000, fails=("nbytes",))),
        _Unreadable(_BadIndex()),
        _Unreadable(16, base=np.empty(1 << 12, np.uint8)),  # an array's view: the array counts
    ]
    refs = [weakref.ref(obj) for obj in objects]
    graph = provider.begin_capture("lane")
    assert arena.keep_with_capture(objects, stream="lane")
    provider.end_capture(graph)
    del objects
    gc.collect()
    assert arena.stats().kept_bytes == 100 + 0 + 8 + 0 + (1 << 12)
    assert all(ref() is not None for ref in refs)
    graph.close()
    assert arena.stats().kept_bytes == 0
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_stats_read_no_kept_array_and_count_each_memory_once(provider):
    """kept_bytes is counted as each array is kept, by its owner's nbytes, and taken off as the graphs' pins let go
    of them: stats() reads no kept array (once, every stats() read every array kept: 30,000 of them over 100 graphs
    took 11 ms a call, and each wsarena.capture() calls it). A memory that graphs alive keep, through views in each,
    counts once until the last of them is gone."""
    reads = []

    class Counted:
        base = None

        @property
        def nbytes(self):
            reads.append(self)
            return 64

    arena = wsarena.get_arena("cpu")
    base = np.empty(1000, np.uint8)
    graphs = []
    for views in ([base[1:], base[:10]], [base[5:]], [base[::2]]):
        graph = provider.begin_capture("lane")
        assert arena.keep_with_capture([*views, Counted()], stream="lane")
        provider.end_capture(graph)
        graphs.append(graph)
    del base, views
    read = len(reads)
    for graph, left in zip(graphs, (2, 1, 0)):
        assert arena.stats().kept_bytes == 1000 + 64 * (left + 1)
        arena.trim()
        graph.close()
    assert arena.stats().kept_bytes == 0
    assert len(reads) == read  # read as they were kept, never again


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_a_forked_child_lets_go_of_nothing_its_parent_kept_for_a_graph(provider, freed):
    """What the parent's pins kept is the parent's memory: a forked child's stats or growth never lets go of it, which
    would free it through the array library (CUDA, which the child cannot use), as the parent's workspace buffers are
    never freed there. The parent lets go of it. Once, the child's first stats or growth let go of what a graph the
    parent destroyed before the fork had kept."""
    x, w = strided_operands()
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    graph = provider.begin_capture("lane")
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    provider.end_capture(graph)
    graph.close()  # no trim, stats or growth since
    gc.collect()
    freed.clear()

    def in_the_child():
        wsarena.get_arena("cpu").stats()
        wsarena.conv_forward(x[:1], w, padding=1, stream="another lane")  # a growth
        gc.collect()
        return sorted(freed)

    assert fork(in_the_child)() == ["copy", "copy", "result"]  # the child's own call's
    wsarena.get_arena("cpu").stats()
    gc.collect()
    assert sorted(freed) == ["copy", "copy", "result"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_a_forked_childs_stats_count_nothing_its_parent_kept(provider):
    """What the parent's graphs keep is the parent's: a forked child's arenas, started again, count none of it, as
    they pin none of its buffers."""
    x, w = strided_operands()
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    graph = provider.begin_capture("lane")
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    provider.end_capture(graph)
    arena = wsarena.get_arena("cpu")

    def in_the_child():
        stats = arena.stats()
        return stats.kept_bytes, stats.pinned_bytes

    assert fork(in_the_child)() == (0, 0)
    assert arena.stats().kept_bytes == made_bytes(x, w, False)
    graph.close()
