"""Reading a file that must be a regular one, or where the caller takes it, a pipe: a model file, the device
properties file, a search cache entry.

A FIFO opened as ``open()`` opens one is waited on until a writer comes, for good where none comes, and a character
device (``/dev/zero``) has no end: :func:`read_regular_file` refuses both, and any other file that is no regular one,
with :class:`NotRegularFile`, which each caller words as its own error. A caller that takes a pipe (``pipes``: a
FIFO, or the anonymous pipe a shell's ``<(command)`` or a pipe on ``/dev/stdin`` names) has it read to its end
without that wait: opened without blocking, which returns at once, then read blocking, which returns what its
writers write until the last of them closes it, or at once an end where it has none. A caller's ``limit`` bounds
what is read: a regular file larger than that is refused unread, a pipe once it gives a byte more
(:class:`TooLarge`). :func:`read_regular_part` reads a part of a regular file, opened as these are, inside a folder
and reached through no link, as onnx reads an external data file.
"""

from __future__ import annotations

import errno
import io
import os
import stat

from ._sizes import short_path

__all__: list[str] = []

# Opened without blocking: a FIFO put in the file's place after it was looked at is then refused, not waited on.
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_READ_FLAGS = os.O_RDONLY | _NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)
_CHUNK = 1 << 16  # what is asked for past the size the file's status gave (it grew meanwhile), and of a pipe


class NotRegularFile(Exception):
    """The path given to :func:`read_regular_file` is no regular file (nor a pipe, where the caller takes one), or
    the one given to :func:`read_regular_part` is no regular file of one link (a symbolic link, a file of several
    hard links): ``kind`` says what it is (``"a FIFO (named pipe)"``), ``folder`` whether it is a folder. No error of
    wsarena's own: each caller raises its own."""

    def __init__(self, kind: str, folder: bool = False) -> None:
        super().__init__(kind)
        self.kind = kind
        self.folder = folder


class TooLarge(Exception):
    """The file given to :func:`read_regular_file` holds more than the caller's ``limit`` of bytes: ``size`` is its
    size, where its status gave it (a regular file, refused unread), or None where it gave more as it was read (a
    pipe, or a file that grew), read no further. No error of wsarena's own: each caller raises its own."""

    def __init__(self, size: int | None, limit: int) -> None:
        super().__init__(f"more than {limit} bytes" if size is None else f"{size} bytes, more than {limit}")
        self.size = size
        self.limit = limit


def _kind(mode: int) -> str | None:
    """What a file of ``mode`` is, where it is not a regular file; ``None`` for a regular one."""
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    # none of these: a door, or an anonymous inode, which has no type (an epoll's, linked to as /proc/PID/fd/N)
    return next((kind for test, kind in kinds if test(mode)), "a file of another kind")


def _refuse(mode: int, pipes: bool) -> None:
    """Raise :class:`NotRegularFile` where ``mode`` is not a regular file's, nor a pipe's where ``pipes``."""
    kind = None if pipes and stat.S_ISFIFO(mode) else _kind(mode)
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


def read_regular_file(path: str | os.PathLike[str], *, limit: int | None = None, look_first: bool = True,
                      pipes: bool = False) -> tuple[bytes, os.stat_result]:
    """The bytes of the file ``path`` (a link is followed), which must be a regular file, or a pipe where ``pipes``,
    and its status; with ``limit``, a file of at most ``limit`` bytes: a regular file whose status gives it more is
    refused unread, and a pipe (or a file that grows as it is read) once ``limit + 1`` bytes are read, no more.

    What ``path`` is, is looked at before it is opened (``look_first``), so that a device is not even opened (opening
    one may do something: a watchdog's starts it), and again on the descriptor, opened without blocking, as another
    process may have put something else in its place meanwhile. The search cache, which reads an entry in each
    lookup, leaves out the first look: its folder is its own, and its read of an entry then makes six system calls
    (open, fstat, the ioctl that makes the descriptor blocking, a read of the entry, a read that finds its end, close)
    where the look would make it seven.

    A pipe (``pipes``) is read to the end of what its writers write, blocking until the last of them closes it, as
    ``cat`` reads it; a FIFO that no writer has open when it is read reads as empty, at once (opened without
    blocking, it is not waited on until a writer comes).

    Raises
    ------
    NotRegularFile
        Where ``path`` is no regular file (nor a pipe, where ``pipes``), or one :func:`os.open` refuses as it refuses
        a socket (``ENXIO``).
    TooLarge
        Where it holds more than ``limit`` bytes.
    OSError
        What :func:`os.stat`, :func:`os.open` and the reads raise otherwise.
    ValueError
        A NUL in ``path``.
    """
    fd, st = _open(path, look_first, pipes)
    try:
        size = st.st_size if stat.S_ISREG(st.st_mode) else 0  # what a pipe's status says is no size
        if limit is not None and size > limit:
            raise TooLarge(size, limit)
        data = _read_to_end(fd, size, limit)
        if limit is not None and len(data) > limit:
            raise TooLarge(None, limit)
        return data, st
    finally:
        os.close(fd)


