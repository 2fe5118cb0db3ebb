"""What an exhaustive search costs where its outcome serves one call alone and the call comes again.

Three cases on the cpu backend (float32, NCHW), which times its candidates for real:

- ``plan-untimed``: a plan of layers that repeat one call (ResNet-50's layer1 blocks), under memory that gives the
  search nothing: the provider refuses every growth and the workspace-free ``implicit_gemm`` runs out of memory of its
  own as it is timed (NumPy's temporaries). The search times nothing and the call gets the heuristic order.
- ``ops-untimed``: the same pressure, one forward convolution called again and again.
- ``ops-refused``: memory keeps the backend from ranking its last candidate (``PartlyRanked``, as cuDNN's graph API
  when it cannot allocate what finalizing a plan takes) and it refuses to time one candidate on the call's operands
  (``PartlyTimed.refused``, as cuDNN for a view's alignment); memory is plentiful. One forward convolution called
  again and again, the search cache off.

Each reports the host time (a plan, or the mean call after the first), the random operands made, the provider's
allocations asked for, and the backend's timings run. To compare checkouts side by side, name their roots: each runs
in a subprocess of its own, alternately, ``--rounds`` times, and the table gives each case's best round and its ratio
to the first checkout's.

    python bench/bench_search_repeats.py [--calls 50] [--rounds 3] [--checkout DIR ...]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import _checkouts  # this folder is on sys.path when the script runs

CASES = ("plan-untimed", "ops-untimed", "ops-refused")


def measure(case: str, calls: int) -> dict[str, float]:
    """Of this process's package: milliseconds for ``case`` (a plan, or one call after the first), and how many random
    operands were made, growths asked of the provider and timings the backend ran meanwhile."""
    import numpy as np

    import wsarena
    from wsarena.arena import Arena, set_arena
    from wsarena.arena.testing import RecordingProvider
    from wsarena.backends import PartlyRanked, PartlyTimed
    from wsarena.backends._cpu_backend import CpuBackend

    counts = {"operands": 0, "asks": 0, "timings": 0}
    pressure = case != "ops-refused"

    def refuse(nbytes: int) -> bool:
        counts["asks"] += 1
        return pressure

    real_random, real_measure, real_candidates = CpuBackend.random, CpuBackend.measure, CpuBackend.candidates

    def random(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts["operands"] += 1
        return real_random(self, *args, **kwargs)

    def timed(self: Any, pass_: str, geom: Any, a: Any, b: Any, out: Any, workspace: Any, candidates: Any,
              stream: Any) -> Any:
        counts["timings"] += 1
        # Under pressure implicit_gemm's temporaries cannot be had; otherwise the backend refuses the call's operands
        # for implicit_gemm (no verdict on it)
        left_out = [c for c in candidates if c.algo == "implicit_gemm"]
        rest = [c for c in candidates if c.algo != "implicit_gemm"]
        found = real_measure(self, pass_, geom, a, b, out, workspace, rest, stream) if rest else []
        if not left_out:
            return found
        if pressure:
            if not found:
                raise MemoryError("no memory for implicit_gemm's temporaries")
            raise PartlyTimed(found, left_out)
        raise PartlyTimed(found, [], left_out)

    def candidates(self: Any, pass_: str, geom: Any) -> Any:
        return real_candidates(self, pass_, geom) if pressure else _partly(real_candidates(self, pass_, geom))

    def _partly(cands: list[Any]) -> Any:
        last = next(c for c in reversed(cands) if c.algo != "implicit_gemm")  # one left unranked
        raise PartlyRanked([c for c in cands if c is not last])

    CpuBackend.random, CpuBackend.measure = random, timed  # type: ignore[method-assign]
    CpuBackend.candidates = candidates  # type: ignore[method-assign]
    set_arena("cpu", Arena(RecordingProvider(fail=refuse)))
    wsarena.configure(algo_search="exhaustive", cap_workspace=None, cache_dir=None)
    import warnings

    warnings.simplefilter("ignore")
    if case == "plan-untimed":
        layers = wsarena.load_model("resnet50")[4:11]  # layer1.1 and layer1.2 repeat layer1.0's calls
        start = time.perf_counter()
        wsarena.plan(layers, batch=4, backend="cpu", passes=("fwd", "bwd_data", "bwd_filter"))
        elapsed = time.perf_counter() - start
    else:
        rng = np.random.default_rng(0)
        x = rng.standard_normal((2, 16, 16, 16), dtype=np.float32)
        w = rng.standard_normal((16, 16, 3, 3), dtype=np.float32)
        wsarena.conv_forward(x, w, padding=1)  # the first call searches
        counts.update(operands=0, asks=0, timings=0)
        start = time.perf_counter()
        for _ in range(calls):
            wsarena.conv_forward(x, w, padding=1)
        elapsed = (time.perf_counter() - start) / calls
    return {"ms": 1e3 * elapsed, **counts}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50, help="timed calls of the ops' cases")
    _checkouts.add_options(parser, json_metavar="CASE")
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.json, args.calls)))
        return 0
    roots = args.checkout or [_checkouts.ROOT]
    best = _checkouts.best_of_rounds(__file__, roots, CASES, args.rounds, ["--calls", str(args.calls)],
                                     env={"OPENBLAS_NUM_THREADS": "1"})
    print(f"plan: ResNet-50 layer1 at batch 4, three passes; ops: forward of (2, 16, 16, 16) by (16, 16, 3, 3), "
          f"mean of {args.calls} calls after the first; best of {args.rounds} rounds")
    print(f"{'case':<13} {'checkout':<16} {'ms':>9} {'operands':>9} {'asks':>6} {'timings':>8} {'vs first':>9}")
    for case, name, got, ratio in _checkouts.rows(best, roots, CASES):
        print(f"{case:<13} {name:<16} {got['ms']:9.3f} {got['operands']:9d} {got['asks']:6d} {got['timings']:8d} "
              f"{ratio:8.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
