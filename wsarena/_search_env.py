"""What decides a measured algorithm time besides the call itself: the environment half of a search cache key.

A time measured on one GPU, driver, cuDNN or wsarena version, or through one cuDNN API path, says nothing about
another; on the CPU the processor, the cores this process may use, NumPy, its BLAS and the BLAS thread settings
decide it. :func:`environment` gathers these once per backend and device.
"""

from __future__ import annotations

import os
import platform
from typing import Any

from . import _forksafe

__all__ = ["api_path", "environment"]

# BLAS and OpenMP read these when they load: they set how many threads a GEMM uses, and so its time.
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")

_known: dict[tuple[str, Any], dict[str, Any]] = {}
_lock = _forksafe.lock()  # guards _known


def api_path(backend: Any) -> str | None:
    """The convolution API path the backend's searches time: its ``api`` attribute (``"legacy"`` or ``"graph"``
    on cuDNN), ``"legacy"`` for a cuDNN backend without one, ``None`` on the CPU."""
    return getattr(backend, "api", "legacy" if backend.name == "cudnn" else None)


def environment(backend: Any) -> dict[str, Any]:
    """A JSON-ready description of what, besides the call, decides ``backend``'s measured times on its device.

    A backend may describe itself with a ``search_environment()`` method; the built-in ones are described here.
    """
    from . import __version__

    device = backend.device_key()
    key = (backend.name, device)
    found = _known.get(key)
    if found is None:
        own = getattr(backend, "search_environment", None)
        if callable(own):
            facts = dict(own())
        elif backend.name == "cpu":
            facts = _cpu()
        elif backend.name == "cudnn":
            facts = _cudnn(int(device))
        else:
            label = getattr(backend, "device_label", None)
            facts = {"device": label() if callable(label) else str(device)}
        found = {"backend": backend.name, **facts, "wsarena": __version__}
        with _lock:
            _known[key] = found
    return {**found, "api": api_path(backend)}


def _cpu() -> dict[str, Any]:
    import numpy as np

    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 0
    threads = {var: os.environ[var] for var in _THREAD_VARIABLES if os.environ.get(var)}
    return {
        "device": _processor(),
        "machine": platform.machine(),
        "cpus": cpus,
        "numpy": np.__version__,
        "blas": _blas(np),
        "threads": threads,
    }


# The fields of /proc/cpuinfo that name the processor: x86's, then Arm's (no model name: implementer and part number),
# POWER's and RISC-V's. Only the first processor's are read.
_CPUINFO_FIELDS = ("model name", "vendor_id", "cpu family", "model", "stepping",
                   "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "CPU revision",
                   "cpu", "revision", "uarch")


def _processor() -> str:
    """The processor's model name, family and model number (Linux; on Arm its implementer and part number), else what
    :mod:`platform` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            fields: dict[str, str] = {}
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
    except OSError:
        fields = {}
    parts = [fields.get(k, "") for k in _CPUINFO_FIELDS]
    if any(parts):
        return " ".join(p for p in parts if p)
    return platform.processor() or platform.machine()


def _blas(np: Any) -> dict[str, Any]:
    """NumPy's BLAS as its build configuration names it, and the SIMD extensions NumPy found at run time."""
    try:
        conf = np.show_config(mode="dicts")
    except Exception:  # noqa: BLE001 - an older or unusual NumPy: its version alone then keys the times
        return {}
    blas = conf.get("Build Dependencies", {}).get("blas", {})
    simd = conf.get("SIMD Extensions", {})
    return {
        "name": blas.get("name"),
        "version": blas.get("version"),
        "configuration": blas.get("openblas configuration"),
        "simd": list(simd.get("found", [])),
    }


def _cudnn(device: int) -> dict[str, Any]:
    import cupy

    from .cudnn import library_info

    runtime = cupy.cuda.runtime
    props = runtime.getDeviceProperties(device)
    name = props["name"]
    return {
        "device": name.decode() if isinstance(name, bytes) else str(name),
        "compute_capability": f"{props['major']}.{props['minor']}",
        "driver": runtime.driverGetVersion(),
        "cuda_runtime": runtime.runtimeGetVersion(),
        "cudnn": library_info().get("version"),
    }
