"""The persistent search cache: exhaustive-search results kept across processes.

An exhaustive search times every candidate algorithm of a call; this cache keeps each candidate's time and
workspace on disk, so that a restarted job (and ``wsarena tune``, and :func:`wsarena.plan`) searches nothing it
searched before. The ops, the planner and ``tune`` all reach it through :func:`wsarena.algos.select`.

Where: the ``cache_dir`` setting (``configure(cache_dir=...)``, ``config(cache_dir=...)``, ``WSARENA_CACHE_DIR``;
``off`` or ``None`` turns the cache off), by default the user's cache folder
(``platformdirs.user_cache_dir("wsarena")``: ``$XDG_CACHE_HOME/wsarena`` or ``~/.cache/wsarena`` on Linux). Entries
are files under its ``search/`` folder, one per call, named by a hash of their key. A key is the environment
(:func:`wsarena._search_env.environment`: device and compute capability, driver and cuDNN versions, on the CPU the
processor, NumPy and its BLAS; wsarena's version; the API path) and the call: the pass and the whole geometry
(shapes, dtype, layout, every convolution parameter). Each file holds its key, so a file that does not match is
recognised.

Safety: a file is written whole to a temporary name and renamed over the entry, so a reader sees the old entry or
the new one, never part of one, and processes writing at once lose no entry (each call is its own file; two writers
of the same call both write complete results). A truncated, corrupt or foreign file is ignored and replaced, with
one :class:`~wsarena.errors.SearchCacheWarning` for the first such file of the folder; a directory that cannot be
written gives one warning and the process goes on without saving.

Size: the disk space the entries take stays within the ``search_cache_max_size`` setting
(``WSARENA_SEARCH_CACHE_MAX_SIZE``, default 64 MiB): each file counts the blocks it occupies, or its size where that
is larger (:func:`_disk_size`). A write that takes the folder over it removes the least recently used entries, down
to 90 % of it, so that the next trim is a tenth of the limit away. "Used" is the file's modification time: a write
sets it, and a read sets it when it is more than an hour old (as Go's build cache does), so that a lookup costs no
write. Entries of other wsarena versions, drivers or devices are not removed first: another installation may share
the folder, and those no one uses become the least recently used anyway. The folder's size is learnt by listing it
at a process's first write, then kept up to date with what the process writes; it is listed again when that count
passes the limit. With several processes writing at once, the folder can therefore pass the limit by what the others
wrote since this one last listed it, until one of them trims. Reads never list the folder. Trimming races with the
other processes harmlessly: an entry they removed first is gone either way, a write in progress is a temporary file
that no trim touches (a temporary file an hour old is a killed writer's, and is removed), and a reader that finds
its entry gone searches again. A trim that cannot remove files gives one warning. The size is kept per folder as
its resolved path names it, so that a folder reached through a symbolic link is counted once. A dangling symbolic
link in the folder (its target gone, or a loop) is removed by the listing and by :func:`clear`, the link and not
what it points to: nothing else would ever remove it.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import secrets
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import _callsite, _forksafe
from ._config import get_config
from ._search_env import environment
from ._sizes import format_size
from .backends import Candidate
from .errors import SearchCacheWarning

__all__ = ["ENV_VAR", "cache_dir", "clear", "counts", "info", "search", "source"]

ENV_VAR = "WSARENA_CACHE_DIR"
_FORMAT = "wsarena-search-cache"
_VERSION = 1
_SUBDIR = "search"
_TEMP_PREFIX = ".tmp-"
_MARK_USED_AFTER = 3600.0  # seconds: a read older than this marks the entry used (sets its modification time)
_STALE_TEMP = 3600.0  # seconds: a temporary file this old is a killed writer's
_TRIM_TO = 0.9  # a trim leaves the entries at this fraction of the limit

_Results = dict[tuple[str, int | None], tuple[int, float | None]]  # (algo, math type) -> (workspace, ms or None)
_Measure = Callable[[], tuple[list[Candidate], list[Candidate]]]

_warned: set[tuple[str, str]] = set()
_warn_lock = _forksafe.lock()  # guards _warned
# Per search folder: its entries' size when this process last listed it, plus what the process wrote since.
_known_size: dict[str, int] = {}  # keyed by the resolved path (_same_folder)
_size_lock = _forksafe.lock()  # guards _known_size (the listing itself runs without it)
# Searches of this process: answered from the cache ("read") or timed ("timed"). A list of two ints: += on an item
# is not atomic across threads, and a miscount under a race costs only a figure of a report.
_counts = [0, 0]


def cache_dir() -> Path | None:
    """The cache directory in force now (the ``cache_dir`` setting), or ``None`` when the cache is off."""
    return get_config().cache_dir


def source() -> str:
    """Which setting gives the folder in force (or turns the cache off): ``"config"`` (a :func:`~wsarena.config`
    block), ``"configure"`` (:func:`~wsarena.configure`), ``"environment"`` (``WSARENA_CACHE_DIR``) or
    ``"default"`` (the user's cache folder). A setting that gives the same folder as the one below it is not told
    apart from it: either names the folder in force."""
    from ._config import _base_state, overridden

    base, _, (env, env_set) = _base_state()  # the environment as the settings read it, not as it is now
    block = overridden()
    if block is not None and block.cache_dir != base.cache_dir:
        return "config"
    if base.cache_dir != env.cache_dir:
        return "configure"
    return "environment" if "cache_dir" in env_set else "default"


def search(
    backend: Any, pass_: str, geom: Any, candidates: Sequence[Candidate], measure: _Measure
) -> tuple[list[Candidate], list[Candidate]]:
    """The exhaustive search of ``candidates``: from the cache when it holds all of them, else ``measure()``.

    Returns what ``measure`` returns, ``(timed, skipped)``: the timed candidates fastest first, and those the
    search had no memory to time. A fresh measurement is saved (merged into what the entry held): each timed
    candidate's time and workspace, and as rejected those the backend's search dropped. Candidates skipped for
    memory are not saved, so a later search times them.
    """
    root = cache_dir()
    if root is None or not candidates:
        _counts[1] += 1
        return measure()
    key = _key(backend, pass_, geom)
    path = root / _SUBDIR / (hashlib.sha256(_canonical(key).encode()).hexdigest()[:40] + ".json")
    stored = _read(path, key)
    if stored is not None and all((c.algo, c.math_type) in stored for c in candidates):
        names = {c.algo for c in candidates}
        limit = max(c.workspace_bytes for c in candidates)
        timed = [
            Candidate(algo, nbytes, ms, math)
            for (algo, math), (nbytes, ms) in stored.items()
            if ms is not None and algo in names and nbytes <= limit
        ]
        if timed:
            _counts[0] += 1
            return sorted(timed, key=lambda c: c.time_ms or 0.0), []
    _counts[1] += 1
    timed, skipped = measure()
    if timed:
        results = dict(stored or {})
        left_out = {(c.algo, c.math_type) for c in (*timed, *skipped)}
        results.update({(c.algo, c.math_type): (c.workspace_bytes, None) for c in candidates
                        if (c.algo, c.math_type) not in left_out})
        results.update({(c.algo, c.math_type): (c.workspace_bytes, c.time_ms) for c in timed})
        _write(path, key, results)
    return timed, skipped


def counts() -> tuple[int, int]:
    """``(read, timed)``: how many exhaustive searches of this process the cache answered, and how many timed
    their candidates (the cache off, or not holding them all). Searches the in-process algorithm cache answers
    reach neither."""
    return _counts[0], _counts[1]


def _key(backend: Any, pass_: str, geom: Any) -> dict[str, Any]:
    fields = {f.name: getattr(geom, f.name) for f in dataclasses.fields(geom)}
    # Through JSON once, so that the key compares equal to the one read back from a file (tuples become lists).
    return json.loads(json.dumps({"environment": environment(backend), "pass": str(pass_), "geometry": fields}))


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _same_folder(folder: Path) -> str:
    """The key of ``folder`` in this process's memos: its resolved path, so that a folder reached through a symbolic
    link, or through two of them, is one folder (counted twice, its size would pass the limit; warned twice, it
    would print its line twice)."""
    return os.path.realpath(folder)


def _warn_once(kind: str, where: Path, message: str) -> None:
    seen = (kind, _same_folder(where))
    with _warn_lock:
        if seen in _warned:
            return
        _warned.add(seen)
    _callsite.warn(message, SearchCacheWarning)


def _warn_bad(path: Path, exc: Exception) -> None:
    """One warning per folder, not per file: a crash or a full disk can spoil many entries at once, and each
    would otherwise add a line to the output of the job that replaces them."""
    _warn_once("bad", path.parent, f"ignoring the search cache file {path}: {exc}; it will be replaced, as will "
                                   "any other bad file in this folder, without another warning")


def _read(path: Path, key: dict[str, Any]) -> _Results | None:
    """The entry's results, or ``None`` when there is none (or none usable: then one warning says why)."""
    try:
        with path.open("rb") as f:
            modified = os.fstat(f.fileno()).st_mtime
            text = f.read().decode("utf-8")
    except (FileNotFoundError, NotADirectoryError):
        return None
    except UnicodeDecodeError as exc:
        _warn_bad(path, exc)
        return None
    except OSError as exc:
        _warn_once("read", path.parent, f"cannot read the search cache in {path.parent}: {exc}; searching afresh")
        return None
    try:
        results = _parse(json.loads(text), key)
    except (ValueError, TypeError, KeyError, RecursionError) as exc:  # RecursionError: JSON nested too deep
        _warn_bad(path, exc)
        return None
    if time.time() - modified > _MARK_USED_AFTER:
        try:
            os.utime(path)  # used now: the last to go when the cache is trimmed
        except OSError:  # a folder this process may read but not write: nothing to mark, nothing it trims
            pass
    return results


def _parse(data: Any, key: dict[str, Any]) -> _Results:
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise ValueError("not a wsarena search cache file")
    if data.get("version") != _VERSION:
        raise ValueError(f"format version {data.get('version')!r}, this wsarena reads {_VERSION}")
    if data.get("key") != key:
        raise ValueError(f"it holds another key (written by wsarena {_written_by(data.get('key'))})")
    results: _Results = {}
    for entry in data["results"]:
        algo, math, nbytes, ms = entry["algo"], entry["math_type"], entry["workspace_bytes"], entry["time_ms"]
        if not isinstance(algo, str) or not (math is None or type(math) is int) or type(nbytes) is not int:
            raise ValueError(f"malformed entry {entry!r}")
        if nbytes < 0 or not (ms is None or (isinstance(ms, (int, float)) and ms >= 0)):
            raise ValueError(f"malformed entry {entry!r}")
        results[(algo, math)] = (nbytes, None if ms is None else float(ms))
    return results


def _written_by(key: Any) -> Any:
    """The wsarena version a file's key names, or ``None`` where it names none (a foreign or damaged file)."""
    env = key.get("environment") if isinstance(key, dict) else None
    return env.get("wsarena") if isinstance(env, dict) else None


def _write(path: Path, key: dict[str, Any], results: _Results) -> None:
    """Write the entry whole under a temporary name, then rename it over ``path``; warn once if it cannot."""
    entries = [
        {"algo": algo, "math_type": math, "workspace_bytes": nbytes, "time_ms": ms}
        for (algo, math), (nbytes, ms) in results.items()
    ]
    data = json.dumps({"format": _FORMAT, "version": _VERSION, "key": key, "results": entries}, indent=1).encode()
    folder = path.parent
    tmp: str | None = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = _temporary(folder)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            nbytes = _disk_size(os.fstat(f.fileno()))
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        _warn_once("write", folder, f"cannot save to the search cache in {folder}: {exc}; going on without saving")
        return
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    _written(folder, nbytes)


def _disk_size(st: os.stat_result) -> int:
    """What a file counts against the size limit: the disk space it takes (``st_blocks``, in 512-byte units, where
    the system reports it), or its size if that is larger (where it reports none, or compression makes it less).
    An entry of a kilobyte or two takes a whole block, typically 4 KiB: its size alone would let the folder take
    two or three times the limit."""
    return max(getattr(st, "st_blocks", 0) * 512, st.st_size)


def _temporary(folder: Path) -> tuple[int, str]:
    """A new file in ``folder`` to write an entry into: ``(descriptor, path)``.

    Unlike :func:`tempfile.mkstemp`, whose files are private (mode 0600), it is made as any other file, with the
    permissions the umask leaves, so that an entry renamed over it can be read by whoever may read the folder (a
    cache shared by a team, or by another installation under another user).
    """
    while True:
        path = os.path.join(folder, f"{_TEMP_PREFIX}{secrets.token_hex(8)}.json")
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), path
        except FileExistsError:  # another writer's name: draw another
            continue


