"""Host time per convolution call on a GPU: wsarena's ops, the cuDNN call alone, and PyTorch, side by side.

For a few ResNet-50 layers (batch 32, float32, all three passes) and one tiny convolution, the host time of one
cached call, measured while the GPU is held busy by a spin kernel queued ahead, so that the time is the host's
alone (no waiting for a full launch queue). wsarena's op and the bare cuDNN call alternate round by round:

- ``wsarena``     the public op (``out=`` given; algorithm cached, arena warm);
- ``cudnn``       the same legacy cuDNN call alone, through ``wsarena.cudnn.convolution`` with the descriptors
                  built and the handle bound beforehand: what any caller of cuDNN's legacy API pays;
- ``torch``       PyTorch's own path (cuDNN's graph API with cached execution plans);
- ``torch v7``    PyTorch with ``TORCH_CUDNN_V8_API_DISABLED=1``: its legacy-API path, in a child process.

Prints microseconds per call and the ratios wsarena/cudnn (wsarena's own share) and wsarena/torch.
Run: python bench/bench_gpu_host.py [--calls 20] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

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
        than the host takes to issue the calls (20 at up to ~0.5 ms)."""
        for fn in fns:
            fn()
        self.stream.synchronize()
        best = [float("inf")] * len(fns)
        for _ in range(self.rounds):
            for i, fn in enumerate(fns):
                self.spin((1,), (1,), (cupy.int64(100_000_000),), stream=self.stream)
                start = time.perf_counter()
                for _ in range(self.calls):
                    fn()
                best[i] = min(best[i], (time.perf_counter() - start) / self.calls * 1e6)
                self.stream.synchronize()
        return best


def torch_times(timer: HostTimer) -> dict[str, float]:
    import torch
    import torch.nn.grad as tgrad

    torch.backends.cudnn.allow_tf32 = False  # float32 as wsarena computes it (FMA, no TF32)
    torch.backends.cudnn.benchmark = False
    times = {}
    with torch.no_grad(), torch.cuda.stream(torch.cuda.ExternalStream(timer.stream.ptr)):
        for name, xs, ws, stride, padding in cases():
            x = torch.randn(xs, device="cuda")
            w = torch.randn(ws, device="cuda")
            y = torch.nn.functional.conv2d(x, w, stride=stride, padding=padding)
            dy = torch.randn_like(y)
            fns = {
                "fwd": lambda: torch.nn.functional.conv2d(x, w, stride=stride, padding=padding),
                "bwd_data": lambda: tgrad.conv2d_input(x.shape, w, dy, stride=stride, padding=padding),
                "bwd_filter": lambda: tgrad.conv2d_weight(x, w.shape, dy, stride=stride, padding=padding),
            }
            for pass_, fn in fns.items():
                times[f"{name}/{pass_}"] = timer(fn)[0]
    return times


def wsarena_times(timer: HostTimer) -> dict[str, tuple[float, float]]:
    from wsarena import algos
    from wsarena._geometry import conv_geometry
    from wsarena.backends import get_backend

    backend = get_backend("cudnn")
    cudnn = wsarena.cudnn
    times = {}
    for name, xs, ws, stride, padding in cases():
        rng = cupy.random.default_rng(0)
        x = rng.standard_normal(xs, dtype=cupy.float32)
        w = rng.standard_normal(ws, dtype=cupy.float32)
        kw = dict(stride=stride, padding=padding)
        y = wsarena.conv_forward(x, w, **kw)
        dy = rng.standard_normal(y.shape, dtype=cupy.float32)
        dx, dw = cupy.empty_like(x), cupy.empty_like(w)
        ops = {
            "fwd": (lambda: wsarena.conv_forward(x, w, **kw, out=y), (x, w, y)),
            "bwd_data": (lambda: wsarena.conv_backward_data(dy, w, xs, **kw, out=dx), (dy, w, dx)),
            "bwd_filter": (lambda: wsarena.conv_backward_filter(x, dy, ws, **kw, out=dw), (x, dy, dw)),
        }
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
            times[f"{name}/{pass_}"] = tuple(timer(op, bare))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--torch-only", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    timer = HostTimer(args.calls, args.rounds)
    if args.torch_only:
        print(json.dumps(torch_times(timer)))
        return
    ws = wsarena_times(timer)
    try:
        torch_now = torch_times(timer)
        child = subprocess.run(
            [sys.executable, __file__, "--torch-only", "--calls", str(args.calls), "--rounds", str(args.rounds)],
            env={**os.environ, "TORCH_CUDNN_V8_API_DISABLED": "1"}, capture_output=True, text=True, check=True,
        )
        torch_v7 = json.loads(child.stdout.strip().splitlines()[-1])
    except ImportError:
        torch_now = torch_v7 = {}
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    print(f"host us per cached call on {name}, cuDNN {wsarena.cudnn.library_info().get('version_string')}; "
          f"fewest of {args.rounds} rounds of {args.calls} calls, queued behind a spinning kernel")
    heads = ("wsarena", "cudnn", "torch", "torch v7", "ws/cudnn", "ws/torch")
    print(f"{'layer/pass':<28} " + " ".join(f"{h:>{9 if len(h) > 7 else 8}}" for h in heads))
    for key, (t_ws, t_cudnn) in ws.items():
        t_torch, t_v7 = torch_now.get(key), torch_v7.get(key)
        cells = [f"{t_ws:8.1f}", f"{t_cudnn:8.1f}", f"{t_torch:8.1f}" if t_torch else f"{'-':>8}",
                 f"{t_v7:9.1f}" if t_v7 else f"{'-':>9}", f"{t_ws / t_cudnn:8.2f}x",
                 f"{t_ws / t_torch:8.2f}x" if t_torch else f"{'-':>9}"]
        print(f"{key:<28} " + " ".join(cells))


if __name__ == "__main__":
    main()
