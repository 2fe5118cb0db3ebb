"""CUDA graph capture of wsarena calls on a real GPU: replays equal the eager step, through growth of the arena, on
two streams, and the arena after the graph is gone (both cuDNN API paths)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import weakref

import pytest

import wsarena
from wsarena.arena import Arena, AsyncProvider, CupyProvider, set_arena
from wsarena.arena._capture import capture_of
from wsarena.arena.testing import RecordingProvider

pytestmark = pytest.mark.gpu

APIS = ["legacy", "graph"]
TOL = {"rtol": 1e-4, "atol": 1e-4}  # float32; some backward-filter algorithms sum in a nondeterministic order


@pytest.fixture
def cupy():
    import cupy

    return cupy


@pytest.fixture
def arena(cupy):
    device = cupy.cuda.Device().id
    made = Arena(CupyProvider(device))
    previous = set_arena(device, made)
    yield made
    set_arena(device, previous)
    made.close()


def resnet_layers(cupy, batch=2):
    """ResNet-50's 53 convolutions at ``batch``: operands and preallocated outputs of all three passes."""
    rng = cupy.random.default_rng(0)
    layers = []
    for layer in wsarena.load_model("resnet50"):
        x_shape = (batch, *layer.input_shape[1:])
        probe = wsarena.conv_forward(cupy.zeros(x_shape, cupy.float32), cupy.zeros(layer.weight_shape, cupy.float32),
                                     layer.stride, layer.padding, layer.dilation, layer.groups)
        x = rng.standard_normal(x_shape, dtype=cupy.float32)
        w = rng.standard_normal(layer.weight_shape, dtype=cupy.float32)
        dy = rng.standard_normal(probe.shape, dtype=cupy.float32)
        layers.append((layer, x, w, dy))
    # Written on the legacy default stream; the steps and replays run on non-blocking streams, which do not wait
    # for it.
    cupy.cuda.Device().synchronize()
    return layers


def outputs(cupy, layers):
    return [(cupy.empty_like(dy), cupy.empty_like(x), cupy.empty_like(w)) for _, x, w, dy in layers]


def step(layers, outs, stream=None):
    for (layer, x, w, dy), (y, dx, dw) in zip(layers, outs):
        kw = {"stride": layer.stride, "padding": layer.padding, "dilation": layer.dilation, "groups": layer.groups,
              "stream": stream}
        wsarena.conv_forward(x, w, **kw, out=y)
        wsarena.conv_backward_data(dy, w, x.shape, **kw, out=dx)
        wsarena.conv_backward_filter(x, dy, w.shape, **kw, out=dw)


def assert_same(cupy, got, want):
    for a, b in zip(got, want):
        for u, v in zip(a, b):
            cupy.testing.assert_allclose(u, v, **TOL)


def released(arena, timeout=5.0):
    """Wait until CUDA has run the destructors of dropped graphs (on its own thread) and the arena freed them."""
    deadline = time.monotonic() + timeout
    while arena.stats().pinned_bytes and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return arena.stats().pinned_bytes == 0


@pytest.mark.parametrize("api", APIS)
def test_a_replayed_resnet50_step_equals_the_eager_step_even_after_the_arena_grew(cupy, arena, api):
    with wsarena.config(cudnn_api=api):
        layers = resnet_layers(cupy)
        eager = outputs(cupy, layers)
        step(layers, eager)  # also the warm-up: choices, plans, handles, arena size
        captured = outputs(cupy, layers)
        allocations = arena.stats().allocations
        with wsarena.capture() as graph:
            step(layers, captured)
        held = arena.stats()
        # one allocation, the new capture stream's buffer, made before the capture began; none while capturing
        assert held.pinned_bytes > 0 and held.allocations == allocations + 1
        for _ in range(100):
            graph.launch()
        graph.stream.synchronize()
        assert_same(cupy, captured, eager)
        with graph.stream:  # in the replay's order: on the legacy stream the fills could land after it
            for y, dx, dw in captured:
                y.fill(0), dx.fill(0), dw.fill(0)
        key = graph.stream.ptr
        arena.reserve(4 * held.streams[key].capacity_bytes + (1 << 20), stream=graph.stream)  # the stream grows
        with graph.stream:
            step(layers, outputs(cupy, layers))  # eager calls there use the new buffer
        grown = arena.stats().streams[key]
        assert grown.capacity_bytes > held.streams[key].capacity_bytes
        assert grown.pinned_bytes == held.streams[key].pinned_bytes  # the old buffer is kept for the graph
        graph.launch()
        graph.stream.synchronize()
        assert_same(cupy, captured, eager)
        graph.close()
        del graph
        assert released(arena)


