"""The device providers' adapters, without a GPU: which of CuPy's and cuda.core's errors are a shortage of
memory (``MemoryError``, hence ``ArenaOutOfMemoryError`` from the arena) and which pass through."""

import contextlib
import weakref

import numpy as np
import pytest

import wsarena
from wsarena._sizes import short_repr
from wsarena.arena import Arena, HostProvider, set_arena
from wsarena.arena.testing import RecordingProvider
from wsarena.errors import ArenaOutOfMemoryError, BackendUnavailableError


def test_cupy_provider_reports_a_failed_cudamalloc_as_out_of_memory(monkeypatch):
    """Without a pool (cupy.cuda.set_allocator(None)) CuPy raises cudaMalloc's CUDARuntimeError, not a MemoryError."""
    import cupy

    from wsarena.arena import CupyProvider, providers

    def fails_with(exc):
        def alloc(nbytes):
            raise exc

        return alloc

    monkeypatch.setattr(cupy.cuda, "Device", lambda device: contextlib.nullcontext())  # no GPU here
    monkeypatch.setattr(providers, "cupy_stream", lambda handle: contextlib.nullcontext())
    monkeypatch.setattr(providers, "capture_of", lambda stream: None)  # no stream is being captured
    provider = CupyProvider(0)
    monkeypatch.setattr(cupy.cuda, "alloc", fails_with(cupy.cuda.runtime.CUDARuntimeError(2)))
    with pytest.raises(MemoryError, match="cudaMalloc of 4096 bytes"):
        provider.allocate(4096, stream=7)
    arena = Arena(provider)
    with pytest.raises(ArenaOutOfMemoryError), arena.lease(4096, stream=7):
        pass
    assert arena.held_bytes(stream=7) == 0
    monkeypatch.setattr(cupy.cuda, "alloc", fails_with(OverflowError("size_t")))
    with pytest.raises(MemoryError):
        provider.allocate(2**70, stream=7)
    monkeypatch.setattr(cupy.cuda, "alloc", fails_with(cupy.cuda.runtime.CUDARuntimeError(700)))
    with pytest.raises(cupy.cuda.runtime.CUDARuntimeError):  # an illegal address is not a memory shortage
        provider.allocate(4096, stream=7)


class _Scope:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def __enter__(self):
        self.log.append(f"enter {self.name}")

    def __exit__(self, *exc):
        self.log.append(f"exit {self.name}")


def test_cupy_provider_frees_a_block_with_its_stream_current(monkeypatch):
    """CuPy's stream-ordered allocator (MemoryAsyncPool) frees a block on the stream object current when it was
    allocated while that object lives, else on the stream current when it is freed. The provider allocates under an
    object made for the allocation, which dies with it, so deallocate(stream=H) drops the last reference to the block
    with H current on the provider's device, after H's work; it went on whatever stream the freeing thread had current
    (a trim outside a call raced H's last kernels). With no stream (it may be gone) the device is synchronised first,
    and no stream is entered."""
    import cupy

    from wsarena.arena import CupyProvider, providers

    log = []
    monkeypatch.setattr(cupy.cuda, "Device", lambda device: _Scope(log, f"device {device}"))  # no GPU here
    monkeypatch.setattr(providers, "cupy_stream", lambda handle: _Scope(log, f"stream {handle:#x}"))
    monkeypatch.setattr(cupy.cuda.runtime, "deviceSynchronize", lambda: log.append("synchronize"))
    monkeypatch.setattr(cupy.cuda, "alloc", lambda size: type("MemoryPointer", (), {"ptr": 0x1000})())
    provider = CupyProvider(3)
    for stream, freed in [(0x51, ["enter device 3", "enter stream 0x51", "freed", "exit stream 0x51"]),
                          (None, ["enter device 3", "synchronize", "freed"])]:
        buffer = provider.allocate(256, stream=0x51)
        assert log == ["enter device 3", "enter stream 0x51", "exit stream 0x51", "exit device 3"]
        log.clear()
        weakref.finalize(buffer.owner, log.append, "freed")
        provider.deallocate(buffer, stream=stream)
        assert log == [*freed, "exit device 3"] and buffer.owner is None
        log.clear()


class _FailingResource:
    """A cuda.core memory resource whose allocations fail with the error cuda.core raises for a CUresult."""

    def __init__(self, result):
        self.result = result
        self.calls = 0

    def allocate(self, size, *, stream):
        self.calls += 1
        raise RuntimeError(f"{self.result}: from a fake resource")  # cuda.core's CUDAError names the CUresult


@pytest.mark.parametrize(("result", "raised"), [("CUDA_ERROR_OUT_OF_MEMORY", MemoryError),
                                                 ("CUDA_ERROR_INVALID_VALUE", RuntimeError)])
