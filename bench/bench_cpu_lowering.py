"""The CPU backend's plans and the passes that use them, side by side: a committed tree before, the working tree after.

The baseline is ``git archive REV wsarena`` of this repository (``--baseline``, default ``main``), unpacked as a
package named ``wsarena_before``; "after" is the ``wsarena`` beside this script. Two measurements:

* planning: what ``wsarena report`` asks of the cpu backend per layer, ``plan()`` and the twelve workspace sizes,
  on a cold plan cache, in a fresh process per tree and kernel (the trees taking turns ``--rounds`` times): its
  time (the best of ``--repeat`` cold plans, one where the first took a second) and the memory the first one
  took, at its peak and kept (the process's resident memory, so to about 0.1 MiB);
* sweep: what the plans keep (tracemalloc) and the time, in a fresh process per tree, after running one large-kernel
  geometry after another (``--sweep N`` of each of ``SWEEPS``, each geometry's passes twice), as a long-running
  process that sees many shapes would;
* passes: every algorithm of every pass on a few ordinary geometries and three large kernels, through
  ``cpu.run`` with a workspace of its size, both trees in one process, their calls alternating (after one
  call each that fills the plans' caches): the best of ``--repeat`` calls, so that load from other processes
  hits both alike. Only the cpu backend's modules of the baseline run, and those import nothing by name. The
  outputs of the two trees' first calls are compared bit for bit: a row whose bits differ says so.

``after/before`` below 1 is faster or smaller::

    python bench/bench_cpu_lowering.py [--baseline REV] [--rounds 2] [--repeat 10] [--only plan|sweep|passes]
                                       [--sweep 20] [--threads N]
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import platform
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and "--threads" in sys.argv:
    # BLAS reads its thread count when it loads, so set it before NumPy is imported.
    _n = sys.argv[sys.argv.index("--threads") + 1]
    for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[_var] = _n

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "wsarena_before"

# name: (input shape NCHW, weight shape NCHW, keyword arguments)
KERNELS = {
    "3x3 (ResNet 64->64 @56)": ((32, 64, 56, 56), (64, 64, 3, 3), {"padding": 1}),
    "31x31 depthwise (RepLKNet @56)": ((32, 128, 56, 56), (128, 1, 31, 31), {"padding": 15, "groups": 128}),
    "1-D 4096 (16 ch @16384)": ((8, 16, 16384), (16, 16, 4096), {"padding": 2048}),
    "1000x1000 (1 ch @1000)": ((1, 1, 1000, 1000), (1, 1, 1000, 1000), {"padding": 500}),
}

GEOMETRIES = {
    "3x3 64->64 @28": ((2, 64, 28, 28), (64, 64, 3, 3), {"padding": 1}),
    "3x3 64->64 @28 NHWC": ((2, 64, 28, 28), (64, 64, 3, 3), {"padding": 1, "layout": "NHWC"}),
    "1x1 64->128 @28": ((2, 64, 28, 28), (128, 64, 1, 1), {}),
    "7x7 s2 3->64 @112": ((2, 3, 112, 112), (64, 3, 7, 7), {"stride": 2, "padding": 3}),
    "3x3 s2 64->128 @28": ((2, 64, 28, 28), (128, 64, 3, 3), {"stride": 2, "padding": 1}),
    "3x3 g4 64->64 @28": ((2, 64, 28, 28), (64, 16, 3, 3), {"padding": 1, "groups": 4}),
    "3x3 d2 32->32 @28": ((2, 32, 28, 28), (32, 32, 3, 3), {"padding": 2, "dilation": 2}),
    "depthwise 3x3 128 @28": ((2, 128, 28, 28), (128, 1, 3, 3), {"padding": 1, "groups": 128}),
    "1-D k5 32->32 @256": ((2, 32, 256), (32, 32, 5), {"padding": 2}),
    "3-D 3x3x3 16->16 @12": ((2, 16, 12, 12, 12), (16, 16, 3, 3, 3), {"padding": 1}),
    "31x31 depthwise 32 @28": ((1, 32, 28, 28), (32, 1, 31, 31), {"padding": 15, "groups": 32}),
    "31x31 depthwise 32 @28 NHWC": ((1, 32, 28, 28), (32, 1, 31, 31), {"padding": 15, "groups": 32, "layout": "NHWC"}),
    "1-D 4096 2->2 @4096": ((1, 2, 4096), (2, 2, 4096), {"padding": 2048}),
    "1x4096 2->2 @8x1024": ((1, 2, 8, 1024), (2, 2, 1, 4096), {"padding": (0, 2048)}),
}


# name: (the geometry of step i, its algorithms); each step a new shape of one large kernel
SWEEPS = {
    "181x181 kernel, implicit_gemm": (
        lambda i: ((1, 1, 4, 4 + i), (1, 1, 181, 181), {"padding": 90}), ("implicit_gemm",)),
    "1-D 4096 kernel, implicit_gemm and gemm_tiled": (
        lambda i: ((1, 2, 4096 + 16 * i), (2, 2, 4096), {"padding": 2048}), ("implicit_gemm", "gemm_tiled")),
}


def _geometry(package: str, ishape, wshape, kw):
    conv_geometry = importlib.import_module(f"{package}._geometry").conv_geometry
    if kw.get("layout") == "NHWC":
        ishape, wshape = (ishape[0], *ishape[2:], ishape[1]), (wshape[0], *wshape[2:], wshape[1])
    return conv_geometry(ishape, wshape, **kw)


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child_plan(package: str, name: str, repeat: int) -> dict:
    """Plan one kernel on a cold cache: time, peak and kept memory of the first plan, then the best cold time."""
    cpu = importlib.import_module(f"{package}.backends.cpu")
    plan = importlib.import_module(f"{package}.backends._cpu_lowering").plan

    def sizes(g) -> list[int]:
        return [cpu.workspace_size(p, a, g) for p, algos in cpu.ALGORITHMS.items() for a in algos]

    sizes(_geometry(package, (1, 2, 9, 9), (2, 2, 2, 2), {"padding": 1}))  # NumPy's first calls, not counted
    g = _geometry(package, *KERNELS[name])
    before = _resident_mib()
    start = time.perf_counter()
    sizes(g)
    times = [time.perf_counter() - start]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    kept = _resident_mib() - before
    while len(times) < repeat and times[0] < 1.0:
        plan.cache_clear()
        start = time.perf_counter()
        sizes(g)
        times.append(time.perf_counter() - start)
    return {"ms": min(times) * 1e3, "peak_mib": max(peak, 0.0), "kept_mib": max(kept, 0.0),
            "module": cpu.__file__}


def child_sweep(package: str, name: str, steps: int) -> dict:
    """Run ``steps`` geometries of sweep ``name`` (the forward pass, each algorithm twice): the memory traced at the
    end (the plans and what they keep), the items they keep, and the time."""
    import tracemalloc

    import numpy as np

    cpu = importlib.import_module(f"{package}.backends.cpu")
    lowering = importlib.import_module(f"{package}.backends._cpu_lowering")
    shape, algos = SWEEPS[name]

    def run(g, algo: str) -> None:
        rng = np.random.default_rng(0)
        x, w = (rng.standard_normal(s).astype(g.dtype) for s in (g.input_shape, g.weight_shape))
        ws = np.empty(cpu.workspace_size("fwd", algo, g), np.uint8)
        cpu.run("fwd", algo, g, x, w, np.empty(g.output_shape, g.dtype), ws)

    run(_geometry(package, *shape(10**4)), algos[0])  # NumPy's first calls, not counted
    lowering.plan.cache_clear()
    geometries = [_geometry(package, *shape(i)) for i in range(steps)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    for g in geometries:
        for _ in range(2):
            for algo in algos:
                run(g, algo)
    took = time.perf_counter() - start
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    if hasattr(lowering, "_total"):
        items = lowering._total
    else:  # each plan counted its own
        items = sum(lowering.plan(g).memo.get("kept", 0) for g in geometries)
    return {"mib": traced / 2**20, "items": items, "s": took, "module": cpu.__file__}


def passes(repeat: int):
    """Per geometry, pass and algorithm: the best milliseconds of the baseline's calls and of the working tree's,
    alternating in this process, and whether their outputs have the same bits; yields ``(key, before, after,
    same)``."""
    import numpy as np

    trees = {package: importlib.import_module(f"{package}.backends.cpu") for package in (BEFORE, "wsarena")}
    for name, spec in GEOMETRIES.items():
        gs = {package: _geometry(package, *spec) for package in trees}
        g = gs["wsarena"]
        rng = np.random.default_rng(0)
        x, w, dy = (rng.standard_normal(s).astype(g.dtype) for s in (g.input_shape, g.weight_shape, g.output_shape))
        operands = {"fwd": (x, w, g.output_shape), "bwd_data": (dy, w, g.input_shape),
                    "bwd_filter": (x, dy, g.weight_shape)}
        for pass_, (a, b, shape) in operands.items():
            for algo in trees["wsarena"].ALGORITHMS[pass_]:
                ws = np.empty(trees["wsarena"].workspace_size(pass_, algo, g), np.uint8)
                out = np.empty(shape, g.dtype)
                best: dict[str, float] = {}
                bits: set[bytes] = set()
                for package, cpu in trees.items():
                    cpu.run(pass_, algo, gs[package], a, b, out, ws)  # fills the plan's caches
                    bits.add(out.tobytes())
                for _ in range(repeat):
                    for package, cpu in trees.items():
                        start = time.perf_counter()
                        cpu.run(pass_, algo, gs[package], a, b, out, ws)
                        took = time.perf_counter() - start
                        best[package] = min(took, best.get(package, took))
                yield f"{name}|{pass_}|{algo}", best[BEFORE] * 1e3, best["wsarena"] * 1e3, len(bits) == 1


def _run_child(folder: Path, args: list[str], options: tuple[str, ...] = ()) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(folder)])}
    out = subprocess.run([sys.executable, __file__, *options, "--child", *args], env=env, capture_output=True,
                         text=True, check=False, cwd=tempfile.gettempdir())
    if out.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def _baseline(rev: str, folder: Path) -> None:
    """Unpack ``wsarena`` at ``rev`` as the package ``wsarena_before`` in ``folder``."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, "wsarena"], capture_output=True,
                         check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(folder, filter="data")
    (folder / "wsarena").rename(folder / BEFORE)


