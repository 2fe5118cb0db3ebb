"""The cuDNN backends' device path without a GPU, on tests/device_calls.py's stand-in for CuPy, the CUDA runtime and
libcudnn: which device and stream a call runs on, what it leaves current, and how many CUDA calls a cached call makes
(what bench/bench_device_calls.py prints)."""

from __future__ import annotations

import contextlib
import functools
import sys
import threading

import pytest

import wsarena

from .device_calls import (
    GET_DEVICE,
    IS_CAPTURING,
    SET_DEVICE,
    CudaArray,
    CUDARuntimeError,
    _tensor_type,
    cuda_tensor,
    fake_gpu,
    torch_cuda,
)

X, W, Y = (2, 4, 8, 8), (6, 4, 3, 3), (2, 6, 8, 8)
CONVOLUTIONS = ("cudnnBackendExecute", "cudnnConvolutionForward", "cudnnConvolutionBackwardData",
                "cudnnConvolutionBackwardFilter")


@pytest.fixture(params=["graph", "legacy"])
def gpu(request):
    with fake_gpu() as gpu, wsarena.config(cudnn_api=request.param, backend="cudnn"):
        gpu.api = request.param
        yield gpu


def _calls(gpu, device=0, out=True):
    """Each pass's call on CuPy operands of ``device``, with ``out=`` or without."""
    return _calls_on(gpu, lambda gpu, shape, device: gpu.cupy.array(shape, device=device), device, out)


def _calls_on(gpu, make, device=0, out=True):
    """Each pass's call on operands ``make(gpu, shape, device)``, with ``out=`` or without."""
    x, w, dy = (make(gpu, shape, device) for shape in (X, W, Y))
    outs = {"fwd": make(gpu, Y, device), "bwd_data": make(gpu, X, device), "bwd_filter": make(gpu, W, device)}

    def kw(pass_, stream):
        return {"padding": 1, "stream": stream, **({"out": outs[pass_]} if out else {})}

    return {
        "fwd": lambda stream=None: wsarena.conv_forward(x, w, **kw("fwd", stream)),
        "bwd_data": lambda stream=None: wsarena.conv_backward_data(dy, w, X, **kw("bwd_data", stream)),
        "bwd_filter": lambda stream=None: wsarena.conv_backward_filter(x, dy, W, **kw("bwd_filter", stream)),
    }


def _ran(gpu):
    """(handle, device it was made on) of each convolution cuDNN was given, in order."""
    made = {args[0]: args[1] for name, args in gpu.record.log if name == "cudnnCreate"}
    return [(args[0], made[args[0]]) for name, args in gpu.record.log if name in CONVOLUTIONS]


def _bound(gpu):
    """The streams the handles were bound to, in order."""
    return [args[1] for name, args in gpu.record.log if name == "cudnnSetStream"]


@pytest.mark.parametrize("out", [True, False])
def test_a_cached_call_asks_the_current_device_once_and_sets_none(gpu, out):
    """The operands' device is current already: it is asked once (where CuPy's Device asks as it enters and sets it
    again as it leaves, and the call asked again for its algorithm's key, its arena and its handle: four asked, one
    set), and the stream's capture is asked once, by the lease. Each pass runs one convolution."""
    for pass_, call in _calls(gpu, out=out).items():
        call()
        gpu.record.clear()
        call()
        calls = gpu.calls
        assert (calls[GET_DEVICE], calls[SET_DEVICE], calls[IS_CAPTURING]) == (1, 0, 1), (pass_, dict(calls))
        assert sum(calls[name] for name in CONVOLUTIONS) == 1 and calls["cudnnSetStream"] == 0
        assert gpu.current_device() == 0


@pytest.mark.filterwarnings("ignore::wsarena.WorkspaceCapWarning")  # the cap leaves out the first candidate
def test_a_call_on_a_zero_byte_lease_binds_its_handle_to_the_leases_stream_resolved_once(gpu):
    """An algorithm that takes no workspace (cap_workspace=0) leases zero bytes, which carry the stream the lease
    resolved: CuPy's current stream is read once a call (where the handle's binding read it again, asking the current
    device for it), and the handle follows it from call to call."""
    side = gpu.cupy.cuda.Stream(0x5000, 0)
    with wsarena.config(cap_workspace=0):
        for call in _calls(gpu).values():
            call()
            gpu.record.clear()
            call()
            assert (gpu.calls["cupy.cuda.get_current_stream"], gpu.calls[GET_DEVICE]) == (1, 1), dict(gpu.calls)
            with side:
                call()
            call()
            assert _bound(gpu) == [0x5000, 0]
    assert wsarena.get_arena(0).stats().streams == {}  # nothing leased


def test_a_call_on_another_devices_operands_runs_there_and_restores_the_current_device(gpu):
    """Operands on device 1, device 0 current: the call makes 1 current, runs on device 1's handle and leases from
    device 1's arena, and leaves 0 current, also when cuDNN refuses the call."""
    for call in _calls(gpu, device=1).values():
        call()
        assert gpu.current_device() == 0
        mark = len(gpu.record.log)
        call()
        assert [args[0] for name, args in gpu.record.log[mark:] if name == SET_DEVICE] == [1, 0]
    assert gpu.current_device() == 0
    _ran_on_device_1_and_refused_there(gpu, _calls(gpu, device=1)["fwd"])


