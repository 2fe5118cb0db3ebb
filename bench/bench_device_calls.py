"""The calls a cached convolution makes into CuPy, the CUDA runtime, cuda.bindings and libcudnn, counted per call.

Without a GPU (the default): the ops run on ``tests/device_calls.py``'s stand-in for CuPy (made as CuPy 14.2's Cython
is: which CUDA runtime function each of its calls makes), each device's arena over a ``CupyProvider``, the graph and
legacy cuDNN backends with libcudnn's per-call functions recorded. Each pass is called once (the algorithm chosen,
the plan built, the handle made, the arena grown), then ``--calls`` times; the counts printed are those of one cached
call, for each pass, backend and way of calling: ``stream=None`` with ``out=`` (as ``bench_gpu_host.py`` calls),
without ``out=``, with ``out=`` under ``cap_workspace=0`` (an algorithm that takes no workspace: a zero-byte lease),
``stream=`` a CuPy stream that is not the current one, the same stream made current around the call
(``with s: conv(..., stream=s)``), and operands on device 1 while device 0 is current; then through
``wsarena._interop``: CUDA tensors of PyTorch's (``tests/device_calls.py``'s stand-in: host tensors that say they are
on a device), with ``out=`` (as ``wsarena.torch``'s operators call) or without, on PyTorch's default stream or a side
stream of its current, on device 1, or ``stream=s`` (a DLPack import each); and arrays with ``__cuda_array_interface__``
alone, ``stream=None`` with ``out=``, ``stream=s`` and ``with s:`` around it. The PyTorch ways need PyTorch installed.

``--gpu``, on a GPU: the same calls for real, with ``cudnnBackendExecute`` replaced by a C no-op (as
``bench_gpu_host.py``'s ``graph py`` column), timed per call, and each CUDA-touching piece alone (``cudaGetDevice``
through CuPy, a CuPy ``Device`` entered and left, ``cudaStreamIsCapturing``, ...), and where PyTorch has CUDA the
same calls on its tensors and its current stream's query. Run:
python bench/bench_device_calls.py [--calls 10] [--json FILE] [--gpu]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import platform
import sys
import timeit
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import wsarena

SHAPES = {"x": (2, 4, 8, 8), "w": (6, 4, 3, 3), "y": (2, 6, 8, 8)}  # padding 1


def _passes(arrays: dict[str, Any], out: bool, stream: Any) -> dict[str, Any]:
    """One closure per pass, on ``arrays`` (x, w, y: the forward's; dx, dw: the results)."""
    x, w, dy = arrays["x"], arrays["w"], arrays["y"]
    kw: dict[str, Any] = {"padding": 1, "stream": stream}
    return {
        "fwd": lambda: wsarena.conv_forward(x, w, **kw, **({"out": arrays["y_out"]} if out else {})),
        "bwd_data": lambda: wsarena.conv_backward_data(dy, w, SHAPES["x"], **kw,
                                                       **({"out": arrays["dx"]} if out else {})),
        "bwd_filter": lambda: wsarena.conv_backward_filter(x, dy, SHAPES["w"], **kw,
                                                           **({"out": arrays["dw"]} if out else {})),
    }


def _arrays(make: Any, device: int = 0) -> dict[str, Any]:
    """The operands and results of the three passes, each ``make(shape, "float32", device)``."""
    names = {"x": "x", "w": "w", "y": "y", "y_out": "y", "dx": "x", "dw": "w"}
    return {name: make(SHAPES[shape], "float32", device) for name, shape in names.items()}


def _tensor(cuda_tensor: Any, gpu: Any, shape: tuple[int, ...], dtype: str, device: int) -> Any:
    return cuda_tensor(gpu, shape, device)  # float32


def _interface_holder(holder: Any, cupy: Any, shape: tuple[int, ...], dtype: str, device: int) -> Any:
    return holder(cupy.array(shape, dtype, device))


WAYS = ("stream=None, out=", "stream=None", "stream=None, out=, cap 0", "stream=s", "with s: stream=s",
        "operands on device 1")
# The same through wsarena._interop: CUDA tensors of PyTorch's (as wsarena.torch's operators call, stream=None and
# out=), PyTorch's current stream its default one unless said; arrays of no library's, __cuda_array_interface__ alone
TORCH_WAYS = ("torch, stream=None, out=", "torch, stream=None", "torch, stream=None, out=, a side stream current",
              "torch, operands on device 1", "torch, stream=s")
CAI_WAYS = ("cuda_array_interface, stream=None, out=", "cuda_array_interface, stream=s",
            "cuda_array_interface, with s: stream=s")
ALL_WAYS = WAYS + TORCH_WAYS + CAI_WAYS


def counts(calls: int) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """Per backend, way of calling and pass: each recorded call's count per cached call."""
    from tests.device_calls import CudaArray, cuda_tensor, fake_gpu, torch_cuda

    found: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for api in ("graph", "legacy"):
        per_way: dict[str, dict[str, dict[str, float]]] = {}
        for way in ALL_WAYS:
            if way.startswith("torch") and importlib.util.find_spec("torch") is None:
                continue
            cap = 0 if way.endswith("cap 0") else None  # the candidate that takes no workspace: a zero-byte lease
            with (fake_gpu() as gpu, wsarena.config(cudnn_api=api, backend="cudnn", cap_workspace=cap),
                  warnings.catch_warnings(), torch_cuda(gpu) if way.startswith("torch") else contextlib.nullcontext()):
                warnings.simplefilter("ignore", wsarena.WorkspaceCapWarning)  # the cap leaves the first candidate out
                cupy = gpu.cupy
                device = 1 if way.endswith("operands on device 1") else 0
                if way.startswith("torch"):
                    arrays = _arrays(functools.partial(_tensor, cuda_tensor, gpu), device)
                    if way.endswith("a side stream current"):
                        gpu.torch_stream = 0x6000
                elif way.startswith("cuda_array_interface"):
                    arrays = _arrays(functools.partial(_interface_holder, CudaArray, cupy), device)
                else:
                    arrays = _arrays(gpu.cupy.array, device)
                side = cupy.cuda.Stream(0x5000, 0)  # a stream of device 0's, not the current one
                stream = side if way.endswith("stream=s") else None
                out = "stream=None, out=" in way or device == 1
                per_pass = {}
                for pass_, fn in _passes(arrays, out, stream).items():
                    scope = side if way.endswith("with s: stream=s") else None
                    if scope is not None:
                        scope.__enter__()
                    try:
                        fn()  # chooses, plans, makes the handle, grows the arena
                        gpu.record.clear()
                        for _ in range(calls):
                            fn()
                        per_pass[pass_] = {name: n / calls for name, n in sorted(gpu.calls.items())}
                    finally:
                        gpu.record.on = False  # the caller's own stream block is not the call's
                        if scope is not None:
                            scope.__exit__(None, None, None)
                        gpu.record.on = True
                    assert gpu.current_device() == 0, "the current device was not restored"
                per_way[way] = per_pass
        found[api] = per_way
    return found


def print_counts(found: dict[str, Any]) -> None:
    for api, per_way in found.items():
        for way, per_pass in per_way.items():
            print(f"\n{api}, {way}: calls per cached call")
            names = sorted({name for calls in per_pass.values() for name in calls})
            print(f"  {'call':<34} " + " ".join(f"{p:>10}" for p in per_pass))
            for name in names:
                print(f"  {name:<34} " + " ".join(f"{per_pass[p].get(name, 0):>10g}" for p in per_pass))


def gpu_times(number: int, repeat: int) -> dict[str, float]:
    """Microseconds per cached call on a GPU (cudnnBackendExecute a C no-op) and per CUDA-touching piece alone."""
    import cupy
    from bench_graph_host import no_op_execute

    from wsarena.arena._capture import capture_of
    from wsarena.cudnn import _prototypes

    best = lambda fn: min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6
    out: dict[str, float] = {}
    device = cupy.cuda.Device(0)
    stream = cupy.cuda.get_current_stream()
    out["cupy.cuda.runtime.getDevice()"] = best(cupy.cuda.runtime.getDevice)
    out["cupy.cuda.Device() (one cudaGetDevice)"] = best(cupy.cuda.Device)
    out["cupy.cuda.runtime.setDevice(0), current already"] = best(lambda: cupy.cuda.runtime.setDevice(0))

    def entered() -> None:
        with device:
            pass

    out["with cupy.cuda.Device(0): (current already)"] = best(entered)
    out["cupy.cuda.get_current_stream(0)"] = best(lambda: cupy.cuda.get_current_stream(0))
    out["capture_of(current stream) (cudaStreamIsCapturing)"] = best(lambda: capture_of(stream.ptr))
    side = cupy.cuda.Stream(non_blocking=True)

    def side_entered() -> None:
        with side:
            pass

    out["with a CuPy stream:"] = best(side_entered)
    torch = _torch_on_gpu()
    if torch is not None:
        out["torch._C._cuda_getCurrentRawStream(0)"] = best(lambda: torch._C._cuda_getCurrentRawStream(0))
    with wsarena.config(cudnn_api="graph", backend="cudnn"):
        arrays = _arrays(lambda shape, dtype, device: cupy.empty(shape, dtype=dtype))
        no_op = no_op_execute()
        _prototypes.function("cudnnBackendExecute")
        real = _prototypes._bound["cudnnBackendExecute"]
        torch = _torch_on_gpu()
        tensors = None if torch is None else _arrays(lambda shape, dtype, device: torch.empty(
            shape, dtype=getattr(torch, dtype), device="cuda"))
        try:
            _prototypes._bound["cudnnBackendExecute"] = no_op
            for pass_, fn in _passes(arrays, True, None).items():
                fn()
                out[f"graph {pass_}, stream=None, out= (execute a no-op)"] = best(fn)
            if tensors is not None:  # through wsarena._interop, as wsarena.torch's operators call
                for pass_, fn in _passes(tensors, True, None).items():
                    fn()
                    out[f"graph {pass_}, torch tensors, stream=None, out= (execute a no-op)"] = best(fn)
        finally:
            _prototypes._bound["cudnnBackendExecute"] = real
    return out


def _torch_on_gpu() -> Any:
    """PyTorch where it is installed with CUDA, else None."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    return torch if torch.cuda.is_available() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10, help="cached calls counted per pass (default 10)")
    parser.add_argument("--gpu", action="store_true", help="also time the calls and pieces on this machine's GPU")
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    from gpu_check import checkout_commit

    found: dict[str, Any] = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                             "python": platform.python_version(), "commit": checkout_commit()}
    found["counts"] = counts(args.calls)
    print(f"{found['machine']}; python {found['python']}; commit {found['commit']}")
    print_counts(found["counts"])
    if args.gpu:
        found["gpu_us"] = gpu_times(args.number, args.repeat)
        print(f"\nus per call on the GPU, best of {args.repeat} x {args.number}:")
        for name, us in found["gpu_us"].items():
            print(f"  {name:<58} {us:8.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