def test_async_provider_reports_a_resource_out_of_memory_as_memory_error(monkeypatch, result, raised):
    import cupy

    from wsarena.arena import AsyncProvider, providers

    monkeypatch.setattr(cupy.cuda, "Device", lambda device: contextlib.nullcontext())  # no GPU here
    monkeypatch.setattr(providers, "_core_stream", lambda handle: handle)
    provider = AsyncProvider(0, resource=_FailingResource(result))
    with pytest.raises(raised, match=result) as info:
        provider.allocate(1 << 20, stream=0)
    assert provider.resource.calls == 1
    assert raised is MemoryError or not isinstance(info.value, MemoryError)  # only a shortage is a MemoryError


def test_async_provider_quotes_its_resource_shortened(monkeypatch):
    """The MemoryError quoted the resource's repr whole, where every other error quotes a value as short_repr cuts
    it: a resource whose repr lists its options at length gave a line of that length."""
    import cupy

    from wsarena.arena import AsyncProvider, providers

    class Verbose(_FailingResource):
        def __repr__(self):
            return f"Verbose({'o' * 100_000})"

    monkeypatch.setattr(cupy.cuda, "Device", lambda device: contextlib.nullcontext())  # no GPU here
    monkeypatch.setattr(providers, "_core_stream", lambda handle: handle)
    provider = AsyncProvider(0, resource=Verbose("CUDA_ERROR_OUT_OF_MEMORY"))
    with pytest.raises(MemoryError) as info:
        provider.allocate(1 << 20, stream=0)
    quoted = short_repr(provider.resource)
    assert len(quoted) < 200 and str(info.value).startswith(f"{quoted} could not allocate 1048576 bytes: ")


class _Owner:
    """A cuda.core Buffer as AsyncProvider's allocation gives it: close(stream) frees the block on that stream."""

    def __init__(self, closed):
        self.closed = closed

    def close(self, stream):
        self.closed.append(stream)


@pytest.mark.parametrize("failure", ["device refused", "interrupted", "synchronisation failed"])
def test_async_provider_free_that_fails_before_it_frees_leaves_the_block_to_a_later_one(monkeypatch, failure):
    """Entering CuPy's Device refused (cudaSetDevice's error) or interrupted, or the device's synchronisation failed:
    nothing was freed, and the buffer still holds its owner, which a later deallocate frees, once, and a deallocate
    after that frees nothing. (Its owner cleared before, as TorchProvider's was, the block went to cuda.core's
    collection, unsynchronised, and the later deallocate raised AttributeError on None.)"""
    import cupy

    from wsarena.arena import AsyncProvider, Buffer, providers

    refuse = {"device refused": cupy.cuda.runtime.CUDARuntimeError(101), "interrupted": KeyboardInterrupt()}

    class Device:
        def __init__(self, device):
            self.id = device

        def __enter__(self):
            if failure in refuse:
                raise refuse[failure]

        def __exit__(self, *exc):
            pass

    def synchronize():
        if failure == "synchronisation failed":
            raise cupy.cuda.runtime.CUDARuntimeError(700)

    monkeypatch.setattr(cupy.cuda, "Device", Device)  # no GPU here
    monkeypatch.setattr(cupy.cuda.runtime, "deviceSynchronize", synchronize)
    monkeypatch.setattr(providers, "_core_stream", lambda handle: ("stream", handle))
    closed = []
    owner = _Owner(closed)
    provider = AsyncProvider(0, resource=object())
    buffer = Buffer(0x1000, 256, owner)
    with pytest.raises(type(refuse.get(failure, cupy.cuda.runtime.CUDARuntimeError(700)))):
        provider.deallocate(buffer, stream=None)
    assert buffer.owner is owner and closed == []
    failure = "none"
    provider.deallocate(buffer, stream=None)
    provider.deallocate(buffer, stream=9)
    assert closed == [("stream", 0)] and buffer.owner is None


def test_device_providers_read_a_streams_id_from_cuda_bindings(monkeypatch):
    """stream_id(handle) is cudaStreamGetId's id, or None where CUDA refuses (the arena then takes the stream for
    another: wsarena.arena._table)."""
    from cuda.bindings import runtime as rt

    from wsarena.arena import CupyProvider

    def get_id(stream):  # cuda-bindings' reply: (cudaError_t, id), the id None on an error
        if stream == 7:
            return (rt.cudaError_t.cudaSuccess, 42)
        return (rt.cudaError_t.cudaErrorInvalidResourceHandle, None)

    monkeypatch.setattr(rt, "cudaStreamGetId", get_id)
    provider = CupyProvider(0)
    assert provider.stream_id(7) == 42 and provider.stream_id(8) is None


class LeaseOnlyProvider:
    """A provider of leases alone: what Arena() requires, without as_array and fill."""

    device_id = None

    def __init__(self):
        self.host = HostProvider()

    def allocate(self, size, *, stream=None):
        return self.host.allocate(size, stream=stream)

    def deallocate(self, buffer, *, stream=None):
        self.host.deallocate(buffer, stream=stream)


