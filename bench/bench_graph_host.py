"""The graph-API path's own host time per call, measured without a GPU.

A cached call on cuDNN's graph API is wsarena's shared op path (argument checks, the call's record, the lease) plus
the graph backend's ``run`` (pointers and their alignment, the plan cache, the variant pack) plus the handle's
stream binding and ``cudnnBackendExecute``. The first two are Python and run here:

- ``ops``       the public op on a tiny NumPy call with the CPU backend's convolution replaced by a no-op: the
                path every backend shares (on a GPU the ops also enter CuPy's device and stream);
- ``run``       the graph backend's ``run`` on execution plans cuDNN finalizes here for an H100's properties
                (``tests/data/h100-handwritten.json``, docs/deviceless.md), ``cudnnBackendExecute`` replaced by a
                C function that does nothing, declared as it is (ctypes converts its arguments, a handle among them,
                as on a GPU), with the variant packs kept by pointers (the default) and one built per call
                (``run/pc``).

``bench_gpu_host.py``'s ``graph py`` column measures the same sum on a GPU. Run:
python bench/bench_graph_host.py [--number 20000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import sys
import timeit
import weakref
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]  # the tests' stand-in for libcuda.so.1, and the header tools

import wsarena
from wsarena.backends import Candidate, get_backend

LAYERS = ("conv1", "layer1.0.conv1", "layer1.0.conv2", "layer3.0.conv3")


def _handle() -> object:
    """A stand-in for a cuDNN handle that ctypes converts as it converts one (:class:`wsarena.cudnn.Handle`, an
    ``Owned``), bound to no stream: on a GPU, the thread's handle, bound to the call's stream once. With no stream,
    there is none to check for a capture (with CUDA) before a plan is finalized."""
    from wsarena.cudnn._owned import Owned

    class Handle(Owned):
        __slots__ = ("__weakref__", "_finalizer", "_handle")
        stream = None

        def __init__(self) -> None:
            self._handle = 0x1  # never dereferenced
            self._finalizer = weakref.finalize(self, int)

    return Handle()


def no_op_execute() -> Callable[..., Any]:
    """A C function declared as ``cudnnBackendExecute`` is, which returns 0 (SUCCESS) and touches nothing:
    ``pthread_equal`` of two different values (the handle and the plan; the variant pack, a third argument, a C
    call may ignore). A Python stand-in would leave out ctypes' conversion of the arguments."""
    from wsarena.cudnn._prototypes import PROTOTYPES

    stub = ctypes.CDLL(None).pthread_equal
    stub.restype, argtypes = PROTOTYPES["cudnnBackendExecute"]  # as wsarena.cudnn declares the real one
    stub.argtypes = list(argtypes)
    return stub


def best_us(fn, number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def ops_us(number: int, repeat: int) -> float:
    x, w = np.ones((1, 1, 4, 4), np.float32), np.ones((1, 1, 3, 3), np.float32)
    y = np.empty((1, 1, 2, 2), np.float32)
    with mock.patch.object(type(get_backend("cpu")), "run", lambda self, *args: None):
        call = lambda: wsarena.conv_forward(x, w, out=y)
        call()
        return best_us(call, number, repeat)


def run_us(number: int, repeat: int) -> dict[str, tuple[float, float]]:
    from tests.cudnn_probe import driver
    from wsarena.backends._cudnn_graph import CudnnGraphBackend
    from wsarena.backends._graph_plans import PlanCache, conv_problem, ranked_names
    from wsarena.cudnn import _prototypes, graph

    driver.load_stand_in()
    reason = driver.finalize_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"cuDNN cannot finalize plans here: {reason}")
    props = graph.device_properties((ROOT / "tests" / "data" / "h100-handwritten.json").read_text())
    handle = _handle()

    class Backend(CudnnGraphBackend):
        def _bound_handle(self, stream: Any, workspace: Any = None) -> Any:
            return handle  # the stand-in, whatever the stream

    backend = Backend()
    backend._plans = PlanCache(
        lambda handle, pass_, geom, aligned: graph.operation_graph(conv_problem(pass_, geom), properties=props),
        lambda handle, op_graph, name: graph.execution_plan(graph.engine_config(op_graph, name, properties=props),
                                                            properties=props),
    )
    _prototypes._bound["cudnnBackendExecute"] = no_op_execute()  # what call() finds for it
    x, w, y = (SimpleNamespace(data=SimpleNamespace(ptr=p)) for p in (0x10000, 0x20000, 0x30000))
    by_name = {layer.name: layer for layer in wsarena.load_model("resnet50")}
    out = {}
    for name in LAYERS:
        geom = by_name[name].geometry(batch=32)
        for pass_ in ("fwd", "bwd_data", "bwd_filter"):
            op_graph = graph.operation_graph(conv_problem(pass_, geom), properties=props)
            (engine, nbytes), *_ = ranked_names(graph, op_graph, "float32", properties=props)
            cand = Candidate(engine, nbytes)
            ws = SimpleNamespace(ptr=0x100000, nbytes=nbytes, cuda_stream=None, pin=None)
            call = lambda p=pass_, c=cand, ws=ws, geom=geom: backend.run(p, c, geom, x, w, y, ws, None)
            times = []
            for reuse in (True, False):
                call()  # builds the plan (with this mode for its packs)
                for plan in backend._plans.built():
                    plan.reuse_variant_packs = reuse
                call()
                times.append(best_us(call, number, repeat))
            out[f"{name}/{pass_}"] = (times[0], times[1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; python "
          f"{platform.python_version()}; best of {args.repeat} runs of {args.number} calls, us per call")
    shared = ops_us(args.number, args.repeat)
    print(f"ops (shared path, convolution replaced): {shared:.2f}")
    print(f"{'layer/pass (batch 32)':<26} {'run':>6} {'run/pc':>7} {'ops + run':>10}")
    for key, (kept, per_call) in run_us(args.number, args.repeat).items():
        print(f"{key:<26} {kept:6.2f} {per_call:7.2f} {shared + kept:10.2f}")


if __name__ == "__main__":
    main()
