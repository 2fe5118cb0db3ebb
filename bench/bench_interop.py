"""Host time of one tiny cached call, NumPy operands against operands of other array libraries.

The tiny call is a 1x1x4x4 float32 input and a 1x1x3x3 filter, so the time is the op's own Python, not the
arithmetic. Cases: NumPy with ``out=`` and without, and, when torch is installed, the same through torch CPU
tensors (converted to NumPy views, and the result back to a tensor) and ``torch.nn.functional.conv2d`` for scale; a
bfloat16 tensor's conversions alone, in (to a NumPy view) and out (a result back to torch); and the same
convolution as a module, ``wsarena.torch.Conv2d(1, 1, 3)`` beside ``torch.nn.Conv2d(1, 1, 3)``: a forward without
gradient (``fwd``), a forward with a backward of both gradients (``fwd+bwd``) and a forward in
``torch.inference_mode()`` on an inference tensor (``fwd inf``). BLAS and torch run one thread.

To compare checkouts side by side (say the package before and after a change), name their roots: each runs in a
subprocess of its own, alternately, ``--rounds`` times, and the table gives each case's best round.

    python bench/bench_interop.py [--number 2000] [--repeat 5] [--rounds 3] [--checkout DIR ...]
"""

from __future__ import annotations

import argparse
import json
import os
import timeit
from typing import Any

import _checkouts  # this folder is on sys.path when the script runs


def measure(number: int, repeat: int) -> dict[str, float]:
    """Microseconds per call of each case, best of ``repeat`` runs of ``number`` calls, in this process."""
    import numpy as np

    import wsarena

    x = np.random.default_rng(0).standard_normal((1, 1, 4, 4), dtype=np.float32)
    w = np.ones((1, 1, 3, 3), np.float32)
    y = np.empty((1, 1, 2, 2), np.float32)
    cases = {
        "numpy, out=": lambda: wsarena.conv_forward(x, w, out=y),
        "numpy": lambda: wsarena.conv_forward(x, w),
    }
    try:
        import torch
    except ImportError:
        pass  # the NumPy cases alone
    else:
        tx, tw, ty = torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(y)
        cases["torch cpu, out="] = lambda: wsarena.conv_forward(tx, tw, out=ty)
        cases["torch cpu"] = lambda: wsarena.conv_forward(tx, tw)
        cases["torch F.conv2d"] = lambda: torch.nn.functional.conv2d(tx, tw)
        # bfloat16 on its way in and out (the CPU backend computes no bfloat16, so the conversions alone): a torch
        # tensor's NumPy view, and a result going back to torch
        from wsarena import _interop

        tb = torch.from_numpy(x).to(torch.bfloat16)
        rb = tb.view(torch.int16).numpy().view(_interop._bfloat16())
        cases["torch bf16 in"] = lambda: _interop._host_view(_interop._Operand("x", tb))
        cases["torch bf16 out"] = lambda: _interop._returned(tb, rb)
        torch.set_num_threads(1)
        cases.update(_modules(torch, tx))
    results = {}
    for name, fn in cases.items():
        try:
            fn()
        except TypeError:  # a checkout that does not take these operands
            continue
        best = min(timeit.repeat(fn, number=number, repeat=repeat))
        results[name] = best / number * 1e6
    return results


def _modules(torch: Any, x: Any) -> dict[str, Any]:
    """The module cases: wsarena.torch's Conv2d and torch's own, forward alone, forward with backward, and forward
    in inference mode."""
    try:
        import wsarena.torch
    except ImportError:
        return {}
    cases = {}
    with torch.inference_mode():
        made = x.clone()  # an inference tensor, as activations in inference mode are; the weights are ordinary
    for name, module in (("wsarena.torch", wsarena.torch.Conv2d(1, 1, 3)), ("nn.Conv2d", torch.nn.Conv2d(1, 1, 3))):
        given = x.clone().requires_grad_()

        def forward(module: Any = module) -> None:
            with torch.no_grad():
                module(x)

        def step(module: Any = module, given: Any = given) -> None:
            module(given).sum().backward()

        def inference(module: Any = module) -> None:
            with torch.inference_mode():
                module(made)

        cases[f"{name} fwd"], cases[f"{name} fwd+bwd"] = forward, step
        cases[f"{name} fwd inf"] = inference
    return cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=2000, help="calls per timing")
    parser.add_argument("--repeat", type=int, default=5, help="timings per round; the best counts")
    _checkouts.add_options(parser)
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.number, args.repeat)))
        return 0
    if not args.checkout:
        for name, us in measure(args.number, args.repeat).items():
            print(f"{name:<22} {us:8.2f} us")
        return 0
    best: dict[str, dict[str, float]] = {root: {} for root in args.checkout}
    for _ in range(args.rounds):
        for root in args.checkout:
            found = _checkouts.measure_in(root, __file__, ["--json", "--number", str(args.number), "--repeat",
                                                          str(args.repeat)])
            for name, us in found.items():
                best[root][name] = min(us, best[root].get(name, us))
    names = list(dict.fromkeys(n for found in best.values() for n in found))
    print(f"best of {args.rounds} alternating rounds, each the best of {args.repeat} x {args.number} calls "
          "(us per call)")
    print(f"{'case':<22}" + "".join(f" {os.path.basename(os.path.abspath(r)):>14}" for r in args.checkout))
    for name in names:
        cells = "".join(f" {best[r][name]:14.2f}" if name in best[r] else f" {'-':>14}" for r in args.checkout)
        print(f"{name:<22}{cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
