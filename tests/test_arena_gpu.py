"""Device providers on a real GPU: CuPy's allocator, cudaMallocAsync, streams, debug poisoning."""

import gc

import pytest

import wsarena
from wsarena.arena import Arena, AsyncProvider, CupyProvider, get_arena
from wsarena.arena._arena import POISON_BYTE
from wsarena.arena.streams import stream_handle

pytestmark = pytest.mark.gpu

PROVIDERS = [CupyProvider, AsyncProvider]


@pytest.fixture
def cupy():
    import cupy

    return cupy


@pytest.mark.parametrize("make", PROVIDERS)
def test_lease_gives_a_cupy_array_over_ptr(cupy, make):
    arena = Arena(make(0))
    s = cupy.cuda.Stream(non_blocking=True)
    with arena.lease(1 << 20, stream=s) as ws:
        assert isinstance(ws.array, cupy.ndarray)
        assert ws.array.shape == (1 << 20,) and ws.array.dtype == cupy.uint8
        assert ws.array.data.ptr == ws.ptr
        assert ws.stream == s.ptr
        with s:
            ws.array.fill(3)
        s.synchronize()
        assert int(ws.array.sum()) == 3 << 20
    with arena.lease(0, stream=s) as ws:
        assert ws.ptr == 0 and ws.array.size == 0
    arena.close()


@pytest.mark.parametrize("make", PROVIDERS)
def test_streams_get_disjoint_bytes_and_growth_retires_in_stream_order(cupy, make):
    arena = Arena(make(0))
    a, b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with arena.lease(4096, stream=a) as wa, arena.lease(4096, stream=b) as wb:
        assert wa.ptr + 4096 <= wb.ptr or wb.ptr + 4096 <= wa.ptr
        with a:
            wa.array.fill(7)
        arena.reserve(64 << 20, stream=a)  # grows a's buffer under the live lease: the old one is retired
        assert arena.stats().streams[a.ptr].retired_bytes == 4096
        with (
            pytest.raises(RuntimeError, match="already holds a lease"),  # a nested lease would share wa's bytes
            arena.lease(64 << 20, stream=a),
        ):
            pass
        a.synchronize()
        assert int(wa.array.sum()) == 7 * 4096  # still valid
    assert arena.stats().retired_bytes == 0  # freed on a, after the fill
    with arena.lease(64 << 20, stream=a) as big:
        assert big.ptr != wa.ptr
    a.synchronize()
    arena.close()


@pytest.mark.parametrize("make", PROVIDERS)
def test_per_thread_default_streams_get_their_own_bytes(cupy, make):
    import threading

    arena = Arena(make(0))
    both_live = threading.Barrier(2)
    seen = []

    def work():
        with cupy.cuda.Stream.ptds, arena.lease(1 << 20) as ws:  # stream=None: this thread's ptds (handle 2)
            # the key is this thread's own PerThreadStream (no int since the arena was split up), its handle 2
            assert ws.cuda_stream == ws.stream.handle == 2 == stream_handle(None) == stream_handle(ws.stream)
            seen.append(ws.ptr)
            ws.array.fill(len(seen))
            both_live.wait(10)
            cupy.cuda.Stream.ptds.synchronize()

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(seen) == 2 and abs(seen[0] - seen[1]) >= 1 << 20
    arena.close()


def test_cupy_provider_shares_the_users_memory_pool(cupy):
    pool = cupy.get_default_memory_pool()
    arena = Arena(CupyProvider(0))
    gc.collect()  # arrays of earlier tests freed now, not between the two readings
    before = pool.used_bytes()
    arena.reserve(32 << 20)
    assert pool.used_bytes() - before == 32 << 20
    arena.trim()
    assert pool.used_bytes() == before


