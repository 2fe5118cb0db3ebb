"""Operands from other array libraries (wsarena._interop) on the CPU: PyTorch CPU tensors, DLPack and
``__array_interface__`` objects, against the float64 direct convolution of tests/reference.py.

Tolerance: max|got - ref| / max|ref| <= 1e-12 in float64, 1e-5 in float32.
"""

import collections
import ctypes
import enum
import gc
import inspect
import itertools
import re
import sys
import types
import weakref
from typing import ClassVar

import numpy as np
import pytest

import wsarena
from wsarena import _interop, conv_backward_data, conv_backward_filter, conv_forward, ops
from wsarena._dlpack import BFLOAT16, INT16, READ_ONLY, DLManagedTensorVersioned, Export, ReadOnlyExport
from wsarena._pass import Pass
from wsarena._sizes import short_repr
from wsarena.arena import streams

from .reference import ref_conv_backward_data, ref_conv_backward_filter, ref_conv_forward

torch = pytest.importorskip("torch")
# DLPack 1.0's keyword arguments to a tensor's __dlpack__ (max_version, dl_device, copy), and with them a versioned,
# writable export; PyTorch 2.7 takes none of them, and NumPy imports its legacy capsule read-only
TORCH_DLPACK_1 = "max_version" in inspect.signature(torch.Tensor.__dlpack__).parameters

TOL = {"float32": 1e-5, "float64": 1e-12}
KW = {"stride": 2, "padding": 1, "dilation": 1, "groups": 2}


def rel_err(got, ref):
    got = got.numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    return float(np.max(np.abs(got.astype(np.float64) - ref))) / (float(np.max(np.abs(ref))) or 1.0)


def problem(dtype="float64", seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 4, 9, 9)).astype(dtype)
    w = rng.standard_normal((6, 2, 3, 3)).astype(dtype)
    dy = rng.standard_normal(ref_conv_forward(x, w, **KW).shape).astype(dtype)
    return x, w, dy


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_torch_cpu_tensors_through_the_three_ops(dtype, layout):
    x, w, dy = problem(dtype)
    refs = (ref_conv_forward(x, w, **KW), ref_conv_backward_data(dy, w, x.shape, **KW),
            ref_conv_backward_filter(x, dy, w.shape, **KW))
    last = (lambda a: np.ascontiguousarray(np.moveaxis(a, 1, -1))) if layout == "NHWC" else (lambda a: a)
    back = (lambda a: np.moveaxis(a, -1, 1)) if layout == "NHWC" else (lambda a: a)
    tx, tw, tdy = (torch.from_numpy(last(a)) for a in (x, w, dy))
    got = (conv_forward(tx, tw, **KW, layout=layout),
           conv_backward_data(tdy, tw, tuple(tx.shape), **KW, layout=layout),
           conv_backward_filter(tx, tdy, tuple(tw.shape), **KW, layout=layout))
    for result, ref in zip(got, refs):
        assert isinstance(result, torch.Tensor) and result.dtype == tx.dtype
        assert rel_err(back(result.numpy()), ref) <= TOL[dtype]


def test_torch_results_match_torch_own_convolution():
    x, w, _dy = problem()
    tx, tw = torch.from_numpy(x), torch.from_numpy(w)
    expected = torch.nn.functional.conv2d(tx, tw, **KW)
    assert torch.allclose(conv_forward(tx, tw, **KW), expected, rtol=0, atol=1e-12 * float(expected.abs().max()))


def test_out_of_the_callers_library_is_written_and_returned():
    x, w, _ = problem()
    ref = ref_conv_forward(x, w, **KW)
    out = torch.full(ref.shape, np.nan, dtype=torch.float64)
    assert conv_forward(torch.from_numpy(x), torch.from_numpy(w), **KW, out=out) is out
    assert rel_err(out, ref) <= TOL["float64"]
    out2 = torch.full(ref.shape, np.nan, dtype=torch.float64)  # NumPy operands, a torch out: all host memory
    assert conv_forward(x, w, **KW, out=out2) is out2
    assert rel_err(out2, ref) <= TOL["float64"]


def test_a_torch_out_written_in_place_is_seen_by_autograd_as_modified():
    # Autograd keeps tensors for the backward pass and checks their version when it uses them: an out= written
    # through a NumPy view must count as an in-place write, as PyTorch's own out= does, or a gradient that uses the
    # old values comes out silently wrong.
    x, w, _ = problem()
    shape = ref_conv_forward(x, w, **KW).shape
    a = torch.ones(shape, dtype=torch.float64, requires_grad=True)
    out = torch.ones(shape, dtype=torch.float64)
    loss = (a * out).sum()  # saves out for the gradient of a
    before = out._version
    conv_forward(torch.from_numpy(x), torch.from_numpy(w), **KW, out=out)
    assert out._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_torch_out_written_by_a_call_that_then_raised_is_seen_by_autograd_as_modified(monkeypatch):
    """A warning made an error (here the MemoryFallbackWarning of a first choice the arena could not grow for) is
    raised after the convolution wrote out: the write still counts, or autograd would use the new values."""
    import warnings

    from wsarena.arena import Arena
    from wsarena.arena.testing import RecordingProvider
    from wsarena.backends._cpu_backend import CpuBackend

    arena = Arena(RecordingProvider(fail=lambda nbytes: nbytes > 0))
    monkeypatch.setattr(CpuBackend, "arena", lambda self: arena)
    x, w, _ = problem()
    ref = ref_conv_forward(x, w, **KW)
    a = torch.ones(ref.shape, dtype=torch.float64, requires_grad=True)
    out = torch.ones(ref.shape, dtype=torch.float64)
    loss = (a * out).sum()  # saves out for the gradient of a
    before = out._version
    with warnings.catch_warnings():
        warnings.simplefilter("error", wsarena.MemoryFallbackWarning)
        with pytest.raises(wsarena.MemoryFallbackWarning):
            conv_forward(torch.from_numpy(x), torch.from_numpy(w), **KW, out=out)
    assert rel_err(out, ref) <= TOL["float64"]  # written, by the algorithm that needs no workspace
    assert out._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_an_inference_tensor_is_out_only_inside_inference_mode(fresh_arena):
    x, w, _ = problem()
    ref = ref_conv_forward(x, w, **KW)
    with torch.inference_mode():
        out = torch.full(ref.shape, np.nan, dtype=torch.float64)
    before = fresh_arena.stats()
    with pytest.raises(TypeError, match="out is an inference tensor"):  # as PyTorch refuses its own in-place writes
        conv_forward(torch.from_numpy(x), torch.from_numpy(w), **KW, out=out)
    assert fresh_arena.stats() == before and torch.isnan(out).all()
    with torch.inference_mode():
        assert conv_forward(torch.from_numpy(x), torch.from_numpy(w), **KW, out=out) is out
    assert rel_err(out, ref) <= TOL["float64"]