def _ran_on_device_1_and_refused_there(gpu, forward):
    """The calls so far ran on device 1's handle and arena alone; ``forward`` (on device 1's operands), refused by
    cuDNN, leaves device 0 current."""
    assert {device for _, device in _ran(gpu)} == {1}
    assert wsarena.get_arena(1).stats().high_water_bytes > 0 and wsarena.get_arena(0).stats().high_water_bytes == 0
    from wsarena.cudnn import _prototypes

    name = "cudnnBackendExecute" if gpu.api == "graph" else "cudnnConvolutionForward"
    _prototypes._bound[name] = lambda *args: 3  # BAD_PARAM
    with pytest.raises(wsarena.cudnn.CudnnError):
        forward()
    assert gpu.current_device() == 0


def test_each_thread_runs_on_its_own_current_device_and_handle(gpu):
    """A thread whose current device is 1 calls on device 1's operands as this thread calls on device 0's: each runs
    on its own handle of its own device, and neither changes the other's current device."""
    calls = {device: _calls(gpu, device=device) for device in (0, 1)}
    ran = {}

    def worker():
        gpu.cupy.cuda.runtime.setDevice(1)
        for call in calls[1].values():
            call()
        ran["worker"] = gpu.current_device()

    for call in calls[0].values():
        call()
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    for call in calls[0].values():
        call()
    assert ran["worker"] == 1 and gpu.current_device() == 0
    handles = _ran(gpu)
    assert [device for _, device in handles] == [0] * 3 + [1] * 3 + [0] * 3
    assert len({handle for handle, _ in handles}) == 2  # one per thread and device


def test_a_side_stream_is_entered_for_the_call_and_bound_to_the_handle(gpu):
    """``stream=s``, a stream that is not CuPy's current one: the call enters it (what it allocates goes on it), binds
    the handle to it and leases from its sub-arena, and leaves CuPy's current stream as it was."""
    side = gpu.cupy.cuda.Stream(0x5000, 0)
    _calls(gpu)["fwd"](side)
    assert _bound(gpu) == [0x5000]
    for call in _calls(gpu).values():
        call(side)
        gpu.record.clear()
        call(side)
        assert [args for name, args in gpu.record.log if name == "cupy.cuda.Stream.__enter__"] == [(0x5000,)]
        assert gpu.cupy.cuda.get_current_stream(0).ptr == 0
    assert set(wsarena.get_arena(0).stats().streams) == {0x5000}


def test_a_cupy_external_stream_is_entered_through_an_object_of_the_calls_own(gpu):
    """``stream=`` CuPy's (deprecated) ``ExternalStream``, which is no ``Stream``: the call enters an object of its own
    over its handle (``Stream.from_external``), as for any other library's stream, and runs on it; CuPy's current
    stream is as it was after it."""
    external = gpu.cupy.cuda.ExternalStream(0x5000, 0)
    assert not isinstance(external, gpu.cupy.cuda.Stream)
    for call in _calls(gpu).values():
        call(external)
        mark = len(gpu.record.log)
        call(external)
        log = gpu.record.log[mark:]
        assert [name for name, _ in log].count("cupy.cuda.Stream.from_external") == 1
        assert [args for name, args in log if name == "cupy.cuda.Stream.__enter__"] == [(0x5000,)]
        assert gpu.cupy.cuda.get_current_stream(0).ptr == 0
    assert set(_bound(gpu)) == {0x5000}


def test_a_stream_current_already_is_not_entered_again(gpu):
    """``with s: conv(..., stream=s)``, s given as CuPy's object, its raw handle or another library's object over it:
    CuPy's current stream on the operands' device already, so the call enters nothing (entering asked the current
    device twice and leaving it once more), and runs on it all the same: the handle bound to it, the lease its."""
    from wsarena.arena.testing import FakeStream

    side = gpu.cupy.cuda.Stream(0x5000, 0)
    for given in (side, 0x5000, FakeStream(0x5000)):
        with side:
            for call in _calls(gpu).values():
                call(given)
                mark = len(gpu.record.log)
                call(given)
                entered = [name for name, _ in gpu.record.log[mark:] if name.startswith("cupy.cuda.Stream")]
                assert entered == [] and gpu.record.log[mark:].count((GET_DEVICE, ())) == 1
                assert gpu.cupy.cuda.get_current_stream(0) is side
        assert gpu.cupy.cuda.get_current_stream(0).ptr == 0
    assert _bound(gpu) == [0x5000]
    assert set(wsarena.get_arena(0).stats().streams) == {0x5000}



def test_the_stand_ins_device_and_stream_stacks_are_two_as_cupys_are():
    """CuPy keeps its Device stack (device.pyx) apart from the devices its streams went on (stream.pyx), so a Device
    left before a stream entered within it is left as entered, and the stream after it comes off its own device's
    stack, CuPy then making the null stream it goes back to the current one of the device current then (device 0),
    its own device's current stream staying the stream left: what the interop's scope sets the device back for. (One
    stack for both, the Device's exit took the stream's entry and set no device CUDA has.)"""
    with fake_gpu() as gpu:
        cuda = gpu.cupy.cuda
        device, stream = cuda.Device(1), cuda.Stream(0x5000, 1)
        device.__enter__()
        stream.__enter__()
        device.__exit__(None, None, None)
        assert gpu.current_device() == 0 and cuda.get_current_stream(1) is stream
        stream.__exit__(None, None, None)
        thread = gpu.cupy.thread()
        assert thread.entered == [] and [[s.ptr for s in stack] for stack in thread.streams] == [[0], [0]]
        assert [cuda.get_current_stream(d).ptr for d in (0, 1)] == [0, 0x5000]