@pytest.mark.parametrize("api", APIS)
def test_capture_forked_to_two_streams_keeps_their_workspaces_apart(cupy, arena, api):
    with wsarena.config(cudnn_api=api):
        layers = resnet_layers(cupy)
        half = len(layers) // 2
        side = cupy.cuda.Stream(non_blocking=True)
        eager = outputs(cupy, layers)
        with cupy.cuda.Stream(non_blocking=True) as main:
            step(layers[:half], eager[:half])
            step(layers[half:], eager[half:], stream=side)
            side.synchronize()
            captured = outputs(cupy, layers)
            with wsarena.capture(main) as graph:
                fork = cupy.cuda.Event()
                fork.record(main)
                side.wait_event(fork)
                step(layers[half:], captured[half:], stream=side)
                step(layers[:half], captured[:half])
                join = cupy.cuda.Event()
                join.record(side)
                main.wait_event(join)
        stats = arena.stats()
        assert stats.streams[main.ptr].pinned_bytes > 0 and stats.streams[side.ptr].pinned_bytes > 0
        graph.launch()
        graph.stream.synchronize()
        assert_same(cupy, captured, eager)


def _strided_step(cupy):
    """A step of two convolutions on a view (not C-contiguous: the first call copies it) whose first result is
    dropped, as an intermediate is; ``step(out)`` writes the second into ``out``, or returns it."""
    rng = cupy.random.default_rng(0)
    x = rng.standard_normal((4, 8, 34, 34), dtype=cupy.float32)[:, :, 1:33, 1:33]
    w1, w2 = (rng.standard_normal((8, 8, 3, 3), dtype=cupy.float32) for _ in range(2))
    cupy.cuda.Device().synchronize()  # made on the legacy stream; the steps run on a non-blocking one

    def step(out=None):
        return wsarena.conv_forward(wsarena.conv_forward(x, w1, padding=1), w2, padding=1, out=out)

    return x.shape, step  # the copy of x and the first result are both of x's shape


@pytest.mark.parametrize("api", APIS)
def test_memory_a_captured_call_allocated_is_given_to_no_later_allocation(cupy, arena, api):
    """The copy a captured call made of its operand and the result its step dropped stay the graph's as long as it
    exists: arrays of their size allocated on the capture's stream afterwards, which CuPy's MemoryPool would hand
    the blocks freed there, are left as they were by the replays, which equal the eager step. Once, the pool handed
    those blocks out, and every replay wrote into them."""
    with wsarena.config(cudnn_api=api):
        shape, step = _strided_step(cupy)
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            want = step()
            stream.synchronize()
        with wsarena.capture(stream) as graph:
            y = step()
        with stream:
            later = [cupy.full(shape, 7.0, dtype=cupy.float32) for _ in range(4)]
            for _ in range(3):
                graph.launch()
            stream.synchronize()
        cupy.testing.assert_allclose(y, want, **TOL)
        assert all(bool((array == 7.0).all()) for array in later)
        assert arena.stats().kept_bytes == 3 * y.nbytes  # the copy of x and both results, each of x's shape
        graph.close()
        deadline = time.monotonic() + 5.0  # CUDA runs the graph's destructors on its own thread
        while arena.stats().kept_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert arena.stats().kept_bytes == 0