def test_libraries_mix_when_every_view_is_zero_copy_and_the_first_operand_decides():
    x, w, _ = problem()
    ref = ref_conv_forward(x, w, **KW)
    y = conv_forward(x, torch.from_numpy(w), **KW)
    assert type(y) is np.ndarray and rel_err(y, ref) <= TOL["float64"]
    y = conv_forward(torch.from_numpy(x), w, **KW)
    assert isinstance(y, torch.Tensor) and rel_err(y, ref) <= TOL["float64"]


class _CudaArray:
    """An object that says its memory is on a CUDA device (never read here: the call is refused first)."""

    __cuda_array_interface__: ClassVar[dict] = {"shape": (6, 2, 3, 3), "typestr": "<f8", "data": (0, False),
                                                "version": 3}


def test_host_and_device_memory_in_one_call_is_a_type_error():
    x, _, _ = problem()
    with pytest.raises(TypeError, match=r"cannot mix host and device memory.*w is a tests array on a CUDA device"):
        conv_forward(torch.from_numpy(x), _CudaArray(), **KW)


def test_a_cuda_array_interface_out_whose_data_says_read_only_is_refused_before_any_cuda_library_is_touched(
    monkeypatch,
):
    """CuPy, which views such an ``out``, has no read-only arrays: it would write one."""
    monkeypatch.setattr(_interop, "_cupy", lambda: pytest.fail("a CUDA library was touched"))
    x, w, dy = problem()

    def on_device(shape, read_only=False):
        array = _CudaArray()
        array.__cuda_array_interface__ = {**_CudaArray.__cuda_array_interface__, "shape": shape,
                                          "data": (1 << 40, read_only)}
        return array

    out = on_device(dy.shape, read_only=True)
    with pytest.raises(ValueError, match=r"^out is read-only: its __cuda_array_interface__'s data says so"):
        conv_forward(on_device(x.shape), on_device(w.shape), **KW, out=out)
    assert _interop._says_read_only(out.__cuda_array_interface__)
    assert not any(map(_interop._says_read_only, ({"data": (1, False)}, {"data": None}, {}, None)))


def test_dlpack_round_trips_with_numpy_share_memory():
    x, w, _ = problem()
    tx = torch.from_numpy(x)
    y = conv_forward(tx, torch.from_numpy(w), **KW)
    back = np.from_dlpack(y)  # the result's memory is the NumPy array the op wrote: no copy either way
    assert back.ctypes.data == y.data_ptr()
    if TORCH_DLPACK_1:  # else NumPy made the view read-only
        back[0, 0, 0, 0] = 123.0
        assert float(y[0, 0, 0, 0]) == 123.0
    out = torch.zeros(y.shape, dtype=torch.float64)
    conv_forward(x, w, **KW, out=out)  # written in place through its NumPy view
    assert rel_err(out, ref_conv_forward(x, w, **KW)) <= TOL["float64"]


class _Foreign:
    """A minimal array of a library "fakearrays": DLPack only, over a NumPy array."""

    __module__ = "fakearrays"

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


class _Interface:
    """Only ``__array_interface__``, from a library with no way back in."""

    __module__ = "plainbuffers"

    def __init__(self, array):
        self.array = array
        self.__array_interface__ = array.__array_interface__


def test_dlpack_operands_come_back_through_their_librarys_from_dlpack(monkeypatch):
    library = types.ModuleType("fakearrays")
    library.from_dlpack = lambda a: _Foreign(np.from_dlpack(a))
    monkeypatch.setitem(sys.modules, "fakearrays", library)
    monkeypatch.setattr(_interop, "_RETURNERS", {})
    x, w, _ = problem()
    y = conv_forward(_Foreign(x), _Foreign(w), **KW)
    assert isinstance(y, _Foreign) and rel_err(y.array, ref_conv_forward(x, w, **KW)) <= TOL["float64"]


