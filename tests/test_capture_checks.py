"""The capture checks that ask CUDA, without a GPU: the answers of CuPy and cuda-bindings (or of the capture query
itself) are a test's, the rest is the code that runs on a GPU."""

from __future__ import annotations

import pytest

from wsarena import algos
from wsarena._geometry import conv_geometry
from wsarena.arena import Arena, _capture, streams
from wsarena.arena._capture import CudaCapture, capture_of, refuse_in_capture
from wsarena.arena.testing import FakeStream, RecordingProvider
from wsarena.errors import CaptureError, CudaError, WsarenaError

S1 = 0x51
GEOM = conv_geometry((2, 4, 9, 9), (6, 4, 3, 3), padding=1)
INVALIDATED = "the stream was capturing, but an error has invalidated the capture sequence"  # CuPy's own words


@pytest.fixture
def cuda(monkeypatch):
    """CuPy's and cuda-bindings' capture queries, answering for a capture of S1 in ``cuda.status``."""
    import cupy
    from cuda.bindings import runtime as rt

    status = rt.cudaStreamCaptureStatus

    class Cuda:
        state = status.cudaStreamCaptureStatusNone

        @classmethod
        def is_capturing(cls, stream):  # as CuPy 14 answers: a bool, or a plain RuntimeError if invalidated
            if stream != S1 or cls.state == status.cudaStreamCaptureStatusNone:
                return False
            if cls.state == status.cudaStreamCaptureStatusInvalidated:
                raise RuntimeError(INVALIDATED)
            return True

        @classmethod
        def capture_info(cls, stream):  # the 7 values cuda-bindings 13 returns
            state = cls.state if stream == S1 else status.cudaStreamCaptureStatusNone
            return rt.cudaError_t.cudaSuccess, state, 7, "graph", [], [], 0

    monkeypatch.setattr(cupy.cuda.runtime, "streamIsCapturing", Cuda.is_capturing)
    monkeypatch.setattr(rt, "cudaStreamGetCaptureInfo", Cuda.capture_info)
    return Cuda


def test_an_invalidated_capture_is_a_capture_error_that_says_so(cuda):
    """CuPy's streamIsCapturing raises a plain RuntimeError for an invalidated capture. Once, that error escaped
    every lease and check on the stream, instead of the CaptureError that says what to do."""
    from cuda.bindings import runtime as rt

    assert capture_of(S1) is None
    cuda.state = rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusActive
    capture = capture_of(S1)
    assert capture is not None and (capture.id, capture.graph) == (7, "graph")
    cuda.state = rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusInvalidated
    with pytest.raises(CaptureError, match="capture on stream 0x51 was invalidated.*capture again"):
        capture_of(S1)
    with pytest.raises(CaptureError, match="invalidated"):
        refuse_in_capture(S1, "create this thread's cuDNN handle")
    provider = RecordingProvider(device_id=0)
    provider.capture = capture_of  # what the device providers answer
    arena = Arena(provider)
    with pytest.raises(CaptureError, match="invalidated"), arena.lease(1000, stream=S1):
        pass
    assert provider.allocations == [] and arena.stats().streams == {}


def test_a_zero_byte_workspace_on_an_invalidated_capture_is_the_capture_error_before_anything_runs(cuda, monkeypatch):
    """A call whose algorithm takes no workspace (cap 0, or the heuristics' first choice) leases zero bytes: on a
    stream whose capture was invalidated it gets the CaptureError that says what to do, before its kernels are
    enqueued, as a call that takes workspace does. Once, a zero-byte lease asked nothing, and cuDNN's launch on the
    invalidated stream failed with an error of its own."""
    from cuda.bindings import runtime as rt

    from wsarena.algos import run_with_fallback
    from wsarena.backends import Candidate

    provider = RecordingProvider(device_id=0)
    provider.capture = capture_of  # what the device providers answer
    arena = Arena(provider)
    cuda.state = rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusInvalidated
    ran = []
    with pytest.raises(CaptureError, match="capture on stream 0x51 was invalidated.*capture again"):
        run_with_fallback(arena, (Candidate("implicit_gemm", 0),), ran.append, stream=S1, cap=None)
    assert ran == [] and provider.allocations == [] and arena.stats().streams == {}
    # A capture under way: zero bytes, and the graph's pin (what the call ties its plan to), which pins no buffer
    cuda.state = rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusActive
    retained = []
    monkeypatch.setattr(CudaCapture, "retain", lambda capture, pin: retained.append((capture.graph, pin)))
    with arena.lease(0, stream=S1) as ws:
        assert ws.ptr == 0 and retained == [("graph", ws.pin)]
    assert list(arena._table.captures) == [7] and arena.stats().pinned_bytes == 0


