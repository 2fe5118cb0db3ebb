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

``--ranking`` times the algorithms alone (no torch) on :data:`RANKING`, ordinary layers and the geometries at the
bounds of :func:`~wsarena.backends.cpu.candidates`' rules, and says per pass how far the algorithm it ranks first is
from the fastest (median against median, the algorithms timed in turn: on a shared machine compare these ratios, not
times across runs); with ``--baseline REV`` the ranking of that git revision too, timed in the same run::

    python bench/bench_cpu_conv.py --ranking [--only TEXT] [--baseline main] [--repeat 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

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

# name: (input shape NCHW, weight shape, keyword arguments), NCHW. Ordinary layers first (ResNet's 3x3 and 1x1 at
# 56^2, 28^2 and 14^2, VGG's and U-Net's large images, 1-D and 3-D), then those at the bounds of candidates()' rules:
# a row's column matrix of 16 tiles or more (long kernels over wide rows) over outputs of 1 to 8 MiB.
RANKING: dict[str, tuple[tuple[int, ...], tuple[int, ...], dict[str, Any]]] = {
    "3x3 64 @56 b1": ((1, 64, 56, 56), (64, 64, 3, 3), {"padding": 1}),
    "3x3 64 @56 b8": ((8, 64, 56, 56), (64, 64, 3, 3), {"padding": 1}),
    "3x3 128 @28 b1": ((1, 128, 28, 28), (128, 128, 3, 3), {"padding": 1}),
    "3x3 128 @28 b8": ((8, 128, 28, 28), (128, 128, 3, 3), {"padding": 1}),
    "3x3 256 @14 b1": ((1, 256, 14, 14), (256, 256, 3, 3), {"padding": 1}),
    "3x3 256 @14 b8": ((8, 256, 14, 14), (256, 256, 3, 3), {"padding": 1}),
    "3x3 512 @14 b4": ((4, 512, 14, 14), (512, 512, 3, 3), {"padding": 1}),
    "3x3 s2 128 @56 b4": ((4, 128, 56, 56), (128, 128, 3, 3), {"stride": 2, "padding": 1}),
    "1x1 64->256 @56 b8": ((8, 64, 56, 56), (256, 64, 1, 1), {}),
    "1x1 256->64 @56 b1": ((1, 256, 56, 56), (64, 256, 1, 1), {}),
    "1x1 512->128 @28 b4": ((4, 512, 28, 28), (128, 512, 1, 1), {}),
    "1x1 s2 256->512 @56 b2": ((2, 256, 56, 56), (512, 256, 1, 1), {"stride": 2}),
    "1x1 1024->256 @14 b8": ((8, 1024, 14, 14), (256, 1024, 1, 1), {}),
    "3x3 256 @56 b2": ((2, 256, 56, 56), (256, 256, 3, 3), {"padding": 1}),
    "3x3 128 @112 b1": ((1, 128, 112, 112), (128, 128, 3, 3), {"padding": 1}),
    "3x3 64 @224 b1": ((1, 64, 224, 224), (64, 64, 3, 3), {"padding": 1}),
    "3x3 64 @224 b2": ((2, 64, 224, 224), (64, 64, 3, 3), {"padding": 1}),
    "U-Net 3x3 64 @570 b1": ((1, 64, 570, 570), (64, 64, 3, 3), {}),
    "U-Net 3x3 128->64 @392 b1": ((1, 128, 392, 392), (64, 128, 3, 3), {}),
    "U-Net 3x3 256 @138 b1": ((1, 256, 138, 138), (256, 256, 3, 3), {}),
    "U-Net 3x3 512->256 @104 b1": ((1, 512, 104, 104), (256, 512, 3, 3), {}),
    "U-Net 3x3 1024->512 @56 b1": ((1, 1024, 56, 56), (512, 1024, 3, 3), {}),
    "1-D k3 64 @4096 b4": ((4, 64, 4096), (64, 64, 3), {"padding": 1}),
    "1-D k3 512 @1024 b8": ((8, 512, 1024), (512, 512, 3), {"padding": 1}),
    "1-D k5 256 @16384 b1": ((1, 256, 16384), (256, 256, 5), {"padding": 2}),
    "3-D 3x3x3 16 @12 b2": ((2, 16, 12, 12, 12), (16, 16, 3, 3, 3), {"padding": 1}),
    "3-D 3x3x3 64 @16 b4": ((4, 64, 16, 16, 16), (64, 64, 3, 3, 3), {"padding": 1}),
    "3-D 3x3x3 32 @32 b2": ((2, 32, 32, 32, 32), (32, 32, 3, 3, 3), {"padding": 1}),
    "3-D 3x3x3 64 @64 b1": ((1, 64, 64, 64, 64), (64, 64, 3, 3, 3), {"padding": 1}),
    "3-D 3x3x3 64 @64 b2": ((2, 64, 64, 64, 64), (64, 64, 3, 3, 3), {"padding": 1}),
    "3x3 256 @8x2048 b1": ((1, 256, 8, 2048), (256, 256, 3, 3), {"padding": 1}),
    "1x64 16 @2x8192 b1": ((1, 16, 2, 8192), (16, 16, 1, 64), {"padding": (0, 32)}),
    "1x64 16 @3x8192 b1": ((1, 16, 3, 8192), (16, 16, 1, 64), {"padding": (0, 32)}),
    "1x64 16 @4x8192 b1": ((1, 16, 4, 8192), (16, 16, 1, 64), {"padding": (0, 32)}),
    "1x64 16 @6x8192 b1": ((1, 16, 6, 8192), (16, 16, 1, 64), {"padding": (0, 32)}),
    "1x64 16 @8x8192 b1": ((1, 16, 8, 8192), (16, 16, 1, 64), {"padding": (0, 32)}),
    "1x64 16 @12x8192 b1": ((1, 16, 12, 8192), (16, 16, 1, 64), {"padding": (0, 32)}),
    "1x64 16 @16x8192 b1": ((1, 16, 16, 8192), (16, 16, 1, 64), {"padding": (0, 32)}),
    "1x4096 2 @8x4096 b4": ((4, 2, 8, 4096), (2, 2, 1, 4096), {"padding": (0, 2048)}),
    "1x2048 16 @8x2048 b1": ((1, 16, 8, 2048), (16, 16, 1, 2048), {"padding": (0, 1024)}),
    "1x2048 16 @8x2048 b2": ((2, 16, 8, 2048), (16, 16, 1, 2048), {"padding": (0, 1024)}),
}


def _interleaved_ms(fns: dict, repeat: int, seconds: float = 0.0) -> dict:
    """Best and median milliseconds of each callable, timed round-robin so that load from other processes
    (a shared 2-core machine) hits every contender alike: ``repeat`` rounds, or more (up to ten times as many)
    where fewer would take less than ``seconds``."""
    start = time.perf_counter()
    for fn in fns.values():
        fn()  # warm up (page faults, BLAS thread start)
    warm = time.perf_counter() - start
    repeat = max(repeat, min(10 * repeat, int(seconds / max(warm, 1e-9))))
    times: dict[str, list[float]] = {name: [] for name in fns}
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


def _geometry(cpu_module, ishape, wshape, kw, dtype):
    conv_geometry_of = importlib.import_module(cpu_module.__name__.rsplit(".", 2)[0] + "._geometry").conv_geometry
    return conv_geometry_of(ishape, wshape, dtype=dtype, **kw)


def ranking(names, dtype, repeat, baseline) -> None:
    """Every algorithm of every pass on ``names`` of :data:`RANKING`, timed in turn; per pass the medians, and how far
    the algorithm ranked first (now, and by ``baseline``'s cpu module if given) is from the fastest."""
    trees = {"now": cpu}
    if baseline is not None:
        trees["before"] = baseline
    print(f"\nmedian ms of {repeat} calls each (up to {10 * repeat} where that takes under 2 s), in turn; "
          "x: median / the fastest median")
    rows = []
    for name in names:
        g = conv_geometry(*RANKING[name][:2], dtype=dtype, **RANKING[name][2])
        rng = np.random.default_rng(0)
        x, w, dy = (rng.standard_normal(s, dtype=np.float64).astype(dtype)
                    for s in (g.input_shape, g.weight_shape, g.output_shape))
        operands = {"fwd": (x, w, g.output_shape), "bwd_data": (dy, w, g.input_shape),
                    "bwd_filter": (x, dy, g.weight_shape)}
        for pass_, (a, b, shape) in operands.items():
            out = np.empty(shape, dtype)
            algos = cpu.ALGORITHMS[pass_]
            wss = {algo: np.empty(cpu.workspace_size(pass_, algo, g), np.uint8) for algo in algos}
            ms = _interleaved_ms({algo: partial(cpu.run, pass_, algo, g, a, b, out, wss[algo]) for algo in algos},
                                 repeat, seconds=2.0)
            del wss
            fastest = min(med for _, med in ms.values())
            first = {tree: module.candidates(pass_, _geometry(module, *RANKING[name], dtype))[0]
                     for tree, module in trees.items()}
            cells = "  ".join(f"{algo.split('_', 1)[-1] if algo != 'implicit_gemm' else 'implicit'} "
                              f"{ms[algo][1]:.1f} ({cpu.workspace_size(pass_, algo, g) / 2**20:.0f} MiB)"
                              for algo in algos)
            firsts = "  ".join(f"{tree}: {algo} x{ms[algo][1] / fastest:.2f}" for tree, algo in first.items())
            print(f"{name:<24} {pass_:<10} {cells}  | {firsts}", flush=True)
            rows.append((name, pass_, {tree: ms[algo][1] / fastest for tree, algo in first.items()}))
    for tree in trees:
        ratios = [r[tree] for _, _, r in rows]
        print(f"{tree}: the first ranked is the fastest in {sum(r == 1.0 for r in ratios)} of {len(ratios)} passes; "
              f"x{statistics.geometric_mean(ratios):.3f} the fastest (geometric mean), x{max(ratios):.2f} at worst")


def _baseline_cpu(rev: str, folder: Path):
    """The cpu module of ``wsarena`` at git revision ``rev``, imported as ``wsarena_before`` from ``folder``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_cpu_lowering import BEFORE, _baseline

    _baseline(rev, folder)
    sys.path.insert(0, str(folder))
    return importlib.import_module(f"{BEFORE}.backends.cpu")


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
    parser.add_argument("--ranking", action="store_true", help="how far each pass's first ranked is from the fastest")
    parser.add_argument("--only", action="append", help="with --ranking: the cases whose name has this text")
    parser.add_argument("--baseline", help="with --ranking: a git revision whose ranking to time too")
    args = parser.parse_args(argv)
    if args.ranking:
        names = [n for n in RANKING if not args.only or any(text in n for text in args.only)]
        print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; numpy {np.__version__}"
              f" ({args.threads or 'default'} BLAS threads); {args.dtype}, NCHW")
        with tempfile.TemporaryDirectory() as tmp:
            baseline = _baseline_cpu(args.baseline, Path(tmp)) if args.baseline else None
            ranking(names, args.dtype, args.repeat, baseline)
        return
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
