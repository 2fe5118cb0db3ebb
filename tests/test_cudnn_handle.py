"""cuDNN handles on a machine without a usable GPU: a clear, typed error (GPU behaviour: test_cudnn_gpu.py)."""

from __future__ import annotations

import ctypes
import gc
import os
import threading
import time

import numpy as np
import pytest

from wsarena import cudnn
from wsarena._gpu import gpu_unusable_reason
from wsarena.cudnn import handle as handle_mod
from wsarena.errors import BackendUnavailableError

from .forking import fork

_info = cudnn.library_info()


@pytest.mark.skipif(gpu_unusable_reason() is None, reason="a GPU is usable here; see test_cudnn_gpu.py")
@pytest.mark.skipif(not _info["found"], reason=f"libcudnn not loadable: {_info['error']}")
def test_get_handle_without_gpu_says_there_is_no_usable_gpu():
    with pytest.raises(cudnn.CudnnGpuUnavailableError) as info:
        cudnn.get_handle(0)
    err = info.value
    assert isinstance(err, BackendUnavailableError) and isinstance(err, cudnn.CudnnError)
    text = str(err)
    assert "no usable GPU" in text and gpu_unusable_reason() in text
    assert "cudnnCreate" in text and "CUDNN_STATUS_NOT_INITIALIZED" in text
    assert err.status is cudnn.Status.NOT_INITIALIZED and err.func_name == "cudnnCreate"
    # Nothing half-built is kept: asking again fails the same way.
    with pytest.raises(cudnn.CudnnGpuUnavailableError):
        cudnn.get_handle(0)
    assert not list(handle_mod._live)


def test_close_all_handles_destroys_each_live_handle_once(monkeypatch):
    destroyed = []

    def fake_create(out):
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = 0x3000 + len(destroyed)
        return 0

    monkeypatch.setattr(handle_mod, "function", lambda name: fake_create)
    monkeypatch.setattr(handle_mod, "call", lambda name, handle, **kw: destroyed.append((name, handle)))
    monkeypatch.setattr(handle_mod, "_current_device", lambda: 0)
    cudnn.close_all_handles()  # none open: nothing to do
    assert destroyed == [] and not list(handle_mod._live)
    handle = cudnn.get_handle(0)
    cudnn.close_all_handles()
    cudnn.close_all_handles()  # each handle once, however often it is called
    assert destroyed == [("cudnnDestroy", 0x3000)] and handle.closed and not list(handle_mod._live)


