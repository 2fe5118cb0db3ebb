import gc
import sys

import pytest

import wsarena._config
from wsarena import algos, ops
from wsarena._gpu import gpu_unusable_reason
from wsarena.arena import Arena, HostProvider, _refusals, reset_arenas, streams
from wsarena.arena.testing import RecordingProvider
from wsarena.backends import reset_backends
from wsarena.backends._cpu_backend import CpuBackend

from .arena_helpers import KINDS, ArenaKind, RefusalClock


def pytest_configure(config):
    # Before anything touches cuDNN: its first finalize decides, for the whole process, whether the backend API
    # works (tests/cudnn_probe/driver.py). Where even the stand-in cannot be had, the tests that finalize skip.
    from .cudnn_probe import driver

    config.wsarena_no_driver = driver.load_stand_in()


def pytest_collection_modifyitems(config, items):
    reason = gpu_unusable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"no usable GPU: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _reset_process_state():
    wsarena._config._reset()
    algos.cache_clear()
    ops.records_clear()
    shapes = sys.modules.get("wsarena.torch._shapes")  # wsarena.torch's records of call signatures, where loaded
    if shapes is not None:
        shapes._remembered.clear()
    reset_arenas()
    reset_backends()  # and the cuDNN backend's descriptor cache with it
    streams.forget_kept_stream()  # the cuda.core stream object kept by the last test


@pytest.fixture(autouse=True)
def _fresh_process_state(monkeypatch):
    """Every test starts from the defaults and an empty process: no WSARENA_* variables, no earlier configure(),
    no cached algorithm choice or remembered call, no arena, no backend (nor the descriptors it cached)."""
    for var in wsarena._config._ENV.values():  # every setting's variable (WSARENA_CACHE_DIR: _no_user_cache)
        monkeypatch.delenv(var, raising=False)
    _reset_process_state()
    yield
    _reset_process_state()


@pytest.fixture(autouse=True)
def _no_user_cache(monkeypatch, tmp_path_factory):
    """No test reads or writes the user's search cache: it is off unless a test points WSARENA_CACHE_DIR at a
    folder of its own, and the user cache folder of any child process (which may drop WSARENA_* variables) is a
    temporary one."""
    monkeypatch.setenv("WSARENA_CACHE_DIR", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))


@pytest.fixture
def fresh_arena(monkeypatch):
    """The cpu backend leases from a host arena of this test's own, so the arena's statistics are the test's
    alone."""
    arena = Arena(HostProvider())
    monkeypatch.setattr(CpuBackend, "arena", lambda self: arena)
    yield arena
    arena.close()


@pytest.fixture
def refusal_clock(monkeypatch):
    """The clock the arena times refusals by, stopped: it moves only as the test moves it (``.now``)."""
    clock = RefusalClock()
    monkeypatch.setattr(_refusals, "clock", clock)
    return clock


@pytest.fixture(params=KINDS)
def arena_kind(request):
    """Each kind of arena in turn: a test using it (or ``key``, ``provider``, ``arena``) runs on both."""
    return ArenaKind(request.param)


@pytest.fixture
def key(arena_kind):
    """``key(name)``: the stream a test calls ``name``, as the kind of arena under test keys it."""
    return arena_kind.key


@pytest.fixture
def provider(arena_kind):
    """A ``RecordingProvider`` of the kind under test."""
    return RecordingProvider(device_id=arena_kind.device_id)


@pytest.fixture
def arena(provider):
    """An arena of the kind under test, over ``provider``."""
    return Arena(provider)


@pytest.fixture
def host_provider():
    return RecordingProvider()


@pytest.fixture
def host_arena(host_provider):
    """A host arena: sub-arenas are CPU lanes."""
    return Arena(host_provider)


@pytest.fixture
def device_provider():
    return RecordingProvider(device_id=0)


@pytest.fixture
def device_arena(device_provider):
    """A device arena on host memory: sub-arenas are keyed by CUDA stream handles, handle 2 per thread."""
    return Arena(device_provider)


@pytest.fixture
def frozen_heap():
    """The objects that exist as the test starts, out of the collector's sight for the test (``gc.freeze``). The
    tests that interrupt a step at each place, one run each, collect the garbage of the last run before the next (so
    that no collection, and no finalizer, runs inside the traced step): some run hundreds of times. Over the heap the
    whole suite leaves (some 750,000 objects, PyTorch's among them) each collection took a third of a second, and
    such a test minutes, past its timeout; frozen, a collection looks at what the test itself made."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