def test_a_zero_byte_workspace_on_the_legacy_stream_while_another_is_captured_is_the_capture_error():
    """The legacy default stream cannot be used while a blocking stream of the device is captured (CUDA refuses even
    the question, and a kernel enqueued there would invalidate that capture): a zero-byte lease there is refused as
    any lease is."""

    def capture(stream):  # as capture_of answers: the refusal for the legacy stream, no capture elsewhere
        if stream == 0:
            raise CaptureError("the legacy default stream (0) cannot be used while another stream is captured")

    provider = RecordingProvider(device_id=0)
    provider.capture = capture
    arena = Arena(provider)
    with pytest.raises(CaptureError, match="legacy default stream"), arena.lease(0, stream=0):
        pass
    with arena.lease(0, stream=S1) as ws:  # another stream is usable
        assert ws.ptr == 0 and ws.nbytes == 0


def test_a_plain_runtime_error_of_a_stream_not_captured_is_cupys_own(cuda, monkeypatch):
    import cupy

    def refuse(stream):
        raise RuntimeError("something else")

    monkeypatch.setattr(cupy.cuda.runtime, "streamIsCapturing", refuse)
    with pytest.raises(RuntimeError, match="something else"):
        capture_of(S1)


@pytest.fixture
def captured(monkeypatch):
    """S1 is being captured, and it is CuPy's current stream, as inside ``with wsarena.capture(s)``."""
    monkeypatch.setattr(_capture, "capture_of", lambda stream: object() if stream == S1 else None)
    monkeypatch.setattr(streams, "_cupy_current", lambda: FakeStream(S1))


def test_a_forced_algorithm_creates_no_cudnn_handle_during_capture(monkeypatch, captured):
    """A forced algorithm's workspace size is asked outside any lease, with no stream: a thread with no handle yet
    would create one during the capture. Once, only calls given their stream were refused."""
    from wsarena import cudnn
    from wsarena.backends._cudnn_backend import CudnnBackend

    backend = CudnnBackend()
    made = []
    monkeypatch.setattr(backend, "_device", lambda: 0)
    monkeypatch.setattr(cudnn, "has_handle", lambda device: False)
    monkeypatch.setattr(cudnn, "get_handle", made.append)
    with pytest.raises(CaptureError, match="create this thread's cuDNN handle.*on this thread"):
        algos.forced(backend, "fwd", GEOM, "implicit_gemm", cap=None)
    assert made == []


def test_a_forced_engine_finalizes_no_plan_during_capture(monkeypatch, captured):
    from wsarena.backends._cudnn_graph import CudnnGraphBackend
    from wsarena.backends._graph_plans import PlanCache

    class Plan:
        numerical_notes = frozenset()

        def __init__(self, name):
            self.name, self.closed, self.workspace_bytes = name, False, 4096

    backend = CudnnGraphBackend()
    built = []
    monkeypatch.setattr(backend, "_handle", lambda stream=None: "handle")
    backend._plans = PlanCache(lambda *args: Plan("graph"),
                               lambda handle, graph, name: built.append(name) or Plan(name))
    with pytest.raises(CaptureError, match="finalize a cuDNN execution plan"):
        algos.forced(backend, "fwd", GEOM, "eng0", cap=None)
    assert built == []
    monkeypatch.setattr(_capture, "capture_of", lambda stream: None)  # the capture is over
    assert algos.forced(backend, "fwd", GEOM, "eng0", cap=None)[0].workspace_bytes == 4096 and built == ["eng0"]


