"""JAX arrays through the ops on the CPU (wsarena._interop over DLPack), against the float64 direct convolution
of tests/reference.py.

JAX is not in the test extra (its CPU build adds about 500 MB): these tests run where it is installed and skip
elsewhere. That importing wsarena and a NumPy call leave JAX unimported is tests/test_package.py's
``test_import_is_light``.

Tolerance: max|got - ref| / max|ref| <= 1e-12 in float64, 1e-5 in float32.
"""

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from wsarena import _interop, conv_backward_data, conv_backward_filter, conv_forward, ops

from .reference import ref_conv_backward_data, ref_conv_backward_filter, ref_conv_forward

jax = pytest.importorskip("jax", reason="JAX is not installed (it is not in the test extra): pip install jax")
jnp = jax.numpy

TOL = {"float32": 1e-5, "float64": 1e-12}
KW = {"stride": 2, "padding": 1, "dilation": 1, "groups": 2}


def rel_err(got, ref):
    return float(np.max(np.abs(np.asarray(got).astype(np.float64) - ref))) / (float(np.max(np.abs(ref))) or 1.0)


def problem(dtype="float64", seed=0, batch=2):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, 4, 9, 9)).astype(dtype)
    w = rng.standard_normal((6, 2, 3, 3)).astype(dtype)
    dy = rng.standard_normal(ref_conv_forward(x, w, **KW).shape).astype(dtype)
    return x, w, dy


@pytest.fixture
def runs(monkeypatch):
    """What the ops ran on: one ``(a, b, result)`` of NumPy arrays per call, to tell views and copies apart."""
    seen = []
    real = ops._run

    def recording(pass_, a, b, *args, **kwargs):
        result = real(pass_, a, b, *args, **kwargs)
        seen.append((a, b, result))
        return result

    monkeypatch.setattr(ops, "_run", recording)
    return seen


def pointer(array):
    return array.unsafe_buffer_pointer() if isinstance(array, jax.Array) else array.ctypes.data


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_jax_arrays_through_the_three_ops_without_a_copy_either_way(runs, dtype, layout):
    x, w, dy = problem(dtype)
    refs = (ref_conv_forward(x, w, **KW), ref_conv_backward_data(dy, w, x.shape, **KW),
            ref_conv_backward_filter(x, dy, w.shape, **KW))
    last = (lambda a: np.ascontiguousarray(np.moveaxis(a, 1, -1))) if layout == "NHWC" else (lambda a: a)
    back = (lambda a: np.moveaxis(a, -1, 1)) if layout == "NHWC" else (lambda a: a)
    with jax.enable_x64(dtype == "float64"):
        # the results of a JAX computation, perhaps not finished when the call takes them (dispatch is async)
        jx, jw, jdy = jax.jit(lambda *a: tuple(v + 0 for v in a))(*(jnp.asarray(last(a)) for a in (x, w, dy)))
        got = (conv_forward(jx, jw, **KW, layout=layout),
               conv_backward_data(jdy, jw, jx.shape, **KW, layout=layout),
               conv_backward_filter(jx, jdy, jw.shape, **KW, layout=layout))
    for result, ref, (a, b), (va, vb, vresult) in zip(got, refs, ((jx, jw), (jdy, jw), (jx, jdy)), runs):
        assert isinstance(result, jax.Array) and result.dtype == jx.dtype
        assert rel_err(back(np.asarray(result)), ref) <= TOL[dtype]
        assert (pointer(va), pointer(vb)) == (pointer(a), pointer(b))  # the ops read JAX's own memory
        assert pointer(vresult) == pointer(result)  # and JAX took the memory they wrote


def test_results_go_back_to_jax_without_a_copy_whatever_their_size(runs):
    """JAX takes host memory without a copy only on a 64-byte boundary, which NumPy's allocator does not
    promise: the results the ops hand to JAX are allocated there."""
    for batch in (1, 2, 3, 5, 7):
        x, w, _ = problem("float32", seed=batch, batch=batch)
        y = conv_forward(jnp.asarray(x), jnp.asarray(w), **KW)
        assert pointer(runs[-1][2]) == pointer(y), batch
        assert rel_err(y, ref_conv_forward(x, w, **KW)) <= TOL["float32"]


