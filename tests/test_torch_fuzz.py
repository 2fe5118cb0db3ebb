"""wsarena.torch's functions against torch.nn.functional's on generated calls, on the CPU.

A drop-in must agree with what it replaces on every call, not only on the cases written out elsewhere. For each
generated call (1-, 2- or 3-D, plain or transposed; groups, and stride, padding, dilation, output_padding each an
int, one per dimension or one in a sequence for every dimension; batched, unbatched or empty; contiguous,
channels-last or strided operands; with or without a bias), PyTorch's own function is the reference:

- a call PyTorch accepts is accepted, and gives the same result (shape, dtype and, but for an empty result or a
  3-D one in another dtype than float64, memory format) and the same gradients of input, weight and bias (all of
  them, or some: a backward runs only the passes those need): float64 within 1e-10 of PyTorch's, relative to the
  largest magnitude of that tensor, float32 within 1e-4, float16 within 1e-2 and bfloat16 within 2e-2 (both
  compute in float32 and round);
- a call PyTorch refuses is refused with a ``ValueError``, ``TypeError`` or ``RuntimeError``.

What the README documents wsarena.torch refuses where PyTorch computes is checked to be refused with a
``ValueError`` that says why: ``output_padding`` not below the stride, and a transposed convolution whose output has
no size in a dimension.

``WSARENA_FUZZ_EXAMPLES=N`` tries N generated calls instead of the fixed 300.
"""

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
F = torch.nn.functional
wt = pytest.importorskip("wsarena.torch")

SETTINGS = settings(max_examples=int(os.environ.get("WSARENA_FUZZ_EXAMPLES", "300")), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
# float16 and bfloat16 are computed in float32 and rounded, by both: a few roundings of the operands and the result
TOLERANCES = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
FORMATS = {2: torch.channels_last, 3: torch.channels_last_3d}


def per_dim(draw, nd, low, high):
    """One int for every dimension, one per dimension, or one in a sequence for every dimension (as PyTorch reads
    it: ``padding=(2,)``); a sequence as a tuple or a list."""
    kind = draw(st.sampled_from(["int", "int", "each", "each", "one"]))
    if kind == "int":
        return draw(st.integers(low, high))
    values = [draw(st.integers(low, high)) for _ in range(nd if kind == "each" else 1)]
    return values if draw(st.booleans()) else tuple(values)


def dims(value, nd):
    values = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    return values if len(values) == nd else values * nd


def operand(draw, shape, dtype, seed, nd):
    """A tensor of ``shape``: contiguous, channels-last (2- and 3-D, batched) or a strided view of a larger one."""
    g = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["contiguous", "channels_last", "strided"]))
    if kind == "channels_last" and len(shape) in (4, 5):
        return torch.randn(shape, dtype=dtype, generator=g).contiguous(memory_format=FORMATS[len(shape) - 2])
    if kind == "strided" and shape and shape[-1] > 0:
        return torch.randn((*shape[:-1], 2 * shape[-1]), dtype=dtype, generator=g)[..., ::2]
    return torch.randn(shape, dtype=dtype, generator=g)


@st.composite
def calls(draw):
    """``(transposed, nd, x, w, bias, kwargs, asked, computed)``: a call of ``conv{nd}d`` or ``conv_transpose{nd}d``,
    the positions among input, weight and bias of the gradients to ask for, and whether the operands are computed
    from the leaves asked about."""
    nd = draw(st.sampled_from([2, 1, 3]))
    transposed = draw(st.booleans())
    dtype = draw(st.sampled_from([torch.float64, torch.float64, torch.float32, torch.float16, torch.bfloat16]))
    groups = draw(st.integers(1, 3))
    cg, kg = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    n = draw(st.sampled_from([1, 2, 2, 0]))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    size = tuple(draw(st.integers(1, 6)) for _ in range(nd))
    kwargs = {"stride": per_dim(draw, nd, 1, 3), "dilation": per_dim(draw, nd, 1, 2), "groups": groups}
    if transposed:
        kwargs["padding"] = per_dim(draw, nd, 0, 2)
        kwargs["output_padding"] = per_dim(draw, nd, 0, 2)
        x_shape, w_shape = (n, cg * groups, *size), (cg * groups, kg, *kernel)
    else:
        kwargs["padding"] = draw(st.one_of(st.just(per_dim(draw, nd, 0, 2)), st.sampled_from(["same", "valid"])))
        x_shape, w_shape = (n, cg * groups, *size), (kg * groups, cg, *kernel)
    seed = draw(st.integers(0, 2**16))
    x = operand(draw, x_shape, dtype, seed, nd)
    if n == 1 and draw(st.booleans()):
        x = x[0]  # unbatched, (C, *spatial), as torch.nn.functional takes it
    w = operand(draw, w_shape, dtype, seed + 1, nd)
    channels = kg * groups if transposed else w_shape[0]
    bias = torch.randn(channels, dtype=dtype, generator=torch.Generator().manual_seed(seed + 2))
    bias = bias if draw(st.booleans()) else None
    # the gradients asked for: all of them mostly, else some (a backward runs only the passes those need)
    asked = draw(st.sampled_from([(0, 1, 2), (0, 1, 2), (0,), (1,), (0, 2), (1, 2)]))
    # the operands as the leaves asked about, or computed from them (an earlier layer's output, a parametrized weight)
    computed = draw(st.booleans())
    return transposed, nd, x, w, bias, kwargs, asked, computed


