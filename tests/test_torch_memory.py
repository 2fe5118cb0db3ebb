"""Device memory from PyTorch's caching allocator (TorchProvider) and the ``allocator`` setting.

Without a GPU, PyTorch's allocator functions are replaced by a recorder: what is tested here is what the provider
and the arena ask of PyTorch (which stream, which device, when), and how out-of-memory is reported. The real
allocator is exercised by the GPU tests in test_torch_gpu.py.
"""

import cupy
import pytest

import wsarena
from wsarena import _interop
from wsarena.arena import Arena, CupyProvider, TorchProvider, get_arena, providers
from wsarena.arena._registry import make_device_arena

torch = pytest.importorskip("torch")


class _FakeCaching:
    """Stands in for torch.cuda's caching-allocator functions; records each call. ``current`` is CUDA's current
    device, which CuPy's ``Device`` (:meth:`device`) sets as it enters and sets back as it leaves; ``leaves``, where
    set, is the device each call leaves current, as PyTorch's device guard may (it restores a device that has no CUDA
    context yet only in its own records)."""

    def __init__(self):
        self.calls = []
        self.next = 0x10000
        self.fail = False
        self.current = 0
        self.entered = []  # CuPy's Device stack: the devices found as each Device entered
        self.leaves = None
        self.refuse = None  # where set, what entering CuPy's Device raises (cudaSetDevice's error, a Ctrl-C)
        self.sync_fails = False

    def _ran(self, *call):
        self.calls.append(call)
        if self.leaves is not None:
            self.current = self.leaves

    def alloc(self, size, device=None, stream=None):
        self._ran("alloc", size, device, stream)
        if self.fail:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate ...")
        self.next += 1 << 20
        return self.next

    def delete(self, ptr):
        self._ran("delete", ptr)

    def synchronize(self, device=None):
        self._ran("synchronize", device)
        if self.sync_fails:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def device(self, device):
        fake = self

        class Device:  # CuPy's: the device found current set again as it leaves, whatever happened within
            id = device

            def __enter__(self):
                fake.entered.append(fake.current)  # pushed before the device is set, which may be refused
                if fake.refuse is not None:
                    raise fake.refuse
                fake.current = device

            def __exit__(self, *exc):
                fake.current = fake.entered.pop()

        return Device()


@pytest.fixture
def caching(monkeypatch):
    fake = _FakeCaching()
    monkeypatch.setattr(torch.cuda, "caching_allocator_alloc", fake.alloc)
    monkeypatch.setattr(torch.cuda, "caching_allocator_delete", fake.delete)
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    monkeypatch.setattr(cupy.cuda, "Device", fake.device)  # no GPU here: CuPy's would ask a CUDA driver
    monkeypatch.setattr(providers, "capture_of", lambda stream: None)  # no GPU here: no stream is being captured
    return fake


def test_buffers_come_from_torch_on_the_sub_arenas_stream_and_go_back_in_stream_order(caching):
    arena = Arena(TorchProvider(0))
    with arena.lease(1000, stream=7) as ws:
        assert ws.ptr == caching.next and ws.nbytes == 1000
    assert caching.calls == [("alloc", arena.stats()["capacity_bytes"], 0, 7)]
    arena.trim()
    assert caching.calls[1:] == [("delete", caching.next)]  # on its stream: no synchronisation
    arena.close()


def test_a_buffer_whose_stream_may_be_gone_is_freed_after_the_device_synchronises(caching):
    provider = TorchProvider(0)
    buffer = provider.allocate(4096, stream=9)
    provider.deallocate(buffer, stream=None)
    assert caching.calls[1:] == [("synchronize", 0), ("delete", buffer.ptr)]
    assert buffer.owner is None
    provider.deallocate(buffer, stream=9)  # a second time gives nothing back twice
    assert len(caching.calls) == 3


