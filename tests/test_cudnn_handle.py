"""cuDNN handles on a machine without a usable GPU: a clear, typed error (GPU behaviour: test_cudnn_gpu.py)."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest

import wsarena.cudnn as cudnn
from wsarena._gpu import gpu_unusable_reason
from wsarena.cudnn import handle as handle_mod
from wsarena.errors import BackendUnavailableError

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


def test_close_all_handles_with_none_open_is_harmless():
    cudnn.close_all_handles()


def test_the_first_handle_is_created_alone_and_later_ones_concurrently(monkeypatch):
    # cudnnCreate and cudnnDestroy replaced by fakes that record how many creations overlap.
    active, overlaps, lock = [0], [], threading.Lock()

    def fake_create(out):
        with lock:
            active[0] += 1
            overlaps.append(active[0])
        time.sleep(0.05)
        with lock:
            active[0] -= 1
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = 0x1000
        return 0

    monkeypatch.setattr(handle_mod, "function", lambda name: fake_create)
    monkeypatch.setattr(handle_mod, "call", lambda *args, **kwargs: None)
    monkeypatch.setattr(handle_mod, "_current_device", lambda: 0)
    monkeypatch.setattr(handle_mod, "_created", False)
    made = []

    def first_use():
        made.append(cudnn.get_handle(0))

    try:
        for wave in range(2):  # the first wave races for the first creation, the second creates freely
            threads = [threading.Thread(target=first_use) for _ in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(10)
        assert len(made) == 8
        assert max(overlaps[:4]) == 1  # the first wave: one creation at a time, while the first was unsettled
        assert max(overlaps[4:]) > 1  # afterwards no lock: creations overlap
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