def test_the_probe_for_element_aligned_operands_finalizes_nothing_during_capture(monkeypatch, captured):
    """The configuration for views aligned only to their element size is probed outside the plan cache, so the
    cache's own refusal does not cover it."""
    from wsarena.backends._cudnn_graph import CudnnGraphBackend

    backend = CudnnGraphBackend()
    built = []
    monkeypatch.setattr(backend, "_build_graph", lambda *args: built.append("graph"))
    monkeypatch.setattr(backend, "_build_plan", lambda handle, graph, name: built.append(name))
    with pytest.raises(CaptureError, match="finalize a cuDNN execution plan"):
        backend._general("handle", "fwd", GEOM, ["eng0"])
    assert built == []


def test_cudnn_9_1_finalizes_no_plan_to_size_a_configuration_during_capture(monkeypatch, captured):
    """cuDNN 9.0 and 9.1 have no ENGINECFG_WORKSPACE_SIZE: ranking a geometry's configurations finalizes a plan for
    each to read its size (graph.config_workspace), outside the plan cache and its refusal. During a capture none
    is finalized: the call is refused before, as one whose plan is not cached is."""
    import dataclasses

    from wsarena.backends._cudnn_graph import CudnnGraphBackend
    from wsarena.backends._graph_plans import PlanCache
    from wsarena.cudnn import _library, graph

    backend = CudnnGraphBackend()
    monkeypatch.setattr(_library, "_loaded", dataclasses.replace(_library.load_library(), version=90100))
    monkeypatch.setattr(backend, "_handle", lambda stream=None: "handle")
    made = []
    backend._plans = PlanCache(lambda *args: "graph", lambda handle, graph, name: made.append(name))
    monkeypatch.setattr(graph, "engine_configs", lambda op_graph, mode, properties=None: ["cfg"])
    monkeypatch.setattr(graph, "config_name", lambda cfg: "eng0")
    monkeypatch.setattr(graph, "engine_notes", lambda cfg: (frozenset(), frozenset()))

    class Descriptor:  # what graph.config_workspace creates its plan with
        def __init__(self, kind):
            made.append(kind)
            raise AssertionError(f"{kind.name} created during the capture")

    monkeypatch.setattr(graph, "BackendDescriptor", Descriptor)
    with pytest.raises(CaptureError, match="finalize a cuDNN execution plan"):
        backend.candidates("fwd", GEOM)
    assert made == []


def test_a_pin_cuda_never_took_reads_released_and_its_semaphore_is_freed(monkeypatch):
    """cudaUserObjectCreate fails: no graph holds the pin, and CUDA will never post it. It reads as released (nothing
    is kept for it) and its semaphore is freed with it. Once, it stayed live, so the semaphore was never freed. The
    failure is a ``wsarena.CudaError``, a ``WsarenaError`` and a ``RuntimeError``, naming the call and CUDA's error."""
    import gc

    from cuda.bindings import runtime as rt

    from wsarena.arena import _pins

    gc.collect()  # other tests' pins go now, not under the patch below
    _pins.free_posted()
    frees = []
    monkeypatch.setattr(_pins, "_free", frees.append)  # never freed for real here: a test pin
    monkeypatch.setattr(_pins, "_unposted", {})  # those of other tests' pins are theirs
    monkeypatch.setattr(rt, "cudaUserObjectCreate", lambda *args: (rt.cudaError_t.cudaErrorMemoryAllocation, None))
    pin = _pins.GraphPin()
    address = pin.address
    with pytest.raises(WsarenaError, match="cudaUserObjectCreate failed: cudaErrorMemoryAllocation") as caught:
        _capture.CudaCapture(7, "graph").retain(pin)
    assert type(caught.value) is CudaError and isinstance(caught.value, RuntimeError)  # once a plain RuntimeError
    assert not pin.live()
    del pin, caught  # its traceback holds the pin too
    gc.collect()
    _pins.free_posted()  # what the next pin made, or an arena closed, runs
    assert frees == [address]


