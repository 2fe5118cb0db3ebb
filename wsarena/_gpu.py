"""Is a CUDA GPU usable here? A check that never raises, shared by the backends, `wsarena info` and tests."""

from __future__ import annotations

import functools

__all__ = ["gpu_count", "gpu_unusable_reason", "no_such_device"]


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[int, str | None]:
    try:
        from cuda.bindings import runtime
    except Exception as exc:  # noqa: BLE001 - any import failure means "no GPU", with the reason
        return 0, f"cuda-bindings cannot be imported ({exc})"
    try:
        err, count = runtime.cudaGetDeviceCount()
    except Exception as exc:  # noqa: BLE001
        return 0, f"cudaGetDeviceCount raised {type(exc).__name__}: {exc}"
    if err != runtime.cudaError_t.cudaSuccess:
        return 0, f"cudaGetDeviceCount returned {err.name} (no usable CUDA driver or device)"
    if not count:
        return 0, "the CUDA driver sees no device"
    return int(count), None


def gpu_count() -> int:
    """Number of CUDA devices usable by this process (0 when there is no driver or device)."""
    return _probe()[0]


def gpu_unusable_reason() -> str | None:
    """``None`` when a GPU is usable, else one line saying why not."""
    return _probe()[1]


def no_such_device(device: int, count: int) -> str:
    """What is said of CUDA device ``device`` where CUDA counts ``count`` devices, at most ``device``: by
    ``get_arena(device)`` and by the ops on operands that name it."""
    return f"CUDA has no device {device} here: it counts {count}{'' if count == 0 else f' (0 to {count - 1})'}"