@pytest.mark.parametrize("api", APIS)
def test_stats_in_a_global_capture_with_no_pool_leaves_what_a_graph_gone_kept_until_the_capture_ends(
    cupy, arena, api, monkeypatch
):
    """With no memory pool (cupy.cuda.set_allocator(None)) dropping an array frees it (cudaFree), which a capture in
    CUDA's global mode refuses, invalidating the capture. A graph destroyed before such a capture kept a captured
    call's copy of its operand and its results: a stats() during the capture leaves them (and raises nothing), the
    capture ends into a graph that replays as the eager call, and the end of its block lets go of them. Once, a trim,
    stats or growth during a capture let go of them there."""
    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(None)
    unraisable = []  # a cudaFree that CUDA refused, in an array's deallocation, raises nowhere else
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    try:
        with wsarena.config(cudnn_api=api):
            shape, step = _strided_step(cupy)
            rng = cupy.random.default_rng(1)
            x = rng.standard_normal(shape, dtype=cupy.float32)  # C-contiguous: a call on it copies nothing
            w = rng.standard_normal((8, 8, 3, 3), dtype=cupy.float32)
            cupy.cuda.Device().synchronize()  # made on the legacy stream; the steps run on a non-blocking one
            stream = cupy.cuda.Stream(non_blocking=True)
            with stream:
                step()  # the warm-up of the first graph's calls
                want = wsarena.conv_forward(x, w, padding=1)  # and of the second's
                y = cupy.empty_like(want)
                stream.synchronize()
            with wsarena.capture(stream) as first:  # relaxed: cudaMalloc may make the copy and the results
                step()
            assert arena.stats().kept_bytes == 3 * y.nbytes  # the copy of x and both results
            owners = [weakref.ref(entry[2]) for entry in list(arena._table.kept_arrays.owners.values())]
            assert len(owners) == 3
            first.close()
            del first
            deadline = time.monotonic() + 5
            while any(pin.live() for pin in arena._table.captures.values()) and time.monotonic() < deadline:
                gc.collect()
                time.sleep(0.01)  # CUDA runs the graph's destructor on a thread of its own
            assert not any(pin.live() for pin in arena._table.captures.values())
            assert all(ref() is not None for ref in owners)  # no trim, stats or growth since
            gc.collect()  # garbage of earlier steps goes now, not in the global capture (a cudaFree there too)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a failed free warns
                gc.disable()
                try:
                    with wsarena.capture(stream, mode="global") as second:
                        wsarena.conv_forward(x, w, padding=1, out=y)  # allocates nothing
                        stats = arena.stats()
                        assert capture_of(stream.ptr) is not None  # still capturing: not invalidated
                        assert stats.kept_bytes == 3 * y.nbytes and all(ref() is not None for ref in owners)
                finally:
                    gc.enable()
                assert all(ref() is None for ref in owners)  # the end of the block let go of them
            assert arena.stats().kept_bytes == 0 and unraisable == []
            with stream:  # in the replay's order (the stream is non-blocking)
                y.fill(0)
                second.launch()
                stream.synchronize()
            cupy.testing.assert_allclose(y, want, **TOL)
            second.close()
    finally:
        cupy.cuda.set_allocator(previous)


def test_memory_the_graph_allocated_itself_is_left_to_it(cupy, arena):
    """Under CuPy's MemoryAsyncPool a capture's allocations are the graph's own (allocation nodes), and so are their
    frees: the copy and the dropped result are not kept past the capture, which would leave the graph an allocation it
    never frees, and CUDA refuses to launch such a graph again. Launched again and again, it equals the eager step."""
    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(cupy.cuda.MemoryAsyncPool().malloc)
    try:
        _, step = _strided_step(cupy)
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            want = step()
            y = cupy.empty_like(want)
            stream.synchronize()
        with wsarena.capture(stream) as graph:
            step(out=y)
        for _ in range(3):
            graph.launch()
        stream.synchronize()
        cupy.testing.assert_allclose(y, want, **TOL)
        assert arena.stats().kept_bytes == 0  # the graph's own
        graph.close()
        del graph
        stream.synchronize()
    finally:
        cupy.cuda.set_allocator(previous)


def test_a_capture_that_would_search_raises_before_anything_is_enqueued(cupy, arena):
    x = cupy.ones((2, 8, 17, 17), cupy.float32)
    w = cupy.ones((8, 8, 3, 3), cupy.float32)
    y = cupy.empty((2, 8, 17, 17), cupy.float32)
    with wsarena.config(algo_search="exhaustive"):
        with pytest.raises(wsarena.CaptureError, match="run the step once"), wsarena.capture() as graph:
            wsarena.conv_forward(x, w, padding=1, out=y)
        assert graph.closed
        wsarena.conv_forward(x, w, padding=1, out=y)  # eager: searches, and the capture after it works
        with wsarena.capture() as graph:
            wsarena.conv_forward(x, w, padding=1, out=y)
    with graph.stream:  # in the replay's order (the capture's own stream is non-blocking)
        y.fill(0)
    graph.launch()
    graph.stream.synchronize()
    assert float(y[0, 0, 8, 8]) == 72.0  # 8 channels x 9 taps of ones