def test_the_legacy_stream_beside_a_capture_is_a_capture_error_and_other_cuda_errors_pass_through(cuda, monkeypatch):
    """CuPy's streamIsCapturing raises cudaErrorStreamCaptureImplicit (906) for the legacy default stream while another
    stream of the device is captured: that is the CaptureError that says which stream to pass. Any other CUDA error
    of the question is CuPy's own."""
    import cupy

    runtime = cupy.cuda.runtime
    status = []

    def refuse(stream):
        raise runtime.CUDARuntimeError(status[0])

    monkeypatch.setattr(runtime, "streamIsCapturing", refuse)
    status.append(906)
    with pytest.raises(CaptureError, match=r"legacy default stream \(0\) cannot be used .*pass the capturing stream"):
        capture_of(0)
    status[0] = 400  # cudaErrorInvalidResourceHandle
    with pytest.raises(runtime.CUDARuntimeError) as caught:
        capture_of(S1)
    assert caught.value.status == 400 and not isinstance(caught.value, CaptureError)


def test_a_failed_capture_info_query_is_a_cuda_error(cuda, monkeypatch):
    """cudaStreamGetCaptureInfo fails: a ``wsarena.CudaError`` naming the call and CUDA's error, not an answer made
    of what it returned with the error."""
    from cuda.bindings import runtime as rt

    cuda.state = rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusActive
    monkeypatch.setattr(
        rt, "cudaStreamGetCaptureInfo",
        lambda stream: (rt.cudaError_t.cudaErrorInvalidValue, cuda.state, 7, "graph", [], [], 0),
    )
    with pytest.raises(CudaError, match="cudaStreamGetCaptureInfo failed: cudaErrorInvalidValue"):
        capture_of(S1)


@pytest.mark.parametrize("fails", [False, True], ids=["held", "refused"])
def test_a_pin_the_graph_refuses_to_retain_is_released_and_its_error_named(monkeypatch, fails):
    """cudaGraphRetainUserObject fails: the user object made for the pin is released (its one reference: CUDA runs
    the destructor, and the pin reads as released) and the failure is a ``wsarena.CudaError`` naming the call.
    Retained, the object's one reference is the graph's: nothing is released."""
    import gc

    from cuda.bindings import runtime as rt

    from wsarena.arena import _pins

    gc.collect()  # other tests' pins go now, not under the patch below
    _pins.free_posted()
    monkeypatch.setattr(_pins, "_free", lambda address: None)  # never freed for real here: a test pin
    monkeypatch.setattr(_pins, "_unposted", {})  # those of other tests' pins are theirs
    pin = _pins.GraphPin()
    released = []

    def release(obj, count):
        released.append((obj, count))
        return (rt.cudaError_t.cudaSuccess,)

    error = rt.cudaError_t.cudaErrorInvalidValue if fails else rt.cudaError_t.cudaSuccess
    calls = []

    def create(address, destroy, count, flags):
        calls.append(("create", address, count, flags))
        return rt.cudaError_t.cudaSuccess, "object"

    def retain(graph, obj, count, flags):
        calls.append(("retain", graph, obj, count, flags))
        return (error,)

    monkeypatch.setattr(rt, "cudaUserObjectCreate", create)
    monkeypatch.setattr(rt, "cudaGraphRetainUserObject", retain)
    monkeypatch.setattr(rt, "cudaUserObjectRelease", release)
    if fails:
        with pytest.raises(CudaError, match="cudaGraphRetainUserObject failed: cudaErrorInvalidValue"):
            _capture.CudaCapture(7, "graph").retain(pin)
        assert released == [("object", 1)]
    else:
        _capture.CudaCapture(7, "graph").retain(pin)
        assert released == []
    # one reference, made with the object and moved to the graph: the graph's destruction runs the destructor
    assert calls == [
        ("create", pin.address, 1, rt.cudaUserObjectFlags.cudaUserObjectNoDestructorSync),
        ("retain", "graph", "object", 1, rt.cudaUserObjectRetainFlags.cudaGraphUserObjectMove),
    ]
    pin.never_held()  # a test pin: posted here, so that it is let go as a released one is
    del pin
    gc.collect()
    _pins.free_posted()
