"""Host time per convolution call on a GPU: wsarena's ops, the cuDNN call alone, and PyTorch, side by side.

For a few ResNet-50 layers (batch 32, float32, all three passes) and one tiny convolution, the host time of one
cached call, measured while the GPU is held busy by a spin kernel queued ahead, so that the time is the host's
alone (no waiting for a full launch queue). wsarena's op and the bare cuDNN call alternate round by round:

- ``wsarena``     the public op on the legacy API (``out=`` given; algorithm cached, arena warm);
- ``cudnn``       the same legacy cuDNN call alone, through ``wsarena.cudnn.convolution`` with the descriptors
                  built and the handle bound beforehand: what any caller of cuDNN's legacy API pays;
- ``graph``       the public op on cuDNN's graph API (``cudnn_api="graph"``; its plan cached), with the variant
                  packs kept by pointers (the default), and ``graph/pc`` with one built per call (PyTorch's way);
- ``graph py``    the graph op with ``cudnnBackendExecute`` replaced by a C no-op declared as it is (ctypes still
                  converts its arguments): wsarena's own host time;
- ``torch``       PyTorch's own path (cuDNN's graph API with cached execution plans);
- ``torch v7``    PyTorch with ``TORCH_CUDNN_V8_API_DISABLED=1``: its legacy-API path, in a child process.

Prints microseconds per call and the ratios wsarena/cudnn (wsarena's own share), wsarena/torch and graph/torch.
Then where wsarena's own time goes (``--profile-calls N``, 0 for none): the graph op of one layer with the C no-op
for ``cudnnBackendExecute``, on CuPy arrays (``ops``) and through ``wsarena.torch.conv2d`` on PyTorch tensors
(``torch``), each timed, then run N times under ``cProfile``: the functions with the most time of their own, per
call (the profiler's own cost inflates the many small calls; the ranking is what to read).
Run: python bench/bench_gpu_host.py [--calls 20] [--rounds 7] [--profile-calls 2000] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import TypedDict

import cupy

import wsarena

LAYERS = ("conv1", "layer1.0.conv1", "layer1.0.conv2", "layer2.0.conv2", "layer3.0.conv3")
TINY = ("tiny", (1, 1, 4, 4), (1, 1, 3, 3), 1, 0)
PASSES = ("fwd", "bwd_data", "bwd_filter")
_SPIN = r'''extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}'''


def spin_kernel() -> cupy.RawKernel:
    """A one-thread kernel that busy-waits ``cycles`` SM clock cycles: queued ahead of timed work, it holds the
    GPU busy until the host has issued all of that work (used by bench_gpu_arena.py too)."""
    return cupy.RawKernel(_SPIN, "spin")


def layer_operands(plan, dtype: str):
    """Each planned layer's geometry with random operands of ``dtype`` on the GPU: ``(geometry, x, w, dy)``, the
    same numbers in every benchmark that asks (bench_gpu_arena.py and bench_gpu_pressure.py do)."""
    rng = cupy.random.default_rng(0)
    for lp in plan.layers:
        g = lp.geometry
        x, w, dy = (rng.standard_normal(s, dtype=cupy.float32).astype(dtype)
                    for s in (g.input_shape, g.weight_shape, g.output_shape))
        yield g, x, w, dy


def event_time_ms(fn, stream: cupy.cuda.Stream, spin: cupy.RawKernel, queued: bool) -> float:
    """Milliseconds between CUDA events recorded on ``stream`` around ``fn()``. ``queued``: behind ``spin`` (a
    :func:`spin_kernel`) spinning ~0.5 s, so that the host has issued all of ``fn``'s work before the GPU starts it
    and only the GPU's own time counts (bench_gpu_arena.py and bench_gpu_capture.py time their steps so)."""
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    if queued:
        spin((1,), (1,), (cupy.int64(1_000_000_000),), stream=stream)
    start.record(stream)
    fn()
    end.record(stream)
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end)


class Params(TypedDict):
    """A case's convolution parameters, as the ops and wsarena.torch take them by keyword."""

    stride: tuple[int, ...]
    padding: tuple[int, ...]


def cases() -> list[tuple[str, tuple, tuple, tuple, tuple]]:
    """(name, input shape, weight shape, stride, padding) of each layer measured."""
    by_name = {layer.name: layer for layer in wsarena.load_model("resnet50")}
    out = []
    for name in LAYERS:
        g = by_name[name].geometry(batch=32)
        out.append((name, g.input_shape, g.weight_shape, g.stride, g.padding))
    name, x, w, s, p = TINY
    out.append((name, x, w, (s, s), (p, p)))
    return out


