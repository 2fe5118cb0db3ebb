"""A ResNet-50 step (forward, backward-data, backward-filter over its 53 convolutions) issued eagerly and replayed
from a CUDA graph, wsarena beside PyTorch, side by side in one run.

- ``wsarena legacy`` / ``wsarena graph``: the public ops, eager, on cuDNN's legacy and graph APIs;
- ``wsarena replay``: the graph-API step captured once with ``wsarena.capture()`` and replayed;
- ``torch eager`` / ``torch replay``: ``torch.ops.aten.convolution`` and ``convolution_backward`` on the same
  layers (cuDNN benchmark mode off), eager and captured with ``torch.cuda.graph``.

For each: the median step time as issued and the median GPU time (the step queued behind a spinning kernel) over
interleaved rounds, and the workspace memory held: the arena's capacity (pinned buffers included) for wsarena;
for torch eager, the largest allocation one convolution call makes beyond its outputs (its workspace, measured as
bench_gpu_torch.py measures it), which PyTorch's caching allocator keeps; for the replay, the private pool's growth
(the step's transient outputs included). float32 is computed in float32 on both sides: TF32 is off in PyTorch's
convolutions, as wsarena computes it. Run: python bench/bench_gpu_capture.py [--batch 32] [--dtype float32]
[--repeat 9] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics

import cupy
from bench_gpu_host import event_time_ms, spin_kernel  # this folder is on the path when the script runs

import wsarena
from wsarena.arena import Arena, CupyProvider, set_arena


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--json")
    args = parser.parse_args()
    import torch
    from bench_gpu_torch import WorkspaceProbe

    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = False  # float32 as wsarena computes it (FMA, no TF32)
    device = cupy.cuda.Device().id
    stream = cupy.cuda.Stream(non_blocking=True)
    tdtype = getattr(torch, args.dtype)
    layers = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for layer in wsarena.load_model("resnet50"):
        x = torch.randn((args.batch, *layer.input_shape[1:]), device="cuda", generator=gen).to(tdtype)
        w = torch.randn(layer.weight_shape, device="cuda", generator=gen).to(tdtype)
        y = torch.ops.aten.convolution(x, w, None, layer.stride, layer.padding, layer.dilation, False, [0, 0],
                                       layer.groups)
        dy = torch.randn_like(y)
        layers.append((layer, x, w, dy, torch.empty_like(y), torch.empty_like(x), torch.empty_like(w)))
    torch.cuda.synchronize()
    c = {id(t): cupy.from_dlpack(t) for lay in layers for t in lay[1:]}  # CuPy views of the same memory
    arenas = {api: Arena(CupyProvider(device)) for api in ("legacy", "graph")}

    def ws_step(api: str):
        def run() -> None:
            wsarena.configure(cudnn_api=api)
            set_arena(device, arenas[api])
            for layer, x, w, dy, y, dx, dw in layers:
                kw = {"stride": layer.stride, "padding": layer.padding, "dilation": layer.dilation,
                      "groups": layer.groups}
                wsarena.conv_forward(c[id(x)], c[id(w)], **kw, out=c[id(y)])
                wsarena.conv_backward_data(c[id(dy)], c[id(w)], x.shape, **kw, out=c[id(dx)])
                wsarena.conv_backward_filter(c[id(x)], c[id(dy)], w.shape, **kw, out=c[id(dw)])
        return run

    def torch_step() -> None:
        for layer, x, w, dy, y, dx, dw in layers:
            args_ = (layer.stride, layer.padding, layer.dilation, False, [0, 0], layer.groups)
            y.copy_(torch.ops.aten.convolution(x, w, None, *args_))
            gx, gw, _ = torch.ops.aten.convolution_backward(dy, x, w, None, *args_, [True, True, False])
            dx.copy_(gx)
            dw.copy_(gw)

    legacy, graph = ws_step("legacy"), ws_step("graph")
    tstream = torch.cuda.ExternalStream(stream.ptr)
    with stream, torch.cuda.stream(tstream):
        legacy(), graph()  # warm-up: choices, plans, arena
        torch_step()
        stream.synchronize()
        # Per call: a whole step's peak also holds the results the calls return (copied into y, dx and dw, then
        # freed, a layer's gradients only once the next layer's replace them), which are no workspace
        with WorkspaceProbe() as probe:
            torch_step()
        stream.synchronize()
        torch_held = max(probe.calls, default=0)
        graph()
        with wsarena.capture(stream) as captured:
            graph()
        tgraph = torch.cuda.CUDAGraph()
        # What torch.cuda.graph does before it captures, done before the count: its empty_cache() gives back the
        # eager steps' cached blocks, which would come off the private pool's growth
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        with torch.cuda.graph(tgraph, stream=tstream):
            torch_step()
        torch_replay_held = torch.cuda.memory_reserved() - before
    ws_held = {api: arenas[api].stats().capacity_bytes for api in arenas}
    # The graph's: its stream's buffer, shared with eager, and what its calls allocated (nothing: out= everywhere)
    replay = arenas["graph"].stats()
    ws_held["replay"] = replay.pinned_bytes + replay.kept_bytes
    spin = spin_kernel()

    def timed(fn, queued: bool) -> float:
        with stream, torch.cuda.stream(tstream):  # the step's calls issue on the stream the events time
            return event_time_ms(fn, stream, spin, queued)

    rows = [("wsarena legacy", legacy, ws_held["legacy"]), ("wsarena graph", graph, ws_held["graph"]),
            ("wsarena replay", lambda: captured.launch(stream), ws_held["replay"]),
            ("torch eager", torch_step, torch_held), ("torch replay", tgraph.replay, torch_replay_held)]
    times: dict = {(label, q): [] for label, _, _ in rows for q in (False, True)}
    for r in range(args.repeat):
        for label, fn, _ in rows[r % len(rows):] + rows[:r % len(rows)]:
            for queued in (False, True):
                times[label, queued].append(timed(fn, queued))
    ref = statistics.median(times["torch eager", False])
    print(f"device {torch.cuda.get_device_name()}; resnet50 convs batch {args.batch} {args.dtype}; "
          f"fwd+bwd_data+bwd_filter; median of {args.repeat}")
    print(f"{'':<15} {'step ms':>9} {'GPU ms':>8} {'step/GPU':>9} {'vs torch eager':>15} {'workspace held':>15}")
    table = {}
    for label, _, held in rows:
        s, g = statistics.median(times[label, False]), statistics.median(times[label, True])
        table[label] = {"step_ms": s, "gpu_ms": g, "held_bytes": int(held)}
        print(f"{label:<15} {s:9.2f} {g:8.2f} {s / g:9.3f} {s / ref:14.2f}x {wsarena.format_size(int(held)):>15}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": torch.cuda.get_device_name(), "batch": args.batch, "dtype": args.dtype,
                       "rows": table}, f, indent=2)
    captured.close()
    wsarena.configure(cudnn_api="legacy")
    set_arena(device, None)


if __name__ == "__main__":
    main()
