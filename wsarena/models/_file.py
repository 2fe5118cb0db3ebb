"""Reading a model file: only a regular file is read, as :func:`read_model_file` says."""

from __future__ import annotations

import os
import stat

from .._sizes import short_path
from ._layer import ModelError

__all__ = ["read_model_file"]

# Opened without blocking: a FIFO put in the file's place after it was looked at is then refused, not waited on.
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)


def _kind(mode: int) -> str | None:
    """What a file of ``mode`` is, where it is not a regular file; ``None`` for a regular one."""
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    # none of these: a door, or an anonymous inode, which has no type (an epoll's, linked to as /proc/PID/fd/N)
    return next((kind for test, kind in kinds if test(mode)), "a file of another kind")


def read_model_file(path: str) -> bytes:
    """The bytes of the model file ``path`` (a link is followed), which must be a regular file: a FIFO would be
    waited on until a writer came, for good where none comes, and a character device (``/dev/zero``) has no end.

    What ``path`` is, is looked at before it is opened, and again on the descriptor opened without blocking, as
    another process may have put something else in its place meanwhile.

    Raises
    ------
    ModelError
        Naming the path and what it is where it is no regular file, or why it cannot be read.
    """
    where = short_path(path)
    try:
        kind = _kind(os.stat(path).st_mode)
        if kind is None:
            fd = os.open(path, _READ_FLAGS)
            try:
                kind = _kind(os.fstat(fd).st_mode)
                if kind is None:
                    with os.fdopen(fd, "rb", closefd=False) as f:
                        return f.read()
            finally:
                os.close(fd)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ModelError(f"cannot read {where}: {why}") from None
    raise ModelError(f"{where} is {kind}, not a regular file: a model is read from a .onnx or .json file")
