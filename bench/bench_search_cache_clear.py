"""What ``wsarena cache clear`` costs: removing a folder of search cache entries, each told from a file that is no
readable entry (``removed`` against ``unreadable``).

    python bench/bench_search_cache_clear.py [--entries 20000] [--unreadable 10] [--repeat 5] [--against CHECKOUT]...

The entries are written once, as a search writes them (``--candidates`` timed algorithms each), with ``--unreadable``
corrupt files beside them, in a temporary folder; each run clears a fresh copy of it (copied, then flushed to disk
with ``sync``, so that no write-back of the copy falls into the time). ``--against CHECKOUT`` (repeatable) loads
``CHECKOUT/wsarena/_searchcache_folder.py`` beside this one and clears with its ``remove_entries`` in turn with this
checkout's, ``--repeat`` times each, on the same machine at the same time: a busy machine moves every figure, the
comparison less, and the process's CPU time (user and system) less than the wall-clock time. Figures are seconds
per clear, min and median, of each.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench_search_cache_io import Backend  # this folder is on the path when the script runs

import wsarena
from wsarena import _searchcache_folder, searchcache
from wsarena._geometry import conv_geometry
from wsarena.backends import Candidate


def _module(checkout: str, index: int):
    """``CHECKOUT/wsarena/_searchcache_folder.py`` as a module of this wsarena (its imports resolve to this one's)."""
    spec = importlib.util.spec_from_file_location(f"wsarena._searchcache_folder_other{index}",
                                                  os.path.join(checkout, "wsarena", "_searchcache_folder.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fill(folder: str, entries: int, unreadable: int, candidates: int) -> None:
    backend = Backend()
    cands = [Candidate(f"algo{i}", i << 20, None, i % 2) for i in range(candidates)]
    timed = [Candidate(c.algo, c.workspace_bytes, 1.0 + i, c.math_type) for i, c in enumerate(cands)]
    with wsarena.config(cache_dir=folder, search_cache_max_size=None):
        for k in range(entries):
            geom = conv_geometry((1, 3, 8, 8), (k + 1, 3, 3, 3))
            searchcache.search(backend, "fwd", geom, cands, lambda: (list(timed), []))
    search = Path(folder, _searchcache_folder.SUBDIR)
    for k in range(unreadable):
        (search / _searchcache_folder.entry_name(f"corrupt {k}")).write_text('{"format": "wsarena-search-cache", ')


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=20000)
    parser.add_argument("--unreadable", type=int, default=10, help="corrupt files beside the entries")
    parser.add_argument("--candidates", type=int, default=20, help="algorithms per entry")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--against", action="append", default=[], help="a checkout whose clear to time in turn")
    parser.add_argument("--dir", help="where to make the temporary folders (default: the system's)")
    args = parser.parse_args(argv)
    here = os.path.dirname(os.path.dirname(_searchcache_folder.__file__))
    variants = {here: _searchcache_folder, **{c: _module(c, i) for i, c in enumerate(args.against)}}
    times: dict[str, list[float]] = {where: [] for where in variants}
    cpu: dict[str, list[float]] = {where: [] for where in variants}
    with tempfile.TemporaryDirectory(dir=args.dir) as top:
        base, run = os.path.join(top, "base"), os.path.join(top, "run")
        _fill(base, args.entries, args.unreadable, args.candidates)
        size = sum(e.stat().st_size for e in os.scandir(os.path.join(base, _searchcache_folder.SUBDIR)))
        for _ in range(args.repeat):
            for where, module in variants.items():
                shutil.copytree(base, run)
                os.sync()
                start, start_cpu = time.perf_counter(), time.process_time()
                out = module.remove_entries(Path(run))
                times[where].append(time.perf_counter() - start)
                cpu[where].append(time.process_time() - start_cpu)
                counted = out["removed"] + out.get("unreadable", 0)
                assert counted == args.entries + args.unreadable, out
                assert "unreadable" not in out or out["unreadable"] == args.unreadable, out
                shutil.rmtree(run)
    print(f"wsarena cache clear of {args.entries} entries ({size / 2**20:.1f} MiB) and {args.unreadable} unreadable "
          f"files, {args.repeat} runs each in turn, seconds per clear (wall clock; CPU time of the process)")
    for where, results in times.items():
        print(f"{where:<40} min {min(results):7.3f}  median {statistics.median(results):7.3f};  "
              f"CPU min {min(cpu[where]):7.3f}  median {statistics.median(cpu[where]):7.3f}")


if __name__ == "__main__":
    main()