def test_array_namespace_and_array_interface_operands():
    x, w, _ = problem()
    ref = ref_conv_forward(x, w, **KW)

    class Namespaced(_Foreign):
        __module__ = "otherarrays"

        def __array_namespace__(self):
            return types.SimpleNamespace(from_dlpack=lambda a: Namespaced(np.from_dlpack(a)))

    y = conv_forward(Namespaced(x), w, **KW)
    assert isinstance(y, Namespaced) and rel_err(y.array, ref) <= TOL["float64"]
    y = conv_forward(_Interface(x), _Interface(w), **KW)  # no library to go back to: NumPy
    assert type(y) is np.ndarray and rel_err(y, ref) <= TOL["float64"]
    out = np.zeros_like(ref)
    assert conv_forward(_Interface(x), w, **KW, out=_Interface(out)).array is out  # written through the view
    assert rel_err(out, ref) <= TOL["float64"]


def test_a_tensor_that_is_not_contiguous_is_handled_and_a_strided_out_refused():
    x, w, _ = problem()
    wide = torch.from_numpy(np.ascontiguousarray(np.moveaxis(x, 1, -1))).movedim(-1, 1)  # x's values, NHWC memory
    assert not wide.is_contiguous()
    ref = ref_conv_forward(x, w, **KW)
    assert rel_err(conv_forward(wide, torch.from_numpy(w), **KW), ref) <= TOL["float64"]
    out = torch.zeros((*ref.shape[:-1], 2 * ref.shape[-1]), dtype=torch.float64)[..., ::2]
    with pytest.raises(ValueError, match="out must be C-contiguous"):
        conv_forward(wide, torch.from_numpy(w), **KW, out=out)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda x: torch.from_numpy(x).requires_grad_(),
         r"x requires grad while autograd records.*use wsarena\.torch.*pass x\.detach\(\)"),
        (lambda x: x.tolist(), "x must be an array"),
        (lambda x: torch.from_numpy(x).to(torch.bfloat16), "cpu backend computes in float32 or float64, not bfloat16"),
        (lambda x: torch.from_numpy(x).to(torch.int32), "x must be a floating-point array"),
    ],
)
def test_a_tensor_that_would_need_a_copy_or_another_kernel_is_refused(fresh_arena, make, match):
    x, w, _ = problem()
    before = fresh_arena.stats()
    with pytest.raises(TypeError, match=match):
        conv_forward(make(x), torch.from_numpy(w).to(torch.bfloat16) if "bfloat16" in match else w, **KW)
    assert fresh_arena.stats() == before


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_tensors_that_require_grad_are_taken_where_no_gradient_is_recorded(fresh_arena, mode):
    """Under ``torch.no_grad()`` or ``torch.inference_mode()`` (a model's parameters in an evaluation loop) the ops
    take them, as PyTorch's own ops do, and the result records nothing; an ``out=`` that requires grad is written,
    as ``torch.no_grad()`` lets a parameter be written in place. Outside, they stay a ``TypeError`` (above)."""
    x, w, dy = problem()
    refs = (ref_conv_forward(x, w, **KW), ref_conv_backward_data(dy, w, x.shape, **KW),
            ref_conv_backward_filter(x, dy, w.shape, **KW))
    tx, tw, tdy = (torch.from_numpy(a).requires_grad_() for a in (x, w, dy))
    out = torch.zeros(refs[0].shape, dtype=torch.float64, requires_grad=True)
    with getattr(torch, mode)():
        got = (conv_forward(tx, tw, **KW), conv_backward_data(tdy, tw, x.shape, **KW),
               conv_backward_filter(tx, tdy, w.shape, **KW))
        assert conv_forward(tx, tw, **KW, out=out) is out
        # what the views are made of, on the host as on a device (whose DLPack export refuses such a tensor)
        assert not _interop._Operand("w", tw).obj.requires_grad
    with pytest.raises(TypeError, match="w requires grad while autograd records"):  # as above
        _interop._Operand("w", tw)
    with pytest.raises(TypeError, match=r"out requires grad while autograd records.*pass out\.detach\(\)"):
        conv_forward(tx.detach(), tw.detach(), **KW, out=out)
    for result, ref in zip((*got, out), (*refs, refs[0])):
        assert isinstance(result, torch.Tensor) and rel_err(result.detach().numpy(), ref) <= TOL["float64"]
    assert not any(r.requires_grad for r in got) and out.requires_grad and out.grad_fn is None


def test_an_unknown_dlpack_device_is_refused():
    class OnOpenCL(_Foreign):
        def __dlpack_device__(self):
            return (4, 0)

    x, w, _ = problem()
    with pytest.raises(TypeError, match="DLPack device type 4"):
        conv_forward(OnOpenCL(x), w, **KW)