def test_the_default_stream_during_a_capture_is_a_capture_error(cupy, arena):
    x = cupy.ones((1, 4, 8, 8), cupy.float32)
    w = cupy.ones((4, 4, 3, 3), cupy.float32)
    wsarena.conv_forward(x, w, padding=1, stream=0)
    blocking = cupy.cuda.Stream()  # a blocking stream being captured makes the legacy stream unusable
    with pytest.raises(wsarena.CaptureError, match="legacy default stream"), wsarena.capture(blocking, mode="relaxed"):
        wsarena.conv_forward(x, w, padding=1, stream=0)


def test_the_per_thread_default_stream_can_be_captured_and_the_legacy_one_cannot(cupy, arena):
    x = cupy.ones((1, 4, 8, 8), cupy.float32)
    w = cupy.ones((4, 4, 3, 3), cupy.float32)
    y = cupy.empty((1, 4, 8, 8), cupy.float32)
    ptds = cupy.cuda.Stream.ptds
    with ptds:
        wsarena.conv_forward(x, w, padding=1, out=y)  # the warm-up, on the stream captured
        y.fill(0)
        with wsarena.capture(ptds) as graph:
            wsarena.conv_forward(x, w, padding=1, out=y)
        assert float(y[0, 0, 4, 4]) == 0.0  # captured, not run
        graph.launch()
        ptds.synchronize()
    assert float(y[0, 0, 4, 4]) == 36.0  # 4 channels x 9 taps of ones
    with pytest.raises(ValueError, match="legacy default stream cannot be captured"), wsarena.capture(
        cupy.cuda.Stream.null
    ):
        pass


def test_the_arena_frees_the_pinned_buffer_once_the_graph_is_dropped(cupy, arena):
    x = cupy.ones((4, 16, 32, 32), cupy.float32)
    w = cupy.ones((16, 16, 3, 3), cupy.float32)
    y = cupy.empty((4, 16, 32, 32), cupy.float32)
    with cupy.cuda.Stream(non_blocking=True) as s:
        arena.reserve(8 << 20, stream=s)
        wsarena.conv_forward(x, w, padding=1, out=y)
        with wsarena.capture(s) as graph:
            wsarena.conv_forward(x, w, padding=1, out=y)
        pinned = arena.stats().streams[s.ptr].pinned_bytes
        assert pinned > 0
        arena.reserve(64 << 20, stream=s)  # grows: the pinned buffer is kept for the graph
        assert arena.stats().pinned_bytes == pinned
        graph.launch()
        s.synchronize()
        frees = arena.stats().frees
        del graph
        assert released(arena)
        assert arena.stats().frees == frees + 1  # the kept buffer, freed on its stream once CUDA let go


def small_conv(cupy):
    x = cupy.ones((4, 16, 32, 32), cupy.float32)
    w = cupy.ones((16, 16, 3, 3), cupy.float32)
    return x, w, cupy.empty((4, 16, 32, 32), cupy.float32)


def test_a_call_after_the_capture_was_invalidated_is_a_capture_error(cupy, arena):
    """CuPy answers a plain RuntimeError for a stream whose capture an earlier error invalidated; wsarena says what
    happened and what to do, before anything is taken."""
    x, w, y = small_conv(cupy)
    with cupy.cuda.Stream(non_blocking=True) as s:
        wsarena.conv_forward(x, w, padding=1, out=y)
        with pytest.raises(wsarena.CaptureError, match="invalidated.*capture again"), wsarena.capture(s):
            with pytest.raises(cupy.cuda.runtime.CUDARuntimeError):
                s.synchronize()  # cannot be captured: CUDA invalidates the capture
            wsarena.conv_forward(x, w, padding=1, out=y)
    assert arena.stats().leases == 0


