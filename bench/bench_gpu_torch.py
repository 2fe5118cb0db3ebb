"""GPU: a ResNet-50 training step in PyTorch, its own convolutions against wsarena's (``wsarena.torch.convert``).

The same model (ResNet-50 as torchvision builds it, defined here so that torchvision is not needed), batch, data
and SGD step in every configuration:

- ``torch``            PyTorch's cuDNN convolutions (``cudnn.benchmark`` off: its heuristics);
- ``torch benchmark``  the same with ``cudnn.benchmark`` on (it times the algorithms, and may take larger ones);
- ``wsarena``          the model converted, no cap, on the default ``cudnn_api`` (``graph``); ``wsarena legacy``:
  the same on cuDNN's legacy API; ``wsarena 64MiB``: the default API under ``cap_workspace="64MiB"``.

TF32 is off in PyTorch's convolutions, as wsarena computes float32 in full float32 (``--autocast float16`` runs the
step under ``torch.autocast`` instead). Per configuration, over ``--steps`` steps after ``--warmup``, medians of:
the step time (CUDA synchronised around each step); the host's time to issue it (until ``opt.step()`` returns,
before the synchronisation); and its GPU time, the step queued behind ``torch.cuda._sleep`` spinning longer than the
host takes to issue it, so that the GPU never waits for the host. A step whose time is its issue time is host-bound;
one whose time is its GPU time is not. The GPU time is the GPU's own only where the host issued the whole step while
the GPU still spun (``gpu_own``; else it is marked ``*``): a step that waits for the device (a synchronisation, a
copy to the host) has the GPU wait for the host after it, and so does one whose issue outlasts the spin. Then the
peak of ``torch.cuda.max_memory_allocated()`` and of ``memory_reserved()`` over a step, and the convolution
workspace: for PyTorch, each convolution call's peak allocation beyond its inputs and outputs (measured in a step of
its own through a ``TorchDispatchMode`` on ``aten.convolution`` and ``aten.convolution_backward``), the largest of
them and their sum; for wsarena, what the arena holds (its memory comes from PyTorch's caching allocator, so it is
inside the peaks too), and how many buffers it allocated and grew over the timed steps (0 once warmed up). With
``--kernels N``, one more step under ``torch.profiler``: the N kernels that took the most GPU time, by name (which
convolution kernels each side runs), the step's number of kernels and their summed GPU time, and how often the host
called each CUDA runtime or driver function that synchronises, copies, allocates or frees
(``cudaStreamSynchronize``, ``cudaMemcpyAsync``, ``cudaMalloc``, ...): where a step's time goes other than to its
kernels.

Run: python bench/bench_gpu_torch.py [--batch 32] [--steps 10] [--warmup 3] [--autocast float16]
                                     [--memory-format channels_last|contiguous] [--kernels 8] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import re
import statistics
import time
import traceback

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import wsarena
import wsarena.torch


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(inplace=True), nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout),
        )
        self.down = nn.Sequential()
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.down(x))


def resnet50(classes: int = 1000) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64),
                               nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1)]
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


class WorkspaceProbe(TorchDispatchMode):
    """Each convolution call's peak allocation beyond what it had before and the outputs it returns."""

    OPS = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in self.OPS:
            return func(*args, **(kwargs or {}))
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = func(*args, **(kwargs or {}))
        kept = sum(t.untyped_storage().nbytes() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        self.calls.append(max(0, torch.cuda.max_memory_allocated() - before - kept))
        return out


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, target: torch.Tensor,
               autocast: torch.dtype | None) -> None:
    opt.zero_grad(set_to_none=True)
    scope = torch.autocast("cuda", dtype=autocast) if autocast else contextlib.nullcontext()
    with scope:
        loss = nn.functional.cross_entropy(model(x), target)
    loss.backward()
    opt.step()


def gpu_ms(step) -> tuple[float, float, bool]:
    """``step()``'s GPU time, queued behind a spin of the GPU (``torch.cuda._sleep``): (GPU ms, spin ms, whether
    it is the GPU's own). It is the GPU's own where the GPU still spun when ``step()`` returned (the event after
    the spin not reached): the host issued the whole step meanwhile and waited for the device nowhere. A step that
    synchronises (or outlasts the spin) ran in part while the GPU waited for the host, and its time counts the waits."""
    stream = torch.cuda.current_stream()
    spin_start, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    spin_start.record(stream)
    torch.cuda._sleep(SPIN_CYCLES)
    start.record(stream)
    step()
    own = not start.query()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end), spin_start.elapsed_time(start), own


