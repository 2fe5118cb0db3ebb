"""Each CPU algorithm (wsarena.backends.cpu, called directly) against PyTorch on the CPU, per pass.

For every layer and pass, times every algorithm of :mod:`wsarena.backends.cpu` with a workspace of exactly
its size, and torch on the same arrays (``conv{1,2,3}d`` forward; ``torch.nn.grad.conv*_input`` and
``conv*_weight`` for the backward passes, which call the same kernels autograd does). Prints the best and
the median time (all contenders timed round-robin, so that load from other processes hits them alike),
GFLOP/s of the best, and the ratios ``algo_time / torch_time`` of both (< 1: faster than torch). On a
shared machine the best times are the stable ones. Algorithms are listed in
:func:`~wsarena.backends.cpu.candidates` order.

The default layer is ResNet-50's 3x3 64->64 convolution at 56x56, batch 4, float32; ``--suite`` adds a few
other ResNet-50 layers (1x1, strided, stem, late 7x7) and a depthwise one.

Run: python bench/bench_cpu_conv.py [--suite] [--layout NCHW|NHWC] [--dtype float32|float64] [--repeat 15]
[--threads N]
Needs torch; prints the machine and thread counts it ran on.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from functools import partial

if __name__ == "__main__" and "--threads" in sys.argv:
    # BLAS reads its thread count when it loads, so set it before NumPy is imported.
    _n = sys.argv[sys.argv.index("--threads") + 1]
    for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[_var] = _n

import numpy as np

from wsarena._geometry import conv_geometry
from wsarena.backends import cpu

MAIN = ("res2 3x3 64->64 @56", (4, 64, 56, 56), (64, 64, 3, 3), {"padding": 1})
SUITE = [
    ("res2 1x1 64->256 @56", (4, 64, 56, 56), (256, 64, 1, 1), {}),
    ("res3 3x3 s2 128 @56", (4, 128, 56, 56), (128, 128, 3, 3), {"stride": 2, "padding": 1}),
    ("res3 1x1 s2 256->512", (4, 256, 56, 56), (512, 256, 1, 1), {"stride": 2}),
    ("stem 7x7 s2 3->64", (4, 3, 224, 224), (64, 3, 7, 7), {"stride": 2, "padding": 3}),
    ("res5 3x3 512 @7", (4, 512, 7, 7), (512, 512, 3, 3), {"padding": 1}),
    ("depthwise 3x3 256 @28", (4, 256, 28, 28), (256, 1, 3, 3), {"padding": 1, "groups": 256}),
]


def _interleaved_ms(fns: dict, repeat: int) -> dict:
    """Best and median milliseconds of each callable, timed round-robin so that load from other processes
    (a shared 2-core machine) hits every contender alike."""
    for fn in fns.values():
        fn()  # warm up (page faults, BLAS thread start)
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: (min(t) * 1e3, statistics.median(t) * 1e3) for name, t in times.items()}


def _torch_fns(torch, g, x, w, dy):
    import torch.nn.grad as tgrad

    nd = g.nd
    conv = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}[nd]
    grad_in = {1: tgrad.conv1d_input, 2: tgrad.conv2d_input, 3: tgrad.conv3d_input}[nd]
    grad_w = {1: tgrad.conv1d_weight, 2: tgrad.conv2d_weight, 3: tgrad.conv3d_weight}[nd]
    kw = {"stride": g.stride, "padding": g.padding, "dilation": g.dilation, "groups": g.groups}

    def first(a):  # torch wants NCHW shapes; NHWC arrays become channels_last tensors (no copy)
        t = torch.from_numpy(a)
        return t if g.layout == "NCHW" else t.permute(0, nd + 1, *range(1, nd + 1))

    tx, tw, tdy = first(x), first(w), first(dy)
    in_shape, w_shape = tuple(tx.shape), tuple(tw.shape)
    return {
        "fwd": lambda: conv(tx, tw, **kw),
        "bwd_data": lambda: grad_in(in_shape, tw, tdy, **kw),
        "bwd_filter": lambda: grad_w(tx, w_shape, tdy, **kw),
    }


def bench_layer(name, ishape, wshape, kw, layout, dtype, repeat, torch):
    if layout == "NHWC":
        ishape, wshape = (ishape[0], *ishape[2:], ishape[1]), (wshape[0], *wshape[2:], wshape[1])
    g = conv_geometry(ishape, wshape, layout=layout, dtype=dtype, **kw)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(g.input_shape, dtype=np.float64).astype(dtype)
    w = rng.standard_normal(g.weight_shape, dtype=np.float64).astype(dtype)
    dy = rng.standard_normal(g.output_shape, dtype=np.float64).astype(dtype)
    operands = {
        "fwd": (x, w, g.output_shape),
        "bwd_data": (dy, w, g.input_shape),
        "bwd_filter": (x, dy, g.weight_shape),
    }
    torch_fns = _torch_fns(torch, g, x, w, dy) if torch is not None else {}
    gmac = g.macs / 1e9
    print(f"\n{name}: input {g.input_shape}, weight {g.weight_shape}, {layout}, {dtype}, {gmac:.3f} GMAC per pass")
    print(
        f"  {'pass':<11} {'algorithm':<17} {'workspace':>12} {'best ms':>9} {'median':>9} {'GFLOP/s':>8}"
        f" {'/torch':>7} {'(med)':>7}"
    )
    for pass_ in ("fwd", "bwd_data", "bwd_filter"):
        a, b, shape = operands[pass_]
        out = np.empty(shape, dtype)
        algos = cpu.candidates(pass_, g)
        wss = {algo: np.empty(cpu.workspace_size(pass_, algo, g), np.uint8) for algo in algos}
        fns = {algo: partial(cpu.run, pass_, algo, g, a, b, out, wss[algo]) for algo in algos}
        if torch_fns:
            fns["torch"] = torch_fns[pass_]
        ms = _interleaved_ms(fns, repeat)
        t_torch, m_torch = ms.get("torch", (float("nan"), float("nan")))
        for algo in (["torch"] if torch_fns else []) + algos:
            mib = f"{wss[algo].nbytes / 2**20:8.1f} MiB" if algo in wss else ""
            best, med = ms[algo]
            print(
                f"  {pass_:<11} {algo:<17} {mib:>12} {best:9.2f} {med:9.2f} {2 * gmac / best * 1e3:8.1f}"
                f" {best / t_torch:7.2f} {med / m_torch:7.2f}"
            )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", action="store_true", help="also a few other ResNet-50 layers and a depthwise one")
    parser.add_argument("--layout", choices=("NCHW", "NHWC"), default="NCHW")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument(
        "--threads", type=int, default=None,
        help="BLAS and torch threads (default: their own); 1 is stable on a busy machine"
    )
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        torch = None
        print("torch is not installed: printing wsarena times only")
    if torch is not None and args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads() if torch is not None else "n/a"
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; numpy {np.__version__}, "
        f"torch {getattr(torch, '__version__', 'n/a')} ({threads} threads); {args.repeat} rounds"
    )
    for layer in [MAIN, *(SUITE if args.suite else [])]:
        bench_layer(*layer, args.layout, args.dtype, args.repeat, torch)


if __name__ == "__main__":
    main()
