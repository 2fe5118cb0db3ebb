"""CPU backend vs PyTorch on the CPU, side by side in one run.

1. Throughput on ResNet-50's 53 conv layers at batch 4: forward + backward-data + backward-filter through
   wsarena's public ops and through torch (conv2d forward and torch.nn.grad.conv2d_input / conv2d_weight),
   on the same float32 arrays. Reported as GMAC/s and as the ratio torch_time / wsarena_time (>1: wsarena faster).
2. Host overhead of one tiny cached call (1x1x4x4 input, 1x1x3x3 filter) against torch.nn.functional.conv2d.

Run: python bench/bench_cpu_ops.py [--batch 4] [--repeat 3] [--layers N]
Needs torch (pip install torch); prints the machine it ran on.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np

import wsarena


def _median_time(fn, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def throughput(batch: int, repeat: int, limit: int | None) -> None:
    import torch
    import torch.nn.grad as tgrad

    layers = wsarena.load_model("resnet50")[:limit]
    rng = np.random.default_rng(0)
    print(f"ResNet-50 conv layers: {len(layers)}, batch {batch}, float32, fwd + bwd_data + bwd_filter, "
          f"median of {repeat}")
    print(f"{'layer':<22} {'GMAC':>7} {'wsarena ms':>11} {'torch ms':>9} {'torch/ws':>9}")
    total_ws = total_torch = total_macs = 0.0
    for layer in layers:
        g = layer.geometry(batch=batch)
        x = rng.standard_normal(g.input_shape, dtype=np.float32)
        w = rng.standard_normal(g.weight_shape, dtype=np.float32)
        dy = rng.standard_normal(g.output_shape, dtype=np.float32)
        kw = {"stride": g.stride, "padding": g.padding, "dilation": g.dilation, "groups": g.groups}
        y = np.empty(g.output_shape, np.float32)
        dx = np.empty(g.input_shape, np.float32)
        dw = np.empty(g.weight_shape, np.float32)

        def ws_step(x=x, w=w, dy=dy, kw=kw, y=y, dx=dx, dw=dw):
            wsarena.conv_forward(x, w, **kw, out=y)
            wsarena.conv_backward_data(dy, w, x.shape, **kw, out=dx)
            wsarena.conv_backward_filter(x, dy, w.shape, **kw, out=dw)

        tx, tw, tdy = (torch.from_numpy(a) for a in (x, w, dy))

        tkw = {"stride": g.stride, "padding": g.padding, "dilation": g.dilation, "groups": g.groups}

        def torch_step(tx=tx, tw=tw, tdy=tdy, tkw=tkw):
            with torch.no_grad():
                torch.nn.functional.conv2d(tx, tw, **tkw)
                tgrad.conv2d_input(tx.shape, tw, tdy, **tkw)
                tgrad.conv2d_weight(tx, tw.shape, tdy, **tkw)

        ws_step(), torch_step()  # warm up: algorithm choice, arena growth, torch's kernels
        t_ws = _median_time(ws_step, repeat)
        t_torch = _median_time(torch_step, repeat)
        macs = 3 * g.macs
        total_ws += t_ws
        total_torch += t_torch
        total_macs += macs
        print(f"{layer.name:<22} {macs / 1e9:7.3f} {t_ws * 1e3:11.2f} {t_torch * 1e3:9.2f} {t_torch / t_ws:9.2f}")
    print(
        f"{'total':<22} {total_macs / 1e9:7.2f} {total_ws * 1e3:11.1f} {total_torch * 1e3:9.1f} "
        f"{total_torch / total_ws:9.2f}"
    )
    print(f"throughput: wsarena {total_macs / total_ws / 1e9:.1f} GMAC/s, "
          f"torch {total_macs / total_torch / 1e9:.1f} GMAC/s, "
          f"ratio wsarena/torch = {total_torch / total_ws:.2f}")
    stats = wsarena.get_arena("cpu").stats()
    print(f"arena after the run: capacity {wsarena.format_size(stats['capacity_bytes'])}, "
          f"high water {wsarena.format_size(stats['high_water_bytes'])}")


def overhead(n: int = 2000) -> None:
    import torch

    x = np.ones((1, 1, 4, 4), np.float32)
    w = np.ones((1, 1, 3, 3), np.float32)
    y = np.empty((1, 1, 2, 2), np.float32)
    tx, tw = torch.from_numpy(x), torch.from_numpy(w)
    wsarena.conv_forward(x, w, out=y)

    def ws_loop():
        for _ in range(n):
            wsarena.conv_forward(x, w, out=y)

    def torch_loop():
        with torch.no_grad():
            for _ in range(n):
                torch.nn.functional.conv2d(tx, tw)

    t_ws = _median_time(ws_loop, 5) / n
    t_torch = _median_time(torch_loop, 5) / n
    print(f"host overhead of one tiny cached call: wsarena {t_ws * 1e6:.1f} us, torch {t_torch * 1e6:.1f} us, "
          f"wsarena/torch = {t_ws / t_torch:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layers", type=int, default=None, help="only the first N layers")
    args = parser.parse_args()
    import torch

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; numpy {np.__version__}, "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads)")
    throughput(args.batch, args.repeat, args.layers)
    overhead()


if __name__ == "__main__":
    main()
