"""Fuzzing the conv ops' arguments: shapes, stride, padding, dilation, groups, dtypes, layouts, out= and stream=.

Only documented exceptions may escape: ``TypeError``/``ValueError`` naming an argument, the ``wsarena.errors``
classes, and the ``MemoryError`` that names an output too large for memory. A refused call leaves the arena as it
was; an accepted one matches the float64 reference. The arena's provider refuses more than 1 MiB, and so does the
output allocation, so that no generated geometry can fill the machine or run for long.

``WSARENA_FUZZ_EXAMPLES=N`` tries N generated calls instead of the fixed 400 (a longer campaign);
``WSARENA_FUZZ_TALLY=FILE`` writes what was tried and refused (:mod:`tests.fuzz_tally`).
"""

import contextlib
import os
import re
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wsarena
from wsarena._geometry import conv_geometry
from wsarena.arena import Arena
from wsarena.arena.testing import RecordingProvider
from wsarena.backends._cpu_backend import CpuBackend
from wsarena.errors import WsarenaError

from .fuzz_tally import record, write_tally  # noqa: F401 - the module fixture that writes the tally
from .reference import ref_conv_backward_data, ref_conv_backward_filter, ref_conv_forward

LIMIT = 1 << 20  # bytes: the largest workspace or output a generated call may get
ARGUMENTS = ("x", "w", "dy", "input_shape", "weight_shape", "stride", "padding", "dilation", "groups", "layout",
             "out", "stream", "algo", "dtype", "dtypes")
EXTREME = [-1, 0, 2**31 - 1, 2**31, 2**40, 2**62, 2**64]
ODD = [1.5, True, None, "1", np.int64(2), np.float32(1), [1.0], (2, "a"), b"x", np.array([1, 2])]
SETTINGS = settings(max_examples=int(os.environ.get("WSARENA_FUZZ_EXAMPLES", "400")), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@contextlib.contextmanager
def small_machine():
    """The cpu backend on an arena whose provider refuses more than LIMIT, and outputs above LIMIT refused too."""
    arena = Arena(RecordingProvider(fail=lambda n: n > LIMIT))
    real_empty = CpuBackend.empty

    def empty(self, shape, dtype):
        if int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize > LIMIT:
            raise MemoryError(f"Unable to allocate an array with shape {shape}")
        return real_empty(self, shape, dtype)

    with mock.patch.object(CpuBackend, "arena", lambda self: arena), mock.patch.object(CpuBackend, "empty", empty):
        yield arena
    arena.close()


def rarely(data):
    """True about one time in six; hypothesis shrinks it to False, the valid choice."""
    return data.draw(st.integers(0, 5)) == 5


def per_dim(data, nd, low, extra=()):
    """A stride, padding or dilation: mostly plain, sometimes extreme or of the wrong kind or length."""
    if not rarely(data):
        return data.draw(st.one_of(st.integers(low, 3), st.lists(st.integers(low, 3), min_size=nd, max_size=nd)))
    kind = data.draw(st.sampled_from(["seq", "extreme", "odd", "extra"]))
    if kind == "seq":
        entry = st.one_of(st.integers(low, 3), st.sampled_from(EXTREME), st.sampled_from(ODD))
        return data.draw(st.lists(entry, min_size=max(nd - 1, 0), max_size=nd + 1).map(tuple))
    if kind == "extreme":
        return data.draw(st.sampled_from(EXTREME))
    return data.draw(st.sampled_from(ODD if kind == "odd" or not extra else list(extra)))


PADDINGS = ["same", "valid", "full", ((1, 1), (0, 0)), ((0, 1), (1, 1)), ((1, 1, 1),), ((2**31, 2**31), (0, 0))]
DTYPES = ["float32", "float64", "float16", "int32", "bool", "complex64", "object"]


def pick(data, valid, others):
    return data.draw(st.sampled_from(others)) if rarely(data) else valid


def shape(data, valid):
    if not rarely(data):
        return valid
    return data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=6).map(tuple))


def array(data, shape_, dtype):
    a = np.arange(int(np.prod(shape_)), dtype=np.float64).reshape(shape_) % 7 - 3
    return a.astype(dtype) if dtype != "object" else a.astype(object)