def test_the_first_handle_is_created_alone_and_later_ones_concurrently(monkeypatch):
    # cudnnCreate and cudnnDestroy replaced by fakes. The first wave of threads records how many creations run
    # while the process's first one does; in the second, every creation waits until all four are inside it at
    # once, which only unlocked creation allows (a lock would break the barrier after its timeout).
    active, overlaps, lock, first_done = [0], [], threading.Lock(), threading.Event()
    together = threading.Barrier(4, timeout=10)
    second_wave = threading.Event()

    def fake_create(out):
        if second_wave.is_set():
            together.wait()
        else:
            with lock:
                active[0] += 1
                if not first_done.is_set():
                    overlaps.append(active[0])
            time.sleep(0.02)
            with lock:
                active[0] -= 1
            first_done.set()
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = 0x1000
        return 0

    monkeypatch.setattr(handle_mod, "function", lambda name: fake_create)
    monkeypatch.setattr(handle_mod, "call", lambda *args, **kwargs: None)
    monkeypatch.setattr(handle_mod, "_current_device", lambda: 0)
    monkeypatch.setattr(handle_mod, "_created", False)
    made, failed = [], []

    def first_use():
        try:
            made.append(cudnn.get_handle(0))
        except threading.BrokenBarrierError as exc:
            failed.append(exc)

    try:
        for wave in range(2):
            if wave:
                second_wave.set()
            threads = [threading.Thread(target=first_use) for _ in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(20)
        assert overlaps and max(overlaps) == 1  # nothing else was created while the first creation ran
        assert not failed and len(made) == 8  # the second: all four inside cudnnCreate at once
    finally:
        for handle in made:
            handle.close()


def test_a_handle_is_destroyed_with_its_own_device_current(monkeypatch):
    # cudnnDestroy synchronizes the current device: a handle of device 1 closed while device 0 is current (at
    # exit, or from another thread) must make device 1 current around it, then restore device 0.
    events, current = [], [1]

    def fake_create(out):
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = 0x2000
        return 0

    def set_device(device):
        events.append(("set", device))
        current[0] = device

    monkeypatch.setattr(handle_mod, "function", lambda name: fake_create)
    monkeypatch.setattr(handle_mod, "call", lambda name, *args, **kw: events.append((name, current[0])))
    monkeypatch.setattr(handle_mod, "_current_device", lambda: current[0])
    monkeypatch.setattr(handle_mod, "_set_device", set_device)
    handle = cudnn.get_handle(1)
    current[0] = 0
    handle.close()
    assert events == [("set", 1), ("cudnnDestroy", 1), ("set", 0)]
    events.clear()
    other = cudnn.get_handle(0)
    other.close()
    assert events == [("cudnnDestroy", 0)]  # its own device is current: nothing switched


@pytest.fixture
def fake_handles(monkeypatch):
    """cudnnCreate and cudnnDestroy replaced: the handles made are 0x5000, 0x5010, ... in turn, and the list yielded
    holds those destroyed. Every handle left is closed after (no made-up handle reaches a real cudnnDestroy)."""
    made, destroyed = iter(range(0x5000, 0x6000, 0x10)), []

    def fake_create(out):
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = next(made)
        return 0

    monkeypatch.setattr(handle_mod, "function", lambda name: fake_create)
    monkeypatch.setattr(handle_mod, "call", lambda name, handle, **kw: destroyed.append(handle))
    monkeypatch.setattr(handle_mod, "_current_device", lambda: None)
    try:
        yield destroyed
    finally:
        cudnn.close_all_handles()


def test_a_handle_whose_thread_ended_is_destroyed_by_the_next_creation_not_as_the_thread_ends(fake_handles):
    """cudnnDestroy synchronizes the device, which invalidates a CUDA graph capture in CUDA's global mode under way in
    any other thread. A thread may end during one: its handle is destroyed by the next creation of a handle (which
    such a capture does not allow either) or by close_all_handles, never by the ending thread."""
    destroyed = fake_handles

    def a_thread_that_ends():
        thread = threading.Thread(target=cudnn.get_handle, args=(3,))
        thread.start()
        thread.join()
        gc.collect()

    a_thread_that_ends()
    assert destroyed == []
    mine = cudnn.get_handle(4)  # a creation: the ended thread's handle goes first
    assert destroyed == [0x5000]
    a_thread_that_ends()
    assert destroyed == [0x5000]
    cudnn.close_all_handles()
    assert sorted(destroyed) == [0x5000, 0x5010, 0x5020] and mine.closed
    cudnn.close_all_handles()
    assert len(destroyed) == 3  # each once


@pytest.mark.skipif(not _info["found"], reason=f"libcudnn not loadable: {_info['error']}")
def test_a_handle_whose_thread_ended_waits_for_a_creation_while_no_capture_is_under_way(fake_handles, monkeypatch):
    """A creation of a handle in one thread while another captures a CUDA graph (CUDA's global mode: its default, and
    CuPy's and PyTorch's) destroys no handle of a thread that ended: cudnnDestroy synchronizes the device, which would
    break the capture. They wait for the first creation once no capture that an arena knows of is under way, the
    question the cuDNN backends give the handles."""
    from wsarena.arena import Arena
    from wsarena.arena.testing import RecordingProvider
    from wsarena.backends._cudnn_backend import CudnnBackend

    from .capture_helpers import S1

    destroyed = fake_handles
    monkeypatch.setattr(handle_mod, "_no_capture", [])  # the question given below goes after the test
    CudnnBackend()
    provider = RecordingProvider(device_id=0)
    arena = Arena(provider)
    thread = threading.Thread(target=cudnn.get_handle, args=(3,))
    thread.start()
    thread.join()
    gc.collect()  # 0x5000 queued
    graph = provider.begin_capture(S1)
    assert arena.keep_with_capture([np.empty(8)], stream=S1)  # the arena knows of the capture
    cudnn.get_handle(4)  # a creation during it
    assert destroyed == []
    provider.end_capture(graph)
    cudnn.get_handle(5)  # the first creation after it
    assert destroyed == [0x5000]
    graph.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_a_forked_child_never_destroys_the_parents_handles(fake_handles):
    """CUDA cannot run in a child forked after the parent used it, and the parent's handles are the parent's: the
    child's first creation and its exit (close_all_handles) destroy neither the handle of a thread that ended before
    the fork nor a live one; a handle the child makes is its own, destroyed as any."""
    destroyed = fake_handles
    thread = threading.Thread(target=cudnn.get_handle, args=(3,))
    thread.start()
    thread.join()
    gc.collect()  # 0x5000 is queued, to be destroyed by the next creation
    live = cudnn.get_handle(4)  # 0x5010, and the queue emptied
    assert destroyed == [0x5000]
    other = threading.Thread(target=cudnn.get_handle, args=(3,))
    other.start()
    other.join()
    gc.collect()  # 0x5020 queued

    def in_the_child():
        del destroyed[:]
        mine = cudnn.get_handle(4)  # the parent's live handle is not the child's: a new one
        cudnn.close_all_handles()
        return destroyed, mine.handle if not mine.closed else None, mine is live

    assert fork(in_the_child)() == ([0x5030], None, False)  # only the child's own handle; the parent's untouched
    assert destroyed == [0x5000] and not live.closed
    cudnn.close_all_handles()
    assert sorted(destroyed) == [0x5000, 0x5010, 0x5020]