class HostTimer:
    def __init__(self, calls: int, rounds: int) -> None:
        self.calls, self.rounds = calls, rounds
        self.stream = cupy.cuda.get_current_stream()
        self.spin = spin_kernel()

    def __call__(self, *fns) -> list[float]:
        """Fewest microseconds per call of each function over the rounds. Each round runs every function in turn
        (so that drift in the host's speed falls on all of them), each queued behind ~50 ms of spinning: longer
        than the host takes to issue the calls (20 at up to ~0.5 ms). A function may come as ``(setup, fn)``:
        ``setup()`` runs, untimed, before each of its timed loops (and returns what undoes it, or None)."""
        pairs = [fn if isinstance(fn, tuple) else (None, fn) for fn in fns]
        for setup, fn in pairs:
            with _applied(setup):
                fn()
        self.stream.synchronize()
        best = [float("inf")] * len(pairs)
        for _ in range(self.rounds):
            for i, (setup, fn) in enumerate(pairs):
                with _applied(setup):
                    self.spin((1,), (1,), (cupy.int64(100_000_000),), stream=self.stream)
                    start = time.perf_counter()
                    for _ in range(self.calls):
                        fn()
                    best[i] = min(best[i], (time.perf_counter() - start) / self.calls * 1e6)
                self.stream.synchronize()
        return best


class _applied:
    """Run a setup before the block and what it returns (an undo, or None) after it."""

    def __init__(self, setup) -> None:
        self.setup, self.undo = setup, None

    def __enter__(self) -> None:
        self.undo = self.setup() if self.setup is not None else None

    def __exit__(self, *exc) -> None:
        if self.undo is not None:
            self.undo()


def torch_times(timer: HostTimer) -> dict[str, float]:
    import torch
    import torch.nn.grad as tgrad

    torch.backends.cudnn.allow_tf32 = False  # float32 as wsarena computes it (FMA, no TF32)
    torch.backends.cudnn.benchmark = False

    def passes(x, w, dy, stride, padding):
        # A lambda per pass, as on wsarena's side: every timed call pays the same one Python frame
        return {
            "fwd": lambda: torch.nn.functional.conv2d(x, w, stride=stride, padding=padding),
            "bwd_data": lambda: tgrad.conv2d_input(x.shape, w, dy, stride=stride, padding=padding),
            "bwd_filter": lambda: tgrad.conv2d_weight(x, w.shape, dy, stride=stride, padding=padding),
        }

    times = {}
    with torch.no_grad(), torch.cuda.stream(torch_stream(timer.stream)):
        for name, xs, ws, stride, padding in cases():
            x = torch.randn(xs, device="cuda")
            w = torch.randn(ws, device="cuda")
            y = torch.nn.functional.conv2d(x, w, stride=stride, padding=padding)
            dy = torch.randn_like(y)
            for pass_, fn in passes(x, w, dy, stride, padding).items():
                times[f"{name}/{pass_}"] = timer(fn)[0]
    return times


def torch_stream(stream: cupy.cuda.Stream):
    """PyTorch's stream for CuPy's ``stream``, so that PyTorch's calls queue behind the spin kernel as wsarena's do.
    ``ExternalStream(0)`` is no wrapper of the legacy default stream: PyTorch reads a zero pointer as none given
    and hands out a stream of its pool, created non-blocking, which the legacy default stream does not order."""
    import torch

    if stream.ptr == 0:
        return torch.cuda.default_stream()
    return torch.cuda.ExternalStream(stream.ptr)


def _api(name: str, *, reuse: bool = True, stub: bool = False):
    """A HostTimer setup: the cuDNN API path ``name``; on the graph API the variant-pack mode of every cached plan,
    and (``stub``) cudnnBackendExecute replaced by a C no-op declared as it is."""
    from wsarena.backends import get_backend
    from wsarena.cudnn import _prototypes, graph

    def setup():
        wsarena.configure(cudnn_api=name)
        if name == "graph":
            graph.REUSE_VARIANT_PACKS = reuse
            for plan in get_backend("cudnn", "graph")._plans.built():  # a refusal cached in its place has no mode
                plan.reuse_variant_packs = reuse
        if not stub:
            return None
        from bench_graph_host import no_op_execute  # this folder is on the path when the script runs

        no_op = no_op_execute()  # a C no-op: ctypes still converts the arguments, as for cuDNN's
        real = _prototypes._bound["cudnnBackendExecute"]  # declared by no_op_execute()
        _prototypes._bound["cudnnBackendExecute"] = no_op  # what call() finds for it

        def undo():
            _prototypes._bound["cudnnBackendExecute"] = real

        return undo

    return setup


