"""What a lease costs: a lease/release pair on an existing CPU lane, beside a bare lock and a fresh allocation.

    python bench/bench_lease.py [--repeat 7] [--min-time 0.2] [--kept 30000] [--graphs 100] [--live 3] [--arenas 46]

For 4 KiB, 1 MiB and 64 MiB: ``with arena.lease(n):`` on a lane whose buffer already holds ``n`` bytes (the
steady state of a network's forward/backward passes), the same with ``ws.array`` taken, a bare
``threading.Lock`` acquire/release, a fresh ``numpy.empty(n, uint8)``, and one trivial ctypes call for scale.
Each figure is the median over ``--repeat`` timeit runs, in microseconds per operation.

Then ``arena.stats()`` of an arena whose pins keep ``--kept`` arrays for ``--graphs`` CUDA graphs (stand-in captures
on a lane, :mod:`wsarena.arena.testing`; each ``keep_with_capture`` keeps two arrays of their own and a view of one
array they all share), which each ``wsarena.capture()`` calls; one such keep, and the ``stats()`` that lets go of them
all once the graphs are destroyed (milliseconds, once); and one keep of the same three again and again during a
capture, its steady cost (the median of ``--repeat`` runs).

Last, a bare lease while ``--live`` graphs alive keep what may free device memory as it goes (``keep_with_capture``:
no pool), whose destruction eager leases look for: one lease in ``_pins.LOOK_EVERY`` looking (a ``sem_getvalue``),
beside every lease looking, and beside no graph keeping, interleaved.

And the question a let-go of what graphs gone kept asks first, whether a capture that an arena knows of is under way
(``_lifecycle._no_capture_under_way``), while ``--arenas`` arenas of one device (stand-in providers of their own) are
alive, each having recorded two streams for captures over since, the same two, or one that all of them recorded and
one its own: each arena asks through its own provider; microseconds per question, and the questions the providers
were asked.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import platform
import statistics
import threading
import time
import timeit
from typing import TypedDict

import numpy as np

from wsarena._sizes import format_size
from wsarena.arena import Arena, HostProvider, _lifecycle, _pins
from wsarena.arena.testing import RecordingProvider

SIZES = (4 << 10, 1 << 20, 64 << 20)


class Timing(TypedDict):
    """How :func:`per_call_us` times, as the command line says: runs, and seconds per run (about)."""

    repeat: int
    min_time: float


def per_call_us(stmt, *, repeat: int, min_time: float, number: int | None = None) -> float:
    """Median microseconds per call of ``stmt`` (a no-argument callable), timeit-style: ``number`` calls per run,
    or as many as take about ``min_time`` seconds."""
    timer = timeit.Timer(stmt)
    if number is None:
        number, _ = timer.autorange()
        number = max(1, int(number * min_time / 0.2))
    runs = timer.repeat(repeat=repeat, number=number)
    return statistics.median(runs) / number * 1e6


def kept_stats(kept: int, graphs: int, timing: Timing) -> tuple[float, float, float, float]:
    """Microseconds per ``stats()`` while ``graphs`` graphs keep ``kept`` arrays, per ``keep_with_capture`` of three,
    milliseconds of the ``stats()`` that lets go of them all once the graphs are destroyed, and microseconds per
    ``keep_with_capture`` of the same three again during one capture."""
    provider = RecordingProvider()
    arena = Arena(provider)
    shared = np.empty(1 << 16, np.uint8)
    keeps = max(1, kept // graphs // 3)
    made = []
    start = time.perf_counter()
    for _ in range(graphs):
        graph = provider.begin_capture("bench")
        for i in range(keeps):
            arena.keep_with_capture([np.empty(16, np.float32), np.empty(16, np.float32), shared[i:]], stream="bench")
        provider.end_capture(graph)
        made.append(graph)
    keep_us = (time.perf_counter() - start) / (graphs * keeps) * 1e6
    graph = provider.begin_capture("bench")
    again = [np.empty(16, np.float32), np.empty(16, np.float32), shared[1:]]
    steady_us = per_call_us(lambda: arena.keep_with_capture(again, stream="bench"), **timing)
    provider.end_capture(graph)
    made.append(graph)
    stats_us = per_call_us(arena.stats, **timing)
    assert arena.stats().kept_bytes == (graphs * keeps + 1) * 2 * 64 + shared.nbytes
    for graph in made:
        graph.close()
    start = time.perf_counter()
    assert arena.stats().kept_bytes == 0
    return stats_us, keep_us, (time.perf_counter() - start) * 1e3, steady_us


class _AskedProvider(RecordingProvider):
    """Counts the questions whether a stream is being captured."""

    asked = 0

    def capture(self, stream):
        _AskedProvider.asked += 1
        return super().capture(stream)


def capture_question(arenas: int, timing: Timing, own: bool) -> tuple[float, float]:
    """Microseconds per question whether a capture that an arena knows of is under way, while ``arenas`` arenas of
    device 0 are alive, each having recorded two streams (captures over, recorded again before each question: found
    over, a record is forgotten), the same two, or with ``own`` one that all of them recorded and one of its own; and
    the providers' questions per call."""
    made = []
    for i in range(arenas):
        arena = Arena(_AskedProvider(device_id=0))
        for stream in (0x51, 0x1000 + i if own else 0x52):
            graph = arena.provider.begin_capture(stream)
            arena.keep_with_capture([np.empty(4, np.float32)], stream=stream)
            arena.provider.end_capture(graph)
            graph.close()
        made.append(arena)
    records = [(arena._table.capturing, dict(arena._table.capturing)) for arena in made]

    def ask() -> None:
        for recorded, kept in records:
            recorded.update(kept)
        assert _lifecycle._no_capture_under_way()

    _AskedProvider.asked = 0
    ask()
    asked = _AskedProvider.asked
    question_us = per_call_us(ask, **timing)
    for arena in made:
        arena.stats()  # lets go of what they kept
    return question_us, asked


