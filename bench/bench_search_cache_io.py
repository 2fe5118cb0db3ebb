"""What the search cache's disk costs: a cached lookup, a fresh entry's write, and the listing a trim needs.

    python bench/bench_search_cache_io.py [--entries 10000] [--candidates 20] [--repeat 7] [--min-time 0.2]
                                          [--against CHECKOUT]

* lookup: :func:`wsarena.searchcache.search` of a call whose entry is on disk (what a restarted process does once
  per distinct call before the in-process cache serves it): open, read, parse, check the key;
* write: a call the cache does not hold, with a measurement that costs nothing, so what is left is writing its
  entry (and counting it against the size limit), into a folder already holding ``--entries`` entries;
* first write: the same, the first of a process, which lists the folder to learn its size (made here by
  forgetting what the process knew; with a wsarena that does not bound the cache it is a plain write).

An entry holds ``--candidates`` timed algorithms (cuDNN's legacy forward has 8 algorithms, some with two math
types). Figures are the median over ``--repeat`` timeit runs, in microseconds per operation. The same script
runs against an older wsarena (``PYTHONPATH=/path/to/it``) for a side-by-side comparison; on a busy machine,
``--against CHECKOUT`` is steadier for the lookup: it loads ``CHECKOUT/wsarena/searchcache.py`` beside this one
and times the two lookups in alternation, in one process, ``--repeat`` times each (min and median).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import platform
import statistics
import tempfile
import timeit
from types import ModuleType

from bench_lease import per_call_us  # this folder is on the path when the script runs

import wsarena
from wsarena import searchcache
from wsarena._geometry import conv_geometry
from wsarena.backends import Candidate


class Backend:
    """The least a backend needs to key the cache: its name and its environment."""

    name = "bench"

    def device_key(self) -> str:
        return "bench"

    def search_environment(self) -> dict:
        return {"device": "bench device"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=10000, help="entries already in the folder")
    parser.add_argument("--candidates", type=int, default=20, help="algorithms per entry")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds per timeit run (about)")
    parser.add_argument("--against", help="a checkout whose searchcache.py lookup to time in alternation")
    args = parser.parse_args(argv)
    if args.against is not None:
        compare(args.against, args.repeat)
        return

    backend = Backend()
    cands = [Candidate(f"algo{i}", i << 20, None, i % 2) for i in range(args.candidates)]
    timed = [Candidate(c.algo, c.workspace_bytes, 1.0 + i, c.math_type) for i, c in enumerate(cands)]

    def measure() -> tuple[list[Candidate], list[Candidate]]:
        return list(timed), []

    def geom(k: int):
        return conv_geometry((1, 3, 8, 8), (k + 1, 3, 3, 3))

    with tempfile.TemporaryDirectory() as folder:
        os.environ[searchcache.ENV_VAR] = folder
        for k in range(args.entries):
            searchcache.search(backend, "fwd", geom(k), cands, measure)
        size = sum(e.stat().st_size for e in os.scandir(os.path.join(folder, "search")))
        known = _known_sizes()

        def lookup() -> None:
            searchcache.search(backend, "fwd", geom(0), cands, measure)

        fresh = itertools.count(args.entries)

        def write() -> None:
            searchcache.search(backend, "fwd", geom(next(fresh)), cands, measure)

        def first_write() -> None:
            if known is not None:
                known.clear()
            write()

        rows = [
            ("lookup (entry on disk)", per_call_us(lookup, repeat=args.repeat, min_time=args.min_time)),
            ("write (a fresh entry)", per_call_us(write, repeat=args.repeat, min_time=args.min_time)),
            ("first write of a process", per_call_us(first_write, repeat=args.repeat, min_time=0, number=3)),
        ]
    print(f"wsarena {wsarena.__version__} from {os.path.dirname(wsarena.__file__)}; Python "
          f"{platform.python_version()}; {args.entries} entries of {args.candidates} algorithms in the folder "
          f"({size / 2**20:.1f} MiB); median of {args.repeat}")
    for label, us in rows:
        print(f"{label:<28} {us:>10.1f} us")


def _known_sizes() -> dict | None:
    """This process's record of the folders' sizes, where the wsarena under test keeps one (``None``: it bounds no
    cache): in wsarena._searchcache_folder, or in searchcache itself in older versions."""
    try:
        from wsarena import _searchcache_folder
    except ImportError:
        return getattr(searchcache, "_known_size", None)
    return _searchcache_folder.known_size


def compare(checkout: str, repeat: int, number: int = 2000) -> None:
    """A cached lookup through ``checkout``'s search cache module and through this one, timed in alternation."""
    spec = importlib.util.spec_from_file_location("wsarena._searchcache_other",
                                                  os.path.join(checkout, "wsarena", "searchcache.py"))
    assert spec is not None and spec.loader is not None
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)  # its imports resolve to this wsarena's modules
    backend = Backend()
    cands = [Candidate(f"algo{i}", i << 20, None, i % 2) for i in range(20)]
    timed = [Candidate(c.algo, c.workspace_bytes, 1.0 + i, c.math_type) for i, c in enumerate(cands)]
    geom = conv_geometry((1, 3, 8, 8), (1, 3, 3, 3))

    def refuse() -> tuple[list[Candidate], list[Candidate]]:
        raise AssertionError("a lookup searched")

    runs: dict[str, list[float]] = {checkout: [], os.path.dirname(os.path.dirname(searchcache.__file__)): []}
    with tempfile.TemporaryDirectory() as folder:
        os.environ[searchcache.ENV_VAR] = folder
        searchcache.search(backend, "fwd", geom, cands, lambda: (list(timed), []))
        for _ in range(repeat):
            for (where, results), module in zip(runs.items(), (other, searchcache)):

                def lookup(m: ModuleType = module) -> object:
                    return m.search(backend, "fwd", geom, cands, refuse)

                seconds = timeit.timeit(lookup, number=number)
                results.append(seconds / number * 1e6)
    print(f"a cached lookup (20 algorithms), {repeat} alternating runs of {number}, microseconds per lookup")
    for where, results in runs.items():
        print(f"{where:<40} min {min(results):7.1f}  median {statistics.median(results):7.1f}")


if __name__ == "__main__":
    main()