def test_a_dlpack_device_that_raises_is_a_type_error_naming_the_operand(fresh_arena):
    """An exporter that cannot say where its memory is (JAX's sharded or deleted arrays raise BufferError or
    TypeError there) is refused as what cannot be viewed is, naming the operand and the cause."""

    class Sharded(_Foreign):
        def __dlpack_device__(self):
            raise BufferError("only supported for unsharded arrays")

    x, w, _ = problem()
    before = fresh_arena.stats()
    match = r"^w cannot be viewed: its __dlpack_device__\(\) raised BufferError: only supported for unsharded arrays$"
    with pytest.raises(TypeError, match=match):
        conv_forward(x, Sharded(w), **KW)
    assert fresh_arena.stats() == before

    class Muddled(_Foreign):
        def __init__(self, array, answer):
            super().__init__(array)
            self.answer = answer

        def __dlpack_device__(self):
            return self.answer

    for answer, shown in ((None, "None"), ((1, 0, 0), r"\(1, 0, 0\)"), ("10", "'10'"), (b"\x01\x00", r"b'\\x01\\x00'"),
                          (itertools.count(), r"count\(3\)")):  # an endless iterator: read one past a pair
        with pytest.raises(TypeError, match=rf"^w cannot be viewed: its __dlpack_device__\(\) returned {shown}, not a "
                                            r"\(device type, device id\) pair$"):
            conv_forward(x, Muddled(w, answer), **KW)
    # A device type or id that is no integer was made one by int(): (1.7, 0) was the host, (2, 1.7) CUDA device 1,
    # ('1', 0) the host
    for answer, which in (((1.7, 0), "device type 1.7"), ((2, 1.7), "device id 1.7"), (("1", 0), "device type '1'"),
                          (("cpu", 0), "device type 'cpu'"), ((1, None), "device id None"),
                          ((True, 0), "device type True"), ([np.float64(1.0), 0], "device type np.float64(1.0)")):
        says = f"w cannot be viewed: its __dlpack_device__() returned {short_repr(answer)}, whose {which} is not an " \
            "integer"
        with pytest.raises(TypeError, match=f"^{re.escape(says)}$"):
            conv_forward(x, Muddled(w, answer), **KW)
    assert fresh_arena.stats() == before
    # A negative device id is no CUDA device: (2, -1) was taken as CUDA device -1
    device_type = enum.IntEnum("DLDeviceType", {"kDLCPU": 1, "kDLCUDA": 2, "kDLCUDAManaged": 13})
    for answer in ((2, -1), (device_type.kDLCUDA, -1), (13, np.int64(-3)), [2, -1]):
        says = f"w cannot be viewed: its __dlpack_device__() returned {short_repr(answer)}, whose device id " \
            f"{int(answer[1])} is no CUDA device (one is >= 0)"
        with pytest.raises(TypeError, match=f"^{re.escape(says)}$"):
            conv_forward(x, Muddled(w, answer), **KW)
    assert fresh_arena.stats() == before
    # integers of any type: a NumPy integer, an IntEnum (PyTorch's and JAX's device type), a list, a named tuple; the
    # host's device id is not read (DLPack gives it as 0)
    pair = collections.namedtuple("pair", "device_type device_id")
    for answer in ((np.int64(1), np.int32(0)), (device_type.kDLCPU, 0), [1, 0], pair(1, 0), (1, -1)):
        np.testing.assert_array_equal(conv_forward(x, Muddled(w, answer), **KW), conv_forward(x, w, **KW))


def test_a_jax_tracer_is_refused_saying_what_it_is(monkeypatch, fresh_arena):
    """A stand-in for JAX's tracers (tests/test_interop_jax.py has the real ones, where JAX is installed)."""

    class DynamicJaxprTracer:
        pass

    monkeypatch.setitem(sys.modules, "jax",
                        types.SimpleNamespace(core=types.SimpleNamespace(Tracer=DynamicJaxprTracer)))
    x, _, _ = problem()
    before = fresh_arena.stats()
    with pytest.raises(TypeError, match=r"^w is a JAX tracer \(DynamicJaxprTracer: a value inside jax.jit, "):
        conv_forward(x, DynamicJaxprTracer(), **KW)
    assert fresh_arena.stats() == before


@pytest.mark.parametrize("jax", [types.SimpleNamespace(), types.SimpleNamespace(core=types.SimpleNamespace())])
def test_a_module_named_jax_without_core_tracer_leaves_a_non_array_the_plain_type_error(monkeypatch, jax):
    """A ``jax`` that is not JAX, or JAX halfway through its import (another thread's): no tracer to test against."""
    monkeypatch.setitem(sys.modules, "jax", jax)
    x, _, _ = problem()
    with pytest.raises(TypeError, match=r"^w must be an array \(NumPy, CuPy, .*not list$"):
        conv_forward(x, [1.0], **KW)


def test_operands_on_different_cuda_devices_are_refused_before_any_view():
    """Checked from what the operands say of themselves (``__dlpack_device__``): no CUDA library is touched."""

    class OnDevice(_Foreign):
        __module__ = "fakearrays"

        def __init__(self, array, ordinal):
            super().__init__(array)
            self.ordinal = ordinal

        def __dlpack_device__(self):
            return (2, self.ordinal)  # kDLCUDA

    x, w, _ = problem()
    match = (r"cannot mix CUDA devices.*x is a fakearrays array on CUDA device 0, "
             r"w is a fakearrays array on CUDA device 1")
    with pytest.raises(TypeError, match=match):
        conv_forward(OnDevice(x, 0), OnDevice(w, 1), **KW)
    with pytest.raises(TypeError, match="cannot mix CUDA devices"):
        conv_forward(OnDevice(x, 1), OnDevice(w, 1), **KW, out=OnDevice(np.empty(0), 0))


def test_a_cupy_array_on_another_device_than_a_dlpack_operand_is_refused():
    """A CuPy array says its device too (``.device.id``): beside a tensor on another device it is refused, not
    read from the other device's scope. (A stand-in: a class CuPy's by name, with no CuPy installed.)"""

    class ndarray:  # the name and module by which wsarena knows CuPy's arrays
        __module__ = "cupy._core.core"
        device = types.SimpleNamespace(id=1)

    class OnDevice0(_Foreign):
        __module__ = "fakearrays"

        def __dlpack_device__(self):
            return (2, 0)  # kDLCUDA

    _, w, _ = problem()
    match = r"cannot mix CUDA devices.*x is a cupy array on CUDA device 1, w is a fakearrays array on CUDA device 0"
    with pytest.raises(TypeError, match=match):
        conv_forward(ndarray(), OnDevice0(w), **KW)


