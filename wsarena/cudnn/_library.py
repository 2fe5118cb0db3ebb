"""Find and load libcudnn 9 on first use, once per process.

Search order (the first place that gives a usable cuDNN 9 wins)::

    1. CUDNN_PATH        $CUDNN_PATH/lib/libcudnn.so.9, then $CUDNN_PATH/lib64/libcudnn.so.9: a user who sets
                         CUDNN_PATH means that install. Skipped while a libcudnn.so.9 is already loaded in the
                         process (by PyTorch, CuPy, ...): a second copy would bind the first one's sub-libraries.
    2. cuda.pathfinder   load_nvidia_dynamic_lib("cudnn"), in its documented order: a copy already loaded, the
                         nvidia-cudnn wheel in site-packages, conda, the system loader (LD_LIBRARY_PATH, the
                         ld.so cache), then $CUDNN_PATH and $CUDA_PATH. It also loads cuBLASLt, which cuDNN needs.

A place that yields a libcudnn whose major version is not 9, or whose sub-libraries do not load, is recorded and
skipped. When nothing works, :class:`~wsarena.cudnn.CudnnNotFoundError` (or
:class:`~wsarena.cudnn.CudnnVersionError` when only other majors were found) lists every place tried and why it
failed. The outcome, success or failure, is cached; library handles are never closed (the shim libcudnn.so.9
loads its sub-libraries on demand and keeps pointers into them).

Nothing here runs at import time: ``import wsarena.cudnn`` does not load libcudnn.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import _forksafe
from ._errors import CudnnNotFoundError, CudnnVersionError

__all__ = ["LIBRARY_NAME", "LoadedLibrary", "library_info", "load_library"]

LIBRARY_NAME = "libcudnn.so.9"
REQUIRED_MAJOR = 9


@dataclasses.dataclass(frozen=True)
class LoadedLibrary:
    """The libcudnn this process uses.

    Attributes
    ----------
    cdll : ctypes.CDLL
        The library; functions are declared on it by :func:`wsarena.cudnn.bind_all`.
    path : str
        Absolute path of the file loaded, or ``"libcudnn.so.9"`` when cuda.pathfinder reports a copy already
        loaded without its path.
    found_via : str
        Which step of the search order found it: ``"CUDNN_PATH"``, or ``"cuda.pathfinder (<how>)"`` with
        cuda.pathfinder's own ``found_via`` (``site-packages``, ``conda``, ``system-search``,
        ``was-already-loaded-from-elsewhere``, ``CUDNN_PATH``, ``CUDA_PATH``, ...).
    version : int
        ``cudnnGetVersion()``, e.g. 92800 for 9.28.0.
    """

    cdll: ctypes.CDLL
    path: str
    found_via: str
    version: int

    @property
    def version_string(self) -> str:
        """``"9.28.0"`` for version 92800."""
        return _version_string(self.version)


class _Miss(Exception):
    """One search step found nothing usable; ``place`` and the reason go into the not-found report."""

    def __init__(self, place: str, reason: str) -> None:
        super().__init__(reason)
        self.place = place


def _version_string(version: int) -> str:
    if version >= 10000:  # cuDNN >= 9: major * 10000 + minor * 100 + patch
        return f"{version // 10000}.{version // 100 % 100}.{version % 100}"
    return f"{version // 1000}.{version // 100 % 10}.{version % 100}"  # cuDNN <= 8: major * 1000 + ...


def _major(version: int) -> int:
    return version // 10000 if version >= 10000 else version // 1000


def _open(path: str, place: str) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(path)
    except OSError as exc:
        raise _Miss(place, f"dlopen failed: {exc}") from None


def _already_loaded() -> ctypes.CDLL | None:
    """The libcudnn.so.9 this process has already loaded, if any (``RTLD_NOLOAD`` never loads another)."""
    try:
        return ctypes.CDLL(LIBRARY_NAME, mode=os.RTLD_NOLOAD)
    except OSError:
        return None


def _via_cudnn_path() -> tuple[ctypes.CDLL, str, str]:
    root = os.environ.get("CUDNN_PATH")
    if not root:
        raise _Miss(f"$CUDNN_PATH/lib/{LIBRARY_NAME}", "CUDNN_PATH is not set")
    candidates = [Path(root) / folder / LIBRARY_NAME for folder in ("lib", "lib64")]
    path = next((str(c) for c in candidates if c.is_file()), None)
    if path is None:
        raise _Miss(" or ".join(map(str, candidates)), "no such file")
    if _already_loaded() is not None:
        raise _Miss(path, f"skipped: a {LIBRARY_NAME} is already loaded in this process (cuda.pathfinder uses it)")
    return _open(path, path), path, "CUDNN_PATH"


def _via_pathfinder() -> tuple[ctypes.CDLL, str, str]:
    place = "cuda.pathfinder.load_nvidia_dynamic_lib('cudnn')"
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError as exc:
        raise _Miss(place, f"cuda-pathfinder is not importable ({exc})") from None
    try:
        loaded = load_nvidia_dynamic_lib("cudnn")
    except Exception as exc:  # noqa: BLE001 - DynamicLibNotFoundError (cuDNN or cuBLASLt missing), ...
        raise _Miss(place, f"{type(exc).__name__}: {exc}") from None
    via = f"cuda.pathfinder ({loaded.found_via})"
    if loaded.abs_path:
        return _open(loaded.abs_path, place), loaded.abs_path, via
    # LoadedDL.abs_path may be None for a copy loaded by someone else (Linux releases always set it): that copy is
    # the process's libcudnn.so.9, which the loader returns for the name without loading anything new.
    cdll = _already_loaded()
    if cdll is None:
        raise _Miss(place, f"found via {loaded.found_via} without a path, and no {LIBRARY_NAME} is loaded")
    return cdll, LIBRARY_NAME, via


# The search order; tests replace it to simulate a machine without cuDNN.
SEARCH_STEPS: list[tuple[str, Callable[[], tuple[ctypes.CDLL, str, str]]]] = [
    ("CUDNN_PATH", _via_cudnn_path),
    ("cuda.pathfinder", _via_pathfinder),
]

_lock = _forksafe.lock()  # guards _loaded/_failure: one thread searches, the others wait for its outcome
_loaded: LoadedLibrary | None = None
_failure: Exception | None = None


# What the shim libcudnn.so.9 loads (from its own folder first: its RPATH is $ORIGIN) for the calls wsarena
# makes. The shim aborts the process, rather than failing a call, when one is missing: check them first.
SUBLIBRARIES = ("libcudnn_graph.so.9", "libcudnn_ops.so.9", "libcudnn_cnn.so.9")


def _check_sublibraries(path: str) -> None:
    folder = Path(path).parent if os.path.dirname(path) else None  # a bare name: only the loader's search
    for name in SUBLIBRARIES:
        beside = folder / name if folder is not None else None
        try:
            ctypes.CDLL(str(beside) if beside is not None and beside.is_file() else name)
        except OSError as exc:
            raise _Miss(path, f"loaded, but its sub-library {name} cannot be loaded: {exc}") from None


# The engine library that links the NVIDIA driver library (cuDNN 9.27 on), which cuDNN loads at the first finalize
ENGINES_NEEDING_DRIVER = "libcudnn_engines_runtime_compiled.so.9"
DRIVER_LIBRARY = "libcuda.so.1"


def missing_driver_library(path: str) -> str | None:
    """Where the engine library beside the libcudnn at ``path`` cannot be loaded for want of ``libcuda.so.1``, the
    loader's reason; ``None`` otherwise (it loads, or fails for another reason, which cuDNN then reports). Asked
    before cuDNN loads it, whose failure prints a line of cuDNN's own to stderr ("Unable to load any of ...") and is
    final for the process; it stays loaded where it loads, as cuDNN would load it (docs/deviceless.md)."""
    beside = Path(path).parent / ENGINES_NEEDING_DRIVER if os.path.dirname(path) else None
    try:
        ctypes.CDLL(str(beside) if beside is not None and beside.is_file() else ENGINES_NEEDING_DRIVER)
    except OSError as exc:
        return str(exc) if str(exc).startswith(f"{DRIVER_LIBRARY}:") else None
    return None


def _read_version(cdll: ctypes.CDLL) -> int:
    get_version = cdll.cudnnGetVersion
    get_version.argtypes = []
    get_version.restype = ctypes.c_size_t
    return int(get_version())


def _search() -> LoadedLibrary:
    tried: list[tuple[str, str]] = []
    wrong_major = False
    for label, step in SEARCH_STEPS:
        try:
            cdll, path, via = step()
        except _Miss as miss:
            tried.append((miss.place, str(miss)))
            continue
        except Exception as exc:  # noqa: BLE001 - a broken step must not hide the others
            tried.append((label, f"{type(exc).__name__}: {exc}"))
            continue
        try:
            # cuDNN 9's shim, by its name or by its versioned file name (a copy someone else loaded as
            # libcudnn.so.9.x.y); another major is reported as such below.
            if Path(path).name.startswith(LIBRARY_NAME):
                _check_sublibraries(path)
        except _Miss as miss:
            tried.append((miss.place, str(miss)))
            continue
        try:
            version = _read_version(cdll)
        except AttributeError:
            tried.append((path, "loaded, but it exports no cudnnGetVersion (not a cuDNN library)"))
            continue
        if _major(version) != REQUIRED_MAJOR:
            wrong_major = True
            tried.append((path, f"is cuDNN {_version_string(version)}; wsarena needs cuDNN {REQUIRED_MAJOR}"))
            continue
        return LoadedLibrary(cdll=cdll, path=path, found_via=via, version=version)
    if wrong_major:
        lines = "; ".join(f"{place}: {why}" for place, why in tried)
        raise CudnnVersionError(f"no cuDNN {REQUIRED_MAJOR} found ({lines})")
    raise CudnnNotFoundError(tried)


def load_library() -> LoadedLibrary:
    """Load libcudnn 9 (first call) or return the library already loaded.

    Raises
    ------
    CudnnNotFoundError
        No place in the search order (module docstring) gave a loadable libcudnn.
    CudnnVersionError
        Only libraries of another major version were found.
    """
    global _loaded, _failure
    loaded = _loaded
    if loaded is not None:
        return loaded
    with _lock:
        if _loaded is None:
            if _failure is not None:
                raise _failure.with_traceback(None)  # else each raise would add to one traceback for good
            try:
                _loaded = _search()
            except (CudnnNotFoundError, CudnnVersionError) as exc:
                _failure = exc
                raise
        return _loaded


def _reset() -> None:
    """Forget the cached outcome so the next call searches again (for tests; never unloads anything)."""
    global _loaded, _failure
    with _lock:
        _loaded = None
        _failure = None


def library_info() -> dict[str, Any]:
    """What ``wsarena info`` reports about cuDNN, loading it if needed; never raises.

    Returns
    -------
    dict
        ``found`` (bool), ``version`` (int, e.g. 92800, or ``None``), ``version_string`` (``"9.28.0"``),
        ``cudart_version`` (the CUDA runtime cuDNN was built for), ``path``, ``found_via``, and ``error``
        (``None``, or why cuDNN is not usable). When not found, ``tried`` lists ``[place, reason]`` pairs.
    """
    info: dict[str, Any] = {
        "found": False,
        "version": None,
        "version_string": None,
        "cudart_version": None,
        "path": None,
        "found_via": None,
        "error": None,
    }
    try:
        loaded = load_library()
    except Exception as exc:  # noqa: BLE001 - this function reports, it does not raise
        info["error"] = str(exc)
        if isinstance(exc, CudnnNotFoundError):
            info["tried"] = [list(pair) for pair in exc.tried]
        return info
    info.update(
        found=True,
        version=loaded.version,
        version_string=loaded.version_string,
        path=loaded.path,
        found_via=loaded.found_via,
    )
    get_cudart = getattr(loaded.cdll, "cudnnGetCudartVersion", None)  # every cuDNN 9 has it; a stand-in may not
    if get_cudart is not None:
        get_cudart.argtypes = []
        get_cudart.restype = ctypes.c_size_t
        info["cudart_version"] = int(get_cudart())
    return info
