"""Reading a file that must be a regular one: a model file, the device properties file, a search cache entry.

A FIFO would be waited on until a writer came, for good where none comes, and a character device (``/dev/zero``)
has no end: :func:`read_regular_file` refuses both, and any other file that is no regular one, with
:class:`NotRegularFile`, which each caller words as its own error.
"""

from __future__ import annotations

import errno
import os
import stat

__all__: list[str] = []

# Opened without blocking: a FIFO put in the file's place after it was looked at is then refused, not waited on.
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_READ_FLAGS = os.O_RDONLY | _NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)
_CHUNK = 1 << 16  # what is asked for past the size the file's status gave (it grew meanwhile)


class NotRegularFile(Exception):
    """The path given to :func:`read_regular_file` is no regular file: ``kind`` says what it is (``"a FIFO (named
    pipe)"``), ``folder`` whether it is a folder. No error of wsarena's own: each caller raises its own."""

    def __init__(self, kind: str, folder: bool = False) -> None:
        super().__init__(kind)
        self.kind = kind
        self.folder = folder


def _kind(mode: int) -> str | None:
    """What a file of ``mode`` is, where it is not a regular file; ``None`` for a regular one."""
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    # none of these: a door, or an anonymous inode, which has no type (an epoll's, linked to as /proc/PID/fd/N)
    return next((kind for test, kind in kinds if test(mode)), "a file of another kind")


def _refuse(mode: int) -> None:
    """Raise :class:`NotRegularFile` where ``mode`` is not a regular file's."""
    kind = _kind(mode)
    if kind is not None:
        raise NotRegularFile(kind, stat.S_ISDIR(mode))


def _unopenable(path: str | os.PathLike[str]) -> NotRegularFile:
    """What ``path`` is, after :func:`os.open` refused it with ``ENXIO``, as it refuses a socket and a device with
    no driver: looked at again, as it may have been put in place of a regular file after that was looked at."""
    try:
        mode: int | None = os.stat(path).st_mode
    except OSError:
        mode = None
    kind = None if mode is None else _kind(mode)
    if mode is None or kind is None:  # gone, or a regular file again meanwhile: what was opened is unknown
        return NotRegularFile("a socket or a device with no driver")
    return NotRegularFile(kind, stat.S_ISDIR(mode))


def read_regular_file(path: str | os.PathLike[str], *, limit: int | None = None,
                      look_first: bool = True) -> tuple[bytes, os.stat_result]:
    """The bytes of the file ``path`` (a link is followed), which must be a regular file, and its status; with
    ``limit``, no more than its first ``limit + 1`` bytes, so that the caller can tell a file larger than that.

    What ``path`` is, is looked at before it is opened (``look_first``), so that a device is not even opened (opening
    one may do something: a watchdog's starts it), and again on the descriptor, opened without blocking, as another
    process may have put something else in its place meanwhile. The search cache, which reads an entry in each
    lookup, leaves out the first look: its folder is its own, and a lookup costs a system call less.

    Raises
    ------
    NotRegularFile
        Where ``path`` is no regular file, or one :func:`os.open` refuses as it refuses a socket (``ENXIO``).
    OSError
        What :func:`os.stat`, :func:`os.open` and :func:`os.read` raise otherwise.
    ValueError
        A NUL in ``path``.
    """
    if look_first:
        _refuse(os.stat(path).st_mode)
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise _unopenable(path) from None
        raise
    try:
        st = os.fstat(fd)
        _refuse(st.st_mode)
        if _NONBLOCK:  # a regular file now: read blocking, as a file system that honours O_NONBLOCK on regular files
            os.set_blocking(fd, True)  # (a FUSE one may) could otherwise return part of it, or raise BlockingIOError
        return _read_to_end(fd, st.st_size, limit), st
    finally:
        os.close(fd)


def _read_to_end(fd: int, size: int, limit: int | None) -> bytes:
    """What ``fd`` holds, or its first ``limit + 1`` bytes: asked for in the ``size`` its status gave and a byte
    more, to find the end. A read of the bound itself would take that much memory first, each time (the search cache
    bounds an entry at 16 MiB, some 15 us of an entry's 20 us read)."""
    most = None if limit is None else limit + 1
    parts: list[bytes] = []
    n = 0
    while most is None or n < most:
        # the rest of the size the status gave (a read may return less: Linux's at most 2 GiB), then past it (the
        # file grew meanwhile) on, 64 KiB at a time
        ask = max(size - n + 1, _CHUNK) if parts else size + 1
        chunk = os.read(fd, ask if most is None else min(ask, most - n))
        if not chunk:
            break
        parts.append(chunk)
        n += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)