def test_an_object_with_dlpack_but_no_dlpack_device_is_refused_naming_both():
    class HalfDLPack:
        def __init__(self, array):
            self.array = array

        def __dlpack__(self, **kwargs):
            return self.array.__dlpack__(**kwargs)

    x, w, _ = problem()
    with pytest.raises(TypeError, match=r"x must be an array .*__dlpack__ and __dlpack_device__.*not HalfDLPack"):
        conv_forward(HalfDLPack(x), w, **KW)


class _Legacy(_Foreign):
    """A DLPack exporter of the kind that predates DLPack 1.0: legacy capsules only, which carry no flags."""

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(stream=kwargs.get("stream"))


def test_out_is_written_through_dlpack_only_where_the_export_allows_writes(fresh_arena):
    x, w, _ = problem()
    ref = ref_conv_forward(x, w, **KW)
    out = _Foreign(np.zeros_like(ref))
    assert conv_forward(x, w, **KW, out=out) is out and rel_err(out.array, ref) <= TOL["float64"]
    frozen = np.zeros_like(ref)
    frozen.flags.writeable = False  # exported with DLPack 1.0's read-only flag
    before = fresh_arena.stats()
    for out, why in ((_Foreign(frozen), "flagged so"), (_Legacy(np.zeros_like(ref)), "a legacy capsule")):
        with pytest.raises(TypeError, match=rf"out cannot be written in place: .*read-only \({why}"):
            conv_forward(_Foreign(x), w, **KW, out=out)
        assert not np.any(out.array)
    assert fresh_arena.stats() == before
    assert rel_err(conv_forward(_Legacy(x), _Legacy(w), **KW), ref) <= TOL["float64"]  # inputs are only read


class _NextMajor(_Foreign):
    """A DLPack exporter whose capsules claim a major version after 1: their layout past the version is unknown."""

    def __dlpack__(self, **kwargs):
        capsule = self.array.__dlpack__(**kwargs)
        get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
        get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, (ctypes.py_object, ctypes.c_char_p)
        ctypes.c_uint32.from_address(get_pointer(capsule, b"dltensor_versioned")).value = 2  # version.major
        return capsule


def test_out_through_a_dlpack_major_version_after_1_is_refused_unread(fresh_arena):
    x, w, _ = problem()
    out = _NextMajor(np.zeros_like(ref_conv_forward(x, w, **KW)))
    with pytest.raises(TypeError, match="out cannot be written in place: .*major version other than 1"):
        conv_forward(x, w, **KW, out=out)
    assert not np.any(out.array)


def test_an_export_that_asks_for_no_writes_takes_a_read_only_one():
    """What reads an operand (and hands a result back) asks no writes of its export: a legacy capsule, and one
    flagged read-only, are imported, unchanged where their dtype is not the one to retype."""
    frozen = np.arange(6, dtype=np.int16)
    frozen.flags.writeable = False  # exported with DLPack 1.0's read-only flag (NumPy exports it in no legacy one)
    for exporter in (_Foreign(frozen), _Legacy(frozen.copy())):
        array = exporter.array
        export = Export(exporter, retype=(BFLOAT16, INT16))
        view = np.from_dlpack(export)
        assert view.dtype == np.int16 and view.ctypes.data == array.ctypes.data and np.array_equal(view, array)
        assert not export.retyped


class _Renamed(_Foreign):
    """A DLPack exporter whose capsules bear a name other than DLPack's (as a consumed capsule does)."""

    def __dlpack__(self, **kwargs):
        capsule = self.array.__dlpack__(**kwargs)
        set_name = ctypes.pythonapi.PyCapsule_SetName
        set_name.argtypes = (ctypes.py_object, ctypes.c_char_p)
        set_name(capsule, b"used_dltensor_versioned")
        return capsule


def test_a_capsule_an_export_cannot_read_goes_to_the_importer_as_it_is():
    """A capsule of a major version after 1, or of a name DLPack does not give, is not read where no write is
    asked: the importer gets the producer's capsule and says what it makes of it."""
    for kind in (_NextMajor, _Renamed):

        class Kept(kind):  # keeps the capsules it gives
            capsules: ClassVar[list] = []

            def __dlpack__(self, **kwargs):
                self.capsules.append(super().__dlpack__(**kwargs))
                return self.capsules[-1]

        export = Export(Kept(np.zeros(3)), retype=(BFLOAT16, INT16))
        assert export.__dlpack__(max_version=(1, 0)) is Kept.capsules[0] and not export.retyped
    with pytest.raises(TypeError, match=r"^x cannot be viewed as a NumPy array without a copy: .*version"):
        conv_forward(_NextMajor(np.zeros((1, 1, 3, 3))), np.ones((1, 1, 1, 1)))


class _Made:
    """A DLPack 1.0 exporter of a capsule made here, over a struct whose flags are ``flags`` and whose 64 preceding
    bytes are each ``before``: an export that read another word than the flags would give another answer. No importer
    consumes it."""

    _new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
        ("PyCapsule_New", ctypes.pythonapi)
    )

    def __init__(self, flags, before):
        self.buffer = (ctypes.c_uint8 * (64 + ctypes.sizeof(DLManagedTensorVersioned)))(*[before] * 64)
        managed = DLManagedTensorVersioned.from_buffer(self.buffer, 64)
        managed.version.major, managed.flags = 1, flags
        self.address = ctypes.addressof(managed)

    def __dlpack__(self, **kwargs):
        return self._new(self.address, b"dltensor_versioned", None)


def test_an_export_reads_the_read_only_flag_where_it_lies():
    writable, frozen = _Made(flags=0, before=0xFF), _Made(flags=READ_ONLY, before=0)
    assert ctypes.pythonapi.PyCapsule_IsValid(ctypes.py_object(Export(writable, writable=True).__dlpack__()),
                                              b"dltensor_versioned")
    with pytest.raises(ReadOnlyExport, match=r"^its DLPack export is read-only \(flagged so\)$"):
        Export(frozen, writable=True).__dlpack__()