@pytest.mark.parametrize("where", ["device", "stream", "stream, device current", "device refused"])
def test_a_scope_interrupted_or_refused_as_it_enters_leaves_what_it_entered(where):
    """CPython raises a Ctrl-C's KeyboardInterrupt as a call returns: on the heels of CuPy's Device or Stream
    ``__enter__``, done, the ops' scope raises with no ``__exit__`` to run. It leaves what was entered: the current
    device, CuPy's device and stream stacks and the backends' device are as they were before it. So does a device
    that cudaSetDevice refuses, which CuPy's Device pushed before it tried."""
    from wsarena.backends._cudnn_backend import _OnDevice, _within

    with fake_gpu() as gpu:
        cuda = gpu.cupy.cuda

        class Device(cuda.Device):
            def __enter__(self):
                super().__enter__()
                if where == "device":
                    raise KeyboardInterrupt

        class Stream(cuda.Stream):
            def __enter__(self):
                super().__enter__()
                raise KeyboardInterrupt

        device = {"stream, device current": 0, "device refused": 5}.get(where, 1)
        stream = None if where.startswith("device") else Stream(0x5000, device)
        raised = CUDARuntimeError if where == "device refused" else KeyboardInterrupt
        with pytest.raises(raised), _OnDevice(cuda, Device(device), stream):
            pass
        thread = gpu.cupy.thread()
        assert gpu.current_device() == 0 and thread.entered == []
        assert [[s.ptr for s in stack] for stack in thread.streams] == [[0], [0]]
        assert getattr(_within, "device", None) is None


@pytest.mark.parametrize("outer", [None, 1])
@pytest.mark.parametrize("scope", ["_OnDevice", "_OnDeviceEntered"])
def test_a_scope_whose_device_cudagetdevice_refuses_to_enter_leaves_cupys_device_stack_alone(scope, outer):
    """CuPy's Device asks cudaGetDevice before it pushes the device it goes back to: where that raises (an error of an
    earlier asynchronous launch, which CUDA reports through any call), it pushed nothing, and the scope leaves nothing
    of it. Within CuPy's Device of device 1, that Device's entry stays its own, and it goes back to device 0; with
    none, CuPy's stack stays empty; either way the error of CUDA's is what comes out. (The scope left the Device as
    though it had pushed: it popped the enclosing Device's entry, whose exit then found the stack empty, or found it
    empty itself, and an IndexError came out in place of CUDA's error.)"""
    from wsarena.arena import _scopes

    with fake_gpu() as gpu:
        cuda = gpu.cupy.cuda
        error = CUDARuntimeError(719)  # cudaErrorLaunchFailure
        with contextlib.ExitStack() as stack:
            if outer is not None:
                stack.enter_context(cuda.Device(outer))
            # on a device other than the current one, which _OnDevice asks cudaGetDevice for itself first
            entered = getattr(_scopes, scope)(cuda, cuda.Device(1 - gpu.current_device()), None)
            gpu.cupy.reported[:] = [error] if scope == "_OnDeviceEntered" else [None, error]
            with pytest.raises(CUDARuntimeError) as info, entered:
                pytest.fail("entered")
            assert info.value is error and gpu.cupy.reported == []
            assert gpu.current_device() == (0 if outer is None else outer)
            assert gpu.cupy.thread().entered == ([] if outer is None else [0])
        assert gpu.current_device() == 0 and gpu.cupy.thread().entered == []
        assert getattr(_scopes._within, "device", None) is None


@pytest.mark.parametrize("outer", [None, 0x6000])
@pytest.mark.parametrize("scope", ["_OnDevice", "_OnDeviceEntered"])
def test_a_scope_whose_stream_pushed_but_not_made_current_leaves_cupys_stream_stack(scope, outer):
    """CuPy's stream pushes itself and its device before it makes itself current, which for a stream tied to no
    device (``Stream.from_external``'s) asks cudaGetDevice again: where that raises, the stream is on CuPy's stack
    though not current, and the scope leaves it there too. CuPy's stacks are as before, an enclosing stream the
    current one, and its exit goes back to the null stream; CUDA's error is what comes out. (Left only where current,
    the stream stayed on the stack, and the enclosing stream's exit took its entry and left that stream current.)"""
    from wsarena.arena import _scopes

    with fake_gpu() as gpu:
        cuda = gpu.cupy.cuda
        thread = gpu.cupy.thread()
        error = CUDARuntimeError(719)  # cudaErrorLaunchFailure
        with contextlib.ExitStack() as stack:
            stack.enter_context(cuda.Device(1))
            if outer is not None:
                stack.enter_context(cuda.Stream(outer, 1))
            before = ([list(entries) for entries in thread.streams], list(thread.entered), list(thread.current))
            # device 1 current, which _OnDevice asks for and so does not enter, where _OnDeviceEntered's Device asks
            # for it as it enters; then the stream asks as it enters and again as it is made current
            entered = getattr(_scopes, scope)(cuda, cuda.Device(1), cuda.Stream(0x5000, -1))
            gpu.cupy.reported[:] = [None, None, error]
            with pytest.raises(CUDARuntimeError) as info, entered:
                pytest.fail("entered")
            assert info.value is error and gpu.cupy.reported == []
            assert ([list(entries) for entries in thread.streams], thread.entered, thread.current) == before
            assert gpu.current_device() == 1 and cuda.get_current_stream(1).ptr == (outer or 0)
        assert gpu.current_device() == 0 and thread.entered == []
        assert [[s.ptr for s in entries] for entries in thread.streams] == [[0], [0]]
        assert [cuda.get_current_stream(d).ptr for d in (0, 1)] == [0, 0]
        assert getattr(_scopes._within, "device", None) is None