def unexpanded_home(path: str | os.PathLike[str], exc: BaseException) -> str:
    """What an error that ``path`` cannot be read (``exc``) adds where it was not found, begins with ``~``, and names a
    file once that is expanded: that ``~`` is not expanded, and the file; else nothing. A path is read as written, as
    ``open()`` reads it: a shell expands ``~`` before wsarena sees it (unless it is quoted), and expanded here, a
    folder named ``~`` in the working directory could not be named as plainly."""
    text = os.fspath(path)
    if not isinstance(exc, FileNotFoundError) or not isinstance(text, str) or not text.startswith("~"):
        return ""
    expanded = os.path.expanduser(text)
    if expanded == text or not os.path.exists(expanded) or os.path.isdir(expanded):  # a folder is no model to read
        return ""
    return f" (~ is not expanded, as open() expands none: did you mean {short_path(expanded)}?)"


def read_regular_part(folder: str | os.PathLike[str], location: str, offset: int, length: int) -> bytes:
    """``length`` bytes from ``offset`` of the regular file ``location`` inside the folder ``folder``, fewer where it
    ends sooner: a small tensor's bytes in the external data file of an ONNX model, which may hold gigabytes of
    weights besides. What onnx's own loader refuses is refused (onnx 1.23: ``onnx.checker``'s checks, then an
    ``openat2`` with ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``): a ``location`` empty, absolute or with ``..`` in it,
    or naming a folder (``data/``, ``data/.``), a link anywhere on the way, even to a file inside the folder, and a
    file of several hard links. Each folder on the way is opened from the one before it, and the file from the last,
    none of them through a link (``O_NOFOLLOW``), so that a link put in the place of one after it was looked at is
    refused, not followed out of the folder; the file is opened as :func:`read_regular_file` opens one, so that a
    FIFO put in its place after it was looked at is refused, not waited on until a writer comes. ``folder`` itself is
    opened as its path says, links followed, as onnx opens it. Only where :func:`os.open` opens from a folder's
    descriptor (not on Windows, :data:`OPENS_BENEATH`).

    Raises
    ------
    ValueError
        A ``location`` empty, absolute or with ``..`` in it, or a NUL in it or ``folder``.
    NotRegularFile
        Where ``location`` is no regular file (a link is ``"a symbolic link"``), or one of several hard links.
    OSError
        What :func:`os.open` (a link on the way: ``ELOOP``; a file on the way: ``ENOTDIR``), :func:`os.lseek` (a
        negative ``offset``) and the reads raise otherwise.
    OverflowError
        An ``offset`` or a ``length`` beyond what a file's can be.
    """
    fd = _open_beneath(folder, location)
    try:
        os.lseek(fd, offset, os.SEEK_SET)
        return _read(fd, length)
    finally:
        os.close(fd)


def _read(fd: int, length: int) -> bytes:
    """Up to ``length`` bytes from ``fd``, fewer at the file's end. Its own function, for the loop's jump back: CPython
    3.13 may take a Ctrl-C there outside the caller's try, whose finally closes ``fd`` (python/cpython#130279); raised
    in here, it reaches the caller at the call."""
    parts: list[bytes] = []
    while length > 0:  # a read may return less than asked for
        chunk = os.read(fd, length)
        if not chunk:
            break
        parts.append(chunk)
        length -= len(chunk)
    return b"".join(parts)


# Whether read_regular_part can open a file beneath a folder, through no link: os.open from a folder's descriptor,
# and the flags that refuse a link and a non-folder; Windows has none of them
OPENS_BENEATH = (os.open in os.supports_dir_fd and os.stat in os.supports_dir_fd and hasattr(os, "O_NOFOLLOW")
                 and hasattr(os, "O_DIRECTORY"))


