"""What ``wsarena info`` prints: versions (PyTorch's too), library paths, devices, the backend ``auto`` picks, the
settings in force with where each comes from, and the ``WSARENA_*`` variables no setting reads.

Every probe here reports failure as text instead of raising, so the command works on any machine.
"""

from __future__ import annotations

import importlib.util
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from . import __version__
from ._config import _SIZES, in_force, unknown_variables
from ._gpu import gpu_count, gpu_unusable_reason
from ._report_cli import printable
from ._sizes import exact_cap

__all__ = ["collect_info", "render_info"]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cuda_versions() -> dict[str, Any]:
    out: dict[str, Any] = {"runtime": None, "driver": None}
    try:
        from cuda.bindings import runtime
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        out["error"] = f"cuda-bindings cannot be imported: {exc}"
        return out
    for key, call in (("runtime", runtime.cudaRuntimeGetVersion), ("driver", runtime.cudaDriverGetVersion)):
        try:
            err, value = call()
        except Exception as exc:  # noqa: BLE001
            out[key] = f"unavailable ({exc})"
            continue
        if err != runtime.cudaError_t.cudaSuccess:
            out[key] = f"unavailable ({getattr(err, 'name', err)})"
        elif not value:  # cudaDriverGetVersion succeeds with 0 when no driver is installed
            out[key] = "none installed"
        else:
            out[key] = f"{value // 1000}.{value % 1000 // 10}"
    return out


def _devices() -> list[dict[str, Any]]:
    devices: list[dict[str, Any]] = []
    if gpu_count() == 0:
        return devices
    try:
        import cupy

        for i in range(gpu_count()):
            props = cupy.cuda.runtime.getDeviceProperties(i)
            name = props["name"]
            devices.append(
                {
                    "ordinal": i,
                    "name": name.decode() if isinstance(name, bytes) else str(name),
                    "memory_bytes": int(props["totalGlobalMem"]),
                    "compute_capability": f"{props['major']}.{props['minor']}",
                }
            )
    except Exception as exc:  # noqa: BLE001
        devices.append({"error": f"cannot query devices: {exc}"})
    return devices


def _cudnn() -> dict[str, Any]:
    try:
        from .cudnn import library_info
    except Exception as exc:  # noqa: BLE001
        return {"found": False, "error": f"wsarena.cudnn cannot be imported: {exc}"}
    return library_info()


def _torch() -> dict[str, Any]:
    """PyTorch as ``wsarena.torch`` finds it: ``installed`` (a ``torch`` package is found); once imported, its
    ``version`` and ``cuda``, the CUDA version its build is for (``None`` for a CPU build); or ``error``, why it cannot
    be imported. Importing it takes a second or two, as a report of the environment is expected to (PyTorch's own
    ``collect_env`` imports it): a torch installed but broken (a CUDA library missing) is what it should show. Only an
    import tells that: the package's metadata and ``torch/version.py``, read as files, give the version and the build
    in 3 ms, and a torch that fails to import as well; an import in a child process takes longer (2.9 to 3.5 s against
    1.5 to 2.2 s here, on a loaded 2-core x86_64)."""
    out: dict[str, Any] = {"installed": False, "version": None, "cuda": None, "error": None}
    try:
        out["installed"] = importlib.util.find_spec("torch") is not None
        if not out["installed"]:
            return out
        import torch

        out["version"] = str(torch.__version__)
        cuda = getattr(getattr(torch, "version", None), "cuda", None)
        out["cuda"] = None if cuda is None else str(cuda)
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        lines = str(exc).strip().splitlines()
        out["error"] = f"cannot be imported: {type(exc).__name__}" + (f": {lines[0]}" if lines else "")
    return out


def _settings() -> dict[str, dict[str, Any]]:
    """The settings in force, each as ``{"value", "source", "error"}`` (:func:`wsarena._config.in_force`), JSON-ready:
    a size in bytes or ``None``, ``cache_dir`` a str or ``None`` (no cache); ``value`` is ``None`` where ``error``
    says that its environment variable is invalid."""
    return {
        name: {"value": None if error is not None else str(value) if isinstance(value, Path) else value,
               "source": source, "error": error}
        for name, (value, source, error) in in_force().items()
    }