def functions(transposed, nd):
    name = f"conv_transpose{nd}d" if transposed else f"conv{nd}d"
    return getattr(wt, name), getattr(F, name)


def documented_difference(transposed, nd, x, w, kwargs):
    """What wsarena.torch refuses with a ``ValueError`` where PyTorch's CPU convolution takes it (README, "PyTorch"),
    and the message's word: ``output_padding`` not below the stride (PyTorch also takes it below the dilation), and a
    transposed convolution whose output has no size in a dimension (PyTorch returns an empty tensor)."""
    if not transposed:
        return None
    stride, padding, dilation, extra = (
        dims(kwargs[k], nd) for k in ("stride", "padding", "dilation", "output_padding")
    )
    if any(e >= s for e, s in zip(extra, stride)):
        return "output_padding"
    sizes = zip(x.shape[-nd:], w.shape[2:], stride, padding, dilation, extra)
    if any((i - 1) * s - 2 * p + d * (k - 1) + e + 1 <= 0 for i, k, s, p, d, e in sizes):
        return "leaves an output of size"
    return None


def close(got, ref, tol):
    if not ref.numel():
        return not got.numel()
    scale = float(ref.detach().abs().max()) or 1.0
    return float((got.detach().double() - ref.detach().double()).abs().max()) <= tol * scale


def memory_format(t):
    """What a tensor's strides say: contiguous, channels-last, both (a size-1 dimension makes them agree) or none."""
    formats = [torch.contiguous_format, *([FORMATS[t.dim() - 2]] if t.dim() in (4, 5) else [])]
    return tuple(t.is_contiguous(memory_format=f) for f in formats)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths:UserWarning")  # PyTorch's
@SETTINGS
@given(calls())
def test_a_generated_call_agrees_with_torch(generated):
    transposed, nd, x, w, bias, kwargs, asked, computed = generated
    ours, theirs = functions(transposed, nd)
    leaves = [t.clone().requires_grad_() for t in (x, w, *([bias] if bias is not None else []))]
    mine = [t.detach().clone().requires_grad_() for t in leaves]
    # t * 1: a copy in t's memory format (a strided one comes out dense), computed as far as autograd can see
    theirs_in, mine_in = ([t * 1 if computed else t for t in ts] for ts in (leaves, mine))
    try:
        ref = theirs(*theirs_in[:2], theirs_in[2] if bias is not None else None, **kwargs)
    except (RuntimeError, ValueError):
        with pytest.raises((ValueError, TypeError, RuntimeError)):
            ours(*mine_in[:2], mine_in[2] if bias is not None else None, **kwargs)
        return
    refused = documented_difference(transposed, nd, x, w, kwargs)
    if refused:
        with pytest.raises(ValueError, match=refused):
            ours(*mine_in[:2], mine_in[2] if bias is not None else None, **kwargs)
        return
    y = ours(*mine_in[:2], mine_in[2] if bias is not None else None, **kwargs)
    tol = TOLERANCES[x.dtype]
    assert (y.shape, y.dtype) == (ref.shape, ref.dtype)
    # PyTorch's format of a 3-D result but a float64 one follows oneDNN's heuristics (README), and that of an empty
    # one is the format of an elementwise product of the input viewed in the output's shape: neither is repeated
    if y.numel() and not (nd == 3 and x.dtype != torch.float64):
        assert memory_format(y) == memory_format(ref), (y.stride(), ref.stride())
    assert close(y, ref, tol)
    dy = torch.randn(ref.shape, dtype=ref.dtype, generator=torch.Generator().manual_seed(7))
    asked = [i for i in asked if i < len(leaves)]
    expected = torch.autograd.grad(ref, [leaves[i] for i in asked], dy)
    got = torch.autograd.grad(y, [mine[i] for i in asked], dy)
    for i, g, e in zip(asked, got, expected):
        assert g.shape == e.shape, ("input", "weight", "bias")[i]
        assert close(g, e, tol), ("input", "weight", "bias")[i]
