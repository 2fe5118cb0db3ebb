"""The search cache's folder as a whole: its size kept within the limit, what ``wsarena cache info`` and ``wsarena
cache clear`` do, and the files that are no entry (a killed writer's temporary file, a dangling symbolic link).
:mod:`wsarena.searchcache` reads and writes the entries, and tells this module what it wrote.

Size: the disk space the entries take stays within the ``search_cache_max_size`` setting
(``WSARENA_SEARCH_CACHE_MAX_SIZE``, default 64 MiB): each file counts the blocks it occupies, or its size where that
is larger (:func:`disk_size`). A write that takes the folder over it removes the least recently used entries, down
to 90 % of it, so that the next trim is a tenth of the limit away, but for the most recently used where it fits the
limit alone; a limit smaller than one entry keeps none, which one warning says. "Used" is the file's modification
time: a write sets it, and a read sets it when it is more than an hour old (as Go's build cache does), so that a
lookup costs no write. Entries of other wsarena versions, drivers or devices are not removed first: another
installation may share the folder, and those no one uses become the least recently used anyway. The folder's size is
learnt by listing it at a process's first write, then kept up to date with what the process writes; it is listed
again when that count passes the limit. With several processes writing at once, the folder can therefore pass the
limit by what the others wrote since this one last listed it, until one of them trims. Reads never list the folder.
Trimming races with the other processes harmlessly: an entry they removed first is gone either way, a write in
progress is a temporary file that no trim touches (a temporary file an hour old is a killed writer's, and is
removed), and a reader that finds its entry gone searches again. A trim that cannot remove files gives one warning.
The size is kept per folder as its resolved path names it, so that a folder reached through a symbolic link is
counted once. A dangling symbolic link in the folder named as an entry or a write in progress (its target gone, or a
loop) is removed by the listing and by :func:`remove_entries`, the link and not what it points to: nothing else
would ever remove it. Files and links named otherwise are not the cache's, and the upkeep never looks at them.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import stat
import time
from pathlib import Path
from typing import Any

from . import _callsite, _forksafe
from ._config import get_config
from ._files import NotRegularFile, TooLarge, read_regular_file
from ._sizes import exact_cap, format_size, os_error_text, short_path
from .errors import SearchCacheWarning

__all__: list[str] = []  # wsarena.searchcache's own: its info() and clear() are the public names

SUBDIR = "search"  # the entries' folder, under the cache directory
TEMP_PREFIX = ".tmp-"  # a write in progress (or a killed writer's)
_STALE_TEMP = 3600.0  # seconds: a temporary file this old is a killed writer's
_TRIM_TO = 0.9  # a trim leaves the entries at this fraction of the limit
# The names of entries (a key's hash) and of writes in progress: the only files the folder's upkeep looks at. The
# folder may hold files of someone else's (a cache directory set to a folder that has a "search" folder of its own),
# and those are never the cache's to count or remove.
_ENTRY_HEX = 40
_TEMP_HEX = 16
_OURS = re.compile(rf"[0-9a-f]{{{_ENTRY_HEX}}}\.json|{re.escape(TEMP_PREFIX)}[0-9a-f]{{{_TEMP_HEX}}}\.json")
# The most a file named as an entry is read of: far more than any entry takes (a few KiB). A larger file is no entry,
# and reading it whole would take its size in memory, and seconds a gigabyte, in a lookup or in cache info.
MAX_ENTRY_BYTES = 16 << 20


def entry_name(key_text: str) -> str:
    """The file name of the entry whose canonical key is ``key_text``."""
    return hashlib.sha256(key_text.encode()).hexdigest()[:_ENTRY_HEX] + ".json"


def temp_name() -> str:
    """A new name for a write in progress (drawn at random: another writer may be writing at the same time)."""
    return f"{TEMP_PREFIX}{secrets.token_hex(_TEMP_HEX // 2)}.json"


def read_entry(path: str | Path) -> tuple[str, os.stat_result]:
    """The text of the file named as an entry, and its status, if it is a regular file, as
    :func:`wsarena._files.read_regular_file` reads one (without looking at the path first: a lookup reads an entry
    each time, and the folder is the cache's own).

    Raises ``IsADirectoryError`` for a folder (or a link to one), ``ValueError`` for any other file that is not a
    regular one, for one that holds more than any entry (:data:`MAX_ENTRY_BYTES`: refused unread where its status
    says so, else once a byte more is read) or is not UTF-8, and what :func:`os.open` and :func:`os.read` raise.
    """
    try:
        data, st = read_regular_file(path, limit=MAX_ENTRY_BYTES, look_first=False)
    except NotRegularFile as exc:
        if exc.folder:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path)) from None
        raise ValueError(f"it is {exc.kind}, not a regular file") from None
    except TooLarge:
        raise ValueError(f"it holds more than {format_size(MAX_ENTRY_BYTES)}, far more than any entry") from None
    return data.decode("utf-8"), st


def ours(name: str) -> bool:
    """Whether ``name`` is an entry's or a write in progress's, as :func:`entry_name` and :func:`temp_name` make
    them."""
    return _OURS.fullmatch(name) is not None


_warned: set[tuple[str, str]] = set()
_warn_lock = _forksafe.lock()  # guards _warned
# Per search folder: its entries' size when this process last listed it, plus what the process wrote since.
known_size: dict[str, int] = {}  # keyed by the resolved path (same_folder)
_size_lock = _forksafe.lock()  # guards known_size (the listing itself runs without it)


def same_folder(folder: Path) -> str:
    """The key of ``folder`` in this process's memos: its resolved path, so that a folder reached through a symbolic
    link, or through two of them, is one folder (counted twice, its size would pass the limit; warned twice, it
    would print its line twice)."""
    return os.path.realpath(folder)


def warn_once(kind: str, where: Path, message: str, also: tuple[str, ...] = ()) -> bool:
    """One :class:`~wsarena.errors.SearchCacheWarning` of each ``kind`` per folder; ``also``: the kinds the message
    says too, then said. Returns whether it warned."""
    folder = same_folder(where)
    with _warn_lock:
        if (kind, folder) in _warned:
            return False
        _warned.update((k, folder) for k in (kind, *also))
    _callsite.warn(message, SearchCacheWarning)
    return True


def disk_size(st: os.stat_result) -> int:
    """What a file counts against the size limit: the disk space it takes (``st_blocks``, in 512-byte units, where
    the system reports it), or its size if that is larger (where it reports none, or compression makes it less).
    An entry of a kilobyte or two takes a whole block, typically 4 KiB: its size alone would let the folder take
    two or three times the limit."""
    return max(getattr(st, "st_blocks", 0) * 512, st.st_size)


def written(folder: Path, nbytes: int) -> None:
    """Count ``nbytes`` just written to ``folder``; trim it when its size as this process knows it passes the limit.

    A replaced entry counts in full, so the count can only run ahead of the folder's size: a trim comes early,
    never late.
    """
    limit = get_config().search_cache_max_size
    if limit is not None and nbytes > limit:  # the trim below removes it: no entry of this size is ever kept
        warn_once("limit", folder, f"a search cache entry takes {format_size(nbytes)} on disk in "
                                   f"{short_path(folder, quoted=False)}, more than search_cache_max_size "
                                   f"({exact_cap(limit)}): the cache keeps no entry; set a limit of some entries at "
                                   "least (WSARENA_CACHE_DIR=off turns it off)")
    where = same_folder(folder)
    with _size_lock:
        known = known_size.get(where)
        if known is not None:  # counted with no limit too: one may be set again later in the process
            known_size[where] = known + nbytes
        if limit is None or (known is not None and known + nbytes <= limit):
            return
    target = int(limit * _TRIM_TO)
    try:
        size, failure = _trim(folder, limit, target)
    except OSError as exc:  # the folder cannot be listed
        size, failure = limit + 1, exc
    if size > limit:
        why = os_error_text(failure) if isinstance(failure, OSError) else failure
        warn_once("trim", folder, f"cannot trim the search cache in {short_path(folder, quoted=False)} to "
                                  f"{exact_cap(limit)}: {why}; it may grow past that")
        size = target  # try again once another tenth of the limit is written, not at every write
    with _size_lock:
        known_size[where] = size


def _trim(folder: Path, limit: int, target: int) -> tuple[int, OSError | None]:
    """Remove the least recently used entries of ``folder`` when they pass ``limit``, down to ``target`` bytes.

    Returns the entries' size after it and the first error that kept an entry from being removed (``None`` when
    none did). Raises ``OSError`` when the folder cannot be listed.
    """
    now = time.time()
    entries: list[tuple[float, str, int]] = []  # (last used, name, size)
    total = 0
    failure: OSError | None = None
    with os.scandir(folder) as listing:
        for item in listing:
            if not ours(item.name):
                continue
            try:
                st = item.stat()
                if stat.S_ISDIR(st.st_mode) and not item.is_symlink():
                    continue  # a folder with an entry's name: no entry, and not the cache's to remove
                if item.name.startswith(TEMP_PREFIX):
                    if now - st.st_mtime > _STALE_TEMP:
                        os.unlink(item.path)
                    continue
            except OSError as exc:  # gone meanwhile (renamed or removed by another process), or a dangling link
                try:
                    if _unlink_dangling(item.path) is None and not isinstance(exc, FileNotFoundError):
                        failure = failure or exc
                except OSError as unlink_exc:
                    failure = failure or unlink_exc
                continue
            nbytes = disk_size(st)
            entries.append((st.st_mtime, item.name, nbytes))
            total += nbytes
    if total <= limit:
        return total, failure
    entries.sort()
    for i, (_, name, nbytes) in enumerate(entries):
        # down to the target, but the most recently used stays where it fits the limit alone (a limit under
        # 1/0.9 entries would remove each entry at the write after its own)
        if total <= target or (i == len(entries) - 1 and total <= limit):
            break
        try:
            os.unlink(folder / name)
        except FileNotFoundError:  # another process's trim removed it first
            pass
        except OSError as exc:
            failure = failure or exc
            continue
        total -= nbytes
    return total, failure


def _unlink_dangling(path: str | Path) -> int | None:
    """Remove ``path`` if it is a symbolic link that leads to no file, and return the disk space it took; ``None``
    when it is not one, or is gone. It leads nowhere when its target is gone, passes through a file as if it were a
    folder, or loops. Such a link is no entry and no write in progress (writers make plain files), and nothing else
    would ever remove it: a lookup finds no file behind it, and a write replaces it only where its name is that of
    the call written. Only the link is removed, never what it points to. ``OSError`` when it cannot be removed."""
    try:
        st = os.lstat(path)
        if not stat.S_ISLNK(st.st_mode):
            return None
        try:
            os.stat(path)
            return None  # it leads somewhere
        except OSError as exc:
            if not leads_nowhere(exc):  # a target this process may not look at is still one
                return None
        os.unlink(path)
    except FileNotFoundError:  # another process removed it first
        return None
    return disk_size(st)


def leads_nowhere(exc: OSError) -> bool:
    """Whether ``exc``, from following a path, says that it resolves to no file (gone, through a file, a loop)."""
    return isinstance(exc, (FileNotFoundError, NotADirectoryError)) or exc.errno == errno.ELOOP


def _entry_files(root: Path) -> list[Path]:
    """The entries' files; none when the folder does not exist yet. ``OSError`` when it cannot be listed (a file
    stands in its place, or it may not be read): every search then goes without the cache, which should not pass
    for an empty one."""
    folder = root / SUBDIR
    try:
        return sorted(p for p in folder.iterdir() if ours(p.name) and not p.name.startswith(TEMP_PREFIX))
    except FileNotFoundError:
        return []


# What reading a file named as an entry raises where it is no readable entry (RecursionError: JSON nested too deep)
_UNREADABLE = (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError)


def _environment(path: str | Path) -> tuple[str | None, ...]:
    """The environment the entry ``path`` was searched in: backend, device, wsarena version and API path, as written
    (the CPU's API path is null), each a string or None, so that they sort. Raises one of :data:`_UNREADABLE` where
    the file is no readable entry."""
    return _environment_in(read_entry(path)[0])


def _environment_in(text: str) -> tuple[str | None, ...]:
    """:func:`_environment` of an entry file's ``text``."""
    env = json.loads(text)["key"]["environment"]
    return tuple(_text(env.get(k)) for k in ("backend", "device", "wsarena", "api"))


def describe(root: Path) -> dict[str, Any]:
    """What :func:`wsarena.searchcache.info` tells of the entries under ``root``: ``entries``, ``size_bytes``,
    ``unreadable`` (files that are no readable entry) and ``environments``. A folder with an entry's name is none of
    these. ``OSError`` when the folder cannot be listed."""
    out: dict[str, Any] = {"entries": 0, "size_bytes": 0, "unreadable": 0}
    groups: dict[tuple, int] = {}
    for path in _entry_files(root):
        size = 0
        try:
            st = path.stat()
            if stat.S_ISDIR(st.st_mode) and not path.is_symlink():
                continue  # a folder with an entry's name: no entry, and not the cache's (the trim leaves it too)
            size = disk_size(st)
            group = _environment(path)
        except _UNREADABLE as exc:
            if isinstance(exc, FileNotFoundError) and not os.path.lexists(path):
                continue  # removed since the listing, by another process's trim or clear: no entry, not a bad one
            out["size_bytes"] += size
            out["unreadable"] += 1
            continue
        out["size_bytes"] += size
        out["entries"] += 1
        groups[group] = groups.get(group, 0) + 1
    out["environments"] = [
        {"backend": b, "device": d, "wsarena": v, "api": a, "entries": n}
        for (b, d, v, a), n in sorted(groups.items(), key=lambda item: tuple(x or "" for x in item[0]))
    ]
    return out


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def remove_entries(root: Path) -> dict[str, int]:
    """Remove the entries under ``root`` as :func:`wsarena.searchcache.clear` says; return ``removed`` (entries),
    ``unreadable`` (files named as entries that were none, as :func:`describe` counts them, but for one that begins
    and ends as entries are written: :func:`_readable`) and ``freed_bytes``.
    ``OSError`` when the folder cannot be listed or an entry cannot be removed."""
    out = {"removed": 0, "unreadable": 0, "freed_bytes": 0}
    folder = root / SUBDIR
    try:
        with os.scandir(folder) as listing:  # each item's type without a call of its own, as iterdir() has not
            # a generator, not a list comprehension, for the with: wsarena.arena._interrupts, rule 8
            items = list(item for item in listing if ours(item.name))  # noqa: C400
    except FileNotFoundError:
        return out
    now = time.time()
    for item in items:
        entry = not item.name.startswith(TEMP_PREFIX)
        path = item.path
        try:
            st = item.stat()
            if stat.S_ISDIR(st.st_mode) and not item.is_symlink():
                continue  # a folder with an entry's name: no entry, and not the cache's to remove
            if not entry and now - st.st_mtime <= _STALE_TEMP:
                continue  # a write in progress
            size = disk_size(st)
            readable = entry and _readable(path)
            os.unlink(path)
        except OSError as exc:  # another process removed or renamed it meanwhile, or a dangling link
            if not leads_nowhere(exc):
                raise
            freed = _unlink_dangling(path)
            if freed is None:
                if isinstance(exc, FileNotFoundError):
                    continue
                raise
            size, readable = freed, False
        if entry:
            out["removed" if readable else "unreadable"] += 1
        out["freed_bytes"] += size
    return out


# How the file of every entry begins and ends, as wsarena.searchcache writes it (json.dumps(..., indent=1) of its
# format, version, key, whose environment comes first, and results; the tests check both against what it writes)
ENTRY_HEAD = '{\n "format": "wsarena-search-cache",\n "version": 1,\n "key": {\n  "environment": {'
ENTRY_TAIL = "\n ]\n}"


def _readable(path: str | Path) -> bool:
    """Whether ``path`` is a readable entry, as :func:`remove_entries` counts them.

    A file that begins and ends as entries are written is one without being parsed, which would take half the time
    of a clear (20,000 entries on tmpfs: 0.78 s of CPU time parsed, 0.38 s not, 0.27 s not read at all): an entry is
    written whole and then renamed into place, so such a file is one a search wrote, and what a full parse finds
    more (a middle damaged on disk, or edited by hand) is counted here among the entries, where :func:`describe`,
    which parses each file, counts it unreadable, and a lookup refuses and replaces it. Any other file is parsed, and
    counts as :func:`describe` counts it.
    """
    try:
        text = read_entry(path)[0]
        if text.startswith(ENTRY_HEAD) and text.endswith(ENTRY_TAIL):
            return True
        _environment_in(text)
    except _UNREADABLE:
        return False
    return True