def _written(folder: Path, nbytes: int) -> None:
    """Count ``nbytes`` just written to ``folder``; trim it when its size as this process knows it passes the limit.

    A replaced entry counts in full, so the count can only run ahead of the folder's size: a trim comes early,
    never late.
    """
    limit = get_config().search_cache_max_size
    where = _same_folder(folder)
    with _size_lock:
        known = _known_size.get(where)
        if known is not None:  # counted with no limit too: one may be set again later in the process
            _known_size[where] = known + nbytes
        if limit is None or (known is not None and known + nbytes <= limit):
            return
    target = int(limit * _TRIM_TO)
    try:
        size, failure = _trim(folder, limit, target)
    except OSError as exc:  # the folder cannot be listed
        size, failure = limit + 1, exc
    if size > limit:
        _warn_once("trim", folder, f"cannot trim the search cache in {folder} to {format_size(limit)}: {failure}; "
                                   "it may grow past that")
        size = target  # try again once another tenth of the limit is written, not at every write
    with _size_lock:
        _known_size[where] = size


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
            if not item.name.endswith(".json"):
                continue
            try:
                st = item.stat()
                if stat.S_ISDIR(st.st_mode) and not item.is_symlink():
                    continue  # a folder with an entry's name: no entry, and not the cache's to remove
                if item.name.startswith(_TEMP_PREFIX):
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
            nbytes = _disk_size(st)
            entries.append((st.st_mtime, item.name, nbytes))
            total += nbytes
    if total <= limit:
        return total, failure
    entries.sort()
    for _, name, nbytes in entries:
        if total <= target:
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
            if not _leads_nowhere(exc):  # a target this process may not look at is still one
                return None
        os.unlink(path)
    except FileNotFoundError:  # another process removed it first
        return None
    return _disk_size(st)