def wsarena_times(timer: HostTimer) -> dict[str, list[float]]:
    from wsarena import algos
    from wsarena._geometry import conv_geometry
    from wsarena.backends import get_backend

    wsarena.configure(cudnn_api="legacy")
    backend = get_backend("cudnn", "legacy")
    cudnn = wsarena.cudnn

    def passes(x, w, y, dy, dx, dw, xs, ws, kw):
        # The op of each pass (a lambda, as on torch's side) and its arrays in the order the op takes them
        return {
            "fwd": (lambda: wsarena.conv_forward(x, w, **kw, out=y), (x, w, y)),
            "bwd_data": (lambda: wsarena.conv_backward_data(dy, w, xs, **kw, out=dx), (dy, w, dx)),
            "bwd_filter": (lambda: wsarena.conv_backward_filter(x, dy, ws, **kw, out=dw), (x, dy, dw)),
        }

    times = {}
    for name, xs, ws, stride, padding in cases():
        rng = cupy.random.default_rng(0)
        x = rng.standard_normal(xs, dtype=cupy.float32)
        w = rng.standard_normal(ws, dtype=cupy.float32)
        kw: Params = {"stride": stride, "padding": padding}
        y = wsarena.conv_forward(x, w, **kw)
        dy = rng.standard_normal(y.shape, dtype=cupy.float32)
        dx, dw = cupy.empty_like(x), cupy.empty_like(w)
        ops = passes(x, w, y, dy, dx, dw, xs, ws, kw)
        geom = conv_geometry(xs, ws, stride=stride, padding=padding, dilation=1, groups=1, layout="NCHW",
                             dtype="float32")
        for pass_, (op, (a, b, out)) in ops.items():
            handle = cudnn.get_handle(cupy.cuda.Device().id)
            handle.set_stream(timer.stream.ptr)
            ptr = {"fwd": (a, b, out), "bwd_data": (out, b, a), "bwd_filter": (a, out, b)}[pass_]  # x, w, y
            # What the op runs: the first candidate (cached) that cuDNN does not refuse for these operands
            for cand in algos.choose(backend, pass_, geom, cap=None, warn=False):
                bare = _bare_call(cudnn, backend, pass_, geom, cand, handle, ptr)
                try:
                    bare()
                except backend.retry_errors:
                    continue
                break
            else:
                raise RuntimeError(f"cuDNN refused every {pass_} algorithm for {name}")
            legacy = _api("legacy")
            times[f"{name}/{pass_}"] = timer(
                (legacy, op), (legacy, bare), (_api("graph"), op), (_api("graph", reuse=False), op),
                (_api("graph", stub=True), op),
            )
    wsarena.configure(cudnn_api="legacy")
    return times


def _bare_call(cudnn, backend, pass_, geom, cand, handle, ptr):
    """The legacy cuDNN call of ``cand`` alone: descriptors built, handle bound, workspace allocated up front."""
    xd, wd, cd, yd = backend._descriptors(geom, cand.math_type)
    scratch = cupy.empty(max(cand.workspace_bytes, 1), cupy.uint8)
    algo = cudnn.conv.algorithm(pass_, cand.algo.upper())

    def bare() -> None:
        cudnn.convolution(
            pass_, handle, x_desc=xd, x_ptr=ptr[0].data.ptr, w_desc=wd, w_ptr=ptr[1].data.ptr, conv_desc=cd,
            y_desc=yd, y_ptr=ptr[2].data.ptr, algo=algo, workspace_ptr=scratch.data.ptr,
            workspace_bytes=cand.workspace_bytes,
        )

    return bare


