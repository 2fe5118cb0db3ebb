"""Start-up a second process saves thanks to the search cache: its time to the first training step.

Each run is a fresh process that loads a model, makes random operands for every conv layer, and runs one
training step (forward, backward-data, backward-filter of every layer, through the public ops) with the
exhaustive search, then a second step. Three kinds of process, side by side:

* ``off``:   ``WSARENA_CACHE_DIR=off``: every process searches (what PyTorch's ``cudnn.benchmark`` does);
* ``first``: an empty cache folder: the first process searches and fills it;
* ``second``: the same folder again: the second process reads what the first one timed.

Times are from the start of the process's ``main`` (after the interpreter started, before ``import wsarena``),
the median of ``--repeat`` rounds (each round with a new folder)::

    python bench/bench_search_cache.py [--model resnet50] [--batch 8] [--backend cpu] [--dtype float32]
                                       [--repeat 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(model: str, batch: int, backend_name: str, dtype: str) -> dict:
    start = time.perf_counter()
    import wsarena
    from wsarena.backends import get_backend

    backend = get_backend(backend_name)
    wsarena.configure(algo_search="exhaustive", backend=backend_name)
    calls = []
    for layer in wsarena.load_model(model):
        g = layer.geometry(batch=batch, dtype=dtype)
        x, w, dy = (backend.random(s, dtype) for s in (g.input_shape, g.weight_shape, g.output_shape))
        calls.append((layer, x, w, dy))
    ready = time.perf_counter()

    def step() -> None:
        for layer, x, w, dy in calls:
            p = {"stride": layer.stride, "padding": layer.padding, "dilation": layer.dilation, "groups": layer.groups}
            wsarena.conv_forward(x, w, **p)
            wsarena.conv_backward_data(dy, w, input_shape=x.shape, **p)
            wsarena.conv_backward_filter(x, dy, weight_shape=w.shape, **p)
        if backend_name == "cudnn":
            import cupy

            cupy.cuda.Device().synchronize()

    step()
    first = time.perf_counter()
    step()
    second = time.perf_counter()
    return {"setup_s": ready - start, "first_step_done_s": first - start, "steady_step_s": second - first}


def run_child(args: argparse.Namespace, cache: str) -> dict:
    env = {**os.environ, "WSARENA_CACHE_DIR": cache,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, __file__, "--child", "--model", args.model, "--batch", str(args.batch),
               "--backend", args.backend, "--dtype", args.dtype]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=False, timeout=args.timeout)
    if out.returncode != 0:
        raise SystemExit(f"a measuring process failed (exit status {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--backend", default="cpu", choices=("cpu", "cudnn"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600, help="seconds for one process")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.batch, args.backend, args.dtype)))
        return 0
    runs: dict[str, list[dict]] = {"off": [], "first": [], "second": []}
    for _ in range(args.repeat):
        runs["off"].append(run_child(args, "off"))
        with tempfile.TemporaryDirectory() as folder:
            runs["first"].append(run_child(args, folder))
            runs["second"].append(run_child(args, folder))
    medians = {
        kind: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for kind, results in runs.items()
    }
    print(f"{args.model}, batch {args.batch}, {args.dtype}, {args.backend} backend, exhaustive search; "
          f"median of {args.repeat} (seconds from the start of the process's main)")
    print(f"{'process':<28} {'setup':>8} {'first step done':>16} {'steady step':>12}")
    labels = {"off": "cache off", "first": "cache on, first process", "second": "cache on, second process"}
    for kind, m in medians.items():
        print(f"{labels[kind]:<28} {m['setup_s']:>8.2f} {m['first_step_done_s']:>16.2f} {m['steady_step_s']:>12.2f}")
    saved = medians["off"]["first_step_done_s"] - medians["second"]["first_step_done_s"]
    print(f"start-up saved by the cache: {saved:.2f} s "
          f"({medians['off']['first_step_done_s']:.2f} s -> {medians['second']['first_step_done_s']:.2f} s)")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("json", "child")},
                                         "runs": runs, "medians": medians, "saved_s": saved}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
