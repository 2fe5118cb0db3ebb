import pytest

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