SPIN_CYCLES = 600_000_000  # some 0.3 s on an H100's or H200's clock: twice the slowest step's issue seen


# The CUDA runtime and driver functions that wait for the device or copy (cudaStreamSynchronize, cudaMemcpyAsync)
# or allocate and free (cudaMalloc, cuMemAlloc_v2, cudaFree), by their names in torch.profiler's host events
API_CALLS = re.compile(r"Synchronize|Memcpy|Malloc|MemAlloc|Free")


def profile_step(step, count: int) -> dict:
    """One ``step()`` under ``torch.profiler`` (CUPTI, host and device): the ``count`` kernels with the most GPU time
    (``kernels``), the number of kernels and their summed GPU time (``kernel_count``, ``kernel_ms``; copies and
    memsets on the device count as kernels), and how often the host called each CUDA runtime or driver function
    that waits for the device, copies, allocates or frees (``api_calls``, by name; ``cudaDeviceSynchronize`` counts
    the profile's own, after the step and as the profiler stops)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        # a user annotation (a record_function range: Optimizer.step) is on the device too, spanning its kernels
        if event.device_type == torch.autograd.DeviceType.CUDA and not event.is_user_annotation:
            entry = totals.setdefault(event.name, [0.0, 0])
            entry[0] += event.device_time_total  # us
            entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:count]
    calls = {e.key: e.count for e in prof.key_averages()  # the runtime's and driver's calls are host events
             if e.device_type == torch.autograd.DeviceType.CPU and API_CALLS.search(e.key)}
    return {
        "kernels": [{"kernel": name, "gpu_ms": round(us / 1e3, 3), "calls": n} for name, (us, n) in ranked],
        "kernel_count": int(sum(n for _, n in totals.values())),
        "kernel_ms": round(sum(us for us, _ in totals.values()) / 1e3, 3), "api_calls": calls,
    }


def measure(name: str, model: nn.Module, x: torch.Tensor, target: torch.Tensor, args: argparse.Namespace,
            autocast: torch.dtype | None, probe: bool) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        train_step(model, opt, x, target, autocast)

    def arena_counts() -> dict[str, int]:
        stats = wsarena.get_arena(x.device.index).stats()
        return {"arena_allocations": stats.allocations, "arena_growths": stats.growths}

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    before = {} if probe else arena_counts()
    times, issues, peaks = [], [], []
    for _ in range(args.steps):
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        step()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        issues.append(issued - start)
        peaks.append((torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))
    # what the arena allocated over the timed steps: warmed up, it should not grow
    grown = {key: n - before[key] for key, n in arena_counts().items()} if before else {}
    gpu, spins, owns = zip(*(gpu_ms(step) for _ in range(min(args.steps, 3))))  # each waits out a spin: three suffice
    row = {
        "name": name, "step_ms": round(statistics.median(times) * 1e3, 2),
        "issue_ms": round(statistics.median(issues) * 1e3, 2), "gpu_ms": round(statistics.median(gpu), 2),
        # a GPU time is the GPU's own only where the host issued each step within its spin, waiting for nothing
        "gpu_own": all(owns), "spin_ms": round(min(spins), 1),
        "peak_allocated_bytes": max(p[0] for p in peaks), "peak_reserved_bytes": max(p[1] for p in peaks),
    }
    if args.kernels:
        try:
            row.update(profile_step(step, args.kernels))
        except Exception as exc:  # noqa: BLE001 - a profiler that cannot run (no CUPTI) leaves the timings
            row["kernels_error"] = f"{type(exc).__name__}: {exc}"
    if probe:
        with WorkspaceProbe() as p:
            step()
        torch.cuda.synchronize()
        row.update(workspace_peak_bytes=max(p.calls, default=0), workspace_sum_bytes=sum(p.calls),
                   conv_calls=len(p.calls))
    else:
        arena = wsarena.get_arena(x.device.index)
        stats = arena.stats()
        row.update(workspace_peak_bytes=stats.high_water_bytes, arena_bytes=stats.capacity_bytes,
                   provider=type(arena.provider).__name__, **grown)
    return row


def print_summary(rows: list[dict]) -> None:
    """The rows as a table; then what each profiled step ran and called, the workspace, and the arena's growth."""
    mib = 1 << 20
    print(f"{'':<16} {'step ms':>8} {'issue ms':>9} {'GPU ms':>8} {'peak alloc MiB':>15} "
          f"{'peak reserved MiB':>18} {'workspace MiB':>14}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<16} failed: {r['error'][:200]}")
            continue
        gpu = f"{r['gpu_ms']:.1f}" + ("" if r["gpu_own"] else "*")
        print(f"{r['name']:<16} {r['step_ms']:8.1f} {r['issue_ms']:9.1f} {gpu:>8} "
              f"{r['peak_allocated_bytes'] / mib:15.0f} {r['peak_reserved_bytes'] / mib:18.0f} "
              f"{r['workspace_peak_bytes'] / mib:14.1f}")
    spin = min((r["spin_ms"] for r in rows if "spin_ms" in r), default=0.0)
    print(f"GPU ms: queued behind {spin:.0f} ms of spinning; *: the host had not issued the step when the spin ended "
          "(it waited for the device, or took longer), so the time counts the GPU's waits for the host")
    for r in rows:
        if "kernel_count" in r:
            calls = ", ".join(f"{name} x{n}" for name, n in sorted(r["api_calls"].items())) or "none"
            print(f"{r['name']}: {r['kernel_count']} kernels, {r['kernel_ms']:.1f} GPU ms; calls that synchronise, "
                  f"copy or allocate: {calls}")
            if r["kernels"]:
                print("  " + "; ".join(f"{k['gpu_ms']:.2f} ms x{k['calls']} {k['kernel'][:70]}" for k in r["kernels"]))
        elif "kernels_error" in r:
            print(f"{r['name']}: not profiled: {r['kernels_error'][:200]}")
    sums = ", ".join(f"{r['name']} {r['workspace_sum_bytes'] / mib:.0f} MiB"
                     for r in rows if "workspace_sum_bytes" in r)
    held = ", ".join(f"{r['name']} {r['arena_bytes'] / mib:.0f} MiB" for r in rows if "arena_bytes" in r)
    print(f"workspace: PyTorch, the largest per-call transient allocation of a convolution (sum over the step: "
          f"{sums}); wsarena, the arena's largest lease (held: {held})")
    grown = ", ".join(f"{r['name']} {r['arena_allocations']} allocations, {r['arena_growths']} growths"
                      for r in rows if "arena_growths" in r)
    if grown:
        print(f"arena over the timed steps (0 expected: the warm-up grew it): {grown}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--autocast", choices=("float16", "bfloat16"), default=None)
    parser.add_argument("--memory-format", choices=("channels_last", "contiguous"), default="channels_last")
    parser.add_argument("--kernels", type=int, default=8, help="list this many kernels by GPU time (0: none)")
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()
    autocast = getattr(torch, args.autocast) if args.autocast else None
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    memory_format = torch.channels_last if args.memory_format == "channels_last" else torch.contiguous_format
    # Module.to takes memory_format (torch's documented channels_last recipe), which torch's overloads leave out
    base = resnet50().cuda().to(memory_format=memory_format)  # type: ignore[call-overload]
    x = torch.randn(args.batch, 3, 224, 224, device="cuda").to(memory_format=memory_format)
    target = torch.randint(0, 1000, (args.batch,), device="cuda")
    rows = []

    def attempt(name: str, make, probe: bool) -> None:
        # A configuration that fails leaves its row with the error: the others are still measured and written
        try:
            rows.append(measure(name, make(), x, target, args, autocast, probe=probe))
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            rows.append({"name": name, "error": f"{type(exc).__name__}: {exc}"})

    for name, bench_mode in (("torch", False), ("torch benchmark", True)):
        torch.backends.cudnn.benchmark = bench_mode
        attempt(name, lambda: copy.deepcopy(base), probe=True)
        torch.cuda.empty_cache()
    torch.backends.cudnn.benchmark = False
    for name, api, cap in (("wsarena", "graph", None), ("wsarena legacy", "legacy", None),
                           ("wsarena 64MiB", "graph", "64MiB")):
        wsarena.arena.reset_arenas()
        wsarena.configure(cap_workspace=cap, cudnn_api=api)
        torch.cuda.empty_cache()
        attempt(name, lambda: wsarena.torch.convert(copy.deepcopy(base)), probe=False)
    if args.json:  # before the table, so that the numbers are kept whatever the table makes of them
        result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "cudnn": torch.backends.cudnn.version(), "batch": args.batch,
                  "dtype": args.autocast or "float32", "memory_format": args.memory_format, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(f"ResNet-50 training step, batch {args.batch}, {args.autocast or 'float32'}, {args.memory_format}, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print_summary(rows)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