def _open_beneath(folder: str | os.PathLike[str], location: str) -> int:
    """A blocking descriptor, which the caller closes, of the regular file ``location`` inside ``folder``, reached
    through no link, as :func:`read_regular_part` says."""
    if not OPENS_BENEATH:
        raise OSError(errno.ENOTSUP, "opening a file beneath a folder through no link is not supported here")
    _refuse_nul(folder)
    _refuse_nul(location)
    # as onnx.checker refuses them: absolute, or ".." anywhere once normalized, even inside a name ("a..b")
    normal = os.path.normpath(location)
    if not location or os.path.isabs(location) or ".." in normal:
        raise ValueError(f"the location {location!r} is not a relative path inside the folder without '..'")
    *folders, name = normal.split(os.sep)
    if os.path.basename(location) in ("", os.curdir) and name != os.curdir:
        # "data/" and "data/." name a folder, as open() and onnx's loader read them, where normpath() drops the end
        # and left "data", read as a file: the look below sees what it is (a file: ENOTDIR; a folder: refused)
        name += os.sep
    no_link = os.O_NOFOLLOW | _NONBLOCK
    at = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | _NONBLOCK)
    try:
        for part in folders:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | no_link, dir_fd=at)  # a link: ELOOP
            os.close(at)
            at = inner
        if name == os.curdir:  # the folder itself
            raise NotRegularFile("a folder", folder=True)
        mode = os.stat(name, dir_fd=at, follow_symlinks=False).st_mode  # a device is not even opened
        if stat.S_ISLNK(mode):
            raise NotRegularFile("a symbolic link")
        _refuse(mode, pipes=False)
        try:
            fd = os.open(name, _READ_FLAGS | no_link, dir_fd=at)  # a link put there since: ELOOP
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                raise NotRegularFile("a socket or a device with no driver") from None
            raise
    finally:
        os.close(at)
    st = _checked(fd, pipes=False)
    if st.st_nlink > 1:  # onnx refuses it: a hard link made to a file elsewhere is read as one inside
        os.close(fd)
        raise NotRegularFile(f"a file of {st.st_nlink} hard links")
    return fd


def _refuse_nul(path: str | bytes | os.PathLike[str]) -> None:
    """Refuse a NUL in ``path``, in the words of CPython 3.11 and 3.12 (and of a str path's :func:`os.open` there),
    where 3.13, and a bytes path's ``open`` on any of them, names the call that refused it ("stat: embedded null
    character in path"): the errors that relay this one read alike on each, for each path."""
    if "\0" in os.fsdecode(path):
        raise ValueError("embedded null byte")


def _open(path: str | os.PathLike[str], look_first: bool, pipes: bool) -> tuple[int, os.stat_result]:
    """A blocking descriptor of ``path``, which the caller closes, and its status, where it is a regular file, or a
    pipe where ``pipes``: looked at first (``look_first``), then opened without blocking and looked at again, as
    :func:`read_regular_file` says; :class:`NotRegularFile` otherwise."""
    _refuse_nul(path)
    if look_first:
        _refuse(os.stat(path).st_mode, pipes)
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise _unopenable(path) from None
        raise
    return fd, _checked(fd, pipes)


def _checked(fd: int, pipes: bool) -> os.stat_result:
    """The status of ``fd``, opened without blocking, now made blocking, where it is a regular file, or a pipe where
    ``pipes``; closed, and :class:`NotRegularFile` raised, otherwise."""
    try:
        st = os.fstat(fd)
        _refuse(st.st_mode, pipes)
        # Read blocking: a pipe would otherwise raise BlockingIOError where its writer has not written yet, and a
        # file system that honours O_NONBLOCK on regular files (a FUSE one may) could return part of a file.
        if _NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return st


def _read_to_end(fd: int, size: int, limit: int | None) -> bytes:
    """What ``fd`` holds, or its first ``limit + 1`` bytes, of which ``size`` were expected (0: unknown).

    Without a limit, :meth:`io.FileIO.readall` reads it into one buffer, of the size the status gave and a byte
    (grown where the file grew, or a pipe gave more), in as many reads as it takes: Linux reads at most 2 GiB at a
    time, and parts of a larger model file read apart and joined held it twice in memory. With one, the reads here
    ask for the ``size`` and a byte, to find the end, then 64 KiB at a time, never past the bound: a read of the
    bound itself would take that much memory first, each time (the search cache bounds an entry at 16 MiB, some
    15 us of an entry's 20 us read; an ONNX model's bound is 2 GiB). A file read in one part (a regular one below
    2 GiB) is that part; parts are written into one buffer as they come, which grows with them, where parts joined
    held a pipe's bytes twice (an ONNX model piped in, up to its 2 GiB).
    """
    if limit is None:
        with io.FileIO(fd, "r", closefd=False) as f:
            return f.readall()
    most = limit + 1
    first = b""
    rest = io.BytesIO()  # the parts after the first, and the first once there are more; its value is not copied
    n = 0
    while n < most:
        # the rest of the size the status gave (a read may return less), then past it (the file grew meanwhile, or
        # it is a pipe) on, 64 KiB at a time
        chunk = os.read(fd, min(size - n + 1 if n < size else _CHUNK, most - n))
        if not chunk:
            break
        if n == 0:
            first = chunk
        else:
            if first:
                rest.write(first)
                first = b""
            rest.write(chunk)
        n += len(chunk)
    return first if n == len(first) else rest.getvalue()
