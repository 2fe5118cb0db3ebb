"""Start-up a second process saves thanks to the search cache: its time to the first training step.

Each run is a fresh process that loads a model, makes random operands for every conv layer, and runs one
training step (forward, backward-data, backward-filter of every layer, through the public ops) with the
exhaustive search, then a second step. Three kinds of process, side by side:

* ``off``:   ``WSARENA_CACHE_DIR=off``: every process searches (what PyTorch's ``cudnn.benchmark`` does);
* ``first``: an empty cache folder: the first process searches and fills it;
* ``second``: the same folder again: the second process reads what the first one timed.

Times are from the start of the process's ``main`` (after the interpreter started, before ``import wsarena``),
the median of ``--repeat`` rounds (each round with a new folder). A process that fails or runs past ``--timeout``
gives no times: the table says which, its row is the median of the others (a row with none is left empty, and so
is the saving it takes), and the exit status is 1 only when no process gave any::

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


LABELS = {"off": "cache off", "first": "cache on, first process", "second": "cache on, second process"}


def run_child(args: argparse.Namespace, cache: str) -> dict | str:
    """One measuring process with the cache folder ``cache``: its times, or why it gave none (it failed, or ran past
    ``--timeout``), so that one process gone wrong does not lose the figures the others measured."""
    env = {**os.environ, "WSARENA_CACHE_DIR": cache,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, __file__, "--child", "--model", args.model, "--batch", str(args.batch),
               "--backend", args.backend, "--dtype", args.dtype]
    try:
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=False, timeout=args.timeout)
    except subprocess.TimeoutExpired as exc:
        return f"timed out after {exc.timeout:g} s"
    if out.returncode != 0:
        print(out.stderr[-3000:], file=sys.stderr)
        return f"failed (exit status {out.returncode}): {(out.stderr.strip().splitlines() or [''])[-1]}"
    return json.loads(out.stdout.splitlines()[-1])


def measure(args: argparse.Namespace) -> tuple[dict[str, list[dict]], list[str]]:
    """``--repeat`` rounds of the three processes: the times of those that gave them, by kind, and a line for each
    that gave none. Each is printed as it comes, so that a run cut short (gpu_check's time limit) still shows them."""
    runs: dict[str, list[dict]] = {kind: [] for kind in LABELS}
    missing: list[str] = []

    def record(round_: int, kind: str, result: dict | str) -> None:
        if isinstance(result, dict):
            runs[kind].append(result)
            print(f"round {round_}, {LABELS[kind]}: setup {result['setup_s']:.2f} s, first step done "
                  f"{result['first_step_done_s']:.2f} s, steady step {result['steady_step_s']:.2f} s", flush=True)
            return
        missing.append(f"round {round_}, {LABELS[kind]}: {result}")
        print(f"{missing[-1]}; its row leaves it out", file=sys.stderr, flush=True)

    for round_ in range(1, args.repeat + 1):
        record(round_, "off", run_child(args, "off"))
        with tempfile.TemporaryDirectory() as folder:
            first = run_child(args, folder)
            record(round_, "first", first)
            # after a first process that filled the folder in part or not at all, a second would time a search
            record(round_, "second", run_child(args, folder) if isinstance(first, dict) else
                   "not run: the first process of its round gave no times")
    return runs, missing


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
    runs, missing = measure(args)
    medians = {
        kind: {key: statistics.median(r[key] for r in results) for key in results[0]} if results else None
        for kind, results in runs.items()
    }
    print(f"{args.model}, batch {args.batch}, {args.dtype}, {args.backend} backend, exhaustive search; "
          f"median of {args.repeat} (seconds from the start of the process's main)")
    print(f"{'process':<28} {'setup':>8} {'first step done':>16} {'steady step':>12} {'of':>4}")
    for kind, m in medians.items():
        cells = [f"{'-':>8}", f"{'-':>16}", f"{'-':>12}"] if m is None else [
            f"{m['setup_s']:>8.2f}", f"{m['first_step_done_s']:>16.2f}", f"{m['steady_step_s']:>12.2f}"]
        print(f"{LABELS[kind]:<28} {' '.join(cells)} {len(runs[kind]):>4}")
    saved = None
    if medians["off"] is not None and medians["second"] is not None:
        saved = medians["off"]["first_step_done_s"] - medians["second"]["first_step_done_s"]
        print(f"start-up saved by the cache: {saved:.2f} s "
              f"({medians['off']['first_step_done_s']:.2f} s -> {medians['second']['first_step_done_s']:.2f} s)")
    else:
        print("start-up saved by the cache: not measured (no times from the processes without the cache, or from "
              "the second ones with it)")
    for line in missing:
        print(f"no times from {line}")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("json", "child")},
                                         "runs": runs, "missing": missing, "medians": medians, "saved_s": saved},
                                        indent=2) + "\n")
    return 0 if any(runs.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