class _FreesWatched(RecordingProvider):
    """A device provider whose frees are recorded, with those made on a stream while it was being captured."""

    def __init__(self, upstream):
        super().__init__(upstream)
        self.during_capture = []

    def capture(self, stream):
        return self.upstream.capture(stream)

    def current_stream(self):
        return self.upstream.current_stream()

    def stream_id(self, stream):
        return self.upstream.stream_id(stream)  # cudaStreamGetId, which a capture must never see

    def deallocate(self, buffer, *, stream):
        if stream is not None and capture_of(stream) is not None:
            self.during_capture.append((buffer.ptr, stream))
        super().deallocate(buffer, stream=stream)


@pytest.mark.parametrize("mode", ["relaxed", "global"])
def test_a_buffer_a_released_graph_held_is_freed_after_the_next_capture_on_its_stream(cupy, mode):
    """Capture, grow, drop the graph, capture again on the same stream: the first graph's buffer, let go during the
    second capture, is freed after it. With AsyncProvider a free during it would be a cudaFreeAsync recorded into the
    second graph, run at each of its replays. Holding it back asks CUDA nothing a global-mode capture refuses (reading
    the stream's id there invalidated it)."""
    device = cupy.cuda.Device().id
    provider = _FreesWatched(AsyncProvider(device))
    arena = Arena(provider)
    previous = set_arena(device, arena)
    try:
        x, w, y = small_conv(cupy)
        with cupy.cuda.Stream(non_blocking=True) as s, warnings.catch_warnings():
            warnings.simplefilter("error")  # a failed free warns
            arena.reserve(8 << 20, stream=s)
            wsarena.conv_forward(x, w, padding=1, out=y)
            with wsarena.capture(s, mode=mode) as first:
                wsarena.conv_forward(x, w, padding=1, out=y)
            arena.reserve(64 << 20, stream=s)  # grows: the first graph's buffer is kept aside
            first.close()
            del first
            deadline = time.monotonic() + 5
            while any(pin.live() for pin in arena._table.captures.values()) and time.monotonic() < deadline:
                gc.collect()
                time.sleep(0.01)  # CUDA runs the graph's destructor on a thread of its own
            held = len(provider.held)
            with wsarena.capture(s, mode=mode) as second:  # its first lease lets go of the first graph's buffer
                wsarena.conv_forward(x, w, padding=1, out=y)
            assert len(provider.held) == held  # not freed yet
            arena.stats()  # the next call after the capture frees it
            assert len(provider.held) == held - 1 and provider.during_capture == []
            y.fill(0)
            for _ in range(3):
                second.launch()
            s.synchronize()
        assert float(y[0, 0, 8, 8]) == 144.0  # 16 channels x 9 taps of ones
    finally:
        set_arena(device, previous)
        arena.close()


def test_a_free_that_would_synchronise_waits_for_a_global_capture_from_its_start(cupy, arena):
    """wsarena.capture(mode="global") on a non-blocking stream: before the step's first lease there, another thread's
    call lets go of a buffer whose free synchronises the device (a thread gone since had it on its per-thread default
    stream), which would invalidate a global-mode capture. It waits until the capture is over."""
    x, w, y = small_conv(cupy)
    wsarena.conv_forward(x, w, padding=1, out=y)  # the eager step
    cupy.cuda.Device().synchronize()
    go, errors = threading.Event(), []

    def record(call):
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - asserted below, in the test's thread
            errors.append(exc)

    def gone_thread():
        with cupy.cuda.Stream.ptds:
            arena.reserve(1 << 20)  # a buffer on this thread's per-thread default stream
        go.wait(60)

    worker = threading.Thread(target=record, args=(gone_thread,))
    worker.start()
    s = cupy.cuda.Stream(non_blocking=True)
    # Garbage of earlier tests (CuPy streams, events, graphs in reference cycles) is destroyed now, not by the
    # collection inside the global-mode capture below, which is there for the gone thread's lane alone.
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed free warns
        with wsarena.capture(s, mode="global") as graph:
            go.set()
            worker.join(60)
            gc.collect()
            other = threading.Thread(target=record, args=(arena.stats,))  # sweeps the gone thread's sub-arena
            other.start()
            other.join(60)
            wsarena.conv_forward(x, w, padding=1, out=y)
        assert errors == []
        frees = arena.stats().frees  # the capture is over: the buffer goes now
    assert frees >= 1 and errors == []
    with s:  # in the replay's order (s is non-blocking)
        y.fill(0)
    graph.launch()
    s.synchronize()
    assert float(y[0, 0, 8, 8]) == 144.0  # 16 channels x 9 taps of ones