def _row(label: str, before: float, after: float, unit: str, width: int) -> str:
    ratio = f"{after / before:>12.3f}" if before > 0 else f"{'-':>12}"
    return f"{label:<{width}} {before:>12.3f} {after:>12.3f} {ratio}  {unit}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="main", help="git revision of the tree measured before")
    parser.add_argument("--rounds", type=int, default=2, help="processes per tree and kernel when planning")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--only", choices=("plan", "sweep", "passes"))
    parser.add_argument("--sweep", type=int, default=20, help="geometries of each sweep")
    parser.add_argument("--threads", type=int, help="BLAS threads (default: its own); 1 is stable on a busy machine")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        package, name = args.child
        found = child_sweep(package, name, args.sweep) if name in SWEEPS else child_plan(package, name, args.repeat)
        print(json.dumps(found))
        return 0
    import numpy as np

    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline], capture_output=True,
                         text=True, check=True).stdout.strip()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; numpy {np.__version__} "
          f"({args.threads or 'default'} BLAS threads); before: {args.baseline} ({rev}), after: the working tree")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        _baseline(args.baseline, folder)
        if args.only in (None, "plan"):
            width = max(map(len, KERNELS)) + 8
            print(f"\nplanning on a cold cache (plan + 12 workspace sizes), best of {args.rounds} processes each\n"
                  f"{'kernel':<{width}} {'before':>12} {'after':>12} {'after/before':>12}")
            for name in KERNELS:
                best: dict[str, dict[str, float]] = {BEFORE: {}, "wsarena": {}}
                for _ in range(args.rounds):
                    for package, found in best.items():
                        result = _run_child(folder, [package, name])
                        if not result.pop("module").startswith(str(folder if package == BEFORE else ROOT)):
                            raise SystemExit(f"{package} was not imported from its tree")
                        for key, value in result.items():
                            found[key] = min(value, found.get(key, value))
                before, after = best[BEFORE], best["wsarena"]
                print(_row(f"{name} time", before["ms"], after["ms"], "ms", width))
                print(_row(f"{name} peak", before["peak_mib"], after["peak_mib"], "MiB", width))
                print(_row(f"{name} kept", before["kept_mib"], after["kept_mib"], "MiB", width), flush=True)
        if args.only in (None, "sweep"):
            width = max(map(len, SWEEPS)) + 8
            print(f"\nsweep: {args.sweep} geometries one after another, each geometry's passes twice\n"
                  f"{'geometries':<{width}} {'before':>12} {'after':>12} {'after/before':>12}")
            for name in SWEEPS:
                found = {}
                for package in (BEFORE, "wsarena"):
                    found[package] = _run_child(folder, [package, name], ("--sweep", str(args.sweep)))
                    if not found[package].pop("module").startswith(str(folder if package == BEFORE else ROOT)):
                        raise SystemExit(f"{package} was not imported from its tree")
                before, after = found[BEFORE], found["wsarena"]
                print(_row(f"{name} kept", before["mib"], after["mib"], "MiB", width))
                print(_row(f"{name} items", before["items"], after["items"], "", width))
                print(_row(f"{name} time", before["s"], after["s"], "s", width), flush=True)
        if args.only in (None, "passes"):
            sys.path.insert(0, str(folder))
            sys.path.insert(0, str(ROOT))
            for package in (BEFORE, "wsarena"):
                print(f"{package}: {importlib.import_module(f'{package}.backends.cpu').__file__}")
            width = max(len(name) for name in GEOMETRIES) + 30
            print(f"\npasses: best ms of {args.repeat} calls each, alternating\n"
                  f"{'geometry|pass|algorithm':<{width}} {'before':>12} {'after':>12} {'after/before':>12}")
            totals: dict[str, list[float]] = {}
            differ = []
            for key, before, after, same in passes(args.repeat):
                print(_row(key, before, after, "ms", width) + ("" if same else "  bits differ"), flush=True)
                if not same:
                    differ.append(key)
                total = totals.setdefault(key.split("|")[0], [0.0, 0.0])
                total[0] += before
                total[1] += after
            for name, (before_ms, after_ms) in totals.items():
                print(_row(f"{name}: all 12", before_ms, after_ms, "ms", width))
            calls = 12 * len(GEOMETRIES)
            print(f"outputs: the bits differ in {len(differ)} of {calls} calls" if differ else
                  f"outputs: the same bits before and after in all {calls} calls")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
