"""Exceptions of the cuDNN bindings and the one :func:`check` every status goes through.

::

    WsarenaError
    ├── BackendUnavailableError (RuntimeError)
    │   ├── CudnnNotFoundError          no loadable libcudnn; lists every place tried and why it failed
    │   ├── CudnnVersionError           libcudnn was found but its major version is not 9
    │   ├── CudnnSymbolError            libcudnn lacks a function wsarena binds
    │   └── CudnnGpuUnavailableError    cudnnCreate failed because no GPU is usable (also a CudnnError)
    └── CudnnError (RuntimeError)       a status other than SUCCESS; ``.status``
        ├── CudnnNotInitializedError, CudnnLicenseError, ...   1xxx, one class each
        ├── CudnnBadParamError                                      2000
        │   └── CudnnBadParamNullPointerError, ...                  2xxx: subclasses of their category
        ├── CudnnNotSupportedError                                  3000
        │   └── CudnnNotSupportedShapeError, ...                    3xxx
        ├── CudnnInternalError                                      4000
        │   └── ...                                                 4xxx (4003, 4004: allocation failed, host or
        │                                                           device; MemoryErrors too)
        └── CudnnExecutionFailedError                               5000
            └── ...                                                 5xxx

There is one subclass per :class:`~wsarena.cudnn.Status` value, generated from the header into
:mod:`wsarena.cudnn._status_errors`. ``CudnnError(status)`` itself returns an instance of the matching subclass,
so ``except CudnnBadParamError`` catches every 2xxx status.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable

from ..errors import BackendUnavailableError, WsarenaError
from ._enums import Status

__all__ = [
    "CudnnError",
    "CudnnGpuUnavailableError",
    "CudnnNotFoundError",
    "CudnnSymbolError",
    "CudnnVersionError",
    "check",
    "error_class",
    "status_message",
]


class CudnnNotFoundError(BackendUnavailableError):
    """No loadable libcudnn 9 was found.

    Attributes
    ----------
    tried : list of tuple of str
        ``(place, why it failed)`` for every place searched, in search order.
    """

    def __init__(self, tried: list[tuple[str, str]]) -> None:
        self.tried = list(tried)
        lines = "\n".join(f"  - {place}: {why}" for place, why in self.tried) or "  (nothing to try)"
        super().__init__(
            "libcudnn.so.9 could not be loaded (install nvidia-cudnn-cu13, or set CUDNN_PATH). Tried:\n" + lines
        )

    def __reduce__(self) -> tuple:
        return (type(self), (self.tried,), self.__dict__)  # the default would pass the message as `tried`


class CudnnVersionError(BackendUnavailableError):
    """A libcudnn was loaded, but it is not cuDNN 9, the only major version wsarena binds."""


class CudnnSymbolError(BackendUnavailableError, AttributeError):
    """The loaded libcudnn does not export a function wsarena needs (raised when it is first bound)."""


class CudnnError(WsarenaError, RuntimeError):
    """A cuDNN call returned a status other than ``SUCCESS``.

    ``CudnnError(status, message)`` returns an instance of the subclass for ``status`` (see the module
    docstring); unknown status values stay plain :class:`CudnnError`.

    Attributes
    ----------
    status : Status or int
        The status the call returned (an ``int`` when this cuDNN is newer than the enum).
    func_name : str or None
        The C function that returned it.
    context : str
        What wsarena was doing (shapes, parameters), or ``""``.
    """

    def __new__(cls, status: int = -1, *args: object, **kwargs: object) -> CudnnError:  # noqa: PYI034
        # CudnnError(status) is an instance of the status's own class, not of CudnnError itself.
        return super().__new__(error_class(status) if cls is CudnnError else cls)

    def __init__(self, status: int, message: str = "", func_name: str | None = None, context: str = "") -> None:
        try:
            self.status: Status | int = Status(status)
        except ValueError:
            self.status = int(status)
        self.func_name = func_name
        self.context = context
        super().__init__(message or _status_text(status))

    def __reduce__(self):  # keeps pickling (multiprocessing, pytest-xdist) working despite __new__
        return (type(self), (int(self.status), str(self), self.func_name, self.context))


class CudnnGpuUnavailableError(BackendUnavailableError, CudnnError):
    """``cudnnCreate`` failed and no CUDA GPU is usable; the message says why (no driver, no device...)."""


def error_class(status: int) -> type[CudnnError]:
    """The exception class raised for ``status`` (plain :class:`CudnnError` for an unknown value)."""
    from ._status_errors import STATUS_ERRORS  # generated; it imports this module for CudnnError

    return STATUS_ERRORS.get(int(status), CudnnError)


def _status_name(status: int) -> str:
    try:
        return f"CUDNN_STATUS_{Status(status).name}"
    except ValueError:
        return f"unknown cuDNN status {int(status)}"


def _status_text(status: int) -> str:
    return f"{_status_name(status)} ({int(status)})"


# Set by the loader once libcudnn is bound: status -> cudnnGetErrorString text, and the last-error reader.
# Kept as hooks so that building an error never loads the library by itself.
_error_string: Callable[[int], str] | None = None
_last_error: Callable[[], str] | None = None
_clear_last: Callable[[], None] | None = None


def clear_last_error() -> None:
    """Drop cuDNN's per-thread last-error message. A success does not clear it, so a message left unread (by
    another library sharing libcudnn, or a call that failed quietly) would otherwise describe the next error."""
    if _clear_last is not None:
        _clear_last()


def _describe(status: int) -> str:
    parts = []
    if _error_string is not None:
        with contextlib.suppress(Exception):  # the description is a courtesy; never mask the real error
            parts.append(_error_string(status))
    if _last_error is not None:
        try:
            last = _last_error()
        except Exception:  # noqa: BLE001
            last = ""
        if last and last not in parts:
            parts.append(last)
    return "; ".join(p for p in parts if p)


def check(status: int, func_name: str, context: str | Callable[[], str] = "") -> None:
    """Raise the :class:`CudnnError` subclass for ``status`` unless it is ``SUCCESS``.

    The message names ``func_name``, the status, cuDNN's own description (``cudnnGetErrorString`` and, when it
    has one, ``cudnnGetLastErrorString``), and ``context`` (what wsarena was doing, e.g. the shapes). ``context``
    may be a function that returns it, called only on failure: the per-convolution calls would otherwise format
    shapes on every call.
    """
    if status == 0:
        return
    if callable(context):
        context = context()
    raise CudnnError(status, status_message(status, func_name, context), func_name, context)


def status_message(status: int, func_name: str, context: str = "") -> str:
    """The text :func:`check` puts in its exception (reads, and so clears, cuDNN's last-error message)."""
    message = f"{func_name} returned {_status_text(status)}"
    described = _describe(status)
    if described:
        message += f": {described}"
    if context:
        message += f" [{context}]"
    return message


def _install_describers(lib: ctypes.CDLL) -> None:
    """Let :func:`check` add cuDNN's own texts; called by :func:`_prototypes._declare_describers` with the library
    where it declared them."""
    global _error_string, _last_error, _clear_last

    def error_string(status: int) -> str:
        text = lib.cudnnGetErrorString(int(status))
        return text.decode(errors="replace") if text else ""

    def last_error() -> str:
        buffer = ctypes.create_string_buffer(1024)
        lib.cudnnGetLastErrorString(buffer, len(buffer))
        return buffer.value.decode(errors="replace").strip()

    scratch = ctypes.create_string_buffer(1)  # reading clears; the text itself is not wanted

    def clear_last() -> None:
        lib.cudnnGetLastErrorString(scratch, 1)

    _error_string = error_string
    _last_error = last_error
    _clear_last = clear_last
