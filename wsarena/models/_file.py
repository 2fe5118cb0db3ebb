"""Reading a model file: only a regular file or a pipe is read, as :func:`read_model_file` says."""

from __future__ import annotations

import stat

from .._files import NotRegularFile, TooLarge, read_regular_file, unexpanded_home
from .._sizes import format_size, short_path
from ._layer import ModelError

__all__ = ["read_model_file"]


def read_model_file(path: str, *, limit: int | None = None, beyond: str = "") -> bytes:
    """The bytes of the model file ``path`` (a link is followed), which must be a regular file or a pipe (a FIFO,
    or ``/dev/fd/N``): a character device (``/dev/zero``) has no end. A pipe is read to its end, as ``cat`` reads
    it, but not waited on until a writer comes: one that none has open reads as empty, which is refused.
    :func:`wsarena._files.read_regular_file` reads it, no larger than ``limit`` where its kind of model has one: a
    regular file larger is refused unread, a pipe once it gives a byte more, saying ``beyond`` of the limit after
    it, where given.

    Raises
    ------
    ModelError
        Naming the path and what it is where it is neither, or a pipe that gave nothing, or why it cannot be read (a
        path is read as written: where one not found begins with ``~`` and names a file once that is expanded, the
        error suggests that file), or its size and ``beyond`` where it is larger than ``limit``.
    """
    where = short_path(path)
    try:
        data, st = read_regular_file(path, limit=limit, pipes=True)
    except TooLarge as exc:
        held = "gave" if exc.size is None else f"holds {format_size(exc.size)} ({exc.size} bytes),"
        said = f"{where} {held} more than {exc.limit} bytes"
        raise ModelError(f"{said}, {beyond}" if beyond else said) from None
    except NotRegularFile as exc:
        raise ModelError(f"{where} is {exc.kind}, not a regular file or a pipe: a model is read from a .onnx or "
                         ".json file") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ModelError(f"cannot read {where}: {why}{unexpanded_home(path, exc)}") from None
    if not data and stat.S_ISFIFO(st.st_mode):  # an empty regular file is the JSON or ONNX reader's to refuse
        raise ModelError(f"{where} is a pipe that gave nothing: no writer had it open, or its writer wrote nothing")
    return data
