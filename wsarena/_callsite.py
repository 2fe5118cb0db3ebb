"""Where a warning about a convolution call points: the user's line that made the call.

A warning raised deep inside wsarena names the first frame outside the code that stands between the user and the
op: wsarena itself, and the libraries registered with :func:`skip` (:mod:`wsarena.torch` registers PyTorch, whose
module call, autograd and custom-operator machinery lie between a model's line and the op).

A backward pass runs where PyTorch's autograd engine runs it: for CUDA tensors on a thread of the engine's own,
whose stack holds no line of the user's. So :mod:`wsarena.torch` takes the :func:`caller` of each forward and runs
its backward under :func:`reported_at`: a warning from a backward pass names the forward call whose gradient it
computes (the module call), on the CPU as on the GPU.
"""

from __future__ import annotations

import contextvars
import os
import sys
import warnings
from types import FrameType
from typing import Any

__all__ = ["Site", "caller", "reported_at", "skip", "warn"]

Site = tuple[str, int, dict[str, Any]]  # a line: its file name, its number, its module's globals

_skipped: tuple[str, ...] = (os.path.dirname(os.path.abspath(__file__)) + os.sep,)  # wsarena's own files
_site: contextvars.ContextVar[Site | None] = contextvars.ContextVar("wsarena_site", default=None)


def skip(prefix: str) -> None:
    """Pass over frames whose file name starts with ``prefix`` (a library's folder, with its trailing separator)."""
    global _skipped
    if prefix not in _skipped:
        _skipped = (*_skipped, prefix)


def _outside(frame: FrameType) -> FrameType:
    """The first frame from ``frame`` outwards outside the skipped code; the outermost frame when there is none."""
    skipped = _skipped
    while frame.f_back is not None and frame.f_code.co_filename.startswith(skipped):
        frame = frame.f_back
    return frame


def _site_of(frame: FrameType) -> Site:
    return frame.f_code.co_filename, frame.f_lineno, frame.f_globals


def caller() -> Site:
    """The line outside wsarena (and the skipped libraries) that led to the calling function: the site of an
    enclosing :func:`reported_at` block (a forward run by a backward pass, for a gradient of a gradient, was led to
    by the backward's own forward), else the first frame outside."""
    site = _site.get()
    return site if site is not None else _site_of(_outside(sys._getframe(1)))


class reported_at:  # lower case: used as a function
    """Inside the block, :func:`warn` names ``site`` (``None``: the calling line, as outside any block). One block
    per object. A class, not a ``contextlib.contextmanager`` generator, which costs some 0.7 us more: every backward
    pass of :mod:`wsarena.torch` enters one."""

    __slots__ = ("site", "token")

    def __init__(self, site: Site | None) -> None:
        self.site = site
        self.token: contextvars.Token[Site | None] | None = None

    def __enter__(self) -> None:
        self.token = _site.set(self.site)

    def __exit__(self, *exc_info: object) -> None:
        token, self.token = self.token, None
        if token is not None:
            _site.reset(token)


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn(message, category)`` naming the user's line: the site of an enclosing :func:`reported_at`
    block, or else the first frame outside wsarena and the skipped libraries."""
    site = _site.get()
    if site is None:
        site = _site_of(_outside(sys._getframe(1)))
    filename, lineno, module_globals = site
    # What warnings.warn does with the frame it picks: that module's name and registry. Not its module_globals,
    # which CPython's warnings.warn does not pass either: warn_explicit would ask the module's loader for the line's
    # source first and raise what the loader raises (the built-in importer's ImportError for the __main__ of
    # `python -c` or of a program read from stdin); the line's text comes from the file, as for warnings.warn.
    module, registry = module_globals.get("__name__", "<string>"), module_globals.setdefault("__warningregistry__", {})
    warnings.warn_explicit(message, category, filename, lineno, module=module, registry=registry)
