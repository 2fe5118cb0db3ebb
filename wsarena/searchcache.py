"""The persistent search cache: exhaustive-search results kept across processes.

An exhaustive search times every candidate algorithm of a call; this cache keeps each candidate's time and
workspace on disk, so that a restarted job (and ``wsarena tune``, and :func:`wsarena.plan`) searches nothing it
searched before. The ops, the planner and ``tune`` all reach it through :func:`wsarena.algos.select`.

Where: the ``cache_dir`` setting (``configure(cache_dir=...)``, ``config(cache_dir=...)``, ``WSARENA_CACHE_DIR``;
``off`` or ``None`` turns the cache off), by default the user's cache folder
(``platformdirs.user_cache_dir("wsarena")``: ``$XDG_CACHE_HOME/wsarena`` or ``~/.cache/wsarena`` on Linux; no cache
where no home folder can be found). Entries are files under its ``search/`` folder, one per call, named by a hash of
their key. A key is the environment (:func:`wsarena._search_env.environment`: device and compute capability, driver
and cuDNN versions, on the CPU the processor, NumPy and its BLAS; wsarena's version; the API path) and the call: the
pass and the whole geometry (shapes, dtype, layout, every convolution parameter). Each file holds its key, so a file
that does not match is recognised.

Safety: a file is written whole to a temporary name and renamed over the entry, so a reader sees the old entry or
the new one, never part of one, and processes writing at once lose no entry (each call is its own file; two writers
of the same call both write complete results). Only a regular file is read, as the descriptor opened says (opened
without waiting: open() of a FIFO waits for a writer). A truncated, corrupt or foreign file, or one that is no
regular file (a FIFO, a socket, a device, a link to one), is ignored and replaced, with one
:class:`~wsarena.errors.SearchCacheWarning` for the first such file of the folder (which says, where the folder
cannot be written, that it cannot be replaced and nothing is saved: no second warning); a link that leads nowhere (its
target gone, a loop) is replaced without one; a directory that cannot be written gives one warning and the process
goes on without saving. A folder with an entry's name is not the cache's
to remove: its call goes unsaved while it stands, which one warning says. An algorithm read back is leased no less
workspace than the backend says it needs now, whatever the entry records, as a search's own is
(:func:`wsarena.algos.select`).

Size: the entries are kept within the ``search_cache_max_size`` setting (``WSARENA_SEARCH_CACHE_MAX_SIZE``,
default 64 MiB), the least recently used removed first; how, and how that races with other processes harmlessly, is
written in :mod:`wsarena._searchcache_folder`, which also does what :func:`info` and :func:`clear` do.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ._config import _ENV, get_config
from ._search_env import environment
from ._searchcache_folder import (
    SUBDIR,
    describe,
    disk_size,
    entry_name,
    leads_nowhere,
    read_entry,
    remove_entries,
    temp_name,
    warn_once,
    written,
)
from ._sizes import os_error_text, short_path, short_repr
from .backends import Candidate

__all__ = ["ENV_VAR", "cache_dir", "clear", "counts", "info", "search", "source"]

ENV_VAR = _ENV["cache_dir"]
_FORMAT = "wsarena-search-cache"
_VERSION = 1
_MAX_TIME_MS = 86_400_000.0  # a day: no time a search measures is longer
_MARK_USED_AFTER = 3600.0  # seconds: a read older than this marks the entry used (sets its modification time)

_Results = dict[tuple[str, int | None], tuple[int, float | None]]  # (algo, math type) -> (workspace, ms or None)
# (timed, skipped), and maybe the largest workspace the search leased and the key of the operands it refused some
# candidates on (wsarena.algos.choose's ``measure``)
Found = (tuple[list[Candidate], list[Candidate]] | tuple[list[Candidate], list[Candidate], int]
         | tuple[list[Candidate], list[Candidate], int, Any])
_Measure = Callable[[], Found]
# Searches of this process: answered from the cache ("read") or timed ("timed"). A list of two ints: += on an item
# is not atomic across threads, and a miscount under a race costs only a figure of a report.
_counts = [0, 0]


def cache_dir() -> Path | None:
    """The cache directory in force now (the ``cache_dir`` setting), or ``None`` when the cache is off."""
    return get_config().cache_dir


def source() -> str:
    """Which setting gives the folder in force (or turns the cache off): ``"config"`` (a :func:`~wsarena.config`
    block), ``"configure"`` (:func:`~wsarena.configure`), ``"environment"`` (``WSARENA_CACHE_DIR``) or
    ``"default"`` (the user's cache folder). A block that sets no folder holds the one in force as it began, which a
    :func:`~wsarena.configure` inside it does not change: the setting named is the one that gave the block's
    folder."""
    from ._config import origin

    return origin("cache_dir")


def search(
    backend: Any, pass_: str, geom: Any, candidates: Sequence[Candidate], measure: _Measure,
    times: dict[tuple[str, int | None], float | None] | None = None, unsaved: Sequence[Candidate] = (),
) -> Found:
    """The exhaustive search of ``candidates``: from the cache when it holds all of them, else ``measure()``.

    Returns what ``measure`` returns, ``(timed, skipped)`` (and what it adds): the timed candidates fastest first,
    and those the search had no memory to time. A fresh measurement is saved (merged into what the entry held):
    each timed candidate's time and workspace, and as rejected those the backend's search dropped. Candidates
    skipped for memory are not saved, so a later search times them, nor those in ``unsaved`` once ``measure()`` has
    run (a lease the backend refused to time them in: no verdict on them alone).

    ``times``, a dict, receives what the entry holds of the call once searched, whatever the cap: per ``(algorithm,
    math type)``, its time in ms, ``None`` where the backend's search rejected it; nothing where the cache is off. A
    search under a cap reads there the times of those the cap excludes (:func:`wsarena.algos.choose`'s ``known``),
    without reading the entry again.
    """
    root = cache_dir()
    if root is None or not candidates:
        _counts[1] += 1
        return measure()
    key = _key(backend, pass_, geom)
    path = root / SUBDIR / entry_name(_canonical(key))
    stored, bad = _read(path, key)
    if times is not None and stored is not None:
        times.update({found: ms for found, (_, ms) in stored.items()})
    if stored is not None and all((c.algo, c.math_type) in stored for c in candidates):
        names = {c.algo for c in candidates}
        limit = max(c.workspace_bytes for c in candidates)
        # A candidate is leased no less than the backend says it needs now: a damaged entry that still parses (a digit
        # of its workspace lost) would have every call of the geometry run in too little. A size past the largest
        # candidate's is left out, as a search of these candidates leaves it out (its lease cannot hold it): a search
        # under a wider cap may have recorded it, cuDNN's FindEx saying an algorithm needs more than its heuristics
        # did, which cannot be told apart from damage (a digit added), and its candidate's size would run it in less
        # than FindEx said
        needed = workspace_needed(candidates)
        timed = [
            Candidate(algo, max(nbytes, needed(algo, math)), ms, math)
            for (algo, math), (nbytes, ms) in stored.items()
            if ms is not None and algo in names and nbytes <= limit
        ]
        if timed:
            _counts[0] += 1
            return sorted(timed, key=lambda c: c.time_ms or 0.0), []
    _counts[1] += 1
    found = measure()
    timed, skipped = found[0], found[1]
    if timed:
        results = dict(stored or {})
        left_out = {(c.algo, c.math_type) for c in (*timed, *skipped, *unsaved)}
        results.update({(c.algo, c.math_type): (c.workspace_bytes, None) for c in candidates
                        if (c.algo, c.math_type) not in left_out})
        results.update({(c.algo, c.math_type): (c.workspace_bytes, c.time_ms) for c in timed})
        if times is not None:
            times.update({found: ms for found, (_, ms) in results.items()})
        _write(path, key, results, bad)
    elif bad is not None:  # nothing to save: the bad file stays
        warn_once("bad", path.parent, f"ignoring the search cache file {_shown(path)}: {bad}; any other bad file in "
                                      "this folder is ignored without another warning")
    return found


def workspace_needed(
    candidates: Sequence[Candidate], fitting: Sequence[Candidate] | None = None
) -> Callable[[str, int | None], int]:
    """The workspace an ``(algorithm, math type)`` pair that a search timed or an entry records needs, as the backend's
    ``candidates`` of the call say now: its own candidate's; for a pair no candidate has (cuDNN's FindEx reports an
    algorithm in the math type it ran it in, which need not be the one its heuristics listed), the most that a
    candidate of its algorithm among ``fitting`` (by default ``candidates``: those a search's workspace holds) needs,
    the one its search stood in for; 0 for an algorithm none has. Without this floor such a pair was leased whatever
    the entry recorded, a digit lost on disk too."""
    own = {(c.algo, c.math_type): c.workspace_bytes for c in candidates}
    most: dict[str, int] = {}
    for c in candidates if fitting is None else fitting:
        most[c.algo] = max(most.get(c.algo, 0), c.workspace_bytes)

    def needed(algo: str, math: int | None) -> int:
        nbytes = own.get((algo, math))
        return most.get(algo, 0) if nbytes is None else nbytes

    return needed


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


def _shown(path: Path) -> str:
    """``path`` as a warning names it: a folder of a 10 kB name (``WSARENA_CACHE_DIR``) cut short."""
    return short_path(path, quoted=False)


def _read(path: Path, key: dict[str, Any]) -> tuple[_Results | None, Exception | None]:
    """The entry's results, or ``None`` when there is none or none usable; and, for a bad file (one that is no
    entry of this key), why, which the write that replaces it, or fails to, says (:func:`_write`)."""
    try:
        text, st = read_entry(path)
    # IsADirectoryError: a folder of the entry's name, which a write cannot replace and says so (_write)
    except IsADirectoryError:
        return None, None
    except ValueError as exc:  # no regular file, more than any entry holds, or not UTF-8
        return None, exc
    except OSError as exc:
        if not leads_nowhere(exc):  # no file, or a link to none (a loop, say), which the write replaces
            warn_once("read", path.parent, f"cannot read the search cache in {_shown(path.parent)}: "
                                           f"{os_error_text(exc)}; searching afresh")
        return None, None
    try:
        results = _parse(json.loads(text), key)
    # RecursionError: JSON nested too deep
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        return None, exc
    if time.time() - st.st_mtime > _MARK_USED_AFTER:
        try:
            os.utime(path)  # used now: the last to go when the cache is trimmed
        except OSError:  # a folder this process may read but not write: nothing to mark, nothing it trims
            pass
    return results, None


def _parse(data: Any, key: dict[str, Any]) -> _Results:
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise ValueError("not a wsarena search cache file")
    if data.get("version") != _VERSION:
        raise ValueError(f"format version {short_repr(data.get('version'))}, this wsarena reads {_VERSION}")
    if data.get("key") != key:
        raise ValueError(f"it holds another key (written by wsarena {_written_by(data.get('key'))})")
    results: _Results = {}
    for entry in data["results"]:
        algo, math, nbytes, ms = entry["algo"], entry["math_type"], entry["workspace_bytes"], entry["time_ms"]
        if not isinstance(algo, str) or not (math is None or type(math) is int) or type(nbytes) is not int:
            raise ValueError(f"malformed entry {short_repr(entry)}")
        # A time a search measures lies within a day: the bound refuses what JSON as Python reads it also takes
        # (Infinity, NaN, 1e999 as infinity, an integer past float's range, compared exactly), and times whose sums
        # over a model's calls (wsarena tune adds them exactly) would pass float's range; true and false are no
        # times, though a bool is an int to isinstance
        if nbytes < 0 or not (ms is None or (type(ms) in (int, float) and 0 <= ms <= _MAX_TIME_MS)):
            raise ValueError(f"malformed entry {short_repr(entry)}")
        results[(algo, math)] = (nbytes, None if ms is None else float(ms))
    return results


def _written_by(key: Any) -> str:
    """The wsarena version a file's key names, its middle cut as :func:`short_repr` cuts a value; ``None`` where it
    names none (a foreign or damaged file)."""
    env = key.get("environment") if isinstance(key, dict) else None
    version = env.get("wsarena") if isinstance(env, dict) else None
    return short_repr(version)[1:-1] if isinstance(version, str) else short_repr(version)


def _write(path: Path, key: dict[str, Any], results: _Results, bad: Exception | None = None) -> None:
    """Write the entry whole under a temporary name, then rename it over ``path``; warn once if it cannot.

    ``bad``: why the file at ``path`` is no entry, which one warning per folder says, with what became of it: a
    crash or a full disk can spoil many entries at once, and each would otherwise add a line to the output of the
    job that replaces them.
    """
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
            nbytes = disk_size(os.fstat(f.fileno()))
        os.replace(tmp, path)
        tmp = None
    except IsADirectoryError:  # renamed over a folder of the entry's name: not the cache's to remove
        warn_once("folder", folder, f"cannot save to the search cache file {_shown(path)}: a folder of that name "
                                    "stands in its place; searches of that call are not kept until it is removed "
                                    "(said once for all such folders here)")
        return
    except OSError as exc:
        # one thing said of a bad file that cannot be replaced, not "it will be replaced" and then "cannot save"
        why = os_error_text(exc)
        if bad is None or not warn_once("bad", folder, f"ignoring the search cache file {_shown(path)}: {bad}; it "
                                        f"cannot be replaced: {why}; going on without saving", also=("write",)):
            warn_once("write", folder, f"cannot save to the search cache in {_shown(folder)}: {why}; going on without "
                                       "saving")
        return
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    if bad is not None:
        warn_once("bad", folder, f"ignoring the search cache file {_shown(path)}: {bad}; replaced it with the "
                                 "search's results, as any other bad file in this folder will be, without another "
                                 "warning")
    written(folder, nbytes)


def _temporary(folder: Path) -> tuple[int, str]:
    """A new file in ``folder`` to write an entry into: ``(descriptor, path)``.

    Unlike :func:`tempfile.mkstemp`, whose files are private (mode 0600), it is made as any other file, with the
    permissions the umask leaves, so that an entry renamed over it can be read by whoever may read the folder (a
    cache shared by a team, or by another installation under another user).
    """
    while True:
        path = os.path.join(folder, temp_name())
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), path
        except FileExistsError:  # another writer's name: draw another
            continue


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
    if root is not None:
        out.update(describe(root))
    return out


def clear() -> dict[str, Any]:
    """Remove every entry (and any temporary file a killed writer left); what ``wsarena cache clear`` does.

    Only the files of the cache's ``search/`` folder named as the cache names them are removed (a key's hash, a
    write in progress), never the directory's or the folder's other contents, nor the temporary file of a write in
    progress in another process (one less than an hour old, as a trim spares it): that writer would lose its entry.
    Returns ``directory``, ``removed`` (entries), ``unreadable`` (the files that were no readable entry, which
    :func:`info` counts apart too; removed as well; a file that begins and ends as an entry is written counts as
    one unparsed, where info() parses it) and ``freed_bytes``. Raises ``OSError`` when the folder cannot be
    listed or an entry cannot be removed.
    """
    root = cache_dir()
    out: dict[str, Any] = {"directory": None if root is None else str(root), "removed": 0, "unreadable": 0,
                           "freed_bytes": 0}
    if root is not None:
        out.update(remove_entries(root))
    return out