@pytest.mark.parametrize("numpy_operands", [False, True])
def test_a_jax_out_is_refused_because_jax_arrays_are_immutable(fresh_arena, numpy_operands):
    x, w, _ = problem("float32")
    out = jnp.zeros(ref_conv_forward(x, w, **KW).shape, jnp.float32)
    before = fresh_arena.stats()
    operands = (x, w) if numpy_operands else (jnp.asarray(x), jnp.asarray(w))
    with pytest.raises(TypeError, match=r"out cannot be written in place: its DLPack export is read-only.*JAX"):
        conv_forward(*operands, **KW, out=out)
    assert not np.any(np.asarray(out)) and fresh_arena.stats() == before


def test_jax_mixes_with_numpy_and_torch_and_the_first_operand_decides():
    torch = pytest.importorskip("torch")
    x, w, _ = problem("float32")
    ref = ref_conv_forward(x, w, **KW)
    y = conv_forward(jnp.asarray(x), w, **KW)
    assert isinstance(y, jax.Array) and rel_err(y, ref) <= TOL["float32"]
    y = conv_forward(x, jnp.asarray(w), **KW)
    assert type(y) is np.ndarray and rel_err(y, ref) <= TOL["float32"]
    y = conv_forward(torch.from_numpy(x), jnp.asarray(w), **KW)
    assert isinstance(y, torch.Tensor) and rel_err(y.numpy(), ref) <= TOL["float32"]
    out = np.zeros_like(ref, dtype=np.float32)  # a writable out of another library, JAX operands
    assert conv_forward(jnp.asarray(x), jnp.asarray(w), **KW, out=out) is out
    assert rel_err(out, ref) <= TOL["float32"]


def test_transposed_and_sliced_jax_arrays_are_read_where_jax_keeps_them(runs):
    """JAX makes a new dense array of a transpose or a slice; the ops read that array's memory."""
    x, w, _ = problem("float32")
    ref = ref_conv_forward(x, w, **KW)
    nchw = jnp.transpose(jnp.asarray(np.ascontiguousarray(np.moveaxis(x, 1, -1))), (0, 3, 1, 2))  # x, NHWC memory
    wide = jnp.asarray(np.repeat(x, 2, axis=-1))[..., ::2]  # x again, every other column of a wider array
    for jx in (nchw, wide):
        assert rel_err(conv_forward(jx, jnp.asarray(w), **KW), ref) <= TOL["float32"]
        assert pointer(runs[-1][0]) == pointer(jx)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_jax_arrays_reach_the_backend_which_says_what_it_computes_in(fresh_arena, dtype):
    x, w, _ = problem("float32")
    before = fresh_arena.stats()
    with pytest.raises(TypeError, match=f"x has dtype {dtype}: the cpu backend computes in float32 or float64"):
        conv_forward(jnp.asarray(x, dtype), jnp.asarray(w, dtype), **KW)
    assert fresh_arena.stats() == before


def test_bfloat16_travels_through_dlpack_as_int16_without_a_copy():
    """Neither NumPy nor CuPy imports or exports DLPack's bfloat16: it travels as int16, relabelled on the way,
    both into the ops (a view of JAX's memory) and back to JAX (the memory the ops wrote)."""
    values = np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 3, 4).astype(ml_dtypes.bfloat16)
    source = jnp.asarray(values)
    view = _interop._host_view(_interop._Operand("x", source))
    assert view.dtype == ml_dtypes.bfloat16 and pointer(view) == pointer(source)
    assert np.array_equal(view, values)
    result = _interop._aligned_empty(values.shape, "int16").view(ml_dtypes.bfloat16)  # as the ops allocate it
    result[...] = values
    back = _interop._returned(source, result)
    assert isinstance(back, jax.Array) and back.dtype == jnp.bfloat16 and pointer(back) == pointer(result)
    assert np.array_equal(np.asarray(back), values)


