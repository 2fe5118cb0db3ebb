"""The cudnn backend: descriptor building through the real libcudnn here; the ops on a GPU (marked `gpu`).

GPU tolerances (relative error max|y - ref| / max|ref| against the float64 reference): float32 1e-5 (FMA_MATH,
no TF32), float16 and bfloat16 2e-2 and 5e-2 (inputs rounded to those types, accumulation in float32).
"""

import dataclasses
import gc
import json
import threading
import warnings
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wsarena import _interop, algos, config, configure, conv_backward_data, conv_backward_filter, conv_forward
from wsarena._geometry import conv_geometry
from wsarena._pass import Pass
from wsarena.arena import streams
from wsarena.backends import Candidate
from wsarena.backends._cudnn_backend import CudnnBackend, _channels_last, _OnDevice, _usable, pointers
from wsarena.cudnn import AlgoPerf, ConvolutionFwdAlgo, MathType, Status
from wsarena.errors import MemoryFallbackWarning, UnsupportedConvolutionError, WorkspaceCapWarning

from .reference import ref_conv_backward_data, ref_conv_backward_filter, ref_conv_forward


@pytest.fixture(scope="module")
def backend():
    return CudnnBackend()  # loads libcudnn; no GPU needed for descriptors


@settings(max_examples=80, deadline=None)
@given(
    nd=st.integers(1, 3), groups=st.integers(1, 3), cpg=st.integers(1, 3), kpg=st.integers(1, 3),
    size=st.integers(3, 9), k=st.integers(1, 3), s=st.integers(1, 2), p=st.integers(0, 2), d=st.integers(1, 2),
    layout=st.sampled_from(["NCHW", "NHWC"]), dtype=st.sampled_from(["float32", "float16", "bfloat16", "float64"]),
)
def test_descriptors_agree_with_the_geometry(backend, nd, groups, cpg, kpg, size, k, s, p, d, layout, dtype):
    if d * (k - 1) + 1 > size + 2 * p:
        return
    c, kk = cpg * groups, kpg * groups
    shape_x = (2, c, *(size,) * nd) if layout == "NCHW" else (2, *(size,) * nd, c)
    shape_w = (kk, cpg, *(k,) * nd) if layout == "NCHW" else (kk, *(k,) * nd, cpg)
    geom = conv_geometry(shape_x, shape_w, stride=s, padding=p, dilation=d, groups=groups, layout=layout, dtype=dtype)
    x, w, conv, y = backend._descriptors(geom)
    assert conv.output_shape(x, w) == (2, kk, *geom.output_size)
    assert y.shape == (2, kk, *geom.output_size)
    # the descriptor's strides are the array's own, in elements
    itemsize = 2 if dtype in ("float16", "bfloat16") else np.dtype(dtype).itemsize
    arr = np.empty(geom.input_shape, dtype=np.dtype(f"V{itemsize}"))
    strides = tuple(st_ // itemsize for st_ in arr.strides)
    if layout == "NHWC":
        strides = (strides[0], strides[-1], *strides[1:-1])
    assert x.strides == strides


def test_descriptors_are_cached(backend):
    geom = conv_geometry((2, 4, 8, 8), (4, 4, 3, 3), padding=1)
    assert all(a is b for a, b in zip(backend._descriptors(geom), backend._descriptors(geom)))


def test_remembered_descriptors_are_rebuilt_when_closed_and_bounded():
    backend = CudnnBackend()
    geom = conv_geometry((2, 4, 8, 8), (4, 4, 3, 3), padding=1)
    x, w, conv, y = backend._descriptors(geom)
    conv.close()  # by mistake: it belongs to the cache
    again = backend._descriptors(geom)
    assert not any(d.closed for d in again) and again[2] is not conv
    assert [(d.shape, d.strides) for d in (again[0], again[3])] == [(d.shape, d.strides) for d in (x, y)]
    assert again[1].shape == w.shape and again[2].padding == conv.padding
    backend._descs.maxsize = 2
    for n in (3, 4, 5):
        backend._descriptors(geom.with_batch(n))
    assert len(backend._descs) == 2
    assert not x.closed  # evicted, not closed: whoever holds a set keeps it usable


class _FakeDevice:
    def __init__(self, id_, log):
        self.id, self.log = id_, log

    def __enter__(self):
        self.log.append(("enter device", self.id))

    def __exit__(self, *exc):
        self.log.append(("exit device", self.id))


class _FakeStream:
    def __init__(self, log, fail=False):
        self.log, self.fail = log, fail

    def __enter__(self):
        if self.fail:
            raise RuntimeError("stream on another device")
        self.log.append("enter stream")

    def __exit__(self, *exc):
        self.log.append("exit stream")


def _on(device):
    return type("FakeArray", (), {"device": device})()


def test_context_refuses_arrays_on_different_devices(backend):
    d0, d1 = _FakeDevice(0, []), _FakeDevice(1, [])
    with pytest.raises(ValueError, match=r"different devices \[0, 1\]"):
        backend.context((_on(d0), _on(d0), _on(d1)), None)
    ctx = backend.context((_on(d1), _on(d1)), None)
    assert ctx.device is d1 and ctx.stream is None  # no stream: the arrays' CuPy device alone


class _Device:
    """A CuPy device that makes itself the fake CUDA current device ``current[0]`` while entered."""

    def __init__(self, id_, current):
        self.id, self.current = id_, current

    def __enter__(self):
        self.prev, self.current[0] = self.current[0], self.id

    def __exit__(self, *exc):
        self.current[0] = self.prev


def _real_streams(monkeypatch, backend, current_streams):
    """The backend's CuPy with its real Stream class, whose objects need no GPU to be made, and CuPy's current stream
    of each device from ``current_streams``, the backend's and wsarena._interop's; returns the handles cuda.core's
    ``Stream.from_handle`` was given."""
    import cupy

    wrapped = []
    from_handle = streams._from_handle

    def counted(handle):
        wrapped.append(handle)
        return from_handle(handle)

    cuda = type("cuda", (), {"Stream": cupy.cuda.Stream,
                             "get_current_stream": staticmethod(current_streams.__getitem__)})
    monkeypatch.setattr(backend, "_cupy", type("FakeCupy", (), {"cuda": cuda}))
    monkeypatch.setattr(cupy.cuda, "get_current_stream", current_streams.__getitem__)
    monkeypatch.setattr(streams, "_from_handle", counted)
    return wrapped


def _current(handle):
    return type("CurrentStream", (), {"ptr": handle})()  # CuPy's current stream of a device, as far as it is asked


def _protocol(handle):
    return type("ForeignStream", (), {"__cuda_stream__": lambda self: (0, handle)})()


def test_a_raw_stream_becomes_a_cupy_stream_entered_on_the_arrays_device(monkeypatch):
    """A stream other than CuPy's current one on the arrays' device is wrapped as a CuPy stream for its handle, tied
    to no device (CuPy's from_external: the device current where it is entered, the arrays', entered first), without
    making any device current to wrap it; one that is current there already leaves the device alone to enter."""
    import cupy

    backend = CudnnBackend()
    current = [0]  # the fake CUDA current device
    current_streams = {0: _current(0x77), 1: _current(0)}
    _real_streams(monkeypatch, backend, current_streams)
    on_1 = _on(_Device(1, current))
    for stream in (0x77, _protocol(0x78)):  # a raw handle (current on device 0, not on 1), a foreign stream object
        ctx = backend.context((on_1, on_1), stream)
        assert isinstance(ctx.stream, cupy.cuda.Stream) and ctx.device is on_1.device and current == [0]
        assert (ctx.stream.ptr, ctx.stream.device_id) == (streams.stream_handle(stream), -1)
    current_streams[1] = _current(0x77)  # made current there by the caller (wsarena._interop for torch tensors)
    ctx = backend.context((on_1, on_1), 0x77)
    assert ctx.device is on_1.device and ctx.stream is None  # nothing to switch: the device alone


def test_each_call_gets_a_cupy_stream_object_of_its_own_over_one_kept_cuda_core_object(monkeypatch):
    """A stream other than CuPy's current one, however given (a raw handle, an object with ``cuda_stream`` as a
    PyTorch stream has, or with ``__cuda_stream__``), on any device, gets a CuPy object made for the call, over
    cuda.core's object for its handle, made once (5 to 9 us) and kept by handle: the keep wsarena._interop's calls
    share, where a call on another handle made since leaves it kept. The default streams are CuPy's own objects,
    which neither take nor evict it."""
    import cupy

    backend = CudnnBackend()
    current = [0]
    wrapped = _real_streams(monkeypatch, backend, {0: _current(0x99), 1: _current(0x99)})  # none of those given
    on_0, on_1 = _on(_Device(0, current)), _on(_Device(1, current))
    torch_like = type("TorchStream", (), {"cuda_stream": 0x77})()
    made = [backend.context((on, on), stream).stream for on in (on_1, on_0) for stream in (0x77, torch_like,
                                                                                              _protocol(0x77))]
    made += [_interop._cupy().scope(device, 0x77, own).stream for device, own in ((1, True), (0, False))]
    assert wrapped == [0x77] and all(stream.ptr == 0x77 for stream in made)
    assert len(set(map(id, made))) == len(made)  # all alive here: one object each
    assert backend.context((on_1, on_1), 0).stream is cupy.cuda.Stream.null
    assert backend.context((on_1, on_1), streams.PerThreadStream(streams.thread_lane())).stream is cupy.cuda.Stream.ptds
    backend.context((on_1, on_1), 0x77)
    assert wrapped == [0x77]
    backend.context((on_1, on_1), 0x78)
    backend.context((on_1, on_1), 0x77)
    assert wrapped == [0x77, 0x78]  # each handle's kept


def test_the_stream_object_a_call_makes_current_dies_with_the_call(monkeypatch):
    """CuPy's stream-ordered allocator (MemoryAsyncPool) frees an array on the stream object current when it was
    allocated while that object lives, else on the stream current when it is freed. An object kept from call to call
    (as the backend's and the interop's were) outlived the call's stream: a result freed once its owner destroyed
    the stream went to a dead handle, or to another stream given it. Made for the call, it is collected once the call
    lets go of it, and so is a stream object of the caller's it was given."""
    backend = CudnnBackend()
    current = [0]
    _real_streams(monkeypatch, backend, {1: _current(0)})
    on_1 = _on(_Device(1, current))
    foreign = _protocol(0x79)
    caller_gone = weakref.ref(foreign)
    made = [weakref.ref(backend.context((on_1, on_1), stream).stream) for stream in (0x79, foreign)]
    made.append(weakref.ref(_interop._cupy().scope(1, 0x79, True).stream))  # wsarena.torch's calls on a side stream
    made.append(weakref.ref(_interop._cupy().scope(1, 0x79, False).stream))  # beside another library's operands
    del foreign
    gc.collect()
    assert [ref() for ref in made] == [None] * 4 and caller_gone() is None


def _runtime(current):
    """``cupy.cuda`` as far as the ops' context asks it: the current device is ``current``, and CuPy's current stream
    there none of the tests' streams."""
    return SimpleNamespace(runtime=SimpleNamespace(getDevice=lambda: current), get_current_stream=lambda device: None)


def test_device_and_stream_enter_in_order_and_leave_in_reverse():
    log = []
    with _OnDevice(_runtime(0), _FakeDevice(3, log), _FakeStream(log)):
        log.append("body")
    assert log == [("enter device", 3), "enter stream", "body", "exit stream", ("exit device", 3)]
    log.clear()
    with (
        pytest.raises(RuntimeError, match="another device"),
        _OnDevice(_runtime(0), _FakeDevice(3, log), _FakeStream(log, fail=True)),
    ):
        log.append("body")
    assert log == [("enter device", 3), ("exit device", 3)]  # the device is left when the stream cannot be entered


def test_cupys_own_device_refused_by_cudagetdevice_leaves_its_device_stack_alone():
    """CuPy's own Device (its Cython) where CUDA refuses cudaGetDevice (no driver or no GPU here): its ``__enter__``
    raises before it pushes, and neither scope pops CuPy's device stack, whose empty list raised an IndexError in
    place of CUDA's error (the scopes tell by the traceback, whose frames Cython names)."""
    cupy = pytest.importorskip("cupy")
    from wsarena.arena._scopes import _OnDeviceEntered

    try:
        cupy.cuda.runtime.getDevice()
    except cupy.cuda.runtime.CUDARuntimeError:
        pass
    else:
        pytest.skip("CUDA answers cudaGetDevice here")
    # _OnDevice asks the current device first: here device 1 is, for it to enter CuPy's Device of device 0
    for scope in (_OnDevice(_runtime(1), cupy.cuda.Device(0), None), _OnDeviceEntered(cupy.cuda, cupy.cuda.Device(0),
                                                                                      None)):
        with pytest.raises(cupy.cuda.runtime.CUDARuntimeError), scope:
            pytest.fail("entered")


def test_a_device_current_already_is_not_entered_and_the_block_knows_it_without_asking(monkeypatch):
    """CuPy's Device asks cudaGetDevice as it enters and calls cudaSetDevice as it leaves, even where nothing changes:
    a device current already is asked once and left alone. Within the block the backend's device (its key, its arena,
    the handle's) is the one made current, in this thread alone, asked of no one; after it CuPy is asked again."""
    log, asked = [], []
    backend = CudnnBackend()
    monkeypatch.setattr(backend, "_cupy", SimpleNamespace(cuda=SimpleNamespace(
        Device=lambda: asked.append(1) or SimpleNamespace(id=5))))
    with _OnDevice(_runtime(3), _FakeDevice(3, log), _FakeStream(log)):
        assert log == ["enter stream"]
        assert backend._device() == backend.device_key() == 3 and asked == []
        elsewhere = []
        thread = threading.Thread(target=lambda: elsewhere.append(backend._device()))
        thread.start()
        thread.join()
        assert elsewhere == [5] and len(asked) == 1  # another thread's current device is CuPy's
        with _OnDevice(_runtime(3), _FakeDevice(4, log), None):  # nested, on another device
            assert backend._device() == 4
        assert backend._device() == 3 and log[-2:] == [("enter device", 4), ("exit device", 4)]
    assert log[-1] == "exit stream" and ("exit device", 3) not in log
    assert backend._device() == 5 and len(asked) == 2
    with pytest.raises(RuntimeError, match="another device"), _OnDevice(_runtime(3), _FakeDevice(3, log),
                                                                        _FakeStream(log, fail=True)):
        pass
    assert backend._device() == 5


def test_the_handle_is_bound_to_the_leased_workspaces_stream(monkeypatch):
    backend = CudnnBackend()
    bound = []
    handle = type("FakeHandle", (), {"set_stream": lambda self, raw: bound.append(raw)})()
    monkeypatch.setattr(backend, "_handle", lambda stream=None: handle)
    leased = type("Leased", (), {"cuda_stream": 7})()  # an arena Workspace: its raw handle, resolved already
    assert backend._bound_handle(None, leased) is handle and bound == [7]
    other = type("Stream", (), {"__cuda_stream__": lambda self: (0, 9)})()
    backend._bound_handle(other, object())  # no leased stream (a caller's own buffer): `stream` is resolved
    backend._bound_handle(11)
    assert bound == [7, 9, 11]


def test_channels_last_strides():
    assert _channels_last(2, 3, (4, 5)) == ((2, 3, 4, 5), (60, 1, 15, 3))
    assert _channels_last(1, 8, (7,)) == ((1, 8, 7), (56, 1, 8))


def test_pointer_order_per_pass():
    class A:
        def __init__(self, ptr):
            self.data = type("D", (), {"ptr": ptr})()

    a, b, out = A(1), A(2), A(3)  # (a, b, out): fwd (x, w, y), bwd_data (dy, w, dx), bwd_filter (x, dy, dw)
    assert pointers("fwd", a, b, out) == (1, 2, 3)
    assert pointers("bwd_data", a, b, out) == (3, 2, 1)
    assert pointers(Pass.BWD_FILTER, a, b, out) == (1, 3, 2)


def test_usable_keeps_each_successful_algorithm_and_math_type_once_in_order():
    def perf(algo, status, mem, math, t=0.5):
        return AlgoPerf(algo, status, t, mem, 0, math)

    tensor_op, default = int(MathType.TENSOR_OP_MATH), int(MathType.DEFAULT_MATH)
    got = _usable(
        [
            perf(ConvolutionFwdAlgo.FFT, Status.NOT_SUPPORTED, 10, default),
            perf(ConvolutionFwdAlgo.IMPLICIT_PRECOMP_GEMM, Status.SUCCESS, 200, tensor_op),
            perf(ConvolutionFwdAlgo.IMPLICIT_PRECOMP_GEMM, Status.SUCCESS, 100, default),
            perf(ConvolutionFwdAlgo.IMPLICIT_PRECOMP_GEMM, Status.SUCCESS, 100, default),
            perf(99, Status.SUCCESS, 0, default),  # an algorithm number from a newer cuDNN
            perf(ConvolutionFwdAlgo.IMPLICIT_GEMM, Status.SUCCESS, 0, default),
        ],
        timed=True,
    )
    # Each entry carries its own math type, so the kernel that runs is the one whose workspace was counted.
    assert got == [
        Candidate("implicit_precomp_gemm", 200, 0.5, tensor_op),
        Candidate("implicit_precomp_gemm", 100, 0.5, default),
        Candidate("implicit_gemm", 0, 0.5, default),
    ]
    # A cap that excludes the tensor-core entry still leaves the algorithm with its other math type.
    assert next(c for c in got if c.workspace_bytes <= 150) == Candidate("implicit_precomp_gemm", 100, 0.5, default)


def test_measure_takes_only_successful_entries_of_a_candidates_algorithm_and_math_type(backend, monkeypatch):
    """FindEx on the float32 descriptor (FMA_MATH) as a stand-in reports: an entry of a candidate's algorithm in a math
    type no candidate has (TF32 tensor cores, which float32 never runs), an algorithm not asked for, a failed
    entry. Only the candidates' own (algorithm, math type) pairs that ran are timed; the first was taken by its
    name alone, and would have run float32 in TF32 (run() builds the descriptor in the entry's math type)."""
    from wsarena.cudnn import Determinism
    from wsarena.cudnn import conv as conv_mod

    fma, tf32 = int(MathType.FMA_MATH), int(MathType.TENSOR_OP_MATH_ALLOW_CONVERSION)
    A = ConvolutionFwdAlgo
    found = [
        AlgoPerf(A.IMPLICIT_PRECOMP_GEMM, Status.SUCCESS, 0.2, 100, Determinism.DETERMINISTIC, tf32),
        AlgoPerf(A.FFT, Status.SUCCESS, 0.3, 150, Determinism.DETERMINISTIC, fma),
        AlgoPerf(A.GEMM, Status.NOT_SUPPORTED, 0.4, 200, Determinism.DETERMINISTIC, fma),
        AlgoPerf(A.IMPLICIT_PRECOMP_GEMM, Status.SUCCESS, 0.5, 100, Determinism.NON_DETERMINISTIC, fma),
        AlgoPerf(A.IMPLICIT_GEMM, Status.SUCCESS, 0.9, 0, Determinism.DETERMINISTIC, fma),
    ]
    asked = []

    def find(pass_, handle, x, x_ptr, w, w_ptr, conv, y, y_ptr, ws_ptr, ws_bytes):
        asked.append((pass_, handle, x_ptr, w_ptr, y_ptr, ws_ptr, ws_bytes, conv.math_type))
        return found

    monkeypatch.setattr(conv_mod, "find_algorithms", find)
    monkeypatch.setattr(backend, "_bound_handle", lambda stream, workspace=None: "handle")
    geom = conv_geometry((2, 4, 8, 8), (4, 4, 3, 3), padding=1)
    cands = [Candidate("implicit_precomp_gemm", 100, None, fma), Candidate("gemm", 200, None, fma),
             Candidate("implicit_gemm", 0, None, fma)]
    arrays = [type("A", (), {"data": type("D", (), {"ptr": ptr})()})() for ptr in (0x1000, 0x2000, 0x3000)]
    workspace = type("W", (), {"ptr": 0x4000, "nbytes": 200})()
    timed = backend.measure("fwd", geom, *arrays, workspace, cands, None)
    assert asked == [("fwd", "handle", 0x1000, 0x2000, 0x3000, 0x4000, 200, MathType.FMA_MATH)]
    assert timed == [Candidate("implicit_precomp_gemm", 100, 0.5, fma), Candidate("implicit_gemm", 0, 0.9, fma)]


def _findex_stand_in(backend, monkeypatch, listed, found):
    """The backend with cuDNN's heuristics listing ``listed`` and FindEx reporting ``found`` (AlgoPerf entries), its
    handle, device and arena stand-ins (a host arena: the leases' sizes are all a search asks of it); returns the
    list of FindEx calls."""
    from wsarena.arena import Arena, HostProvider
    from wsarena.cudnn import conv as conv_mod

    asked = []
    monkeypatch.setattr(conv_mod, "heuristic_algorithms", lambda *args: listed)
    monkeypatch.setattr(conv_mod, "find_algorithms", lambda *args: asked.append(args[-1]) or found)
    monkeypatch.setattr(backend, "_handle", lambda stream=None: "handle")
    monkeypatch.setattr(backend, "_bound_handle", lambda stream, workspace=None: "handle")
    monkeypatch.setattr(backend, "device_key", lambda: 0)
    arena = Arena(HostProvider())
    monkeypatch.setattr(backend, "arena", lambda: arena)
    return asked


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_an_exhaustive_search_takes_findex_entries_in_another_math_type_the_dtype_runs_in(backend, monkeypatch,
                                                                                          dtype):
    """The heuristics list every algorithm in the TENSOR_OP_MATH of a half-precision descriptor; FindEx tries one
    without tensor cores in DEFAULT_MATH and reports it so, and may report one with them in either. Such entries are
    timed and ranked in their own math type (run() builds the descriptor in it), and the ranking is kept: one
    search. Taken only in a candidate's own pair, every entry was left out: the search ranked nothing, kept nothing,
    and every call ran FindEx again, with no word said. An entry in TENSOR_OP_MATH_ALLOW_CONVERSION, which may round
    down, and one of an algorithm no candidate has, are still left out."""
    from wsarena.cudnn import Determinism

    A, ok, det = ConvolutionFwdAlgo, Status.SUCCESS, Determinism.DETERMINISTIC
    default, tensor_op = int(MathType.DEFAULT_MATH), int(MathType.TENSOR_OP_MATH)
    convert = int(MathType.TENSOR_OP_MATH_ALLOW_CONVERSION)
    listed = [AlgoPerf(A.IMPLICIT_PRECOMP_GEMM, ok, -1.0, 100, det, tensor_op),
              AlgoPerf(A.FFT, ok, -1.0, 300, det, tensor_op), AlgoPerf(A.IMPLICIT_GEMM, ok, -1.0, 0, det, tensor_op)]
    found = [AlgoPerf(A.FFT, ok, 0.2, 300, det, default), AlgoPerf(A.IMPLICIT_PRECOMP_GEMM, ok, 0.3, 100, det, convert),
             AlgoPerf(A.WINOGRAD, ok, 0.35, 0, det, tensor_op),
             AlgoPerf(A.IMPLICIT_PRECOMP_GEMM, ok, 0.4, 120, det, default),
             AlgoPerf(A.IMPLICIT_GEMM, ok, 0.9, 0, det, default)]
    asked = _findex_stand_in(backend, monkeypatch, listed, found)
    geom = conv_geometry((2, 8, 8, 8), (8, 8, 3, 3), padding=1, dtype=dtype)
    arrays = [type("A", (), {"data": type("D", (), {"ptr": ptr})()})() for ptr in (0x1000, 0x2000, 0x3000)]
    for _ in range(2):
        got = algos.select(backend, "fwd", geom, cap=None, search="exhaustive", operands=tuple(arrays))
        assert got == (Candidate("fft", 300, 0.2, default), Candidate("implicit_precomp_gemm", 120, 0.4, default),
                       Candidate("implicit_gemm", 0, 0.9, default))
    assert asked == [300] and algos.is_cached(backend, "fwd", geom, cap=None, search="exhaustive")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_an_exhaustive_search_leaves_out_findex_entries_of_float32_and_float64_off_fma(backend, monkeypatch, dtype):
    """float32 and float64 run in FMA_MATH only: an entry FindEx reports in DEFAULT_MATH (TF32 on an Ampere or later
    GPU), TENSOR_OP_MATH or TENSOR_OP_MATH_ALLOW_CONVERSION is not timed, whatever its algorithm."""
    from wsarena.cudnn import Determinism

    A, ok, det, fma = ConvolutionFwdAlgo, Status.SUCCESS, Determinism.DETERMINISTIC, int(MathType.FMA_MATH)
    listed = [AlgoPerf(A.IMPLICIT_PRECOMP_GEMM, ok, -1.0, 100, det, fma), AlgoPerf(A.FFT, ok, -1.0, 300, det, fma),
              AlgoPerf(A.IMPLICIT_GEMM, ok, -1.0, 0, det, fma)]
    found = [AlgoPerf(A.FFT, ok, 0.1, 300, det, int(m)) for m in MathType if m != MathType.FMA_MATH]
    found += [AlgoPerf(A.IMPLICIT_PRECOMP_GEMM, ok, 0.2, 100, det, int(m)) for m in MathType if m != MathType.FMA_MATH]
    found += [AlgoPerf(A.IMPLICIT_GEMM, ok, 0.9, 0, det, fma), AlgoPerf(A.FFT, ok, 1.5, 300, det, fma)]
    _findex_stand_in(backend, monkeypatch, listed, found)
    geom = conv_geometry((2, 8, 8, 8), (8, 8, 3, 3), padding=1, dtype=dtype)
    arrays = [type("A", (), {"data": type("D", (), {"ptr": ptr})()})() for ptr in (0x1000, 0x2000, 0x3000)]
    got = algos.select(backend, "fwd", geom, cap=None, search="exhaustive", operands=tuple(arrays))
    assert got == (Candidate("implicit_gemm", 0, 0.9, fma), Candidate("fft", 300, 1.5, fma))


def _operands(*pointers, copies=True):
    """Stand-ins for CuPy arrays at these addresses; with ``copies=False`` no copy can be had (memory pressure), so a
    search times them where they are."""

    def copy():
        raise MemoryError("no memory for a copy")

    return tuple(SimpleNamespace(data=SimpleNamespace(ptr=ptr), copy=(lambda: None) if copies else copy)
                 for ptr in pointers)


def _entries(statuses, times):
    """FindEx entries in FMA_MATH: per algorithm (a ConvolutionFwdAlgo member's name), its status, its time and its
    workspace (that of ``LISTED``)."""
    from wsarena.cudnn import Determinism

    fma = int(MathType.FMA_MATH)
    found = [AlgoPerf(ConvolutionFwdAlgo[name], status, times.get(name, -1.0), nbytes, Determinism.DETERMINISTIC, fma)
             for name, nbytes in LISTED.items() for status in [statuses.get(name, Status.SUCCESS)]]
    return sorted(found, key=lambda perf: (perf.status != Status.SUCCESS, perf.time_ms))


# What the heuristics list (algorithm and workspace, in FMA_MATH), and FindEx's times of those that run
LISTED = {"IMPLICIT_PRECOMP_GEMM": 100, "FFT": 300, "GEMM": 200, "WINOGRAD": 0, "IMPLICIT_GEMM": 0}
FINDEX_TIMES = {"FFT": 0.1, "IMPLICIT_PRECOMP_GEMM": 0.2, "GEMM": 0.5, "IMPLICIT_GEMM": 0.9}
# Entries that failed: for want of memory, for a pointer FindEx calls misaligned, and NOT_SUPPORTED
FAILED = {"FFT": Status.INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED, "GEMM": Status.BAD_PARAM_MISALIGNED_POINTER,
          "WINOGRAD": Status.NOT_SUPPORTED}


def test_measure_says_which_candidates_findex_failed_on_these_operands_alone(backend, monkeypatch):
    """What FindEx says of a candidate that the search cache may keep (NOT_SUPPORTED on 16-byte-aligned operands: the
    candidate is left out, rejected) and what it may not: an entry out of memory (PartlyTimed's failed: ranked after
    the timed), one for a misaligned pointer, and any entry failed on operands off 16-byte boundaries (refused)."""
    from wsarena.backends import PartlyTimed
    from wsarena.cudnn import conv as conv_mod

    fma = int(MathType.FMA_MATH)
    cands = [Candidate(name.lower(), nbytes, None, fma) for name, nbytes in LISTED.items()]
    found = _entries(FAILED, FINDEX_TIMES)
    monkeypatch.setattr(conv_mod, "find_algorithms", lambda *args: found)
    monkeypatch.setattr(backend, "_bound_handle", lambda stream, workspace=None: "handle")
    geom = conv_geometry((2, 4, 8, 8), (4, 4, 3, 3), padding=1)
    workspace = SimpleNamespace(ptr=0x4000, nbytes=300)
    timed = [Candidate("implicit_precomp_gemm", 100, 0.2, fma), Candidate("implicit_gemm", 0, 0.9, fma)]
    by_name = {c.algo: c for c in cands}
    with pytest.raises(PartlyTimed) as caught:
        backend.measure("fwd", geom, *_operands(0x1000, 0x2000, 0x3000), workspace, cands, None)
    assert caught.value.timed == timed
    assert caught.value.failed == [by_name["fft"]] and caught.value.refused == [by_name["gemm"]]
    with pytest.raises(PartlyTimed) as caught:  # x off a 16-byte boundary: winograd's NOT_SUPPORTED may be its own
        backend.measure("fwd", geom, *_operands(0x1004, 0x2000, 0x3000), workspace, cands, None)
    assert caught.value.timed == timed
    assert caught.value.failed == [by_name["fft"]] and caught.value.refused == [by_name["gemm"], by_name["winograd"]]
    found[:] = _entries({"WINOGRAD": Status.NOT_SUPPORTED}, FINDEX_TIMES)
    got = backend.measure("fwd", geom, *_operands(0x1000, 0x2000, 0x3000), workspace, cands, None)
    assert [c.algo for c in got] == ["fft", "implicit_precomp_gemm", "gemm", "implicit_gemm"]


def test_an_exhaustive_search_saves_no_verdict_on_findex_entries_failed_for_its_call_alone(backend, monkeypatch,
                                                                                           tmp_path):
    """A search on operands off a 16-byte boundary (no copies could be had: memory pressure) whose FindEx reports fft
    out of memory, gemm at a misaligned pointer and winograd NOT_SUPPORTED keeps no word of those three in the search
    cache: a later process (the choices gone, the entry read back from disk) searches again on aligned operands,
    times fft and gemm, and saves winograd as rejected; a third process reads every verdict back, asking FindEx
    nothing. Saved as rejected by the first process, fft, gemm and winograd were never timed again until the cache
    was cleared."""
    from wsarena import _search_env
    from wsarena.cudnn import Determinism

    fma, det = int(MathType.FMA_MATH), Determinism.DETERMINISTIC
    listed = [AlgoPerf(ConvolutionFwdAlgo[name], Status.SUCCESS, -1.0, nbytes, det, fma)
              for name, nbytes in LISTED.items()]
    found = _entries(FAILED, FINDEX_TIMES)
    asked = _findex_stand_in(backend, monkeypatch, listed, found)
    monkeypatch.setattr(backend, "search_environment", lambda: {"device": "stand-in GPU"}, raising=False)
    monkeypatch.setattr(_search_env, "_known", {})
    configure(cache_dir=tmp_path)
    geom = conv_geometry((2, 4, 8, 8), (4, 4, 3, 3), padding=1)

    def process(x_ptr):
        """A new process's search: no choice kept, the search cache on disk as the last one left it."""
        algos.cache_clear()
        operands = _operands(x_ptr, 0x2000, 0x3000, copies=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MemoryFallbackWarning)  # fft ran out of memory of its own
            got = algos.select(backend, "fwd", geom, cap=None, search="exhaustive", operands=operands)
        (entry,) = (tmp_path / "search").glob("*.json")
        saved = {r["algo"]: r["time_ms"] for r in json.loads(entry.read_text())["results"]}
        return [(c.algo, c.time_ms) for c in got], saved

    got, saved = process(0x1004)
    assert got == [("implicit_precomp_gemm", 0.2), ("implicit_gemm", 0.9), ("fft", None)]
    assert saved == {"implicit_precomp_gemm": 0.2, "implicit_gemm": 0.9} and asked == [300]
    found[:] = _entries({"WINOGRAD": Status.NOT_SUPPORTED}, FINDEX_TIMES)  # memory for fft now
    got, saved = process(0x1000)
    assert got == [("fft", 0.1), ("implicit_precomp_gemm", 0.2), ("gemm", 0.5), ("implicit_gemm", 0.9)]
    assert saved == {**{c: t for c, t in got}, "winograd": None} and asked == [300, 300]
    assert process(0x1004) == (got, saved) and asked == [300, 300]  # read back whole, on any operands


def test_a_ranking_searched_on_a_view_serves_views_alike_and_an_aligned_call_searches_again(backend, monkeypatch):
    """A search on x off a 16-byte boundary (no copies could be had: memory pressure) whose FindEx failed gemm and
    winograd there drops them. That ranking serves later calls on operands aligned alike, asking FindEx nothing, but
    a call on 16-byte-aligned operands in the same process searches again, times gemm and keeps that ranking for good.
    The process kept its choice per geometry alone: aligned calls ran the view's ranking, without gemm, for the rest
    of the process."""
    from wsarena.cudnn import Determinism

    fma, det = int(MathType.FMA_MATH), Determinism.DETERMINISTIC
    listed = [AlgoPerf(ConvolutionFwdAlgo[name], Status.SUCCESS, -1.0, nbytes, det, fma)
              for name, nbytes in LISTED.items()]
    found = _entries({"GEMM": Status.BAD_PARAM_MISALIGNED_POINTER, "WINOGRAD": Status.NOT_SUPPORTED}, FINDEX_TIMES)
    asked = _findex_stand_in(backend, monkeypatch, listed, found)
    geom = conv_geometry((2, 4, 8, 8), (4, 4, 3, 3), padding=1)

    def search(x_ptr):
        operands = _operands(x_ptr, 0x2000, 0x3000, copies=False)
        got = algos.select(backend, "fwd", geom, cap=None, search="exhaustive", operands=operands)
        return [c.algo for c in got], len(asked)

    def kept():
        return algos.is_cached(backend, "fwd", geom, cap=None, search="exhaustive")

    view = ["fft", "implicit_precomp_gemm", "implicit_gemm"]
    assert search(0x1004) == (view, 1) and not kept()
    assert search(0x1004) == (view, 1)  # aligned alike: served, FindEx not asked
    found[:] = _entries({"WINOGRAD": Status.NOT_SUPPORTED}, FINDEX_TIMES)
    full = ["fft", "implicit_precomp_gemm", "gemm", "implicit_gemm"]
    assert search(0x1000) == (full, 2) and kept()
    assert search(0x1004) == (full, 2) and search(0x1008) == (full, 2)  # kept for good: any operands


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_precision_search_saves_no_verdict_on_entries_failed_in_another_math_type(backend, monkeypatch,
                                                                                        tmp_path, dtype):
    """The heuristics list every algorithm of a half-precision descriptor in TENSOR_OP_MATH, and FindEx reports one it
    tries in DEFAULT_MATH so, failed entries too: fft out of memory there is out of memory of its own (failed), gemm at
    a misaligned pointer is refused, on 16-byte-aligned operands, as in the candidates' own math type; winograd's
    NOT_SUPPORTED is a verdict (off 16-byte boundaries, none). Matched to the candidates' own pairs alone, fft and gemm
    were saved as rejected, and no later process timed them until the cache was cleared."""
    from wsarena import _search_env
    from wsarena.backends import PartlyTimed
    from wsarena.cudnn import Determinism

    det, default, tensor_op = Determinism.DETERMINISTIC, int(MathType.DEFAULT_MATH), int(MathType.TENSOR_OP_MATH)
    listed = [AlgoPerf(ConvolutionFwdAlgo[name], Status.SUCCESS, -1.0, nbytes, det, tensor_op)
              for name, nbytes in LISTED.items()]
    found = [dataclasses.replace(perf, math_type=default) for perf in _entries(FAILED, FINDEX_TIMES)]
    asked = _findex_stand_in(backend, monkeypatch, listed, found)
    geom = conv_geometry((2, 4, 8, 8), (4, 4, 3, 3), padding=1, dtype=dtype)
    cands = {c.algo: c for c in backend.candidates("fwd", geom)}
    with pytest.raises(PartlyTimed) as caught:
        backend.measure("fwd", geom, *_operands(0x1000, 0x2000, 0x3000), SimpleNamespace(ptr=0x4000, nbytes=300),
                        list(cands.values()), None)
    assert [(c.algo, c.time_ms, c.math_type) for c in caught.value.timed] == [
        ("implicit_precomp_gemm", 0.2, default), ("implicit_gemm", 0.9, default)]
    assert caught.value.failed == [cands["fft"]] and caught.value.refused == [cands["gemm"]]
    with pytest.raises(PartlyTimed) as caught:  # x off a 16-byte boundary: those timed in DEFAULT_MATH are no refusal
        backend.measure("fwd", geom, *_operands(0x1004, 0x2000, 0x3000), SimpleNamespace(ptr=0x4000, nbytes=300),
                        list(cands.values()), None)
    assert caught.value.failed == [cands["fft"]] and caught.value.refused == [cands["gemm"], cands["winograd"]]

    monkeypatch.setattr(backend, "search_environment", lambda: {"device": "stand-in GPU"}, raising=False)
    monkeypatch.setattr(_search_env, "_known", {})
    configure(cache_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemoryFallbackWarning)  # fft ran out of memory of its own
        algos.select(backend, "fwd", geom, cap=None, search="exhaustive", operands=_operands(0x1000, 0x2000, 0x3000))
    (entry,) = (tmp_path / "search").glob("*.json")
    saved = {(r["algo"], r["math_type"]): r["time_ms"] for r in json.loads(entry.read_text())["results"]}
    assert saved == {("implicit_precomp_gemm", default): 0.2, ("implicit_gemm", default): 0.9,
                     ("implicit_precomp_gemm", tensor_op): None, ("implicit_gemm", tensor_op): None,
                     ("winograd", tensor_op): None}
    assert asked == [300, 300, 300]  # two measures, one search


def test_a_call_with_nothing_to_compute_needs_no_workspace(backend, monkeypatch):
    """At batch 0 every algorithm of each pass needs 0 bytes, and a forced one fits a cap of 0: cuDNN refuses a
    tensor descriptor of no images (BAD_PARAM), so the size query raised, and needs no handle to say so. A name that
    is no algorithm of the pass is still refused."""

    def no_handle(stream=None):
        raise AssertionError("a cuDNN handle asked for a call with nothing to compute")

    monkeypatch.setattr(backend, "_handle", no_handle)
    empty = conv_geometry((0, 4, 8, 8), (4, 4, 3, 3), padding=1)
    for pass_ in Pass:
        for algo in backend.algorithms(pass_):
            assert backend.workspace_size(pass_, algo, empty) == 0
            assert algos.forced(backend, pass_, empty, algo, cap=0) == (Candidate(algo, 0),)
    with pytest.raises(ValueError, match="not a cudnn fwd algorithm"):
        algos.forced(backend, "fwd", empty, "winograd_fast", cap=0)
    with pytest.raises(KeyError):
        backend.workspace_size("fwd", "winograd_fast", empty)


def test_descriptors_follow_the_candidates_math_type(backend):
    from wsarena.cudnn import MathType as M

    geom = conv_geometry((2, 4, 8, 8), (4, 4, 3, 3), padding=1, dtype="float16")
    assert backend._descriptors(geom)[2].math_type == M.TENSOR_OP_MATH
    assert backend._descriptors(geom, int(M.DEFAULT_MATH))[2].math_type == M.DEFAULT_MATH
    assert backend._descriptors(geom.with_dtype("float32"))[2].math_type == M.FMA_MATH


# ---------------------------------------------------------------------------------------------------- GPU only
TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-2, "bfloat16": 5e-2}