@st.composite
def calls(draw):
    """One generated call: ``(pass, a, b, shape_arg, kwargs)``; each argument is valid most of the time."""
    data = draw(st.data())
    nd = draw(st.sampled_from([2, 1, 3]))
    groups_ok = draw(st.sampled_from([1, 2]))
    n, cg, kg = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    n = pick(data, n, [0])
    c, k = cg * groups_ok, kg * groups_ok
    size = tuple(draw(st.integers(1, 5)) for _ in range(nd))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    layout = pick(data, draw(st.sampled_from(["NCHW", "NHWC"])), ["nchw", "", None, 3])
    last = layout == "NHWC"
    x_shape = (n, *size, c) if last else (n, c, *size)
    w_shape = (k, *kernel, cg) if last else (k, cg, *kernel)
    kwargs = {
        "stride": per_dim(data, nd, 1),
        "padding": per_dim(data, nd, 0, PADDINGS),
        "dilation": per_dim(data, nd, 1),
        "groups": pick(data, groups_ok, [*range(-1, 5), *EXTREME, *ODD]),
        "layout": layout,
    }
    if rarely(data):
        kwargs["stream"] = draw(st.sampled_from([None, "lane", 0, 7, ("a", 1), [], {}, 1.5, -1, True, ("a", [1])]))
    if rarely(data):
        kwargs["algo"] = draw(st.sampled_from(["nope", 3, "implicit_gemm", "gemm_batch", "im2col_batch"]))
    dtype = pick(data, draw(st.sampled_from(DTYPES[:2])), DTYPES[2:])
    other = pick(data, dtype, DTYPES)
    pass_ = draw(st.sampled_from(["fwd", "bwd_data", "bwd_filter"]))
    x = array(data, shape(data, x_shape), dtype)
    w = array(data, shape(data, w_shape), other)
    if pass_ == "fwd":
        return pass_, x, w, None, kwargs
    # dy: the forward output's shape when the forward geometry is valid, else anything small
    try:
        g = conv_geometry(x_shape, w_shape, **{k: v for k, v in kwargs.items() if k not in ("stream", "algo")})
        dy_shape = g.output_shape if max(g.output_shape) <= 64 else (1, 1, 1, 1)
    except (TypeError, ValueError):
        dy_shape = (1, k, *size)
    dy = array(data, shape(data, dy_shape), dtype)
    if pass_ == "bwd_data":
        odd = [list(x_shape), x_shape[:-1], "x", None, (*x_shape[:-1], 2**31 - 1), (*x_shape[:-1], 2**62)]
        return pass_, dy, w, pick(data, x_shape, odd), kwargs
    return pass_, x, dy, pick(data, w_shape, [list(w_shape), w_shape[:-1], 5, (*w_shape[:-1], 2**40)]), kwargs


def call(pass_, a, b, shape_arg, kwargs):
    if pass_ == "fwd":
        return wsarena.conv_forward(a, b, **kwargs)
    if pass_ == "bwd_data":
        return wsarena.conv_backward_data(a, b, shape_arg, **kwargs)
    return wsarena.conv_backward_filter(a, b, shape_arg, **kwargs)


def documented(exc):
    """Whether ``exc`` is what the ops promise for bad input (see the module docstring)."""
    if isinstance(exc, WsarenaError):
        return True
    if isinstance(exc, MemoryError):
        return str(exc).startswith("no memory for the output:")
    if type(exc) in (TypeError, ValueError):
        return any(re.search(rf"\b{name}\b", str(exc)) for name in ARGUMENTS)
    return False


def check_result(pass_, a, b, shape_arg, kwargs, result):
    """An accepted call: the reference's result where it is cheap to compute, and the same through out=."""
    layout = kwargs["layout"]
    x_shape = shape_arg if pass_ == "bwd_data" else a.shape
    w_shape = shape_arg if pass_ == "bwd_filter" else b.shape
    g = conv_geometry(x_shape, w_shape, stride=kwargs["stride"], padding=kwargs["padding"],
                      dilation=kwargs["dilation"], groups=kwargs["groups"], layout=layout)
    params = {"stride": g.stride, "padding": g.padding, "dilation": g.dilation, "groups": g.groups, "layout": layout}
    if max(g.padding) <= 16 and max(g.stride) <= 16 and max(g.dilation) <= 16:
        if pass_ == "fwd":
            want = ref_conv_forward(a, b, **params)
        elif pass_ == "bwd_data":
            want = ref_conv_backward_data(a, b, tuple(shape_arg), **params)
        else:
            want = ref_conv_backward_filter(a, b, tuple(shape_arg), **params)
        tol = 1e-4 if result.dtype == np.float32 else 1e-10
        np.testing.assert_allclose(result, want, rtol=tol, atol=tol * max(1.0, float(np.abs(want).max(initial=0))))
    out = np.full_like(result, np.nan)
    np.testing.assert_array_equal(call(pass_, a, b, shape_arg, {**kwargs, "out": out}), result)


