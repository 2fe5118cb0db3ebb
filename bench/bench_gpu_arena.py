"""Workspace memory and step time on a GPU: wsarena's arena vs one workspace per layer and pass vs per call.

Same cuDNN algorithms (the heuristic choices, no cap; one cuDNN refuses on these operands is skipped, as the ops
skip it) and the same operands in all three; only where the workspace comes from differs:

- ``wsarena``   the public ops on cuDNN's legacy API, workspace leased from the device arena (one buffer per
  stream);
- ``graph``     the same ops on cuDNN's graph API (``cudnn_api="graph"``: cached execution plans; its own
  heuristic choices, so its own arena, reported beside the legacy one);
- ``unshared``  one workspace per layer and pass allocated up front, as Caffe's cuDNN layer keeps;
- ``per-call``  a workspace allocated from CuPy's memory pool before each call and freed after it, as
  PyTorch does with its caching allocator.

Reports workspace bytes held after a step, the median step time (CUDA events around the step as issued) and the
median GPU time (the same events with the step queued behind a spinning kernel, so the host's issue time is
hidden), over interleaved rounds (the order rotating), with ratios against wsarena. With cuDNN's legacy API the
host can take as long to issue a step as the GPU takes to run it (see bench_gpu_host.py): then the step time
shows host overhead and the GPU time what the workspace's placement costs the kernels.
Then the host time of one tiny cached call (1x1x4x4 input, 1x1x3x3 filter, ``out=`` given), which bounds how
fast small layers can be issued, beside ``torch.nn.functional.conv2d`` on the same GPU when torch is there.
Run: python bench/bench_gpu_arena.py [--model resnet50] [--batch 32] [--repeat 9] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import types

import cupy
from bench_gpu_host import event_time_ms, layer_operands, spin_kernel  # this folder is on sys.path when run

import wsarena
from wsarena import algos
from wsarena.backends import get_backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", help="also write the table as JSON into this file")
    args = parser.parse_args()

    from wsarena.arena import Arena, CupyProvider, set_arena

    wsarena.configure(cudnn_api="legacy")
    backend = get_backend("cudnn", "legacy")
    plan = wsarena.plan(wsarena.load_model(args.model), batch=args.batch, dtype=args.dtype, backend="cudnn",
                        cap_workspace=None)
    with wsarena.config(cudnn_api="graph"):
        graph_plan = wsarena.plan(wsarena.load_model(args.model), batch=args.batch, dtype=args.dtype,
                                  backend="cudnn", cap_workspace=None)
    layers = []
    for lp, (g, x, w, dy) in zip(plan.layers, layer_operands(plan, args.dtype)):
        outs = {"fwd": cupy.empty_like(dy), "bwd_data": cupy.empty_like(x), "bwd_filter": cupy.empty_like(w)}
        ops = {"fwd": (x, w), "bwd_data": (dy, w), "bwd_filter": (x, dy)}
        layers.append((lp, g, ops, outs))
    stream = cupy.cuda.get_current_stream()
    device = cupy.cuda.Device().id
    arenas = {api: Arena(CupyProvider(device)) for api in ("legacy", "graph")}

    def step(api):
        def run():
            wsarena.configure(cudnn_api=api)  # once per step: the ops read it per call
            set_arena(device, arenas[api])
            for lp, g, ops, outs in layers:
                kw = {"stride": g.stride, "padding": g.padding, "dilation": g.dilation, "groups": g.groups}
                wsarena.conv_forward(*ops["fwd"], **kw, out=outs["fwd"])
                wsarena.conv_backward_data(*ops["bwd_data"], g.input_shape, **kw, out=outs["bwd_data"])
                wsarena.conv_backward_filter(*ops["bwd_filter"], g.weight_shape, **kw, out=outs["bwd_filter"])

        return run

    run_wsarena, run_graph = step("legacy"), step("graph")

    def accepted(p, g, ops, out):
        """The candidate the ops run here: the first in the ranked list that cuDNN does not refuse."""
        for c in algos.choose(backend, p, g, cap=None, warn=False):
            mem = cupy.cuda.alloc(max(c.workspace_bytes, 1))
            try:
                backend.run(p, c, g, *ops, out, types.SimpleNamespace(ptr=mem.ptr, nbytes=c.workspace_bytes), stream)
            except backend.retry_errors:
                continue
            return c
        raise RuntimeError(f"cuDNN refused every {p} algorithm for {g}")

    choices = {(i, p): accepted(p, g, ops[p], outs[p])
               for i, (lp, g, ops, outs) in enumerate(layers) for p in lp.choices}
    unshared = {key: cupy.cuda.alloc(max(c.workspace_bytes, 1)) for key, c in choices.items()}

    def run_unshared():
        for i, (lp, g, ops, outs) in enumerate(layers):
            for p in lp.choices:
                c, mem = choices[(i, p)], unshared[(i, p)]
                ws = types.SimpleNamespace(ptr=mem.ptr, nbytes=c.workspace_bytes)
                backend.run(p, c, g, *ops[p], outs[p], ws, stream)

    def run_per_call():
        for i, (lp, g, ops, outs) in enumerate(layers):
            for p in lp.choices:
                c = choices[(i, p)]
                mem = cupy.cuda.alloc(c.workspace_bytes) if c.workspace_bytes else None
                ws = types.SimpleNamespace(ptr=mem.ptr if mem else 0, nbytes=c.workspace_bytes)
                backend.run(p, c, g, *ops[p], outs[p], ws, stream)
                del mem

    spin = spin_kernel()

    pool = cupy.get_default_memory_pool()
    run_wsarena()  # warm up: algorithm choice, arena growth
    run_graph()  # and the plans
    run_unshared()
    stream.synchronize()
    held_ws = arenas["legacy"].stats()["capacity_bytes"]
    held_graph = arenas["graph"].stats()["capacity_bytes"]
    held_un = sum(c.workspace_bytes for c in choices.values())
    pool.free_all_blocks()
    before = pool.total_bytes()
    run_per_call()  # warm up: pool growth
    stream.synchronize()
    held_pc = pool.total_bytes() - before  # what the caching pool keeps after the step
    # Interleaved rounds, the order rotating, so that clock changes and other work on the GPU fall on all three
    strategies = [run_wsarena, run_graph, run_unshared, run_per_call]
    times: dict = {(fn, queued): [] for fn in strategies for queued in (False, True)}
    for r in range(args.repeat):
        for fn in strategies[r % 4:] + strategies[:r % 4]:
            for queued in (False, True):
                times[fn, queued].append(event_time_ms(fn, stream, spin, queued))
    step_ms = {fn: statistics.median(times[fn, False]) for fn in strategies}
    gpu_ms = {fn: statistics.median(times[fn, True]) for fn in strategies}

    name = backend.device_label()
    print(f"device {name}; {args.model} batch {args.batch} {args.dtype}; fwd+bwd_data+bwd_filter; "
          f"median of {args.repeat}")
    print(f"plan: arena {wsarena.format_size(plan.arena_bytes)}, unshared {wsarena.format_size(plan.unshared_bytes)}; "
          f"graph API: arena {wsarena.format_size(graph_plan.arena_bytes)}, "
          f"unshared {wsarena.format_size(graph_plan.unshared_bytes)}")
    print(f"{'strategy':<10} {'workspace held':>15} {'vs wsarena':>11} {'step ms':>9} {'vs wsarena':>11} "
          f"{'GPU ms':>8} {'vs wsarena':>11}")
    rows = (("wsarena", held_ws, run_wsarena), ("graph", held_graph, run_graph), ("unshared", held_un, run_unshared),
            ("per-call", held_pc, run_per_call))
    for label, held, fn in rows:
        ratio = f"{held / held_ws:.2f}x" if held_ws else "-"
        print(f"{label:<10} {wsarena.format_size(int(held)):>15} {ratio:>11} {step_ms[fn]:9.2f} "
              f"{step_ms[fn] / step_ms[run_wsarena]:10.2f}x {gpu_ms[fn]:8.2f} "
              f"{gpu_ms[fn] / gpu_ms[run_wsarena]:10.2f}x")
    for label, fn in (("legacy", run_wsarena), ("graph", run_graph)):
        print(f"{label} API: step as issued / GPU time = {step_ms[fn] / gpu_ms[fn]:.3f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": name, "model": args.model, "batch": args.batch, "dtype": args.dtype,
                       "rows": {label: {"held_bytes": int(held), "step_ms": step_ms[fn], "gpu_ms": gpu_ms[fn]}
                                for label, held, fn in rows}}, f, indent=2)
    wsarena.configure(cudnn_api="legacy")
    set_arena(device, None)

    host_overhead()


def host_overhead(n: int = 2000) -> None:
    x = cupy.ones((1, 1, 4, 4), cupy.float32)
    w = cupy.ones((1, 1, 3, 3), cupy.float32)
    y = cupy.empty((1, 1, 2, 2), cupy.float32)

    def per_call(fn) -> float:
        fn()  # algorithm choice, arena and pool growth
        cupy.cuda.Device().synchronize()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(n):
                fn()
            times.append((time.perf_counter() - start) / n)  # host time: the kernels queue behind
            cupy.cuda.Device().synchronize()
        return statistics.median(times) * 1e6

    t_ws = per_call(lambda: wsarena.conv_forward(x, w, out=y))
    wsarena.configure(cudnn_api="graph")
    t_graph = per_call(lambda: wsarena.conv_forward(x, w, out=y))
    wsarena.configure(cudnn_api="legacy")
    line = f"host time of one tiny cached call: wsarena {t_ws:.1f} us (legacy API), {t_graph:.1f} us (graph API)"
    try:
        import torch
    except ImportError:
        print(line + " (torch not installed: no comparison)")
        return
    tx, tw = torch.as_tensor(x, device="cuda"), torch.as_tensor(w, device="cuda")
    with torch.no_grad():
        t_torch = per_call(lambda: torch.nn.functional.conv2d(tx, tw))
    print(f"{line}, torch {t_torch:.1f} us, wsarena/torch = {t_ws / t_torch:.2f}x")


if __name__ == "__main__":
    main()
