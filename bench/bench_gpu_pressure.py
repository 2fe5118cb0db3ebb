"""A training step's convolutions on a GPU whose memory is nearly full: the arena's record of refusals against asking
the provider again on every call.

The device is filled (a ``cudaMalloc`` outside every pool) until ``--leave`` of the arena's planned size is free, so
that the layers whose first choice needs more run their fallback. Two configurations, side by side in interleaved
rounds, each on an arena of its own:

- ``remembers``   wsarena as it is: after the second refusal in a row, a call that can fall back does not ask for
                  as much again for 100 times the refusal's duration (``wsarena.arena._refusals``);
- ``asks``        the same with the record's gate held shut (``Arena.refusing`` always false): every call whose first
                  choice does not fit asks the provider again, as wsarena did before the record.

For the provider of CuPy's pool (a refusal frees its cache and runs the garbage collector over ``--heap`` objects)
and PyTorch's caching allocator (a refusal frees its cache, which synchronizes the device), when torch is there.
Per step, over ``--steps`` after a warm-up step (the best of ``--rounds``): wall time (issued and synchronized), the
provider's asks and its refusals.

Run: python bench/bench_gpu_pressure.py [--model resnet50] [--batch 32] [--steps 5] [--leave 0.5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import wsarena
from wsarena import algos
from wsarena.arena import Arena, CupyProvider, set_arena
from wsarena.backends import get_backend


class Counted:
    """A provider that counts the asks and refusals of the one it wraps."""

    def __init__(self, upstream: Any) -> None:
        self.upstream = upstream
        self.device_id = upstream.device_id
        self.asks = self.refusals = 0

    def allocate(self, size: int, *, stream: Any) -> Any:
        self.asks += 1
        try:
            return self.upstream.allocate(size, stream=stream)
        except MemoryError:
            self.refusals += 1
            raise

    def __getattr__(self, name: str) -> Any:  # deallocate, as_array, fill, current_stream, capture, stream_id
        return getattr(self.upstream, name)


PASSES = ("fwd", "bwd_data", "bwd_filter")


def run_pass(layer: tuple[Any, ...], pass_: str, algo: str | None = None) -> None:
    """One pass of ``layer`` (its geometry, operands and outputs), into its output."""
    g, x, w, dy, y, dx, dw = layer
    kw = {"stride": g.stride, "padding": g.padding, "dilation": g.dilation, "groups": g.groups, "algo": algo}
    if pass_ == "fwd":
        wsarena.conv_forward(x, w, **kw, out=y)
    elif pass_ == "bwd_data":
        wsarena.conv_backward_data(dy, w, g.input_shape, **kw, out=dx)
    else:
        wsarena.conv_backward_filter(x, dy, g.weight_shape, **kw, out=dw)


def _name(name: Any) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)


def measure(step: Any, providers: dict[str, Any], install: Any, sync: Any, reset: Any, free: Any, steps: int,
            rounds: int) -> dict:
    """For each provider (a name to a function that makes one), ``step()`` on an arena over it that remembers
    refusals and on one that asks every time (``Arena.refusing`` held false), in alternating rounds, each on a new
    arena: a warm-up step, then ``steps`` counted. ``install(arena)`` makes an arena the one ``step`` leases from,
    ``sync()`` waits for the device, ``reset()`` gives the pools' cached memory back once an arena is closed (so
    that each round starts with the same free memory), ``free()`` says how much is free. Per row: the best round's
    milliseconds a step, the provider's asks and refusals a step, the largest arena, the least free memory a round
    started with."""
    shut = property(lambda self: False)
    real = vars(Arena)["refusing"]
    rows: dict[str, dict[str, float]] = {}
    try:
        for name, make in providers.items():
            totals = {config: {"times": [], "asks": 0, "refusals": 0, "bytes": 0, "free": []}
                      for config in ("remembers", "asks")}
            for r in range(rounds * 2):
                config = ("remembers", "asks")[r % 2]
                total: Any = totals[config]
                setattr(Arena, "refusing", shut if config == "asks" else real)  # noqa: B010 - a property swapped
                total["free"].append(free())
                provider = Counted(make())
                arena = Arena(provider)
                install(arena)
                try:
                    step()  # warm up: algorithm choice, the arena's growth and its first refusals
                    sync()
                    provider.asks = provider.refusals = 0
                    start = time.perf_counter()
                    for _ in range(steps):
                        step()
                    sync()
                    total["times"].append((time.perf_counter() - start) / steps)
                    total["asks"] += provider.asks
                    total["refusals"] += provider.refusals
                    total["bytes"] = max(total["bytes"], arena.stats().capacity_bytes)
                finally:
                    arena.close()
                    reset()
            for config, total in totals.items():
                rows[f"{name}, {config}"] = {
                    "step_ms": round(1e3 * min(total["times"]), 2),
                    "asks_per_step": round(total["asks"] / (steps * rounds), 2),
                    "refusals_per_step": round(total["refusals"] / (steps * rounds), 2),
                    "arena_bytes": total["bytes"],
                    "free_bytes_at_start": min(total["free"]),
                }
    finally:
        setattr(Arena, "refusing", real)  # noqa: B010
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds of --steps per configuration")
    parser.add_argument("--leave", type=float, default=0.5, help="free memory left, a fraction of the planned arena")
    parser.add_argument("--heap", type=int, default=200_000, help="objects on Python's heap, for the collector")
    parser.add_argument("--json", help="also write the table as JSON into this file")
    args = parser.parse_args()

    import cupy
    from bench_gpu_host import layer_operands  # this folder is on sys.path when the script runs

    device = cupy.cuda.Device().id
    plan = wsarena.plan(wsarena.load_model(args.model), batch=args.batch, dtype=args.dtype, backend="cudnn",
                        cap_workspace=None)
    layers = [(g, x, w, dy, cupy.empty_like(dy), cupy.empty_like(x), cupy.empty_like(w))
              for g, x, w, dy in layer_operands(plan, args.dtype)]

    def step() -> None:
        for layer in layers:
            for pass_ in PASSES:
                run_pass(layer, pass_)

    providers: dict[str, Any] = {"cupy pool": lambda: CupyProvider(device)}
    pool = cupy.get_default_memory_pool()
    empty_caches = [pool.free_all_blocks]
    try:
        import torch
    except ImportError:
        pass
    else:
        from wsarena.arena import TorchProvider

        torch.empty(1, device=f"cuda:{device}")  # PyTorch's CUDA state made before the device is filled
        providers["torch caching allocator"] = lambda: TorchProvider(device)
        empty_caches.append(torch.cuda.empty_cache)

    def reset() -> None:
        for empty in empty_caches:
            empty()

    # Every candidate of every call runs once while memory is plentiful: CUDA loads a kernel's module on its first
    # launch, into device memory, which a filled device may not have (an execution failure, not a refusal).
    backend = get_backend("cudnn")
    warm = Arena(CupyProvider(device))
    set_arena(device, warm)
    for layer in layers:
        for pass_ in PASSES:
            for cand in algos.choose(backend, pass_, layer[0], cap=None, warn=False):
                try:
                    run_pass(layer, pass_, cand.algo)
                except backend.retry_errors:
                    continue
    cupy.cuda.Device().synchronize()
    warm.close()
    reset()

    planned = max(plan.stream_bytes)
    free, _ = cupy.cuda.runtime.memGetInfo()
    ballast = cupy.cuda.runtime.malloc(max(free - int(planned * args.leave), 1))  # outside every pool
    left = cupy.cuda.runtime.memGetInfo()[0]
    kept = [[i] for i in range(args.heap)]  # a program's heap: lists, which the collector traverses
    try:
        rows = measure(step, providers, lambda arena: set_arena(device, arena), cupy.cuda.Device().synchronize,
                       reset, lambda: cupy.cuda.runtime.memGetInfo()[0], args.steps, args.rounds)
    finally:
        del kept
        cupy.cuda.runtime.free(ballast)
    head = (f"{args.model} batch {args.batch} {args.dtype}, {3 * len(layers)} calls a step, {left >> 20} MiB free "
            f"of a planned arena of {planned >> 20} MiB, {args.heap} objects on the heap; best of {args.rounds} "
            f"rounds of {args.steps} steps ({_name(cupy.cuda.runtime.getDeviceProperties(device)['name'])}), "
            f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF')!r}")
    print(head)
    print(f"{'provider, configuration':<40} {'step ms':>9} {'asks/step':>10} {'refusals/step':>14} {'arena MiB':>10} "
          f"{'free MiB':>9}")
    for name, row in rows.items():
        print(f"{name:<40} {row['step_ms']:9.2f} {row['asks_per_step']:10.2f} {row['refusals_per_step']:14.2f} "
              f"{row['arena_bytes'] / 2**20:10.1f} {row['free_bytes_at_start'] / 2**20:9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": head, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