@SETTINGS
@given(calls())
def test_conv_arguments(generated):
    pass_, a, b, shape_arg, kwargs = generated
    with small_machine() as arena:
        before = arena.stats()
        try:
            result = call(pass_, a, b, shape_arg, kwargs)
        except Exception as exc:  # noqa: BLE001 - what escapes is what is checked
            record("conv arguments", exc, documented(exc))
            assert documented(exc), f"{type(exc).__name__}: {exc}"
            after = arena.stats()
            assert after.leases == 0 and after.capacity_bytes == before.capacity_bytes
            return
        record("conv arguments", None, True)
        check_result(pass_, a, b, shape_arg, kwargs, result)
        assert arena.stats().leases == 0


OUTS = ["right", "shape", "dtype", "strided", "readonly", "overlap", "list", "scalar", "nhwc"]


@pytest.mark.parametrize("kind", OUTS)
@pytest.mark.parametrize("pass_", ["fwd", "bwd_data", "bwd_filter"])
def test_out_argument(pass_, kind):  # every case: there are few
    x = np.arange(2 * 4 * 5 * 5, dtype=np.float32).reshape(2, 4, 5, 5) % 5
    w = np.ones((6, 2, 3, 3), np.float32)
    dy = np.ones((2, 6, 3, 3), np.float32)
    a, b, shape_arg = {"fwd": (x, w, None), "bwd_data": (dy, w, x.shape), "bwd_filter": (x, dy, w.shape)}[pass_]
    want = call(pass_, a, b, shape_arg, {"groups": 2})
    out = {
        "right": lambda: np.empty_like(want),
        "shape": lambda: np.empty(want.shape[:-1] + (want.shape[-1] + 1,), want.dtype),
        "dtype": lambda: np.empty(want.shape, np.float64),
        "strided": lambda: np.empty(want.shape[:-1] + (2 * want.shape[-1],), want.dtype)[..., ::2],
        "readonly": lambda: np.lib.stride_tricks.as_strided(np.empty_like(want), writeable=False),
        "overlap": lambda: None,  # below: shares its last element with the first input
        "list": lambda: want.tolist(),
        "scalar": lambda: 3.0,
        "nhwc": lambda: np.empty_like(want).transpose(0, 2, 3, 1).copy().transpose(0, 3, 1, 2),
    }[kind]()
    if kind == "overlap":
        buffer = np.zeros(a.size + want.size, a.dtype)
        buffer[: a.size] = a.reshape(-1)
        a, out = buffer[: a.size].reshape(a.shape), buffer[a.size - 1 : a.size - 1 + want.size].reshape(want.shape)
    with small_machine() as arena:
        try:
            got = call(pass_, a, b, shape_arg, {"groups": 2, "out": out})
        except Exception as exc:  # noqa: BLE001 - what escapes is what is checked
            record("conv out=", exc, documented(exc) and "out" in str(exc))
            assert documented(exc) and "out" in str(exc), f"{type(exc).__name__}: {exc}"
            assert arena.stats().capacity_bytes == 0
            return
        record("conv out=", None, True)
        assert kind == "right" and got is out
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_generated_valid_call_is_accepted(dtype):
    """The generator reaches the accepted path too (a fuzz that only ever errors would check nothing)."""
    x, w = np.ones((1, 2, 4, 4), dtype), np.ones((3, 2, 3, 3), dtype)
    with small_machine():
        check_result("fwd", x, w, None, {"stride": 1, "padding": 1, "dilation": 1, "groups": 1, "layout": "NCHW"},
                     wsarena.conv_forward(x, w, padding=1))