def test_none_is_cupys_current_stream(cupy):
    arena = Arena(CupyProvider(0))
    s = cupy.cuda.Stream(non_blocking=True)
    with s, arena.lease(10) as ws:
        assert ws.stream == s.ptr == stream_handle(None)
    with arena.lease(10) as ws:
        assert ws.stream == cupy.cuda.get_current_stream().ptr


def test_debug_poisons_device_bytes(cupy):
    arena = Arena(CupyProvider(0))
    with wsarena.config(debug=True), arena.lease(1000) as ws:
        ws.array.fill(1)
        ptr = ws.ptr
    mem = cupy.cuda.UnownedMemory(ptr, 1000, None, 0)
    view = cupy.ndarray((1000,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))
    cupy.cuda.get_current_stream().synchronize()
    assert bool((view == POISON_BYTE).all())


def test_out_of_memory_is_an_arena_error_and_the_arena_stays_usable(cupy):
    arena = Arena(CupyProvider(0))
    with arena.lease(1 << 20):
        pass
    _, total = cupy.cuda.runtime.memGetInfo()
    with pytest.raises(wsarena.ArenaOutOfMemoryError) as info, arena.lease(total * 4):
        pass
    assert info.value.held == 1 << 20
    with arena.lease(1 << 20):
        pass


@pytest.mark.parametrize("make", PROVIDERS)
def test_refusals_of_a_real_provider_are_recorded_and_a_call_with_a_fallback_defers(cupy, make, monkeypatch):
    """The device's own refusals (CuPy's OutOfMemoryError, cuda.core's OUT_OF_MEMORY) are timed and recorded: after
    two in a row a caller that can do with the 1 MiB its stream holds is told not to ask, and a lease still asks.
    (The clock moves a second a read: a refusal takes one, and its wait, 100 times that but at most LONGEST_WAIT's
    60, outlasts the test, however fast the device refuses.)"""
    import itertools

    from wsarena.arena import _refusals
    from wsarena.arena._stats import aligned_size

    monkeypatch.setattr(_refusals, "clock", itertools.count(1000).__next__)
    arena = Arena(make(0))
    with arena.lease(1 << 20):
        pass
    _, total = cupy.cuda.runtime.memGetInfo()
    for _ in range(2):
        with pytest.raises(wsarena.ArenaOutOfMemoryError), arena.lease(total * 4):
            pass
    assert arena.stats().refused_bytes == aligned_size(total * 4)
    assert arena.refusing and arena.defers_growth(total * 4, fallback=1 << 20)
    with arena.lease(2 << 20):  # less than was refused: asked, and granted
        pass
    arena.trim()
    assert not arena.refusing and arena.stats().refused_bytes == 0


@pytest.mark.parametrize("api", ["graph", "legacy"])
def test_a_call_whose_first_choice_the_device_refuses_runs_one_that_fits_and_says_so(cupy, api):
    """A provider over CuPy's pool that refuses any growth: a convolution whose first choice needs workspace runs
    one that needs none, right against the float64 reference, with one MemoryFallbackWarning for the arena over
    three calls; where no candidate needs none, the typed NoAlgorithmFitsError."""
    import warnings

    import numpy as np

    from wsarena import algos
    from wsarena._geometry import conv_geometry
    from wsarena.arena import set_arena
    from wsarena.backends import get_backend

    from .reference import ref_conv_forward

    class Refusing(CupyProvider):
        def allocate(self, size, *, stream):
            raise MemoryError(f"refused {size} bytes")

    wsarena.configure(cudnn_api=api)
    cupy.cuda.Device(0).use()
    arena = Arena(Refusing(0))
    previous = set_arena(0, arena)
    try:
        rng = np.random.default_rng(0)
        x, w = rng.standard_normal((8, 64, 28, 28)), rng.standard_normal((64, 64, 3, 3))
        ref = ref_conv_forward(x, w, padding=1)
        xd, wd = cupy.asarray(x, dtype="float32"), cupy.asarray(w, dtype="float32")
        geom = conv_geometry(x.shape, w.shape, padding=1, dtype="float32")
        ranking = algos.select(get_backend("cudnn"), "fwd", geom, cap=None, search="heuristic")
        if not any(c.workspace_bytes == 0 for c in ranking):
            with pytest.raises(wsarena.NoAlgorithmFitsError):
                wsarena.conv_forward(xd, wd, padding=1)
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                y = cupy.asnumpy(wsarena.conv_forward(xd, wd, padding=1))
                assert float(np.max(np.abs(y - ref))) / float(np.max(np.abs(ref))) <= 1e-4  # float32, no TF32
        said = [str(m.message) for m in caught if issubclass(m.category, wsarena.MemoryFallbackWarning)]
        assert len(said) == (1 if ranking[0].workspace_bytes > 0 else 0), said
        assert not said or f"(0 B of workspace) ran in place of {ranking[0].algo} " in said[0]
        assert arena.stats().capacity_bytes == 0
    finally:
        set_arena(0, previous)  # the settings the fixture resets


