"""What a lease costs: a lease/release pair on an existing CPU lane, beside a bare lock and a fresh allocation.

    python bench/bench_lease.py [--repeat 7] [--min-time 0.2]

For 4 KiB, 1 MiB and 64 MiB: ``with arena.lease(n):`` on a lane whose buffer already holds ``n`` bytes (the
steady state of a network's forward/backward passes), the same with ``ws.array`` taken, a bare
``threading.Lock`` acquire/release, a fresh ``numpy.empty(n, uint8)``, and one trivial ctypes call for scale.
Each figure is the median over ``--repeat`` timeit runs, in microseconds per operation.
"""

from __future__ import annotations

import argparse
import ctypes
import platform
import statistics
import threading
import timeit

import numpy as np

from wsarena._sizes import format_size
from wsarena.arena import Arena, HostProvider

SIZES = (4 << 10, 1 << 20, 64 << 20)


def per_call_us(stmt, *, repeat: int, min_time: float, number: int | None = None) -> float:
    """Median microseconds per call of ``stmt`` (a no-argument callable), timeit-style: ``number`` calls per run,
    or as many as take about ``min_time`` seconds."""
    timer = timeit.Timer(stmt)
    if number is None:
        number, _ = timer.autorange()
        number = max(1, int(number * min_time / 0.2))
    runs = timer.repeat(repeat=repeat, number=number)
    return statistics.median(runs) / number * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds per timeit run (about)")
    args = parser.parse_args(argv)
    timing = {"repeat": args.repeat, "min_time": args.min_time}

    arena = Arena(HostProvider())
    lock = threading.Lock()
    libc = ctypes.CDLL(None)
    getpid = libc.getpid

    def locked() -> None:
        with lock:
            pass

    ctypes_us = per_call_us(getpid, **timing)
    lock_us = per_call_us(locked, **timing)
    rows = []
    for n in SIZES:
        arena.reserve(n, stream="bench")

        def lease(n: int = n) -> None:
            with arena.lease(n, stream="bench"):
                pass

        def lease_array(n: int = n) -> None:
            with arena.lease(n, stream="bench") as ws:
                _ = ws.array  # the view is made on first access: its cost is what this adds

        def empty(n: int = n) -> None:
            np.empty(n, dtype=np.uint8)

        rows.append((n, per_call_us(lease, **timing), per_call_us(lease_array, **timing), per_call_us(empty, **timing)))
    assert arena.stats().allocations == len(SIZES)  # every lease above ran on an existing buffer

    print(f"wsarena lease cost  (Python {platform.python_version()}, NumPy {np.__version__}, {platform.machine()}, "
          f"median of {args.repeat} runs, µs per operation)")
    print(f"threading.Lock acquire/release: {lock_us:.3f} µs    one ctypes call (getpid): {ctypes_us:.3f} µs")
    header = (f"{'size':>8}  {'lease/release':>13}  {'+ ws.array':>10}  {'Lock':>6}  {'np.empty':>8}  "
              f"{'lease/Lock':>10}  {'lease/empty':>11}  {'lease/ctypes':>12}")
    print(header)
    print("-" * len(header))
    for n, lease_us, array_us, empty_us in rows:
        print(f"{format_size(n):>8}  {lease_us:>13.3f}  {array_us:>10.3f}  {lock_us:>6.3f}  {empty_us:>8.3f}  "
              f"{lease_us / lock_us:>9.1f}x  {lease_us / empty_us:>10.2f}x  {lease_us / ctypes_us:>11.1f}x")


if __name__ == "__main__":
    main()
