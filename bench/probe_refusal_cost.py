"""GPU probe: what one refused growth costs through each device provider, and what it costs the allocations after it.

When the arena cannot grow, its provider's pool has already done what it does on a failed ``cudaMalloc``: CuPy's
pool frees its cached blocks, runs Python's garbage collector and tries again; PyTorch's caching allocator frees its
cache, which synchronizes the device. The arena times each refusal and defers a call's next growth for 100 times as
long (``wsarena.arena._refusals``); this probe measures the refusal itself on a GPU, for ``CupyProvider`` and
``TorchProvider``:

- ``refusal ms``        one allocation larger than the device, refused, with ``--busy-cycles`` of spinning queued
                        on the stream (a step in flight) and ``--heap`` objects on Python's heap (a program that has
                        built a model);
- ``warm ms``           then ``--blocks`` allocations of ``--block-mib`` each from a pool that holds them cached;
- ``after ms``          the same allocations right after a refusal, which dropped the pool's cache.

Prints a table; ``--json FILE`` writes it. Run: python bench/probe_refusal_cost.py [--heap 500000] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any


def probe(provider: Any, torch: Any, blocks: int, block: int, busy_cycles: int) -> dict[str, float]:
    """The three times for ``provider``, in milliseconds."""
    sync = torch.cuda.synchronize

    def allocate_all() -> float:
        start = time.perf_counter()
        buffers = [provider.allocate(block, stream=0) for _ in range(blocks)]
        sync()
        elapsed = time.perf_counter() - start
        for buffer in buffers:
            provider.deallocate(buffer, stream=0)
        sync()
        return 1e3 * elapsed

    allocate_all()  # the pool now holds the blocks
    warm = allocate_all()
    huge = torch.cuda.get_device_properties(0).total_memory + (1 << 30)
    if busy_cycles:
        torch.cuda._sleep(busy_cycles)  # a step in flight: a refusal that synchronizes waits for it
    start = time.perf_counter()
    try:
        provider.allocate(huge, stream=0)
        raise RuntimeError(f"{provider!r} granted {huge} bytes, more than the device has")
    except MemoryError:
        refusal = 1e3 * (time.perf_counter() - start)
    sync()
    after = allocate_all()
    return {"refusal_ms": round(refusal, 3), "warm_ms": round(warm, 3), "after_ms": round(after, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heap", type=int, default=500_000, help="objects on Python's heap, for the collector")
    parser.add_argument("--blocks", type=int, default=32, help="blocks the pool holds cached")
    parser.add_argument("--block-mib", type=int, default=64, help="size of each block")
    parser.add_argument("--busy-cycles", type=int, default=10_000_000,
                        help="GPU cycles of spinning queued before the refusal (some 5 ms at 2 GHz)")
    parser.add_argument("--json", metavar="FILE", help="write the table as JSON")
    args = parser.parse_args()

    import torch

    from wsarena.arena.providers import CupyProvider, TorchProvider

    kept = [[i] for i in range(args.heap)]  # a program's heap: lists, which the collector traverses
    rows = {}
    for name, provider in (("cupy pool", CupyProvider(0)), ("torch caching allocator", TorchProvider(0))):
        rows[name] = probe(provider, torch, args.blocks, args.block_mib << 20, args.busy_cycles)
    del kept
    print(f"{args.heap} objects on the heap, {args.blocks} cached blocks of {args.block_mib} MiB, "
          f"{args.busy_cycles} GPU cycles queued before the refusal ({torch.cuda.get_device_name(0)})")
    print(f"{'provider':<25} {'refusal ms':>11} {'warm ms':>9} {'after ms':>9}")
    for name, row in rows.items():
        print(f"{name:<25} {row['refusal_ms']:11.2f} {row['warm_ms']:9.2f} {row['after_ms']:9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "heap": args.heap, "blocks": args.blocks,
                       "block_mib": args.block_mib, "busy_cycles": args.busy_cycles,
                       "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "providers": rows},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