@pytest.mark.parametrize("failure", ["device refused", "interrupted", "synchronisation failed"])
def test_a_free_that_fails_before_it_frees_leaves_the_block_to_a_later_one(caching, failure):
    """Entering CuPy's Device refused (cudaSetDevice's error) or interrupted, or the device's synchronisation failed:
    nothing went back to PyTorch, and the buffer still holds its block, which a later deallocate frees, once. (Its
    owner cleared before, the block was lost for good: a bare pointer, which nothing frees as it is collected.)"""
    provider = TorchProvider(0)
    buffer = provider.allocate(4096, stream=9)
    raised = KeyboardInterrupt if failure == "interrupted" else RuntimeError
    if failure == "synchronisation failed":
        caching.sync_fails = True
    else:
        caching.refuse = raised("CUDA error: invalid device ordinal") if raised is RuntimeError else raised
    with pytest.raises(raised):
        provider.deallocate(buffer, stream=None)
    assert buffer.owner == buffer.ptr and caching.current == 0 and caching.entered == []
    caching.refuse, caching.sync_fails = None, False
    provider.deallocate(buffer, stream=None)
    provider.deallocate(buffer, stream=9)
    assert [call for call in caching.calls if call[0] == "delete"] == [("delete", buffer.ptr)]
    assert buffer.owner is None


@pytest.mark.parametrize("raised", [RuntimeError("CUDA error: invalid device ordinal"), KeyboardInterrupt()])
def test_a_device_refused_or_interrupted_as_it_is_entered_leaves_cupys_device_stack_as_it_was(caching, raised):
    """CuPy's Device pushes the device it finds before cudaSetDevice, which may refuse (or a Ctrl-C lands on the heels
    of its ``__enter__``): an allocation or a free is left with CuPy's device stack as it was, where an entry left
    there was the device the next Device's exit made current, and nothing was asked of PyTorch."""
    provider = TorchProvider(0)
    buffer = provider.allocate(4096, stream=9)
    caching.refuse = raised
    for call in (lambda: provider.allocate(4096, stream=9), lambda: provider.deallocate(buffer, stream=9)):
        with pytest.raises(type(raised)):
            call()
        assert caching.entered == [] and caching.current == 0
    assert caching.calls == [("alloc", 4096, 0, 9)]


@pytest.mark.parametrize("stream", [9, None])
def test_the_device_current_before_is_current_after_whatever_device_torchs_calls_leave_current(caching, stream):
    provider = TorchProvider(0)
    caching.leaves = 1  # PyTorch's guard left device 1 current in CUDA, where it restored 0 in its own records only
    buffer = provider.allocate(4096, stream=9)
    assert caching.current == 0 and caching.calls == [("alloc", 4096, 0, 9)]
    provider.deallocate(buffer, stream=stream)
    assert caching.current == 0 and caching.calls[-1] == ("delete", buffer.ptr)


def test_torchs_out_of_memory_is_a_memory_error_and_the_arena_stays_usable(caching):
    arena = Arena(TorchProvider(0))
    caching.fail = True
    with pytest.raises(wsarena.ArenaOutOfMemoryError, match="could not grow") as info:
        arena.lease(1 << 20, stream=7).__enter__()
    assert isinstance(info.value, MemoryError) and "caching allocator" in str(info.value.__cause__)
    caching.fail = False
    with arena.lease(1 << 20, stream=7) as ws:
        assert ws.nbytes == 1 << 20
    arena.close()


def test_the_allocator_setting_picks_a_new_device_arenas_provider(monkeypatch):
    monkeypatch.setattr("wsarena.arena._registry._require_gpu", lambda what: None)
    monkeypatch.setattr("wsarena.arena._registry.gpu_count", lambda: 1)
    assert type(get_arena(0).provider) is CupyProvider  # "auto" outside a call with torch operands
    wsarena.arena.reset_arenas()
    wsarena.configure(allocator="torch")
    arena = get_arena(0)
    assert type(arena.provider) is TorchProvider
    wsarena.configure(allocator="cupy")
    assert get_arena(0) is arena  # an arena keeps its provider; the setting counts when one is made


@pytest.mark.parametrize(("allocator", "provider"), [("auto", TorchProvider), ("cupy", CupyProvider)])
def test_torch_operands_make_the_arena_with_torchs_memory_unless_the_setting_says_otherwise(allocator, provider):
    with wsarena.config(allocator=allocator):
        _interop._prefer_torch_memory(0)
    assert type(make_device_arena(0, "cupy").provider) is provider  # the arena made by the call above


def test_an_arena_made_before_keeps_its_memory_when_torch_operands_come():
    arena = make_device_arena(0, "cupy")
    _interop._prefer_torch_memory(0)
    assert get_arena(0) is arena and type(arena.provider) is CupyProvider
