import pytest

from wsarena import algos
from wsarena.arena import Arena, HostProvider
from wsarena.backends._cpu_backend import CpuBackend

import wsarena._config
from wsarena._gpu import gpu_unusable_reason


def pytest_collection_modifyitems(config, items):
    reason = gpu_unusable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"no usable GPU: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_config(monkeypatch):
    """Every test starts from the defaults: no WSARENA_* variables, no earlier configure()."""
    for var in ("WSARENA_CAP_WORKSPACE", "WSARENA_ALGO_SEARCH", "WSARENA_BACKEND", "WSARENA_DEBUG"):
        monkeypatch.delenv(var, raising=False)
    wsarena._config._reset()
    yield
    wsarena._config._reset()


@pytest.fixture(autouse=True)
def _no_user_cache(monkeypatch, tmp_path_factory):
    """No test reads or writes the user's search cache: it is off unless a test points WSARENA_CACHE_DIR at a
    folder of its own, and the user cache folder of any child process (which may drop WSARENA_* variables) is a
    temporary one."""
    monkeypatch.setenv("WSARENA_CACHE_DIR", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))


@pytest.fixture
def fresh_arena(monkeypatch):
    """The cpu backend leases from a host arena of this test's own (and the algorithm cache starts empty), so
    the arena's statistics are the test's alone."""
    arena = Arena(HostProvider())
    monkeypatch.setattr(CpuBackend, "arena", lambda self: arena)
    algos.cache_clear()
    yield arena
    algos.cache_clear()
    arena.close()