# -- operands of other libraries, through wsarena._interop ------------------------------------------------------------
@pytest.fixture
def torch_gpu(gpu):
    pytest.importorskip("torch")
    with torch_cuda(gpu):
        yield gpu


def _cuda_array(gpu, shape, device):
    return CudaArray(gpu.cupy.array(shape, device=device))


def _entered(gpu, mark=0):
    return [name for name, _ in gpu.record.log[mark:] if name.startswith(("cupy.cuda.Device.", "cupy.cuda.Stream.__"))]


@pytest.mark.parametrize("out", [True, False])
def test_torch_operands_on_torchs_default_stream_ask_the_current_device_once_and_enter_nothing(torch_gpu, out):
    """CUDA tensors, stream=None (as wsarena.torch's operators call): PyTorch's current stream, its default one, is
    CuPy's current stream already and the tensors' device the current one, so the call enters neither (where the
    interop entered CuPy's Device, asking the device and setting it again as it left, and a CuPy object over the
    null stream, asking the device three times, and the ops asked once more: five asked, one set). It runs on that
    stream, with PyTorch's current stream asked once; with out= it returns out, written (its version bumped), else
    the result through torch.from_dlpack, whose CuPy export asks the current device once more (for CuPy's current
    stream, which is PyTorch's, so that no event orders one after the other)."""
    gpu = torch_gpu
    for pass_, call in _calls_on(gpu, cuda_tensor, out=out).items():
        call()
        gpu.record.clear()
        result = call()
        calls = gpu.calls
        asked = 1 if out else 2
        assert (calls[GET_DEVICE], calls[SET_DEVICE], calls[IS_CAPTURING]) == (asked, 0, 1), (pass_, dict(calls))
        assert calls["cudaEventRecord"] == calls["cudaStreamWaitEvent"] == 0
        assert _entered(gpu) == [] and calls["torch._C._cuda_getCurrentRawStream"] == 1
        assert sum(calls[name] for name in CONVOLUTIONS) == 1
        assert gpu.current_device() == 0 and gpu.cupy.thread().entered == []
        if out:
            assert result._version > 0
        else:
            assert calls["torch.from_dlpack"] == 1  # the result in PyTorch's library
    assert set(wsarena.get_arena(0).stats().streams) == {0}


def test_torch_operands_follow_torchs_current_stream_from_call_to_call(torch_gpu):
    """PyTorch's current stream switched between calls (``with torch.cuda.stream(s):``): each call runs on the one
    current as it is made, entered as CuPy's current stream for the call (a CuPy object made for it) where it is not
    CuPy's current one already, and left after; the device is asked once, never set."""
    gpu = torch_gpu
    calls = _calls_on(gpu, cuda_tensor)
    for handle in (0x6000, 0, 0x7000, 0x6000):
        gpu.torch_stream = handle
        for call in calls.values():
            call()
            mark = len(gpu.record.log)
            call()
            log = gpu.record.log[mark:]
            side = handle != 0
            assert _entered(gpu, mark) == (["cupy.cuda.Stream.__enter__", "cupy.cuda.Stream.__exit__"] if side else [])
            assert [args[0] for name, args in log if name == "cupy.cuda.Stream.__enter__"] == ([handle] if side else [])
            assert log.count((SET_DEVICE, (0,))) == 0 and gpu.cupy.cuda.get_current_stream(0).ptr == 0
    assert _bound(gpu) == [0x6000, 0, 0x7000, 0x6000]
    assert set(wsarena.get_arena(0).stats().streams) == {0, 0x6000, 0x7000}


@pytest.mark.parametrize("make", ["CuPy's", "PyTorch's"])
def test_device_operands_with_the_cpu_backend_configured_are_refused_by_their_memory(gpu, make):
    # PyTorch's CUDA tensors were "CuPy" arrays, told to be NumPy's, where host tensors would do
    if make != "CuPy's":
        pytest.importorskip("torch")
    made = (lambda gpu, shape, device: gpu.cupy.array(shape, device=device)) if make == "CuPy's" else cuda_tensor
    with torch_cuda(gpu) if make != "CuPy's" else contextlib.nullcontext(), wsarena.config(backend="cpu"):
        for call in _calls_on(gpu, made).values():
            with pytest.raises(TypeError) as info:
                call()
            assert str(info.value) == ("backend='cpu' is configured but the arrays are on a CUDA device; pass arrays "
                                       "in host memory (NumPy's, or another library's) or configure backend='auto'")
    assert not any(name in CONVOLUTIONS for name, _ in gpu.record.log)