def _shown_setting(name: str, value: Any) -> str:
    """A setting's value as the text form shows it, as the setting takes it back: a size exactly (``4000 B``, not
    ``3.91 KiB``), ``none`` and ``off``."""
    if name == "cache_dir":
        return "off" if value is None else printable(value)
    if isinstance(value, bool):
        return "on" if value else "off"
    if name in _SIZES:  # the settings given in bytes, as _config names them
        return exact_cap(value)
    return str(value)


def collect_info() -> dict[str, Any]:
    """Gather everything ``wsarena info`` reports, as a JSON-ready dict; never raises."""
    from .backends import resolve_backend_name

    return {
        "wsarena_version": __version__,
        "python": f"{platform.python_implementation()} {sys.version.split()[0]}",
        "platform": platform.platform(),
        "packages": {
            name: _version(dist)
            for name, dist in (
                ("numpy", "numpy"),
                ("cupy", "cupy-cuda13x"),
                ("cuda-bindings", "cuda-bindings"),
                ("cuda-pathfinder", "cuda-pathfinder"),
                ("nvidia-cudnn", "nvidia-cudnn-cu13"),
                ("onnx", "onnx"),
            )
        },
        "cudnn": _cudnn(),
        "cuda": _cuda_versions(),
        "gpu": {"usable": gpu_unusable_reason() is None, "reason": gpu_unusable_reason(), "devices": _devices()},
        "auto_backend": resolve_backend_name("auto"),
        "torch": _torch(),
        "settings": _settings(),
        "unknown_variables": [{"name": name, "closest": closest} for name, closest in unknown_variables().items()],
    }


def render_info(data: dict[str, Any]) -> str:
    """The text form of :func:`collect_info`'s dict."""
    lines = [f"wsarena {data['wsarena_version']}  ({data['python']}, {data['platform']})", "packages:"]
    for name, version in data["packages"].items():
        lines.append(f"  {name:<16} {version or 'not installed'}")
    torch = data["torch"]
    if torch["error"] is not None:
        shown = torch["error"]
    elif torch["version"] is None:
        shown = "not installed"
    else:
        shown = f"{torch['version']} ({'CPU build' if torch['cuda'] is None else 'built for CUDA ' + torch['cuda']})"
    lines.append(f"  {'torch':<16} {printable(shown)}")  # an error's text may hold a tab or an escape sequence
    cudnn = data["cudnn"]
    if cudnn.get("found"):
        cudart = cudnn.get("cudart_version")
        built = f", built for CUDA {cudart // 1000}.{cudart % 1000 // 10}" if cudart else ""
        lines.append(f"cuDNN: {cudnn.get('version_string', cudnn.get('version'))} at {cudnn.get('path')} "
                     f"(found via {cudnn.get('found_via')}{built})")
    else:
        lines.append(f"cuDNN: not usable: {cudnn.get('error')}")
    cuda = data["cuda"]
    runtime = cuda.get("runtime") or cuda.get("error")
    lines.append(f"CUDA runtime (cuda-bindings): {runtime}   driver: {cuda.get('driver') or '-'}")
    gpu = data["gpu"]
    if gpu["usable"]:
        for dev in gpu["devices"]:
            if "error" in dev:
                lines.append(f"device: {dev['error']}")
            else:
                lines.append(
                    f"device {dev['ordinal']}: {dev['name']} (sm_{dev['compute_capability'].replace('.', '')}, "
                    f"{dev['memory_bytes'] / 2**30:.0f} GiB)"
                )
    else:
        lines.append(f"devices: none ({gpu['reason']})")
    lines.append(f"backend 'auto' picks: {data['auto_backend']}")
    lines.append("settings (and where each comes from):")
    for name, setting in data["settings"].items():
        if setting["error"] is not None:
            lines.append(f"  {name:<22} invalid: {setting['error']}")
        else:
            lines.append(f"  {name:<22} {_shown_setting(name, setting['value'])} ({setting['source']})")
    if data["unknown_variables"]:
        lines.append("environment variables not read by the wsarena package:")
        for var in data["unknown_variables"]:
            hint = "" if var["closest"] is None else f"  (did you mean {var['closest']}?)"
            # cut in the middle where long, as wsarena's errors quote a value (short_repr): a 100 kB name gave a 100 kB
            # line; cut as typed, not as repr() writes it, whose escapes a backslash or a quote would get
            shown = printable(var["name"])
            lines.append(f"  {shown if len(shown) <= 60 else shown[:28] + '...' + shown[-29:]}{hint}")
    return "\n".join(lines) + "\n"