@pytest.mark.parametrize("transform", ["jit", "grad", "vmap"])
def test_a_jax_tracer_is_refused_saying_what_it_is(fresh_arena, transform):
    """Inside a JAX transformation the operands are tracers, with no memory for the ops to read: a TypeError that
    names them, not the plain 'must be an array' one."""
    x, w, dy = problem("float32")
    jx, jw, jdy = jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy)
    calls = {
        "jit": lambda: jax.jit(lambda a: conv_backward_filter(jx, a, jw.shape, **KW))(jdy),
        "grad": lambda: jax.grad(lambda a: conv_forward(a, jw, **KW).sum())(jx),
        "vmap": lambda: jax.vmap(lambda b: conv_backward_data(jdy, b, jx.shape, **KW))(jw[None]),
    }
    name = {"jit": "dy", "grad": "x", "vmap": "w"}[transform]
    before = fresh_arena.stats()
    with pytest.raises(TypeError, match=rf"^{name} is a JAX tracer \(\w+Tracer: a value inside jax.jit, .*"
                                        r"through jax.pure_callback"):  # JAX adds a line of its own after it
        calls[transform]()
    assert fresh_arena.stats() == before


def test_a_deleted_jax_array_is_a_type_error_naming_it(fresh_arena):
    """JAX's own ``__dlpack_device__`` fails on a deleted (or donated) array with a TypeError of its internals."""
    x, w, _ = problem("float32")
    jx, out = jnp.asarray(x), jnp.zeros(ref_conv_forward(x, w, **KW).shape, jnp.float32)
    jx.delete()
    out.delete()
    before = fresh_arena.stats()
    with pytest.raises(TypeError, match=r"^x cannot be viewed: its __dlpack_device__\(\) raised TypeError: "):
        conv_forward(jx, w, **KW)
    with pytest.raises(TypeError, match=r"^out cannot be viewed: its __dlpack_device__\(\) raised TypeError: "):
        conv_forward(x, w, **KW, out=out)
    assert fresh_arena.stats() == before


def test_a_sharded_jax_array_is_a_type_error_naming_it():
    """An array sharded over two devices (here two CPU devices, which XLA makes only at start: a new process) has
    no one memory to view: JAX's ``__dlpack_device__`` raises a BufferError, which the call names."""
    code = (
        "import numpy as np, jax, wsarena\n"
        "mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ('b',))\n"
        "x = jax.device_put(np.ones((2, 1, 4, 4), np.float32), jax.NamedSharding(mesh, jax.P('b')))\n"
        "try:\n"
        "    wsarena.conv_forward(x, np.ones((1, 1, 3, 3), np.float32))\n"
        "except TypeError as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("x cannot be viewed: its __dlpack_device__() raised BufferError: "), done.stdout


def test_inside_jit_the_ops_run_through_pure_callback():
    """What the tracer's refusal suggests."""
    x, w, _ = problem("float32")
    shape = jax.ShapeDtypeStruct(ref_conv_forward(x, w, **KW).shape, jnp.float32)
    y = jax.jit(lambda a, b: jax.pure_callback(lambda *v: conv_forward(*v, **KW), shape, a, b))(jnp.asarray(x), w)
    assert isinstance(y, jax.Array) and rel_err(y, ref_conv_forward(x, w, **KW)) <= TOL["float32"]


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_the_three_ops_match_jaxs_own_convolution_in_1_2_and_3_d(nd):
    """Against jax.lax.conv_general_dilated and its vjp in float64, dilation and groups included: max|got - ref| /
    max|ref| <= 1e-10."""
    kw = {"stride": 2, "padding": 1, "dilation": 2, "groups": 2}
    rng = np.random.default_rng(nd)
    with jax.enable_x64(True):
        x = jnp.asarray(rng.standard_normal((2, 4) + (7,) * nd))
        w = jnp.asarray(rng.standard_normal((6, 2) + (3,) * nd))

        def conv(a, b):
            return jax.lax.conv_general_dilated(a, b, (2,) * nd, [(1, 1)] * nd, rhs_dilation=(2,) * nd,
                                                feature_group_count=2, precision=jax.lax.Precision.HIGHEST)

        y, vjp = jax.vjp(conv, x, w)
        dy = jnp.asarray(rng.standard_normal(y.shape))
        dx, dw = vjp(dy)
        got = (conv_forward(x, w, **kw), conv_backward_data(dy, w, x.shape, **kw),
               conv_backward_filter(x, dy, w.shape, **kw))
    for result, ref in zip(got, (y, dx, dw)):
        assert isinstance(result, jax.Array) and result.dtype == jnp.float64
        assert rel_err(result, np.asarray(ref)) <= 1e-10