def test_a_cupy_stream_given_with_torch_operands_is_entered_as_it_is(torch_gpu):
    """``stream=s``, a CuPy stream that is not CuPy's current one, with tensors: the interop's scope enters the
    caller's object, as the ops' scope enters it with CuPy operands (one choice of both), where it made a CuPy object
    of its own over s's handle, tied to no device, whose entry asked the current device once more. The ops' scope
    inside finds it current and enters nothing; the call runs on it and leaves CuPy's current stream as it was."""
    gpu = torch_gpu
    side = gpu.cupy.cuda.Stream(0x5000, 0)
    for call in _calls_on(gpu, cuda_tensor).values():
        call(side)
        mark = len(gpu.record.log)
        call(side)
        log = gpu.record.log[mark:]
        made = [name for name, _ in log if name == "cupy.cuda.Stream.from_external"]
        assert made == [] and _entered(gpu, mark) == ["cupy.cuda.Stream.__enter__", "cupy.cuda.Stream.__exit__"]
        assert gpu.cupy.cuda.get_current_stream(0).ptr == 0
    assert set(_bound(gpu)) == {0x5000}


def test_a_result_goes_back_to_torch_on_the_stream_it_was_computed_on(torch_gpu):
    """Without out=, on a side stream PyTorch's current (on device 1 while 0 is current, too): the result is handed
    to torch.from_dlpack within the call's scope, where CuPy's current stream is PyTorch's, so that CuPy's export
    orders nothing (no event recorded, none waited on) and asks its current stream of the result's device."""
    gpu = torch_gpu
    for device in (0, 1):
        for handle in (0x6000, 0):
            gpu.torch_stream = handle
            for call in _calls_on(gpu, cuda_tensor, device=device, out=False).values():
                call()
                gpu.record.clear()
                call()
                calls = gpu.calls
                assert calls["torch.from_dlpack"] == 1 and calls["cupy.ndarray.__dlpack__"] == 1
                assert calls["cudaEventRecord"] == calls["cudaStreamWaitEvent"] == 0, (device, handle, dict(calls))
                assert gpu.current_device() == 0


def test_torch_operands_on_another_device_run_there_and_the_current_device_is_restored(torch_gpu):
    """Tensors on device 1 while device 0 is current: the call makes 1 current once (the ops' scope inside knows it
    current and asks nothing), runs on device 1's handle and arena, on PyTorch's current stream of device 1 (not of
    the current device), and makes 0 current again, also where cuDNN refuses the call."""
    gpu = torch_gpu
    for call in _calls_on(gpu, cuda_tensor, device=1).values():
        call()
        mark = len(gpu.record.log)
        call()
        log = gpu.record.log[mark:]
        assert [args[0] for name, args in log if name == SET_DEVICE] == [1, 0]
        assert log.count((GET_DEVICE, ())) == 2  # the interop's, and CuPy's Device as it enters
        assert [args for name, args in log if name == "torch._C._cuda_getCurrentRawStream"] == [(1,)]
        assert gpu.current_device() == 0
    _ran_on_device_1_and_refused_there(gpu, _calls_on(gpu, cuda_tensor, device=1)["fwd"])
    assert gpu.cupy.thread().entered == []


def _beside_torchs(gpu, shape, device):
    """``x`` an array of another library's (``__cuda_array_interface__`` alone, which names no device), the rest
    tensors of ``device``: a call whose scope enters CuPy's Device whatever is current, as that library's code runs in
    it."""
    return _cuda_array(gpu, shape, device) if shape == X else cuda_tensor(gpu, shape, device)


@pytest.mark.parametrize("where", ["in the convolution", "as the device is entered", "as the stream is entered"])
@pytest.mark.parametrize("make", [cuda_tensor, _beside_torchs], ids=["torch's", "another library's beside torch's"])
def test_a_ctrl_c_in_a_call_on_torch_operands_leaves_the_device_and_streams_as_they_were(torch_gpu, monkeypatch,
                                                                                       where, make):
    """A KeyboardInterrupt in cuDNN's call, or on the heels of CuPy's Device or Stream ``__enter__`` (CPython raises
    it as a call returns), on tensors of device 1 on a side stream of PyTorch's, alone or beside another library's
    array: device 0 is current after it, CuPy's device and stream stacks as they were, and the backends' device
    unset."""
    from wsarena.backends._cudnn_backend import _within

    gpu = torch_gpu
    gpu.torch_stream = 0x6000
    calls = _calls_on(gpu, make, device=1)
    calls["fwd"]()
    cuda = gpu.cupy.cuda
    if where == "in the convolution":
        from wsarena.cudnn import _prototypes

        name = "cudnnBackendExecute" if gpu.api == "graph" else "cudnnConvolutionForward"

        def interrupted(*args):
            raise KeyboardInterrupt

        monkeypatch.setitem(_prototypes._bound, name, interrupted)
    else:
        entered = cuda.Device if where.endswith("device is entered") else cuda.Stream

        def enter(self, real=entered.__enter__):
            real(self)
            raise KeyboardInterrupt

        monkeypatch.setattr(entered, "__enter__", enter)
    try:
        with pytest.raises(KeyboardInterrupt):
            calls["fwd"]()
    finally:  # before the stand-in's own teardown, which enters devices
        monkeypatch.undo()
    thread = gpu.cupy.thread()
    assert gpu.current_device() == 0 and thread.entered == []
    assert [[s.ptr for s in stack] for stack in thread.streams] == [[0], [0]]
    assert getattr(_within, "device", None) is None