def test_a_dead_stream_wrapper_is_adopted_during_a_global_capture_without_invalidating_it(cupy, arena):
    """Stream wrappers made per call (cuda.core's Stream.from_handle) die after it: the sub-arena of their handle is
    orphaned. wsarena.capture's stream adopts it before the capture begins, asking the stream's id then: asked during
    the capture (cudaStreamGetId), CUDA refused, in relaxed mode too, and the refusal invalidated the capture (and,
    read as another stream's, the lease found no buffer)."""
    from cuda.core import Stream

    s = cupy.cuda.Stream(non_blocking=True)
    arena.reserve(1 << 20, stream=Stream.from_handle(s.ptr))  # its wrapper dies here: the sub-arena is an orphan
    gc.collect()
    with wsarena.capture(s, mode="global") as graph:
        with arena.lease(1 << 20, stream=Stream.from_handle(s.ptr)) as ws:
            pinned = ws.ptr
            ws.array.fill(0)  # a memset node: the graph is not empty
        assert capture_of(s.ptr) is not None  # still capturing: not invalidated
    assert graph.graph is not None and pinned != 0 and arena.held_bytes(stream=s) >= 1 << 20
    graph.launch()
    s.synchronize()


def test_a_dead_stream_wrappers_buffer_is_refused_in_cupys_own_capture_which_goes_on(cupy, arena):
    """Begun by CuPy, the capture gives the orphaned buffer no stream object to adopt it before it begins: the lease
    cannot ask whether the handle still names the same stream, and says so with a CaptureError, leaving the capture
    valid (cudaStreamGetId would have invalidated it). After the capture, a lease adopts the buffer."""
    from cuda.core import Stream

    s = cupy.cuda.Stream(non_blocking=True)
    arena.reserve(1 << 20, stream=Stream.from_handle(s.ptr))
    gc.collect()
    s.begin_capture()
    try:
        with pytest.raises(wsarena.CaptureError, match="stream object that lives until the capture ends"):
            arena.lease(1 << 20, stream=Stream.from_handle(s.ptr)).__enter__()
        assert capture_of(s.ptr) is not None  # still capturing: not invalidated
    finally:
        s.end_capture()
    with arena.lease(1 << 20, stream=s) as ws:
        assert ws.ptr != 0
    assert arena.stats().allocations == 1  # the reserved buffer, adopted


@pytest.mark.parametrize("api", APIS)
def test_a_thread_with_no_cudnn_handle_cannot_make_one_during_a_capture(cupy, arena, api):
    """A forced algorithm's workspace size needs this thread's handle before any lease: a thread whose eager step ran
    elsewhere gets the CaptureError that says so, rather than a handle created during the capture."""
    x, w, y = small_conv(cupy)
    with wsarena.config(cudnn_api=api):
        wsarena.conv_forward(x, w, padding=1, out=y, algo="implicit_gemm")  # this thread's warm-up
        errors = []

        def capture_there():
            try:
                with wsarena.capture():
                    wsarena.conv_forward(x, w, padding=1, out=y, algo="implicit_gemm")
            except Exception as exc:  # noqa: BLE001 - asserted below, in the test's thread
                errors.append(exc)

        thread = threading.Thread(target=capture_there)
        thread.start()
        thread.join(60)
    assert len(errors) == 1 and isinstance(errors[0], wsarena.CaptureError), errors
    assert "create this thread's cuDNN handle" in str(errors[0])


# A child process's start: a graph-API convolution captured on a stream of its own (s, into graph, writing y) beside
# its eager result (want), and the plan the graph keeps (kept). CUDNN_CUDA_GRAPH_RETENTION=none in its environment:
# only wsarena keeps the plan for the graph, as before cuDNN 9.28.
_CAPTURED_CONV = textwrap.dedent("""
    import gc, time, weakref
    import cupy, wsarena
    from wsarena.backends import get_backend

    rng = cupy.random.default_rng(0)
    x = rng.standard_normal((4, 16, 32, 32), dtype=cupy.float32)
    w = rng.standard_normal((16, 16, 3, 3), dtype=cupy.float32)
    y = cupy.empty((4, 16, 32, 32), cupy.float32)
    cupy.cuda.Device().synchronize()  # x and w were written on the legacy default stream, which s does not wait for
    plans = get_backend("cudnn", "graph")._plans
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        want = wsarena.conv_forward(x, w, padding=1)
        with wsarena.capture(s) as graph:
            wsarena.conv_forward(x, w, padding=1, out=y)
    (kept,) = plans.kept()
""")


