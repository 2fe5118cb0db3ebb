"""Process-wide settings: the workspace cap, the algorithm search, the backend and debug checks.

Precedence, lowest first: built-in defaults, environment variables (read once, on first use),
:func:`configure`, and the innermost :func:`config` block of the current thread or task.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import threading
from collections.abc import Iterator
from typing import Any

from ._sizes import parse_size

__all__ = ["ALGO_SEARCHES", "BACKENDS", "Config", "config", "configure", "get_config"]

ALGO_SEARCHES = ("heuristic", "exhaustive")
BACKENDS = ("auto", "cudnn", "cpu")

_ENV = {
    "cap_workspace": "WSARENA_CAP_WORKSPACE",
    "algo_search": "WSARENA_ALGO_SEARCH",
    "backend": "WSARENA_BACKEND",
    "debug": "WSARENA_DEBUG",
}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclasses.dataclass(frozen=True)
class Config:
    """The settings in force. Build changes with :func:`configure` or :func:`config`, not by hand.

    Attributes
    ----------
    cap_workspace : int or None
        Largest workspace, in bytes, that any single convolution call may use; ``None`` for no cap.
    algo_search : str
        ``"heuristic"`` (cuDNN's ranked guesses, no timing) or ``"exhaustive"`` (time the candidates).
    backend : str
        ``"auto"`` (cuDNN for CuPy arrays, CPU for NumPy arrays), ``"cudnn"`` or ``"cpu"``.
    debug : bool
        Poison released workspace bytes and check that live leases on different streams never overlap.
    """

    cap_workspace: int | None = None
    algo_search: str = "heuristic"
    backend: str = "auto"
    debug: bool = False

    def __post_init__(self) -> None:
        if self.cap_workspace is not None:
            object.__setattr__(self, "cap_workspace", parse_size(self.cap_workspace))
        if self.algo_search not in ALGO_SEARCHES:
            raise ValueError(f"algo_search must be one of {ALGO_SEARCHES}, not {self.algo_search!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {self.backend!r}")
        if not isinstance(self.debug, bool):
            raise TypeError(f"debug must be True or False, not {self.debug!r}")


def _parse_cap(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in ("", "none"):
        return None
    return parse_size(value)


def _from_env() -> Config:
    values: dict[str, Any] = {}
    for key, var in _ENV.items():
        raw = os.environ.get(var)
        if raw is None:
            continue
        try:
            if key == "cap_workspace":
                values[key] = _parse_cap(raw)
            elif key == "debug":
                low = raw.strip().lower()
                if low not in _TRUE | _FALSE:
                    raise ValueError(f"expected 0 or 1, not {raw!r}")
                values[key] = low in _TRUE
            else:
                values[key] = raw.strip().lower()
            Config(**values)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"environment variable {var}={raw!r}: {exc}") from None
    return Config(**values)


_lock = threading.Lock()  # guards _base; readers take the reference without it (assignment is atomic)
_base: Config | None = None
_override: contextvars.ContextVar[Config | None] = contextvars.ContextVar("wsarena_config", default=None)


def _replace(base: Config, changes: dict[str, Any]) -> Config:
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(Config)})
    if unknown:
        raise TypeError(f"unknown setting(s) {', '.join(map(repr, unknown))}; known: {', '.join(_ENV)}")
    if "cap_workspace" in changes:
        changes = {**changes, "cap_workspace": _parse_cap(changes["cap_workspace"])}
    return dataclasses.replace(base, **changes)


def _base_config() -> Config:
    global _base
    base = _base
    if base is None:
        with _lock:
            if _base is None:
                _base = _from_env()
            base = _base
    return base


def get_config() -> Config:
    """Return the settings in force for the calling thread or task (a frozen :class:`Config`)."""
    override = _override.get()
    return override if override is not None else _base_config()


def configure(**changes: Any) -> Config:
    """Change the process-wide settings and return the new :class:`Config`.

    Keywords: ``cap_workspace`` (bytes, a size string such as ``"256MiB"``, or ``None``), ``algo_search``,
    ``backend``, ``debug``. Invalid values raise and change nothing.
    """
    global _base
    with _lock:
        new = _replace(_base if _base is not None else _from_env(), changes)
        _base = new
    return new


@contextlib.contextmanager
def config(**changes: Any) -> Iterator[Config]:
    """Override settings for the body of a ``with`` block, in this thread or task only."""
    token = _override.set(_replace(get_config(), changes))
    try:
        yield _override.get()
    finally:
        _override.reset(token)


def _reset() -> None:
    """Forget every change and re-read the environment on next use (for tests)."""
    global _base
    with _lock:
        _base = None