class _NamesDevice5:
    """A DLPack exporter of another library's that says its memory is on CUDA device 5, which the stand-in lacks."""

    def __dlpack__(self, **kwargs):
        pytest.fail("exported")

    def __dlpack_device__(self):
        return (2, 5)


def test_operands_on_a_device_cuda_refuses_leave_cupys_device_stack_as_it_was(gpu, monkeypatch):
    """Operands of another library's on a device cudaSetDevice refuses (cudaErrorInvalidDevice) though CUDA counts it
    (here the stand-in counts 6): CuPy's Device pushed the device it found before it tried, and is left as it raises,
    so that its stack is as it was (an entry left there is the device a later Device's exit makes current, in place of
    the one that Device found)."""
    monkeypatch.setattr(gpu.cupy.cuda.runtime, "getDeviceCount", lambda: 6)
    x, w = _NamesDevice5(), _NamesDevice5()
    with pytest.raises(CUDARuntimeError):
        wsarena.conv_forward(x, w, padding=1)
    assert gpu.current_device() == 0 and gpu.cupy.thread().entered == []


@pytest.mark.parametrize("stream", [None, "CuPy's stream", "a raw handle"])
def test_operands_on_a_device_cuda_does_not_have_are_refused_naming_the_device_and_the_count(gpu, stream):
    """Operands of another library's that say they are on CUDA device 5, where CUDA has 2: a ValueError that names
    both, before anything is entered, where ``stream=`` gave CuPy's IndexError (its list of devices indexed by 5) and
    no stream cudaSetDevice's refusal; CuPy's stacks and the current device are as they were."""
    given = {None: None, "CuPy's stream": gpu.cupy.cuda.Stream(0x5000, 0), "a raw handle": 0x5000}[stream]
    mark = len(gpu.record.log)
    with pytest.raises(ValueError, match=r"^x is a tests array on CUDA device 5, w is a tests "
                                         r"array on CUDA device 5; CUDA has no device 5 here: it counts 2 \(0 to 1\)$"):
        wsarena.conv_forward(_NamesDevice5(), _NamesDevice5(), padding=1, stream=given)
    assert _entered(gpu, mark) == [] and gpu.record.log[mark:].count(("cudaGetDeviceCount", ())) == 1
    thread = gpu.cupy.thread()
    assert gpu.current_device() == 0 and thread.entered == []
    assert [[s.ptr for s in stack] for stack in thread.streams] == [[0], [0]]


def test_operands_on_a_cuda_device_where_cuda_counts_none_are_refused_naming_the_count_0(gpu, monkeypatch):
    """CUDA counts no device (CUDA_VISIBLE_DEVICES="", no GPU) by cudaErrorNoDevice, which CuPy's getDeviceCount
    raises: operands that say they are on a CUDA device are the ValueError of a device past the count, 0, where
    CuPy's CUDARuntimeError came out; another error of CUDA's is CuPy's own."""
    def no_device():
        raise CUDARuntimeError(100)  # cudaErrorNoDevice

    monkeypatch.setattr(gpu.cupy.cuda.runtime, "getDeviceCount", no_device)
    with pytest.raises(ValueError, match=r"; CUDA has no device 5 here: it counts 0$"):
        wsarena.conv_forward(_NamesDevice5(), _NamesDevice5(), padding=1)

    def no_driver():
        raise CUDARuntimeError(35)  # cudaErrorInsufficientDriver

    monkeypatch.setattr(gpu.cupy.cuda.runtime, "getDeviceCount", no_driver)
    with pytest.raises(CUDARuntimeError) as info:
        wsarena.conv_forward(_NamesDevice5(), _NamesDevice5(), padding=1)
    assert info.value.status == 35
    assert gpu.current_device() == 0 and gpu.cupy.thread().entered == []


def test_cudas_device_count_is_asked_once_for_calls_on_devices_it_has(torch_gpu):
    """Calls on tensors of devices 0 and 1, of 2: CUDA's device count is asked by the first call on device 0 and by
    the first on device 1 at most, never by a later call."""
    gpu = torch_gpu
    for device in (0, 1, 0, 1):
        _calls_on(gpu, cuda_tensor, device=device)["fwd"]()
    assert 1 <= gpu.calls["cudaGetDeviceCount"] <= 2
    gpu.record.clear()
    for device in (0, 1):
        for call in _calls_on(gpu, cuda_tensor, device=device).values():
            call()
    assert gpu.calls["cudaGetDeviceCount"] == 0