def test_bfloat16_crosses_dlpack_as_int16_both_ways():
    """NumPy neither imports nor exports DLPack's bfloat16: it travels as int16, relabelled, without a copy."""
    if not TORCH_DLPACK_1:
        pytest.skip("this PyTorch's Tensor.__dlpack__ takes no DLPack 1.0 keywords, which the stand-in exporter of "
                    "a bfloat16 tensor passes on (NumPy asks a copy=False import with them)")
    tensor = torch.linspace(-3, 3, 24).reshape(2, 3, 4).to(torch.bfloat16)
    view = _interop._host_view(_interop._Operand("x", _Foreign(tensor)))
    assert str(view.dtype) == "bfloat16" and view.ctypes.data == tensor.data_ptr()
    assert np.array_equal(view.astype(np.float32), tensor.float().numpy())
    back = torch.from_dlpack(_interop._exported(view))
    assert back.dtype == torch.bfloat16 and back.data_ptr() == tensor.data_ptr() and torch.equal(back, tensor)
    with pytest.raises(TypeError, match="x has dtype bfloat16: the cpu backend computes in float32 or float64"):
        conv_forward(_Foreign(tensor), _Foreign(tensor), **KW)


def test_a_host_result_bound_for_another_library_lies_on_a_64_byte_boundary():
    """Where JAX (XLA) takes host memory without a copy: the ops allocate there what goes back to another library,
    whatever the result's size, while a NumPy caller's result is NumPy's own."""
    for batch in (1, 2, 3, 5, 7):
        x, w, dy = problem()
        x, dy = np.repeat(x, batch, axis=0)[:batch], np.repeat(dy, batch, axis=0)[:batch]
        tx, tw, tdy = (torch.from_numpy(a) for a in (x, w, dy))
        results = (conv_forward(tx, tw, **KW), conv_backward_data(tdy, tw, x.shape, **KW),
                   conv_backward_filter(tx, tdy, w.shape, **KW))
        refs = (ref_conv_forward(x, w, **KW), ref_conv_backward_data(dy, w, x.shape, **KW),
                ref_conv_backward_filter(x, dy, w.shape, **KW))
        for result, ref in zip(results, refs):
            assert isinstance(result, torch.Tensor) and result.data_ptr() % 64 == 0, (batch, result.shape)
            assert rel_err(result, ref) <= TOL["float64"]


def test_one_record_per_signature_whichever_library_and_numpy_stays_on_the_direct_path():
    x, w, _ = problem()
    conv_forward(x, w, **KW)
    conv_forward(torch.from_numpy(x), torch.from_numpy(w), **KW)
    conv_forward(_Interface(x), w, **KW)
    assert len(ops._records) == 1  # keyed by the NumPy views: one signature
    assert np.ndarray in _interop.NATIVE and torch.Tensor not in _interop.NATIVE


def test_the_stream_argument_on_the_cpu_is_still_a_lane():
    x, w, _ = problem()
    arena = wsarena.get_arena("cpu")
    conv_forward(torch.from_numpy(x), torch.from_numpy(w), **KW, stream="lane-a")
    assert "lane-a" in arena.stats()["streams"]


class _CudaTensor(torch.Tensor):
    """A host tensor that says it is on CUDA device 0: the device branch of the call, read on a machine without
    one (its views come from the fake CuPy below)."""

    @property
    def is_cuda(self):
        return True

    def get_device(self):
        return 0


class _Scope:
    """A context manager that logs its entry and exit: a fake CuPy device or stream."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def __enter__(self):
        self.log.append(f"enter {self.name}")

    def __exit__(self, *exc):
        self.log.append(f"exit {self.name}")


class _Device(_Scope):
    """A fake CuPy device: its ordinal, and a log of its entry and exit."""

    def __init__(self, log, ordinal):
        super().__init__(log, f"device {ordinal}")
        self.id = ordinal


class _DeviceResult(np.ndarray):
    """A result that is no NumPy array to the way back, as a CuPy array is not: it returns through DLPack."""


@pytest.fixture
def fake_torch_cuda(monkeypatch):
    """The device branch with torch operands on a machine without CUDA: CuPy faked (its views, device and
    streams log what the call does), PyTorch's current stream a settable handle (0 or 2, the streams CuPy names
    without cuda.core), the device's arena not made but asked for."""
    log, views = [], []
    cupy = types.ModuleType("cupy")
    cupy.from_dlpack = lambda obj, copy=None: views.append("dlpack") or obj.numpy()
    cupy.asarray = np.asarray
    cupy.cuda = types.SimpleNamespace(
        Device=lambda ordinal: _Device(log, ordinal),
        Stream=type("Stream", (), {"null": _Scope(log, "stream 0"), "ptds": _Scope(log, "stream 2")}),  # a class
        # another device current, and CuPy's current stream none of the tests': each call enters its own
        runtime=types.SimpleNamespace(getDevice=lambda: 9, getDeviceCount=lambda: 10),
        get_current_stream=lambda device: types.SimpleNamespace(ptr=-1),
        UnownedMemory=lambda ptr, size, owner, device_id: owner,
        MemoryPointer=lambda memory, offset: memory,
    )
    cupy.ndarray = lambda shape, dtype, owner, strides: views.append("direct") or owner.numpy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    _interop._cupy.cache_clear()
    monkeypatch.setattr(_interop, "_devices", 0)  # the count the fake's
    state = types.SimpleNamespace(log=log, views=views, current=0, asked=0, arenas=[])

    def current(device):
        state.asked += 1
        return state.current

    monkeypatch.setattr(_interop, "make_device_arena",
                        lambda ordinal, allocator: state.arenas.append((ordinal, allocator)))
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device: types.SimpleNamespace(cuda_stream=current(device)))
    state.current_of = current
    yield state
    _interop._cupy.cache_clear()


