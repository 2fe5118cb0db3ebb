"""The process's arenas (``get_arena``, ``set_arena``, ``reset_arenas``) and the arena package's public names."""

import re

import numpy as np
import pytest

import wsarena
from wsarena.arena import Arena, HostProvider, get_arena, reset_arenas, set_arena
from wsarena.arena.testing import RecordingProvider
from wsarena.errors import BackendUnavailableError


def test_get_arena_cpu_is_a_singleton_and_the_top_level_name_maps_here():
    assert get_arena("cpu") is get_arena("cpu") is wsarena.get_arena("CPU")
    assert isinstance(get_arena("cpu").provider, HostProvider)
    assert wsarena.Arena is Arena


def test_a_closed_process_arena_is_replaced_and_the_ops_go_on():
    old = Arena(HostProvider())
    previous = set_arena("cpu", old)
    try:
        old.close()
        with pytest.raises(RuntimeError, match="closed"):
            old.lease(0).__enter__()  # a closed arena refuses even a lease that takes nothing
        x = np.ones((1, 1, 4, 4), np.float32)
        assert wsarena.conv_forward(x, np.ones((1, 1, 3, 3), np.float32)).sum() == 36
        assert get_arena("cpu") is not old and not get_arena("cpu").closed
    finally:
        set_arena("cpu", previous)


@pytest.mark.parametrize("bad", ["tpu", -1, 1.0, True, object()])
def test_get_arena_bad_device(bad):
    with pytest.raises((TypeError, ValueError)):
        get_arena(bad)


@pytest.mark.parametrize("call", [
    pytest.param(get_arena, id="get_arena"),
    pytest.param(lambda value: set_arena(value, None), id="set_arena"),
    pytest.param(lambda value: Arena(HostProvider()).lease(value), id="lease"),
    pytest.param(lambda value: Arena(HostProvider()).reserve(value), id="reserve"),
    pytest.param(lambda value: Arena(HostProvider()).lease(1, cap=value), id="cap"),
])
@pytest.mark.parametrize("value", ["7" * 100_000, ["x" * 100_000], -(10**5000)], ids=["string", "list", "huge"])
def test_an_arena_error_quotes_a_long_value_shortened(call, value):
    with pytest.raises((TypeError, ValueError)) as info:
        call(value)
    assert len(str(info.value)) < 200 and "Exceeds the limit" not in str(info.value)


def test_set_arena_installs_and_returns_the_old_one():
    mine = Arena(RecordingProvider())
    before = get_arena("cpu")
    old = set_arena("cpu", mine)
    assert old is before
    try:
        assert get_arena("cpu") is mine
    finally:
        assert set_arena("cpu", old) is mine
    assert get_arena("cpu") is old


def test_set_arena_device_works_without_a_gpu():
    fake = Arena(RecordingProvider(device_id=0))
    old = set_arena(0, fake)
    try:
        assert get_arena(0) is fake
    finally:
        set_arena(0, old)


def test_reset_arenas_closes_them():
    mine = Arena(RecordingProvider())
    before = get_arena("cpu")
    old = set_arena("cpu", mine)
    assert old is before
    try:
        reset_arenas()
        assert mine.closed
        with pytest.raises(RuntimeError, match="closed"), mine.lease(1):
            pass
        assert get_arena("cpu") is not mine
    finally:
        set_arena("cpu", old)


@pytest.mark.skipif(wsarena._gpu.gpu_unusable_reason() is None, reason="a GPU is usable here")
def test_device_arena_without_gpu_is_backend_unavailable():
    with pytest.raises(BackendUnavailableError, match="GPU"):
        get_arena()
    old = set_arena(0, None)
    try:
        with pytest.raises(BackendUnavailableError):
            get_arena(0)
    finally:
        if old is not None:
            set_arena(0, old)


@pytest.mark.parametrize(("count", "counted"), [(2, "it counts 2 (0 to 1)"), (0, "it counts 0")])
def test_a_device_past_the_count_is_refused_in_the_words_the_ops_use(monkeypatch, count, counted):
    monkeypatch.setattr("wsarena.arena._registry._require_gpu", lambda what: None)
    monkeypatch.setattr("wsarena.arena._registry.gpu_count", lambda: count)
    with pytest.raises(ValueError, match=rf"^get_arena\(5\): CUDA has no device 5 here: {re.escape(counted)}$"):
        get_arena(5)


# ------------------------------------------------------------------------------------------ public names
def test_public_names_are_sorted_and_importable():
    import wsarena.arena as mod

    assert mod.__all__ == sorted(mod.__all__)
    for name in mod.__all__:
        assert getattr(mod, name) is not None


def test_importing_the_arena_does_not_import_cupy_or_cuda_bindings():
    import subprocess
    import sys

    code = "import sys, wsarena.arena; wsarena.arena.get_arena('cpu').reserve(1); " \
           "print(sorted(m for m in ('cupy', 'cuda.bindings') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("device", "provider_device"), [(0, None), ("cpu", 0), (1, 0)])
def test_set_arena_refuses_an_arena_of_another_device(device, provider_device):
    # get_arena(0) handed the host arena to cuDNN calls (or a device's arena to the NumPy ops) as their workspace
    other = Arena(RecordingProvider(device_id=provider_device))
    before = wsarena.arena._registry._arenas.get(device)
    with pytest.raises(ValueError, match="arena.*device"):
        set_arena(device, other)
    assert wsarena.arena._registry._arenas.get(device) is before  # nothing installed, nothing forgotten