def _unruly_operands(gpu, monkeypatch):
    """An array of another library's ("unrulyarrays", whose from_dlpack of the result makes device 1 current and
    leaves it so) and a tensor, both on device 0."""
    import types

    set_device = gpu.cupy.cuda.runtime.setDevice

    def from_dlpack(result):
        set_device(1)
        return result

    monkeypatch.setitem(sys.modules, "unrulyarrays", types.SimpleNamespace(from_dlpack=from_dlpack))
    Unruly = type("Unruly", (CudaArray,), {"__module__": "unrulyarrays"})
    return Unruly(gpu.cupy.array(X)), cuda_tensor(gpu, W)


def test_operands_of_another_library_beside_torchs_still_get_cupys_device_which_sets_the_device_back(torch_gpu,
                                                                                                      monkeypatch):
    """An array of another library's beside a tensor: the library's own code runs in the call (here its from_dlpack,
    which takes the result, makes device 1 current and leaves it so), and CuPy's Device is entered as before, which
    makes the device it found current again as it leaves; the ops ask the device again."""
    gpu = torch_gpu
    x, w = _unruly_operands(gpu, monkeypatch)
    wsarena.conv_forward(x, w, padding=1)
    assert gpu.current_device() == 0
    mark = len(gpu.record.log)
    wsarena.conv_forward(x, w, padding=1)
    assert _entered(gpu, mark) == ["cupy.cuda.Device.__enter__", "cupy.cuda.Device.__exit__"]
    assert gpu.record.log[mark:].count((GET_DEVICE, ())) == 2
    assert gpu.current_device() == 0 and gpu.cupy.thread().entered == []


@pytest.mark.parametrize("given", ["CuPy's stream", "a raw handle"])
def test_a_stream_given_beside_another_librarys_operands_is_left_on_its_device_whatever_that_library_did(
        torch_gpu, monkeypatch, given):
    """``stream=s`` with an array of another library's beside a tensor, whose code (its from_dlpack of the result)
    leaves device 1 current: s is left with device 0 current again, as CuPy sets the stream it goes back to as the
    current one of the device current then where that stream is tied to none (its null stream), so that CuPy's
    current stream of device 0 is its null stream after the call, not s, and device 1's is untouched."""
    gpu = torch_gpu
    x, w = _unruly_operands(gpu, monkeypatch)
    side = gpu.cupy.cuda.Stream(0x5000, 0)
    for _ in range(2):
        wsarena.conv_forward(x, w, padding=1, stream=side if given == "CuPy's stream" else 0x5000)
        assert gpu.current_device() == 0 and gpu.cupy.thread().entered == []
        assert [gpu.cupy.cuda.get_current_stream(device).ptr for device in (0, 1)] == [0, 0]
    assert set(_bound(gpu)) == {0x5000}


@functools.cache
def _hooked_tensor_type():
    """A CUDA tensor (the stand-in's) of a subclass whose own ``__torch_function__`` makes its ``leaves`` device current
    as ``data_ptr()`` or ``__dlpack__()`` is read, as a subclass's code may. (Made once: the interop keeps the types it
    has seen, and one made in a test, whose methods held the stand-in, would keep its arenas.)"""
    class Hooked(_tensor_type()):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("data_ptr", "__dlpack__"):
                args[0].leaves(1)
            return super().__torch_function__(func, types, args, kwargs or {})

    return Hooked


@pytest.mark.parametrize("stream", [None, "CuPy's stream"])
def test_a_tensor_subclass_whose_own_torch_function_leaves_another_device_current_gets_cupys_device(torch_gpu,
                                                                                                   stream):
    """A tensor of a subclass with a ``__torch_function__`` of its own, which leaves device 1 current as the interop
    reads its memory within the call: that is another library's code, so the call enters CuPy's Device, which sets
    device 0 current again as it leaves, and the ops ask the device again and run on device 0's handle. (Taken for
    PyTorch's own code, the ops took device 0 as current, the handle refused device 1, and device 1 stayed current.)"""
    gpu = torch_gpu
    x = cuda_tensor(gpu, X).as_subclass(_hooked_tensor_type())
    x.fake_device, x.record, x.leaves = 0, gpu.record, gpu.cupy.cuda.runtime.setDevice
    w, out = cuda_tensor(gpu, W), cuda_tensor(gpu, Y)
    side = gpu.cupy.cuda.Stream(0x5000, 0) if stream else None
    for _ in range(2):
        wsarena.conv_forward(x, w, padding=1, out=out, stream=side)
        assert gpu.current_device() == 0 and gpu.cupy.thread().entered == []
        assert [gpu.cupy.cuda.get_current_stream(device).ptr for device in (0, 1)] == [0, 0]
    assert {device for _, device in _ran(gpu)} == {0}