def _leads_nowhere(exc: OSError) -> bool:
    """Whether ``exc``, from following a path, says that it resolves to no file (gone, through a file, a loop)."""
    return isinstance(exc, (FileNotFoundError, NotADirectoryError)) or exc.errno == errno.ELOOP


def _entry_files(root: Path) -> list[Path]:
    """The entries' files; none when the folder does not exist yet. ``OSError`` when it cannot be listed (a file
    stands in its place, or it may not be read): every search then goes without the cache, which should not pass
    for an empty one."""
    folder = root / _SUBDIR
    try:
        return sorted(p for p in folder.iterdir() if p.suffix == ".json" and not p.name.startswith(_TEMP_PREFIX))
    except FileNotFoundError:
        return []


def info() -> dict[str, Any]:
    """What ``wsarena cache info`` shows: the directory, the setting it comes from (``source``, as :func:`source`
    names it), the entries and their size (``size_bytes``: on disk, as the limit counts it), the size they are kept
    within (``None``: no limit), and per environment (backend, device, wsarena version, API path) how many entries
    it has.

    Raises ``OSError`` when the directory cannot be listed.
    """
    root = cache_dir()
    out: dict[str, Any] = {"directory": None if root is None else str(root), "enabled": root is not None,
                           "source": source(), "entries": 0, "size_bytes": 0,
                           "max_size_bytes": get_config().search_cache_max_size, "unreadable": 0, "environments": []}
    if root is None:
        return out
    groups: dict[tuple, int] = {}
    for path in _entry_files(root):
        try:
            out["size_bytes"] += _disk_size(path.stat())
            env = json.loads(path.read_text(encoding="utf-8"))["key"]["environment"]
            # as written (the CPU's API path is null), each a string or None, so that the groups sort
            group = tuple(_text(env.get(k)) for k in ("backend", "device", "wsarena", "api"))
        except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
            out["unreadable"] += 1
            continue
        out["entries"] += 1
        groups[group] = groups.get(group, 0) + 1
    out["environments"] = [
        {"backend": b, "device": d, "wsarena": v, "api": a, "entries": n}
        for (b, d, v, a), n in sorted(groups.items(), key=lambda item: tuple(x or "" for x in item[0]))
    ]
    return out


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def clear() -> dict[str, Any]:
    """Remove every entry (and any temporary file a killed writer left); what ``wsarena cache clear`` does.

    Only the files of the cache's ``search/`` folder are removed, never the directory's other contents, nor the
    temporary file of a write in progress in another process (one less than an hour old, as a trim spares it):
    that writer would lose its entry. Returns ``directory``, ``removed`` (entries) and ``freed_bytes``. Raises
    ``OSError`` when the folder cannot be listed or an entry cannot be removed.
    """
    root = cache_dir()
    out: dict[str, Any] = {"directory": None if root is None else str(root), "removed": 0, "freed_bytes": 0}
    if root is None:
        return out
    folder = root / _SUBDIR
    try:
        paths = [p for p in folder.iterdir() if p.suffix == ".json"]
    except FileNotFoundError:
        return out
    now = time.time()
    for path in paths:
        try:
            st = path.stat()
            if stat.S_ISDIR(st.st_mode) and not path.is_symlink():
                continue  # a folder with an entry's name: no entry, and not the cache's to remove
            if path.name.startswith(_TEMP_PREFIX) and now - st.st_mtime <= _STALE_TEMP:
                continue  # a write in progress
            size = _disk_size(st)
            path.unlink()
        except OSError as exc:  # another process removed or renamed it meanwhile, or a dangling link
            if not _leads_nowhere(exc):
                raise
            freed = _unlink_dangling(path)
            if freed is None:
                if isinstance(exc, FileNotFoundError):
                    continue
                raise
            size = freed
        if not path.name.startswith(_TEMP_PREFIX):
            out["removed"] += 1
        out["freed_bytes"] += size
    return out