@pytest.fixture(params=["legacy", "graph"])
def cudnn_api(request):
    """Each GPU test below once per cuDNN API path (the autouse fixture restores the settings after)."""
    from wsarena import configure

    configure(cudnn_api=request.param)
    return request.param


def _fallbacks(record):
    from wsarena.errors import CudnnApiFallbackWarning

    return [w for w in record if issubclass(w.category, CudnnApiFallbackWarning)]


def _rel(got, ref):
    return float(np.max(np.abs(got - ref))) / (float(np.max(np.abs(ref))) or 1.0)


def _gpu_problem(seed, nd, layout, dilation=1):
    rng = np.random.default_rng(seed)
    size = {1: 17, 2: 9, 3: 5}[nd] + 2 * (dilation - 1)
    x = rng.standard_normal((2, 4, *(size,) * nd))
    w = rng.standard_normal((6, 2, *(3,) * nd))
    kw = {"stride": 2, "padding": 1, "dilation": dilation, "groups": 2}
    dy = rng.standard_normal(ref_conv_forward(x, w, **kw).shape)
    return x, w, dy, kw


@pytest.mark.gpu
@pytest.mark.parametrize("dilation", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_gpu_three_passes_match_the_reference(cudnn_api, dtype, nd, layout, dilation):
    import cupy

    x, w, dy, kw = _gpu_problem(nd, nd, layout, dilation)
    move = (lambda a: np.moveaxis(a, 1, -1)) if layout == "NHWC" else (lambda a: a)
    # round the inputs to the tested dtype first, so the reference sees the same numbers
    as_dev = lambda a: cupy.asarray(np.ascontiguousarray(move(a))).astype(dtype)
    xd, wd, dyd = as_dev(x), as_dev(w), as_dev(dy)
    back = lambda a: np.moveaxis(a, -1, 1) if layout == "NHWC" else a
    x64, w64, dy64 = (back(cupy.asnumpy(a.astype("float64"))) for a in (xd, wd, dyd))
    refs = (ref_conv_forward(x64, w64, **kw), ref_conv_backward_data(dy64, w64, x.shape, **kw),
            ref_conv_backward_filter(x64, dy64, w.shape, **kw))
    calls = (lambda: conv_forward(xd, wd, **kw, layout=layout),
             lambda: conv_backward_data(dyd, wd, xd.shape, **kw, layout=layout),
             lambda: conv_backward_filter(xd, dyd, wd.shape, **kw, layout=layout))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for call, ref in zip(calls, refs):
            try:
                got = call()
            except UnsupportedConvolutionError:
                # cuDNN's legacy API has no float64 NHWC kernel for some grouped passes (9.19 on an H200: none of
                # its algorithms supports them): the typed refusal is the right answer there, and only there.
                if not (cudnn_api == "legacy" and dtype == "float64" and layout == "NHWC"):
                    raise
                continue
            assert _rel(back(cupy.asnumpy(got.astype("float64"))), ref) <= TOL[dtype]
    if cudnn_api == "graph" and nd == 2 and dtype in ("float32", "float16"):
        assert not _fallbacks(record)  # the common cases run on the graph API itself


@pytest.mark.gpu
def test_gpu_cap_zero_and_one_mib(cudnn_api):
    import cupy

    from wsarena.arena import Arena, CupyProvider, set_arena

    rng = np.random.default_rng(0)
    x = cupy.asarray(rng.standard_normal((8, 64, 56, 56), dtype=np.float32))
    w = cupy.asarray(rng.standard_normal((64, 64, 3, 3), dtype=np.float32))
    dev = x.device.id
    for cap, bound in ((0, 0), ("1MiB", 1 << 20)):
        arena = Arena(CupyProvider(dev))
        previous = set_arena(dev, arena)
        algos.cache_clear()
        try:
            with config(cap_workspace=cap), warnings.catch_warnings():
                warnings.simplefilter("ignore", WorkspaceCapWarning)
                y = conv_forward(x, w, padding=1)
                dx = conv_backward_data(y, w, x.shape, padding=1)
                dw = conv_backward_filter(x, y, w.shape, padding=1)
            cupy.cuda.get_current_stream().synchronize()
            assert arena.stats()["high_water_bytes"] <= bound
            # The algorithms the cap leaves still compute the convolution (the batch's first image suffices).
            x64, w64 = cupy.asnumpy(x[:1]).astype(np.float64), cupy.asnumpy(w).astype(np.float64)
            y64 = ref_conv_forward(x64, w64, padding=1)
            assert _rel(cupy.asnumpy(y[:1]).astype(np.float64), y64) <= TOL["float32"]
            assert _rel(cupy.asnumpy(dx[:1]).astype(np.float64),
                        ref_conv_backward_data(y64, w64, x64.shape, padding=1)) <= TOL["float32"]
            dw64 = ref_conv_backward_filter(cupy.asnumpy(x).astype(np.float64), cupy.asnumpy(y).astype(np.float64),
                                            w.shape, padding=1)
            assert _rel(cupy.asnumpy(dw).astype(np.float64), dw64) <= TOL["float32"]
        finally:
            set_arena(dev, previous)
            arena.close()


@pytest.mark.gpu
@pytest.mark.parametrize("pass_", ["fwd", "bwd_data", "bwd_filter"])
def test_gpu_float32_candidates_report_fma_math(backend, pass_):
    """run() rebuilds the descriptor with each entry's math type: a float32 entry reporting anything but FMA_MATH
    would let a tensor-core GPU run it in TF32, against the float32 promise."""
    geom = conv_geometry((8, 64, 56, 56), (64, 64, 3, 3), padding=1)
    cands = backend.candidates(pass_, geom)
    assert cands and {c.math_type for c in cands} == {MathType.FMA_MATH}


@pytest.mark.gpu
def test_gpu_exhaustive_search_matches_heuristic_result(cudnn_api):
    import cupy

    rng = np.random.default_rng(1)
    x = cupy.asarray(rng.standard_normal((4, 16, 32, 32), dtype=np.float32))
    w = cupy.asarray(rng.standard_normal((32, 16, 3, 3), dtype=np.float32))
    algos.cache_clear()
    y1 = conv_forward(x, w, padding=1)
    with config(algo_search="exhaustive"):
        y2 = conv_forward(x, w, padding=1)
    # Each against the float64 reference: the two may be different algorithms (Winograd's error is a few 1e-6).
    ref = ref_conv_forward(cupy.asnumpy(x).astype(np.float64), cupy.asnumpy(w).astype(np.float64), padding=1)
    for y in (y1, y2):
        assert _rel(cupy.asnumpy(y).astype(np.float64), ref) <= TOL["float32"]


@pytest.mark.gpu
def test_gpu_four_streams_give_the_serial_results(cudnn_api):
    import cupy

    rng = np.random.default_rng(2)
    jobs = []
    for c in (8, 16, 32, 64):
        jobs.append((cupy.asarray(rng.standard_normal((4, c, 28, 28), dtype=np.float32)),
                     cupy.asarray(rng.standard_normal((c, c, 3, 3), dtype=np.float32))))
    serial = [cupy.asnumpy(conv_forward(x, w, padding=1)) for x, w in jobs]
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in jobs]
    results = [None] * len(jobs)

    def work(i):
        with streams[i]:
            for _ in range(3):
                results[i] = conv_forward(*jobs[i], padding=1, stream=streams[i])
        streams[i].synchronize()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (x, w), got, want in zip(jobs, results, serial):
        np.testing.assert_allclose(cupy.asnumpy(got), want, rtol=1e-5, atol=1e-5)
        ref = ref_conv_forward(cupy.asnumpy(x).astype(np.float64), cupy.asnumpy(w).astype(np.float64), padding=1)
        assert _rel(cupy.asnumpy(got).astype(np.float64), ref) <= TOL["float32"]