def test_tensors_within_a_torch_function_mode_that_leaves_another_device_current_get_cupys_device(torch_gpu):
    """Plain CUDA tensors within a torch-function mode, whose code runs as the interop reads their memory within the
    call (data_ptr()) and leaves device 1 current: as for a subclass's own ``__torch_function__``, the call enters
    CuPy's Device, which sets device 0 current again, and the ops ask the device again and run on device 0's handle."""
    from torch.overrides import TorchFunctionMode

    gpu = torch_gpu
    set_device = gpu.cupy.cuda.runtime.setDevice

    class LeavesDevice1(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("data_ptr", "__dlpack__"):
                set_device(1)
            return func(*args, **(kwargs or {}))

    x, w, out = cuda_tensor(gpu, X), cuda_tensor(gpu, W), cuda_tensor(gpu, Y)
    for _ in range(2):
        with LeavesDevice1():
            wsarena.conv_forward(x, w, padding=1, out=out)
        assert gpu.current_device() == 0 and gpu.cupy.thread().entered == []
    assert {device for _, device in _ran(gpu)} == {0}


class _LeavesDevice1Current:
    """An array of another library's, ``__cuda_array_interface__`` alone, whose interface read within CuPy's
    ``Device`` (a call's) leaves device 1 current. (A class of the module's: one made in a test, whose methods held
    the stand-in, would keep its arenas until a collection.)"""

    def __init__(self, gpu, array):
        self.gpu, self.interface = gpu, CudaArray(array).__cuda_array_interface__

    @property
    def __cuda_array_interface__(self):
        if self.gpu.cupy.thread().entered:
            self.gpu.cupy.cuda.runtime.setDevice(1)
        return self.interface


def test_a_call_within_an_ops_scope_asks_the_device_again_after_another_librarys_code(gpu):
    """A call made within another call's scope on the same device (a provider's code, a finaliser or a signal handler
    of this thread's), on an array of another library's whose code, run within the call's scope (here reading its
    ``__cuda_array_interface__``), leaves device 1 current: the ops' scope asks the device again, as the interop's
    scope records none for its block, and makes 0 current for the convolution, where it took the enclosing scope's
    record of device 0 as current; the enclosing scope's record is as it was after the call."""
    from wsarena.backends._cudnn_backend import _within
    from wsarena.cudnn import _prototypes

    ran_on = []
    name = "cudnnBackendExecute" if gpu.api == "graph" else "cudnnConvolutionForward"
    recorder = _prototypes._bound[name]

    def execute(*args):
        ran_on.append(gpu.current_device())
        return recorder(*args)

    # put back here, not by monkeypatch, whose undo comes after the stand-in's teardown (the autouse fixtures take
    # monkeypatch first) and would leave the recorder bound for the tests after
    _prototypes._bound[name] = execute
    try:
        x, w = _LeavesDevice1Current(gpu, gpu.cupy.array(X)), gpu.cupy.array(W)
        wsarena.conv_forward(x, w, padding=1)  # planned outside any scope
        _within.device = 0  # the enclosing call's scope, on device 0, current already
        try:
            result = wsarena.conv_forward(x, w, padding=1)
            assert _within.device == 0
        finally:
            _within.device = None
    finally:
        _prototypes._bound[name] = recorder
    assert ran_on == [0, 0] and result.data.device_id == 0
    assert gpu.current_device() == 0 and gpu.cupy.thread().entered == []


@pytest.mark.parametrize("make", ["CuPy's", "torch's", "another library's beside torch's"])
def test_a_cupy_stream_of_another_device_than_the_operands_is_refused_before_anything_runs(gpu, make):
    """``stream=s``, a CuPy stream of device 1, with operands of device 0 (CuPy's, or through the interop, which
    enters it as given): CuPy's own refusal of a stream of another device than the current one, a RuntimeError,
    before anything is leased or enqueued, with the device, CuPy's stacks and current streams as they were."""
    if make != "CuPy's":
        pytest.importorskip("torch")
    with torch_cuda(gpu) if make != "CuPy's" else contextlib.nullcontext():
        side = gpu.cupy.cuda.Stream(0x5000, 1)
        maker = {"CuPy's": lambda gpu, shape, device: gpu.cupy.array(shape, device=device),
                 "torch's": cuda_tensor, "another library's beside torch's": _beside_torchs}[make]
        for call in _calls_on(gpu, maker).values():
            mark = len(gpu.record.log)
            with pytest.raises(RuntimeError, match=r"created on \(1\) does not match with the current device \(0\)"):
                call(side)
            assert not [name for name, _ in gpu.record.log[mark:] if name in ("cudnnSetStream", *CONVOLUTIONS)]
            thread = gpu.cupy.thread()
            assert gpu.current_device() == 0 and thread.entered == []
            assert [[s.ptr for s in stack] for stack in thread.streams] == [[0], [0]]
            assert [gpu.cupy.cuda.get_current_stream(device).ptr for device in (0, 1)] == [0, 0]
    assert wsarena.get_arena(0).stats().streams == {}


def test_cuda_array_interface_operands_are_asked_where_their_memory_is_and_come_back_as_cupy_arrays(gpu):
    """Arrays of no library's, __cuda_array_interface__ alone, which names no device: CuPy asks CUDA where each one's
    memory is (cudaPointerGetAttributes), nothing is entered with stream=None, the ops ask the current device once,
    and the result is the out given, or a new CuPy array."""
    for out in (True, False):
        for call in _calls_on(gpu, _cuda_array, out=out).values():
            call()
            gpu.record.clear()
            result = call()
            calls = gpu.calls
            assert (calls[GET_DEVICE], calls[SET_DEVICE], calls["cudaPointerGetAttributes"]) == (1, 0, 2 + out)
            assert _entered(gpu) == [] and type(result) is (CudaArray if out else gpu.cupy.ndarray)
