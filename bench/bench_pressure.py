"""A step's host time under lasting memory pressure: what asking the memory provider again on every call costs.

Each layer's first choice needs more workspace than the provider grants, so every call runs the algorithm that fits
what the arena holds (here, the one that needs none). A refusal is made as costly as CuPy's memory pool makes it:
that pool answers a failed ``cudaMalloc`` by freeing its cached blocks and running ``gc.collect()`` before it
gives up (PyTorch's caching allocator frees its cache and synchronizes the device instead). The heap holds
``--heap`` objects, as a program that has imported PyTorch and built a model does; a collection's cost grows with
it.

The step is four small convolutions (the cpu backend, float32, NCHW), forward, backward-data and backward-filter,
with the heuristic and the exhaustive search. Over ``--steps`` after a warm-up step: the mean step time, how often
the provider was asked, and how many searches timed candidates. To compare checkouts side by side, name their
roots: each runs in a subprocess of its own, alternately, ``--rounds`` times, and the table gives each case's best
round.

    python bench/bench_pressure.py [--steps 20] [--heap 500000] [--rounds 3] [--checkout DIR ...]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any

import _checkouts  # this folder is on sys.path when the script runs

LAYERS = (  # (input, weight, padding): the first choices need 20-300 KiB of workspace
    ((2, 16, 16, 16), (16, 16, 3, 3), 1),
    ((2, 16, 16, 16), (32, 16, 3, 3), 1),
    ((2, 32, 8, 8), (32, 32, 3, 3), 1),
    ((2, 32, 8, 8), (64, 32, 1, 1), 0),
)
LIMIT = 4096  # bytes the provider grants at most: every algorithm but the workspace-free one is refused
SEARCHES = ("heuristic", "exhaustive")  # the cases: algo_search settings


def measure(steps: int, heap: int, search: str) -> dict[str, float]:
    """Of this process's package, over ``steps`` after one warm-up step: milliseconds a step (the mean, the steps
    that ask the provider included), and how many times the provider was asked and a search timed candidates."""
    import numpy as np

    import wsarena
    from wsarena.arena import Arena, set_arena
    from wsarena.arena.testing import RecordingProvider
    from wsarena.backends._cpu_backend import CpuBackend

    asked = [0]

    def refuse(nbytes: int) -> bool:
        asked[0] += 1
        if nbytes > LIMIT:
            gc.collect()  # what CuPy's pool does before it gives up
            return True
        return False

    searches = [0]
    real_measure = CpuBackend.measure

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        searches[0] += 1
        return real_measure(self, *args, **kwargs)

    CpuBackend.measure = counted  # type: ignore[method-assign]
    set_arena("cpu", Arena(RecordingProvider(fail=refuse)))
    wsarena.configure(algo_search=search)
    kept = [[i] for i in range(heap)]  # a program's heap: lists, which the collector traverses
    rng = np.random.default_rng(0)
    layers = []
    for x_shape, w_shape, pad in LAYERS:
        x = rng.standard_normal(x_shape, dtype=np.float32)
        w = rng.standard_normal(w_shape, dtype=np.float32)
        layers.append((x, w, pad, wsarena.conv_forward(x, w, padding=pad)))

    def step() -> None:
        for x, w, pad, y in layers:
            wsarena.conv_forward(x, w, padding=pad)
            wsarena.conv_backward_data(y, w, x.shape, padding=pad)
            wsarena.conv_backward_filter(x, y, w.shape, padding=pad)

    step()  # warm-up: the first calls choose their algorithms
    asked[0] = searches[0] = 0
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = time.perf_counter() - start
    del kept
    return {
        "ms": 1e3 * elapsed / steps,
        "asks": asked[0],
        "searches": searches[0],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--heap", type=int, default=500_000, help="objects on the heap, for the collector")
    _checkouts.add_options(parser, json_metavar="SEARCH")
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.steps, args.heap, args.json)))
        return 0
    roots = args.checkout or [_checkouts.ROOT]
    best = _checkouts.best_of_rounds(__file__, roots, SEARCHES, args.rounds,
                                     ["--steps", str(args.steps), "--heap", str(args.heap)],
                                     env={"OPENBLAS_NUM_THREADS": "1"})
    print(f"{len(LAYERS)} layers x 3 passes a step, provider granting {LIMIT} bytes at most, gc.collect() on each "
          f"refusal, {args.heap} objects on the heap; mean of {args.steps} steps, best of {args.rounds} rounds")
    print(f"{'search':<11} {'checkout':<16} {'step ms':>9} {'asks':>8} {'searches':>9} {'vs first':>9}")
    for search, name, got, ratio in _checkouts.rows(best, roots, SEARCHES):
        print(f"{search:<11} {name:<16} {got['ms']:9.2f} {got['asks']:8d} {got['searches']:9d} {ratio:8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