# A provider of leases alone as the arena's, and under a RecordingProvider, which gave an AttributeError from its
# as_array and fill
_LEASES_ALONE = pytest.mark.parametrize("make", [LeaseOnlyProvider, lambda: RecordingProvider(LeaseOnlyProvider())],
                                        ids=["own", "recorded"])


@_LEASES_ALONE
def test_a_provider_of_leases_alone_leases_and_a_convolution_on_it_names_the_method_it_lacks(make):
    """The first convolution failed with an AttributeError from inside the cpu backend; now the typed error of an
    arena that cannot run it, naming the method, where it is needed: a lease still works, before and after."""
    arena = Arena(make())
    with arena.lease(100) as ws:
        assert ws.ptr and ws.nbytes == 100
    set_arena("cpu", arena)
    x, w = np.ones((1, 2, 6, 6), np.float32), np.ones((3, 2, 3, 3), np.float32)
    for algo in ("gemm_per_image", "implicit_gemm"):  # a workspace, and none: each computes on ws.array
        with pytest.raises(BackendUnavailableError, match=r"ws\.array \(the array the cpu backend computes on\) needs "
                           r"the arena's provider to have as_array\(buffer, nbytes\), and LeaseOnlyProvider has not"):
            wsarena.conv_forward(x, w, algo=algo)
    with arena.lease(100) as ws:  # the lane was let go
        assert ws.ptr
    set_arena("cpu", Arena(HostProvider()))
    np.testing.assert_allclose(wsarena.conv_forward(x, w), np.full((1, 3, 4, 4), 18.0), rtol=1e-6)


@_LEASES_ALONE
def test_debug_mode_on_a_provider_of_leases_alone_names_fill_and_lets_the_lane_go(make):
    provider = make()
    arena = Arena(provider)
    refused = pytest.raises(BackendUnavailableError, match=r"debug mode .* fill\(buffer, value, nbytes, \*, stream\), "
                            "and LeaseOnlyProvider has not")
    with wsarena.config(debug=True), refused, arena.lease(64):
        pass
    with arena.lease(64) as ws:
        assert ws.nbytes == 64
    assert getattr(provider, "fills", []) == []  # no fill made, none recorded


def test_a_device_cuda_refuses_leaves_cupys_device_stack_as_it_was():
    """CuPy's Device pushes the device it finds before cudaSetDevice, which refuses a device CUDA lacks: each of the
    CuPy provider's calls raises CUDA's error with CuPy's device stack as it was, where the entry left there was the
    device the next Device's exit made current (in place of the one that Device found)."""
    from wsarena.arena import Buffer, CupyProvider

    from .device_calls import CUDARuntimeError, fake_gpu

    with fake_gpu() as gpu:
        provider = CupyProvider(5)  # the stand-in has devices 0 and 1
        buffer = Buffer(0x1000, 256, object())
        calls = {"allocate": lambda: provider.allocate(256, stream=0),
                 "deallocate": lambda: provider.deallocate(buffer, stream=0),
                 "deallocate, the stream maybe gone": lambda: provider.deallocate(buffer, stream=None),
                 "as_array": lambda: provider.as_array(buffer, 256),
                 "fill": lambda: provider.fill(buffer, 0, 256, stream=0)}
        for name, call in calls.items():
            with pytest.raises(CUDARuntimeError):
                call()
            assert (gpu.current_device(), gpu.cupy.thread().entered) == (0, []), name
        assert buffer.owner is not None


def test_async_provider_hands_its_resource_cuda_cores_object_for_each_stream(monkeypatch):
    """The resource allocates on cuda.core's own objects for the legacy default stream (0) and the per-thread default
    stream (2), and on one over the handle for any other. (cuda.core, which needs a driver to import, is a stand-in
    here.) A device provider reads as its class and device, as errors quote it."""
    import sys
    import types

    import cupy

    from wsarena.arena import AsyncProvider, CupyProvider

    class Stream:
        @staticmethod
        def from_handle(handle):
            return ("stream over", handle)

    core = types.SimpleNamespace(LEGACY_DEFAULT_STREAM="legacy", PER_THREAD_DEFAULT_STREAM="per-thread", Stream=Stream)
    monkeypatch.setitem(sys.modules, "cuda.core", core)
    monkeypatch.setattr(cupy.cuda, "Device", lambda device: contextlib.nullcontext())  # no GPU here

    class Resource:
        def __init__(self):
            self.streams = []

        def allocate(self, size, *, stream):
            self.streams.append(stream)
            return types.SimpleNamespace(handle=0x1000 + size)

    provider = AsyncProvider(0, resource=Resource())
    for handle in (0, 2, 0x51):
        assert provider.allocate(256, stream=handle).ptr == 0x1100
    assert provider.resource.streams == ["legacy", "per-thread", ("stream over", 0x51)]
    assert repr(provider) == "AsyncProvider(device=0)" and repr(CupyProvider(1)) == "CupyProvider(device=1)"