def test_get_arena_device_and_current():
    assert get_arena(0) is get_arena(0) is get_arena(None)
    assert isinstance(get_arena(0).provider, CupyProvider)
    with pytest.raises(ValueError):
        get_arena(10_000)


def test_a_destroyed_streams_sub_arena_is_swept(cupy):
    arena = Arena(AsyncProvider(0))
    s = cupy.cuda.Stream(non_blocking=True)
    with arena.lease(1 << 20, stream=s):
        pass
    handle = s.ptr
    other = cupy.cuda.Stream(non_blocking=True)  # made first, so it cannot reuse the dead stream's handle
    del s
    gc.collect()
    with arena.lease(10, stream=other):
        pass
    assert handle not in arena.stats().streams


@pytest.mark.parametrize("make", PROVIDERS)
def test_a_new_stream_given_a_destroyed_streams_handle_gets_a_new_buffer(cupy, make):
    """CUDA gives a destroyed stream's handle to the next stream made; the dead stream's kernels may still use its
    workspace, so the new stream must not inherit that buffer. Its id (cudaStreamGetId) tells it from the dead one."""
    provider = make(0)
    arena = Arena(provider)
    s = cupy.cuda.Stream(non_blocking=True)
    with arena.lease(1 << 20, stream=s) as ws:
        old = ws.ptr
        with s:
            ws.array.fill(1)  # work on s that uses the workspace, maybe still running when s is destroyed
    handle, dead_id = s.ptr, provider.stream_id(s.ptr)
    assert isinstance(dead_id, int)
    del s, ws
    gc.collect()
    misses = []  # kept alive, so that their handles are not given again in turn
    for _ in range(64):
        new = cupy.cuda.Stream(non_blocking=True)
        if new.ptr == handle:
            break
        misses.append(new)
    else:
        pytest.skip("CUDA gave the destroyed stream's handle to none of 64 new streams")
    assert provider.stream_id(handle) != dead_id
    with arena.lease(1 << 20, stream=new) as ws:
        assert ws.ptr != old
        with new:
            ws.array.fill(2)
    new.synchronize()
    stats = arena.stats()
    assert stats.streams[handle].allocations == 1 and stats.frees == 1  # the dead stream's buffer, freed as gone
    arena.close()


def test_new_wrappers_of_a_live_stream_keep_its_buffer(cupy):
    """A wrapper that dies is no sign that its stream is gone (torch.cuda.current_stream() makes one per call): a new
    wrapper of the same stream, with the same id, adopts the buffer."""
    arena = Arena(CupyProvider(0))
    s = cupy.cuda.Stream(non_blocking=True)
    ptrs = []
    for _ in range(3):
        with arena.lease(1 << 20, stream=cupy.cuda.ExternalStream(s.ptr, device_id=0)) as ws:
            ptrs.append(ws.ptr)
        gc.collect()
    assert len(set(ptrs)) == 1 and arena.stats().allocations == 1
    arena.close()
