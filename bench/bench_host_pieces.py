"""Where the host time of one tiny cached call goes, piece by piece, with the CPU convolution replaced by a no-op.

The pieces of the path a GPU call shares with the CPU backend, each timed alone on the call's own arguments:

- ``ops``    the public op on NumPy arrays with ``out=`` (a 1x1x4x4 float32 input, a 3x3 filter): the record's key
             and lookup, the ``out=`` checks, the backend's scope, the choice, the lease;
- ``torch``  ``wsarena.torch.Conv2d(1, 1, 3)`` forward without gradient (inside ``torch.no_grad()``): the module
             call, the functional's checks, the operator run straight, its result and NumPy views, the bias; the
             operator called through PyTorch's dispatcher (its autograd kernel), and ``F.conv2d`` for scale;
- ``step``   the same module's forward with gradient and ``.sum().backward()``: the autograd Function, the forward's
             line and settings kept, a backward pass's scopes, one backward pass, the step and the forward without a
             bias, and ``torch.nn.Conv2d``'s step with and without one, for scale.

Each figure is the fewest microseconds per call over ``--rounds`` rounds that time every piece in turn, by the
thread's CPU time (``time.thread_time``): on a machine shared with other work, the wall clock counts the time the
thread waits for a core. A piece timed alone runs warm, with its code and data in cache, and so takes less than it
takes within the call (PyTorch's calls most: the bias added, 2.8 us alone, costs some 6 us of a forward).

    python bench/bench_host_pieces.py [--rounds 15] [--only ops,torch,step]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import time
import timeit
from collections.abc import Callable
from unittest import mock

import numpy as np
import torch

import wsarena
import wsarena.torch
from wsarena import algos, ops
from wsarena._config import get_config
from wsarena._pass import Pass
from wsarena.backends import get_backend
from wsarena.torch import _autograd, _functional, _ops, _shapes

Cases = dict[str, tuple[Callable[[], object], int]]


def best_us(cases: Cases, rounds: int) -> dict[str, float]:
    """Microseconds per call of each case, the fewest over ``rounds`` rounds that time every case in turn."""
    best = dict.fromkeys(cases, float("inf"))
    for fn, _ in cases.values():
        fn()
    for _ in range(rounds):
        for name, (fn, number) in cases.items():
            us = timeit.Timer(fn, timer=time.thread_time).timeit(number) / number * 1e6
            best[name] = min(best[name], us)
    return best


def ops_cases() -> Cases:
    x, w = np.ones((1, 1, 4, 4), np.float32), np.ones((1, 1, 3, 3), np.float32)
    y = np.empty((1, 1, 2, 2), np.float32)
    wsarena.conv_forward(x, w, out=y)
    backend, cfg = get_backend("cpu"), get_config()
    record = next(r for r in ops._records.values() if r.backend is backend and r.out_shape == y.shape)
    arena, chosen = backend.arena(), record.choices["cpu"]
    n = chosen[0].workspace_bytes
    params = (1, 0, 1, 1)
    key = (Pass.FWD, type(x), type(w), x.shape, w.shape, x.dtype, w.dtype, None, params, "NCHW", cfg.backend,
           cfg.cap_workspace, cfg.algo_search, cfg.cudnn_api, cfg.cudnn_heuristic)

    def context() -> None:
        with backend.context((x, w, y), None):
            pass

    def lease() -> None:
        with arena.lease(n, stream=None, cap=None):
            pass

    k = 20000
    return {
        "the call": (lambda: wsarena.conv_forward(x, w, out=y), k),
        "get_config": (get_config, k),
        "record's key and lookup": (lambda: ops._records.get((*key[:3], x.shape, w.shape, *key[5:])), k),
        "out= checks (_check_out)": (lambda: ops._check_out(record, y, x, w), k),
        "  of which two overlap tests": (lambda: (backend.may_share_memory(y, x), backend.may_share_memory(y, w)), k),
        "backend's scope, entered and left": (context, k),
        "operands contiguous (_made_contiguous)": (lambda: ops._made_contiguous([x, w]), k),
        "the choice (_choice)": (lambda: ops._choice(record, Pass.FWD, cfg, [x, w], y, None), k),
        "backend.arena()": (backend.arena, k),
        "run_with_fallback, lease included": (lambda: algos.run_with_fallback(
            arena, chosen, lambda c, ws: None, stream=None, cap=None, warn_for=(Pass.FWD, record.geom)), k),
        "  Arena.lease()": (lambda: arena.lease(n, stream=None, cap=None), k),
        "  the lease, entered and left": (lease, k),
    }


def torch_cases() -> Cases:
    x = torch.ones(1, 1, 4, 4)
    module = wsarena.torch.Conv2d(1, 1, 3)
    w, b = module.weight, module.bias
    checked = _shapes.forward_call(x, w, 1, 0, 1, 1)
    stride, padding, dilation, groups = checked.args
    as_op = ([*stride], [*padding], [*dilation], groups)  # lists, as the operator's schema (int[]) hands its kernel
    y = torch.empty(1, 1, 2, 2)
    xn, wn, yn = x.numpy(), w.detach().numpy(), y.numpy()
    formats = torch.contiguous_format
    k = 5000
    return {
        "the module call": (lambda: module(x), k),
        "conv2d(x, w, b)": (lambda: _functional.conv2d(x, w, b), k),
        "conv2d(x, w), no bias": (lambda: _functional.conv2d(x, w), k),
        "operands checked (_operands)": (lambda: _functional._operands("conv2d", 2, x, w, b), k),
        "the signature's record (forward_call)": (lambda: _shapes.forward_call(x, w, 1, 0, 1, 1), k),
        "bias checked (_check_bias)": (lambda: _functional._check_bias(b, 1), k),
        "the operator (apply)": (lambda: _autograd.apply(_autograd.ConvFunction, None, x, w, *checked.args,
                                                         "NCHW"), k),
        "  its kernel alone": (lambda: _ops._conv_forward(x, w, *as_op, "NCHW"), k),
        "  output shape (_output_shape)": (lambda: _ops._output_shape(x.shape, w.shape, *checked.args[:3]), k),
        "  the result (_empty)": (lambda: _ops._empty([1, 1, 2, 2], x, "NCHW"), k),
        "  operands ready (_computed x2)": (lambda: (_ops._computed(x, formats), _ops._computed(w, formats)), k),
        "  NumPy views (Tensor.numpy() x3)": (lambda: (x.numpy(), y.numpy(), y.numpy()), k),
        "  ops.conv_forward on the views": (lambda: ops.conv_forward(xn, wn, *checked.args, out=yn), k),
        "the bias added (add_bias)": (lambda: _autograd.add_bias(y, b), k),
        "the operator called directly (torch.ops)": (lambda: torch.ops.wsarena.conv_forward(x, w, *checked.args,
                                                                                          "NCHW"), k),
        "torch.nn.functional.conv2d, for scale": (lambda: torch.nn.functional.conv2d(x, w, b), k),
    }


def step_cases() -> Cases:
    x = torch.ones(1, 1, 4, 4, requires_grad=True)
    module, plain = wsarena.torch.Conv2d(1, 1, 3), wsarena.torch.Conv2d(1, 1, 3, bias=False)
    torchs, torchs_plain = torch.nn.Conv2d(1, 1, 3), torch.nn.Conv2d(1, 1, 3, bias=False)
    w = module.weight
    args = (*_shapes.forward_call(x, w, 1, 0, 1, 1).args, "NCHW")
    started = _autograd._started()
    dy = torch.ones(1, 1, 2, 2)

    def scopes() -> None:
        site, settings = _autograd._as_started(started)
        with site, settings:
            pass

    def backward_pass() -> None:
        with torch.no_grad():
            _autograd._pass(_autograd.ConvTransposeFunction, dy, w, [1, 1, 4, 4], *args)

    k = 1000
    return {
        "the step": (lambda: module(x).sum().backward(), k),
        "the step, no bias": (lambda: plain(x).sum().backward(), k),
        "forward with gradient": (lambda: module(x), k),
        "forward with gradient, no bias": (lambda: plain(x), k),
        "  the Function (apply)": (lambda: _autograd.apply(_autograd.ConvFunction, None, x, w, *args), k),
        "  its line and settings kept (_started)": (_autograd._started, k),
        "a backward's scopes, entered and left": (scopes, k),
        "one backward pass (_pass)": (backward_pass, k),
        "torch.nn.Conv2d's step, for scale": (lambda: torchs(x).sum().backward(), k),
        "torch.nn.Conv2d's step, no bias": (lambda: torchs_plain(x).sum().backward(), k),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="rounds; each times every piece in turn")
    parser.add_argument("--only", default="ops,torch,step", help="which paths, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; python "
          f"{platform.python_version()}, torch {torch.__version__}; fewest of {args.rounds} rounds, us per call "
          "(thread CPU time), the CPU convolution a no-op")
    # the forward without gradient timed inside one torch.no_grad() block, which costs some 1.5 us of its own
    makers = {"ops": (ops_cases, contextlib.nullcontext), "torch": (torch_cases, torch.no_grad),
              "step": (step_cases, contextlib.nullcontext)}
    with mock.patch.object(type(get_backend("cpu")), "run", lambda self, *a: None):  # the convolution: a no-op
        for path in args.only.split(","):
            make, scope = makers[path]
            print(f"{path}:")
            with scope():
                found = best_us(make(), args.rounds)
            for name, us in found.items():
                print(f"  {name:<42} {us:8.2f}")


if __name__ == "__main__":
    main()