def _device_run(log):
    def run(pass_, a, b, shape_arg, params, out, stream, layout, algo):
        log.append(f"run on {stream}")
        result = np.zeros((1, 1, 2, 2), dtype=a.dtype).view(_DeviceResult)
        return result if out is None else out

    return run


@pytest.mark.parametrize("raw", [True, False], ids=["raw handle", "current_stream"])
def test_torch_cuda_operands_run_on_torchs_current_stream_asked_on_every_call(fake_torch_cuda, monkeypatch, raw):
    """Each call asks PyTorch for its current stream (a stream switched between calls is seen), makes the device
    and that stream CuPy's current around the run, and asks for the device's arena with PyTorch's memory; the
    result comes back as a tensor. The raw handle where PyTorch's C++ gives it, else through current_stream."""
    state = fake_torch_cuda
    if raw:
        monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", state.current_of, raising=False)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device: pytest.fail("a Stream built, not asked for"))
    else:
        monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream", raising=False)
    x, w = (torch.ones(shape).as_subclass(_CudaTensor) for shape in ((1, 1, 4, 4), (1, 1, 3, 3)))
    run = _device_run(state.log)
    for current in (0, 2, 0):
        state.current = current
        state.log.clear()
        y = _interop.execute(run, Pass.FWD, x, w, None, (1, 0, 1, 1), None, None, "NCHW", None)
        assert state.log == ["enter device 0", f"enter stream {current}", f"run on {current}", f"exit stream {current}",
                             "exit device 0"]
        assert isinstance(y, torch.Tensor) and y.shape == (1, 1, 2, 2)
    assert state.asked == 3 and state.arenas == [(0, "torch")] * 3
    assert state.views == ["direct"] * 6  # on PyTorch's current stream: viewed directly, no DLPack export
    state.log.clear()  # a stream given is the call's: PyTorch's is not asked
    state.views.clear()
    _interop.execute(run, Pass.FWD, x, w, None, (1, 0, 1, 1), None, 2, "NCHW", None)
    assert state.log[1:3] == ["enter stream 2", "run on 2"] and state.asked == 3
    assert state.views == ["dlpack"] * 2  # DLPack's export orders PyTorch's current stream before the call's
    out = torch.zeros(1, 1, 2, 2).as_subclass(_CudaTensor)
    before = out._version
    assert _interop.execute(run, Pass.FWD, x, w, None, (1, 0, 1, 1), out, None, "NCHW", None) is out
    assert out._version > before and state.asked == 4


class _CudaTensor1(_CudaTensor):
    def get_device(self):
        return 1