def lease_with_graphs_keeping(live: int, timing: Timing, rounds: int = 3) -> list[tuple[float, float, float]]:
    """Microseconds per bare lease on a lane with no graph keeping, then with ``live`` graphs alive keeping what may
    free device memory (one lease in LOOK_EVERY looking, and every lease looking), ``rounds`` times interleaved."""
    provider = RecordingProvider()
    arena = Arena(provider)
    arena.reserve(4096, stream="bench")

    def lease() -> None:
        with arena.lease(4096, stream="bench"):
            pass

    looks = _pins._looks
    rows = []
    for _ in range(rounds):
        none = per_call_us(lease, **timing)
        graphs = []
        for _ in range(live):
            graph = provider.begin_capture("bench")
            arena.keep_with_capture([np.empty(16, np.float32)], stream="bench")
            provider.end_capture(graph)
            graphs.append(graph)
        some = per_call_us(lease, **timing)
        _pins._looks = itertools.repeat(True)
        try:
            every = per_call_us(lease, **timing)
        finally:
            _pins._looks = looks
        for graph in graphs:
            graph.close()
        arena.stats()  # lets go of what they kept: the next round starts with none keeping
        rows.append((none, some, every))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds per timeit run (about)")
    parser.add_argument("--kept", type=int, default=30_000, help="arrays kept for graphs, for stats()")
    parser.add_argument("--graphs", type=int, default=100, help="graphs that keep them")
    parser.add_argument("--live", type=int, default=3, help="graphs alive keeping what may free device memory")
    parser.add_argument("--arenas", type=int, default=46, help="arenas of one device alive, for the capture question")
    args = parser.parse_args(argv)
    timing: Timing = {"repeat": args.repeat, "min_time": args.min_time}

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
    stats_us, keep_us, let_go_ms, steady_us = kept_stats(args.kept, args.graphs, timing)
    print(f"stats() with {args.kept:,} arrays kept for {args.graphs} graphs: {stats_us:.1f} µs    "
          f"a keep of 3: {keep_us:.1f} µs    the stats() that lets go of them all: {let_go_ms:.1f} ms")
    print(f"a keep of the same 3 again and again during a capture: {steady_us:.2f} µs")
    print(f"a bare lease (4 KiB), with {args.live} graphs alive keeping what may free device memory, µs:")
    for none, some, every in lease_with_graphs_keeping(args.live, timing):
        print(f"  none keeping {none:.3f}    one lease in {_pins.LOOK_EVERY} looking {some:.3f}    "
              f"every lease looking {every:.3f}    ({every / some:.2f}x)")
    print(f"whether a capture is under way, {args.arenas} arenas of one device alive, each having recorded 2 streams:")
    for own in (False, True):
        question_us, asked = capture_question(args.arenas, timing, own)
        print(f"  {'1 shared, 1 its own' if own else 'the same 2'}: {question_us:.1f} µs, "
              f"{asked:.0f} questions of their providers")


if __name__ == "__main__":
    main()