def profiles(stream: cupy.cuda.Stream, calls: int, top: int = 15) -> dict[str, dict]:
    """wsarena's own host time on the device path, apart: per call, its time (fewest of 5 runs of ``calls``) and
    the ``top`` functions by time of their own under cProfile (see the module's docstring)."""
    import cProfile
    import pstats
    import timeit

    import torch

    import wsarena.torch as wtorch

    name, xs, ws, stride, padding = cases()[1]
    x = cupy.ones(xs, cupy.float32)
    w = cupy.ones(ws, cupy.float32)
    kw: Params = {"stride": stride, "padding": padding}
    y = wsarena.conv_forward(x, w, **kw)
    tx, tw = torch.from_dlpack(x), torch.from_dlpack(w)
    runs = {"ops": lambda: wsarena.conv_forward(x, w, **kw, out=y), "torch": lambda: wtorch.conv2d(tx, tw, **kw)}
    out = {}
    undo = _api("graph", stub=True)()
    try:
        with torch.no_grad(), stream, torch.cuda.stream(torch_stream(stream)):
            for label, fn in runs.items():
                fn()
                us = min(timeit.repeat(fn, number=calls, repeat=5)) / calls * 1e6
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(calls):
                    fn()
                profiler.disable()
                entries = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
                ranked = sorted(entries.items(), key=lambda kv: -kv[1][2])[:top]
                out[f"{name}/fwd {label}"] = {"us_per_call": round(us, 2), "functions": [
                    {"function": f"{os.path.basename(file)}:{line}({func})", "calls": round(nc / calls, 2),
                     "own_us": round(tt / calls * 1e6, 2), "cumulative_us": round(ct / calls * 1e6, 2)}
                    for (file, line, func), (_, nc, tt, ct, _) in ranked]}
            stream.synchronize()
    finally:
        undo()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--profile-calls", type=int, default=2000, help="calls profiled per path (0: no profile)")
    parser.add_argument("--json", help="also write the table as JSON into this file")
    parser.add_argument("--torch-only", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    timer = HostTimer(args.calls, args.rounds)
    if args.torch_only:
        print(json.dumps(torch_times(timer)))
        return
    ws = wsarena_times(timer)
    try:
        torch_now = torch_times(timer)
    except Exception as exc:  # noqa: BLE001 - the torch columns are left empty; the measured ones still printed
        print(f"torch: {type(exc).__name__}: {exc}", file=sys.stderr)
        torch_now = {}
    command = [sys.executable, __file__, "--torch-only", "--calls", str(args.calls), "--rounds", str(args.rounds)]
    try:  # some 20 s; a hung child must not take the measured columns with it
        child = subprocess.run(
            command, env={**os.environ, "TORCH_CUDNN_V8_API_DISABLED": "1"}, capture_output=True, text=True,
            check=False, timeout=120,
        ) if torch_now else None
    except subprocess.TimeoutExpired:
        child = subprocess.CompletedProcess(command, -9, "", "timed out after 120 s")
    torch_v7 = {}
    if child is not None and child.returncode == 0:
        torch_v7 = json.loads(child.stdout.strip().splitlines()[-1])
    elif child is not None:  # the column is left empty: the measured ones are still printed and written
        print(f"torch v7 (TORCH_CUDNN_V8_API_DISABLED=1) failed: {child.stderr.strip()[-500:]}", file=sys.stderr)
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    print(f"host us per cached call on {name}, cuDNN {wsarena.cudnn.library_info().get('version_string')}; "
          f"fewest of {args.rounds} rounds of {args.calls} calls, queued behind a spinning kernel")
    heads = ("wsarena", "cudnn", "graph", "graph/pc", "graph py", "torch", "torch v7", "ws/cudnn", "ws/torch",
             "graph/torch")
    print(f"{'layer/pass':<28} " + " ".join(f"{h:>11}" for h in heads))
    rows = {}
    for key, (t_ws, t_cudnn, t_graph, t_percall, t_py) in ws.items():
        t_torch, t_v7 = torch_now.get(key), torch_v7.get(key)
        row = {"wsarena": t_ws, "cudnn": t_cudnn, "graph": t_graph, "graph_per_call_pack": t_percall,
               "graph_python_only": t_py, "torch": t_torch, "torch_v7": t_v7}
        rows[key] = row
        ratios = [t_ws / t_cudnn, t_ws / t_torch if t_torch else None, t_graph / t_torch if t_torch else None]
        cells = [f"{v:11.1f}" if v else f"{'-':>11}" for v in (t_ws, t_cudnn, t_graph, t_percall, t_py, t_torch, t_v7)]
        cells += [f"{r:10.2f}x" if r else f"{'-':>11}" for r in ratios]
        print(f"{key:<28} " + " ".join(cells))
    found = {}
    if args.profile_calls:
        try:
            found = profiles(timer.stream, args.profile_calls)
        except Exception as exc:  # noqa: BLE001 - the table above stands without it
            print(f"profile: {type(exc).__name__}: {exc}", file=sys.stderr)
    for label, entry in found.items():
        print(f"{label}: {entry['us_per_call']:.1f} us per call; most time of their own (us per call, under cProfile):")
        for f in entry["functions"]:
            print(f"  {f['own_us']:7.2f} own {f['cumulative_us']:7.2f} cum  x{f['calls']:<5g} {f['function']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": name, "cudnn": wsarena.cudnn.library_info().get("version_string"),
                       "us_per_call": rows, "profiles": found}, f, indent=2)


if __name__ == "__main__":
    main()