def test_a_side_stream_gets_a_cupy_object_of_its_own_each_call(fake_torch_cuda, monkeypatch):
    """On a stream other than the default (PyTorch's current, on a side stream), each call enters a CuPy stream
    object made for it, over cuda.core's object for the handle, which is made once and kept by handle, on any
    device, a call on another handle meanwhile too. The default streams are
    CuPy's own objects, which neither take nor evict it. The object a call entered is gone once the call returns:
    CuPy's stream-ordered allocator frees a result on it while it lives, and its owner may destroy the stream (the
    object kept from call to call outlived it)."""
    state = fake_torch_cuda
    wrapped, entered = [], []
    from_handle = streams._from_handle
    monkeypatch.setattr(streams, "_from_handle", lambda handle: wrapped.append(handle) or from_handle(handle))

    def from_external(core):  # CuPy's Stream.from_external: an object of its own for each wrapping
        scope = _Scope(state.log, f"stream {core.__cuda_stream__()[1]}")
        entered.append(weakref.ref(scope))
        return scope

    monkeypatch.setattr(sys.modules["cupy"].cuda.Stream, "from_external", from_external, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", state.current_of, raising=False)
    on = {0: [torch.ones(shape).as_subclass(_CudaTensor) for shape in ((1, 1, 4, 4), (1, 1, 3, 3))],
          1: [torch.ones(shape).as_subclass(_CudaTensor1) for shape in ((1, 1, 4, 4), (1, 1, 3, 3))]}
    run = _device_run(state.log)
    for device, current, made in [(0, 7, [7]), (0, 7, []), (0, 0, []), (0, 7, []), (1, 7, []), (1, 7, []),
                                  (0, 9, [9]), (0, 7, []), (0, 2, []), (0, 7, [])]:
        state.current = current
        state.log.clear()
        wrapped.clear()
        entered.clear()
        _interop.execute(run, Pass.FWD, *on[device], None, (1, 0, 1, 1), None, None, "NCHW", None)
        assert wrapped == made, (device, current)
        assert state.log == [f"enter device {device}", f"enter stream {current}", f"run on {current}",
                             f"exit stream {current}", f"exit device {device}"]
        gc.collect()
        assert len(entered) == (current not in (0, 2)) and not any(ref() for ref in entered), (device, current)


_DIRECT = {  # tensors a call on PyTorch's current stream views directly
    "contiguous": lambda: torch.arange(24.0).reshape(2, 3, 4),
    "channels-last": lambda: torch.arange(120.0).reshape(2, 3, 4, 5).to(memory_format=torch.channels_last),
    "strided, with an offset": lambda: torch.arange(60.0).reshape(3, 4, 5)[1:, ::2, 1:4],
    "a size-1 dimension's stride": lambda: torch.arange(12.0).reshape(3, 4).unsqueeze(1).expand(3, 1, 4),
    "float16": lambda: torch.arange(24.0).reshape(4, 6).half(),
    "bfloat16": lambda: torch.arange(24.0).reshape(4, 6).bfloat16(),
    "float64": lambda: torch.arange(24.0, dtype=torch.float64).reshape(6, 4).t(),
}
_BYTES = {2: (torch.int16, np.int16), 4: (torch.int32, np.int32), 8: (torch.int64, np.int64)}


@pytest.mark.parametrize("make", _DIRECT.values(), ids=_DIRECT.keys())
def test_a_cuda_tensor_is_viewed_over_its_own_memory_as_dlpack_would_view_it(make):
    """A CUDA tensor on the call's stream becomes a CuPy array made from its pointer, sizes and strides (CuPy builds
    one without a GPU): over the same bytes, element for element, as the tensor, in its dtype, and keeping it
    alive. Checked against a NumPy array over those bytes laid out as the view says, read as integers."""
    cupy = pytest.importorskip("cupy")
    import weakref

    tensor = make().as_subclass(_CudaTensor)
    view = _interop._tensor_view(_interop._Operand("x", tensor))
    size = tensor.element_size()
    assert type(view) is cupy.ndarray and view.data.ptr == tensor.data_ptr()
    assert view.shape == tuple(tensor.shape) and view.strides == tuple(n * size for n in tensor.stride())
    assert str(view.dtype) == str(tensor.dtype).removeprefix("torch.")
    as_int, np_int = _BYTES[size]
    extent = sum((n - 1) * st for n, st in zip(view.shape, view.strides)) + size
    assert view.data.mem.size == extent  # the memory it claims: the bytes from the first element to the last
    memory = (ctypes.c_char * extent).from_address(view.data.ptr)
    seen = np.ndarray(view.shape, np_int, buffer=memory, strides=view.strides)
    assert np.array_equal(seen, tensor.view(as_int).numpy())  # every element the tensor's
    alive = weakref.ref(tensor)
    del tensor
    assert alive() is not None  # the view holds the tensor, and so its memory
    del view
    assert alive() is None


class _NoStorage(_CudaTensor):
    """A tensor with no storage of its own, as a wrapper subclass (DTensor, torchao's) or a fake tensor has: its
    data pointer is 0."""

    def data_ptr(self):
        return 0


class _NoSizes(_CudaTensor):
    """A tensor whose sizes cannot be read, as a nested tensor's or torch.func.vmap's batched one's."""

    @property
    def shape(self):
        raise RuntimeError("Internal error: NestedTensorImpl doesn't support sizes.")


_NOT_DIRECT = {  # what DLPack views or refuses, as before
    "no elements": lambda: torch.zeros(0, 3).as_subclass(_CudaTensor),
    "a negated view": lambda: torch._neg_view(torch.ones(2, 3)).as_subclass(_CudaTensor),
    "an integer dtype": lambda: torch.ones(2, 3, dtype=torch.int32).as_subclass(_CudaTensor),
    "no storage of its own": lambda: torch.ones(2, 3).as_subclass(_NoStorage),
    "sizes that cannot be read": lambda: torch.ones(2, 3).as_subclass(_NoSizes),
}


@pytest.mark.parametrize("make", _NOT_DIRECT.values(), ids=_NOT_DIRECT.keys())
def test_what_a_direct_view_would_misread_goes_through_dlpack(make, monkeypatch):
    through = []
    monkeypatch.setattr(_interop, "_view", lambda library, op: through.append(op.name) or "viewed by DLPack")
    monkeypatch.setattr(_interop, "_cupy", lambda: None)
    assert _interop._tensor_view(_interop._Operand("w", make())) == "viewed by DLPack"
    assert through == ["w"]


@pytest.mark.parametrize("direct", [True, False], ids=["on PyTorch's stream", "on a stream given"])
def test_a_cuda_tensor_with_no_memory_of_its_own_is_refused(direct):
    """A wrapper subclass (DTensor's kind) or a fake tensor has no memory of its own: its data pointer is 0, and its
    DLPack export would name memory that is not its data. Refused, naming the operand, as its NumPy view is on the
    host (``.numpy()`` is not supported for tensor subclasses); never viewed."""
    library = _interop._Library("CuPy", lambda t: pytest.fail("exported"), None, None)
    op = _interop._Operand("x", torch.ones(2, 3).as_subclass(_NoStorage))
    with pytest.raises(TypeError, match="x cannot be viewed as a CuPy array without a copy: a tensor with no memory"):
        if direct:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(_interop, "_cupy", lambda: library)
                _interop._tensor_view(op)
        else:
            _interop._view(library, op)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_host_result_comes_back_to_torch_over_its_own_memory(dtype):
    """The way back for a torch caller: the tensor is a view of the array the op wrote, bfloat16 relabelled."""
    caller = torch.zeros(1, dtype=getattr(torch, dtype))
    result = _interop._aligned_empty((2, 3), "int16" if dtype == "bfloat16" else dtype)
    if dtype == "bfloat16":
        result = result.view(_interop._bfloat16())
    result[...] = np.arange(6).reshape(2, 3)
    back = _interop._returned(caller, result)
    assert back.dtype == caller.dtype and back.data_ptr() == result.ctypes.data
    assert torch.equal(back, torch.arange(6, dtype=caller.dtype).reshape(2, 3))