def _run_captured_conv(then: str, **env: str) -> subprocess.CompletedProcess:
    """Run :data:`_CAPTURED_CONV`, then ``then``, in a child process on the graph API."""
    env = {**os.environ, "CUDNN_CUDA_GRAPH_RETENTION": "none", "WSARENA_CUDNN_API": "graph", **env}
    return subprocess.run([sys.executable, "-c", _CAPTURED_CONV + textwrap.dedent(then)], check=False,
                          capture_output=True, text=True, timeout=300, env=env)


def test_a_replay_after_its_plan_was_evicted_equals_the_eager_call():
    """A plan cache of one evicts the captured plan at the next geometry's call: the graph keeps it, and replays as
    the eager call computed. The plan goes at the first miss after the graph is gone."""
    done = _run_captured_conv("""
        descriptor = weakref.ref(kept.descriptor)
        del kept
        with s:
            for k in (1, 5, 7):  # other geometries: their plans evict the captured one
                wsarena.conv_forward(x, rng.standard_normal((16, 16, k, k), dtype=cupy.float32), padding=k // 2)
            gc.collect()
            assert len(plans) == 1 and descriptor() is not None and not descriptor().closed
            y.fill(0)
            for _ in range(3):
                graph.launch()
            s.synchronize()
            cupy.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
            graph.close()
            del graph
            gc.collect()
            deadline = time.monotonic() + 10
            while plans.kept() and time.monotonic() < deadline:  # CUDA runs the graph's destructor on its own time
                time.sleep(0.01)
            wsarena.conv_forward(x, rng.standard_normal((16, 16, 9, 9), dtype=cupy.float32), padding=4)  # a miss
            gc.collect()
            assert descriptor() is None
        print("ok")
    """, WSARENA_PLAN_CACHE_SIZE="1")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_graph_on_the_graph_api_replays_after_close_all_handles_and_its_process_exits_cleanly():
    """close_all_handles (which runs at exit too) destroys every cuDNN handle and every cached plan but those a graph
    that may still exist ran. The graph replays afterwards as it did before, and the process ends with the graph and
    its plan alive, nothing destroyed after the handles."""
    done = _run_captured_conv("""
        from wsarena.cudnn import close_all_handles

        close_all_handles()
        assert not kept.closed and len(plans) == 0
        del kept  # only the plan cache keeps it, through the exit
        with s:
            y.fill(0)
            graph.launch()
            s.synchronize()
        cupy.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
        print("ok")
    """)
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, "ok", "")


@pytest.mark.parametrize("call", ["x, w, padding=1, out=y", "x[:, :, ::2, ::2], w, padding=1"],
                         ids=["out", "copied-and-new"])
def test_a_graph_alive_at_interpreter_exit_ends_the_process_cleanly(call):
    """The exit handler releases the arena while a graph still holds its buffer (kept, never freed), and CUDA may
    run the graph's destructor later, as the interpreter goes: the semaphore it posts is still there. A call that
    copied an operand and made its result leaves them kept for the graph, freed as the interpreter goes."""
    code = (
        "import cupy, wsarena\n"
        "x = cupy.ones((4, 16, 32, 32), cupy.float32)\n"
        "w = cupy.ones((16, 16, 3, 3), cupy.float32)\n"
        "y = cupy.empty((4, 16, 32, 32), cupy.float32)\n"
        "with cupy.cuda.Stream(non_blocking=True) as s:\n"
        f"    wsarena.conv_forward({call})\n"
        "    with wsarena.capture(s) as graph:\n"
        f"        wsarena.conv_forward({call})\n"
        "    wsarena.get_arena(cupy.cuda.Device().id).reserve(64 << 20, stream=s)  # the graph's buffer kept aside\n"
        "    graph.launch()\n"
        "    s.synchronize()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stderr == "", done.stderr
