"""The cuDNN backends' device path without a GPU: a stand-in for CuPy, the CUDA runtime and libcudnn that counts
every call a convolution makes into them.

:class:`FakeCupy` is what the backends, the arena's :class:`~wsarena.arena.providers.CupyProvider` and
:mod:`wsarena.arena.streams` use of CuPy, made the way CuPy 14.2's Cython is (``cupy/cuda/device.pyx``, ``stream.pyx``):
``Device()`` asks ``cudaGetDevice``, entering a ``Device`` asks it, pushes what it answered, and sets the device where
it differs, leaving one pops that and sets it (an error of ``cudaGetDevice``'s, :attr:`reported`, pushes nothing);
entering a ``Stream`` asks the device (twice for a stream tied to none, ``Stream.from_external``'s: the second after it
pushed the stream, which an error there leaves pushed but not current), and so does leaving one to a stream tied to
none (the null stream); ``get_current_stream(device)`` is a thread's own table, asking the
device only when given none, which entering or leaving a stream sets on the stream's device, or for one tied to none on
the device current then (whatever stack the stream came off: CuPy's ``set_current_stream``); ``ExternalStream`` is a
sibling of ``Stream``, not a subclass. The current device and streams are the calling thread's, as CUDA's and CuPy's
are. Arrays (:meth:`FakeCupy.array`) are a type named ``ndarray`` in a ``cupy`` module, which the ops take as CuPy's, on
a device of their own. What :mod:`wsarena._interop` asks of CuPy for operands of other libraries is made as CuPy's is
too: ``asarray`` of a ``__cuda_array_interface__`` asks CUDA for the memory's device (``cudaPointerGetAttributes``, as
``UnownedMemory`` given none does) and synchronises a stream the interface names; ``from_dlpack`` makes the exporter's
device current around its export, asking the device first and for its current stream; ``cuda.UnownedMemory``,
``cuda.MemoryPointer`` and ``ndarray(shape, dtype, memptr, strides)`` build a view over a tensor's memory.

Operands of other libraries: :class:`CudaArray`, an array of no library's with ``__cuda_array_interface__`` alone, over
a fake CuPy array's memory; :func:`cuda_tensor`, a host tensor of PyTorch's that says it is on a CUDA device (its
``get_device()`` recorded); and :func:`torch_cuda`, PyTorch's current stream as the interop asks it (recorded,
settable), and a result bound for such a tensor's library taken through ``torch.from_dlpack`` as PyTorch's takes a
CuPy array: its current stream on the array's device handed to the array's ``__dlpack__``, which asks as CuPy 14.2's
does (its memory's type, twice, and its current stream, the current device's) and orders that stream where it differs.

:func:`fake_gpu` puts it in place for a block: ``sys.modules["cupy"]``, each device's arena over a ``CupyProvider``,
the graph and legacy cuDNN backends as :func:`wsarena.backends.get_backend` hands them out, and libcudnn's per-call
functions (``cudnnCreate``, ``cudnnSetStream``, the legacy convolutions, ``cudnnBackendExecute``) replaced by
recorders (``cudnnCreate`` logs the handle it makes and the device current then); the graph backend's plans are
stand-ins that execute through ``cudnnBackendExecute``, and each backend's candidates are given (cuDNN's heuristics
need a device). ``calls`` counts each call by name, ``log`` keeps them in order with their arguments.
``bench/bench_device_calls.py`` prints the counts of a cached call.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any, Self

import numpy as np

from wsarena.backends import Candidate

# The names calls are counted under: CuPy's API as the backends call it, then the CUDA runtime functions CuPy's
# Cython calls inside it, then cuda.bindings and libcudnn.
GET_DEVICE = "cudaGetDevice"
SET_DEVICE = "cudaSetDevice"
IS_CAPTURING = "cudaStreamIsCapturing"
POINTER_ATTRIBUTES = "cudaPointerGetAttributes"


class Recorder:
    """Counts calls by name and keeps them in order, while ``on``."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.log: list[tuple[str, tuple[Any, ...]]] = []
        self.on = True

    def __call__(self, name: str, *args: Any) -> None:
        if self.on:
            self.calls[name] += 1
            self.log.append((name, args))

    def clear(self) -> None:
        self.calls.clear()
        self.log.clear()


class CUDARuntimeError(RuntimeError):
    def __init__(self, status: int) -> None:
        super().__init__(f"CUDA error {status}")
        self.status = status


class _Thread(threading.local):
    """A thread's CUDA device and CuPy's state for it: CuPy's Device stack and its stream stacks are two, as CuPy's
    are (``device.pyx``, ``stream.pyx``), so that a Device and a stream left in another order than they were entered
    are each left as CuPy leaves them."""

    devices: list[int]
    stream_devices: list[int]

    @property
    def entered(self) -> list[int]:
        """What either stack holds (a Device's entry, then a stream's device): empty where nothing is entered."""
        return [*self.devices, *self.stream_devices]


class FakeCupy(types.ModuleType):
    """CuPy as far as wsarena's device path uses it, on ``devices`` devices, recording into ``record``."""

    def __init__(self, record: Recorder, devices: int = 2) -> None:
        super().__init__("cupy")
        self.record = record
        self.devices = devices
        self.capturing: set[int] = set()  # the raw handles being captured
        # What the next calls of cudaGetDevice report, in order: None for the device, or an error to raise (one of an
        # earlier asynchronous launch's, which CUDA reports through any call); each is reported once
        self.reported: list[BaseException | None] = []
        local = _Thread()
        fake = self

        def thread() -> Any:  # the calling thread's current device, CuPy's stream stacks and its Device stack
            if not hasattr(local, "device"):
                local.device = 0
                local.streams = [[Stream.null] for _ in range(devices)]
                # CuPy's current stream of each device: set as a stream is entered or left, on the stream's device, or
                # for one tied to none (the null stream, Stream.from_external's) the device current then, whatever
                # device the stack it came off was
                local.current = [Stream.null] * devices
                local.devices = []  # CuPy's Device stack (device.pyx's _ThreadLocalStack)
                local.stream_devices = []  # stream.pyx's current_device_id_stack: the device each stream went on
            return local

        self.thread = thread

        # Named as CuPy's runtime functions are, which the tracebacks of its errors name (Cython's frames), as the
        # ops' scopes read them
        def getDevice() -> int:
            record(GET_DEVICE)
            if fake.reported:
                error = fake.reported.pop(0)
                if error is not None:
                    raise error
            return int(thread().device)

        def setDevice(device: int) -> None:
            record(SET_DEVICE, device)
            if not 0 <= device < devices:
                raise CUDARuntimeError(101)  # cudaErrorInvalidDevice
            thread().device = device

        def stream_is_capturing(handle: int) -> bool:
            record(IS_CAPTURING, handle)
            return handle in fake.capturing

        def get_device_count() -> int:
            record("cudaGetDeviceCount")
            return devices

        runtime = types.SimpleNamespace(getDevice=getDevice, setDevice=setDevice, getDeviceCount=get_device_count,
                                        CUDARuntimeError=CUDARuntimeError,
                                        streamIsCapturing=stream_is_capturing,
                                        deviceSynchronize=lambda: record("cudaDeviceSynchronize"))

        class Device:
            def __init__(self, device: Any = None) -> None:
                self.id = getDevice() if device is None else int(device)

            def __enter__(self) -> Self:
                record("cupy.cuda.Device.__enter__", self.id)
                found = getDevice()
                thread().devices.append(found)
                if self.id != found:
                    setDevice(self.id)
                return self

            def __exit__(self, *exc: object) -> None:
                record("cupy.cuda.Device.__exit__", self.id)
                setDevice(thread().devices.pop())

        class Stream:
            null: Stream
            ptds: Stream

            def __init__(self, ptr: int, device_id: int = -1, owner: Any = None) -> None:
                self.ptr, self.device_id, self.owner = ptr, device_id, owner

            @classmethod
            def from_external(cls, obj: Any) -> Stream:
                record("cupy.cuda.Stream.from_external")
                return cls(int(obj.__cuda_stream__()[1]), -1, obj)

            def __cuda_stream__(self) -> tuple[int, int]:
                return (0, self.ptr)

            # Named as stream.pyx's steps are, which the tracebacks of CuPy's errors name (Cython's frames), as the
            # ops' scopes read them: entering asks the device (check_stream_device_match), pushes the stream and its
            # device (push_stream), then makes it current (set_current_stream), asking the device again for a stream
            # tied to none, so that an error there leaves the stream pushed but not current
            def check_stream_device_match(self) -> int:
                current = getDevice()
                if self.device_id not in (-1, current):
                    raise RuntimeError(f"The device that the stream is created on ({self.device_id}) does not match "
                                       f"with the current device ({current})")
                return current

            def push_stream(self, device: int) -> None:
                thread().streams[device].append(self)
                thread().stream_devices.append(device)
                self.set_current_stream()

            def set_current_stream(self) -> None:  # asks the device for a stream tied to none
                thread().current[getDevice() if self.device_id == -1 else self.device_id] = self

            def __enter__(self) -> Self:
                record("cupy.cuda.Stream.__enter__", self.ptr)
                self.push_stream(self.check_stream_device_match())
                return self

            def __exit__(self, *exc: object) -> None:  # pop_stream
                record("cupy.cuda.Stream.__exit__", self.ptr)
                device = thread().stream_devices.pop()
                stack = thread().streams[device]
                stack.pop()
                stack[-1].set_current_stream()

            def __repr__(self) -> str:
                return f"<fake cupy Stream {self.ptr:#x}>"

        Stream.null = Stream(0)
        Stream.ptds = Stream(2)
        # CuPy's deprecated ExternalStream(ptr, device_id): a _BaseStream as Stream is, no Stream
        external = type("ExternalStream", (), {name: value for name, value in vars(Stream).items()
                                               if name in ("__init__", "__cuda_stream__", "check_stream_device_match",
                                                           "push_stream", "set_current_stream", "__enter__",
                                                           "__exit__", "__repr__")})

        def get_current_stream(device_id: int = -1) -> Stream:
            record("cupy.cuda.get_current_stream")
            if device_id == -1:
                device_id = getDevice()
            return thread().current[device_id]

        class Memory:
            def __init__(self, ptr: int, size: int, device_id: int) -> None:
                self.ptr, self.size, self.device_id = ptr, size, device_id

        def unowned(ptr: int, size: int, owner: Any, device_id: int = -1) -> Memory:
            # CuPy's UnownedMemory: the device of a pointer given none asked of CUDA (cudaPointerGetAttributes)
            if device_id < 0:
                record(POINTER_ATTRIBUTES, ptr)
                device_id = fake.devices_of.get(ptr, thread().device)
            memory = Memory(ptr, size, device_id)
            memory.owner = owner  # type: ignore[attr-defined]
            return memory

        class MemoryPointer:
            def __init__(self, mem: Memory, offset: int = 0) -> None:
                self.mem, self.ptr, self.device_id = mem, mem.ptr + offset, mem.device_id

            @property
            def device(self) -> Device:
                return Device(self.device_id)

        addresses = iter(range(0x7F0000000000, 1 << 62, 1 << 20))

        def alloc(size: int) -> MemoryPointer:
            record("cupy.cuda.alloc", size)
            return MemoryPointer(Memory(next(addresses), size, getDevice()))

        memory = types.SimpleNamespace(MemoryAsync=type("MemoryAsync", (Memory,), {}),
                                       PooledMemory=type("PooledMemory", (Memory,), {}))
        self.cuda = types.SimpleNamespace(Device=Device, Stream=Stream, ExternalStream=external, runtime=runtime,
                                          get_current_stream=get_current_stream, alloc=alloc, memory=memory,
                                          UnownedMemory=unowned, MemoryPointer=MemoryPointer)
        self.devices_of: dict[int, int] = {}  # the device of each address array() handed out
        self.Memory, self.MemoryPointer, self._addresses = Memory, MemoryPointer, addresses

        class ndarray:  # the name the ops tell CuPy's arrays by
            __module__ = "cupy._core.core"

            def __init__(self, shape: tuple[int, ...], dtype: Any, data: MemoryPointer,
                         strides: tuple[int, ...] | None = None) -> None:
                self.shape, self.dtype, self.data = tuple(shape), np.dtype(dtype), data
                self.ndim = len(self.shape)
                dense = np.empty(0, self.dtype).itemsize * np.cumprod((1, *self.shape[:0:-1]))[::-1]
                self.strides = tuple(int(s) for s in dense) if strides is None else tuple(strides)
                contiguous = all(a == b for a, b, n in zip(self.strides, dense, self.shape) if n != 1)
                self.flags = types.SimpleNamespace(c_contiguous=contiguous)

            @property
            def device(self) -> Device:  # CuPy: self.data.device, a Device of the memory's ordinal, asked nothing
                return self.data.device

            def __dlpack_device__(self) -> tuple[int, int]:
                # CuPy 14.2's get_dlpack_device: the memory's type asked of CUDA (managed or not), its own device
                record(POINTER_ATTRIBUTES, self.data.ptr)
                return (2, self.data.device_id)

            def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                           copy: Any = None) -> Self:
                # CuPy 14.2's export: its current stream, the current device's (asked), made to order the consumer's
                # stream where they differ (the legacy default stream 1 for 0 and None), then the memory's type asked
                # again; the array itself stands for the capsule
                record("cupy.ndarray.__dlpack__", stream)
                current = get_current_stream().ptr or 1
                consumer = 1 if stream is None or stream == 0 else int(stream)
                if consumer >= 0 and consumer != current:
                    record("cudaEventRecord", current)
                    record("cudaStreamWaitEvent", consumer)
                self.__dlpack_device__()
                return self

            @property
            def nbytes(self) -> int:
                return int(np.prod(self.shape)) * self.dtype.itemsize

        self.ndarray = ndarray

    def array(self, shape: tuple[int, ...], dtype: Any = "float32", device: int = 0) -> Any:
        """An array of ``shape`` on ``device`` (no call recorded: what the caller made before the convolution)."""
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        ptr = next(self._addresses)
        self.devices_of[ptr] = device
        return self.ndarray(shape, dtype, self.MemoryPointer(self.Memory(ptr, nbytes, device)))

    def asarray(self, obj: Any) -> Any:
        """CuPy 14.2's view of a ``__cuda_array_interface__`` (``_convert_object_with_cuda_array_interface``): the
        memory's device asked of CUDA, and a stream the interface names synchronised (its protocol's version 3)."""
        if isinstance(obj, self.ndarray):
            return obj
        desc = obj.__cuda_array_interface__
        shape, dtype, ptr = tuple(desc["shape"]), np.dtype(desc["typestr"]), desc["data"][0]
        memory = self.cuda.UnownedMemory(ptr, int(np.prod(shape)) * dtype.itemsize, obj)
        if desc.get("stream") is not None:
            self.record("cudaStreamSynchronize", desc["stream"])
        return self.ndarray(shape, dtype, self.MemoryPointer(memory, 0), desc.get("strides"))

    def from_dlpack(self, obj: Any, copy: Any = None) -> Any:
        """CuPy 14.2's DLPack import of device memory: the exporter's device made current around its export, asked
        for first, its current stream (the current device's, asked again) handed to it; here the export is a
        :class:`CudaTensor`'s, recorded, and the array made over its memory."""
        device_type, device = obj.__dlpack_device__()
        if device_type not in (2, 13):
            raise TypeError("CPU arrays cannot be directly imported to CuPy")
        runtime = self.cuda.runtime
        before = runtime.getDevice()
        try:
            runtime.setDevice(device)
            stream = self.thread().current[runtime.getDevice()].ptr  # get_current_stream_ptr()
            self.record("Tensor.__dlpack__", stream)
        finally:
            runtime.setDevice(before)
        size = obj.element_size()
        memory = self.Memory(obj.data_ptr(), obj.numel() * size, device)
        return self.ndarray(tuple(obj.shape), str(obj.dtype).removeprefix("torch."), self.MemoryPointer(memory),
                            tuple(n * size for n in obj.stride()))

    def empty(self, shape: tuple[int, ...], dtype: Any = "float32") -> Any:
        self.record("cupy.empty", shape)
        return self.array(shape, dtype, self.thread().device)

    def may_share_memory(self, a: Any, b: Any) -> bool:  # CuPy's bounds check, on the host
        self.record("cupy.may_share_memory")
        return bool(a.data.device_id == b.data.device_id and a.data.ptr < b.data.ptr + b.nbytes
                    and b.data.ptr < a.data.ptr + a.nbytes)


class CudaArray:
    """An array of no library's over a fake CuPy array's memory: ``__cuda_array_interface__`` alone (version 3,
    without a stream, as Numba's and most producers' that order their work themselves)."""

    __module__ = "cudaarrays"  # a library with no import of its own: the result comes back as CuPy's array

    def __init__(self, array: Any) -> None:
        self.__cuda_array_interface__ = {"shape": array.shape, "typestr": array.dtype.str,
                                         "data": (array.data.ptr, False), "version": 3, "strides": None}


@functools.cache
def _tensor_type() -> type:
    import torch

    class CudaTensor(torch.Tensor):
        """A host tensor that says it is on a CUDA device (its ``fake_device``), as the interop reads a tensor: its
        device asked (recorded), its DLPack device CUDA's; its memory is the host's, which nothing here touches."""

        fake_device = 0

        @property
        def is_cuda(self) -> bool:  # type: ignore[override]
            return True

        def get_device(self) -> int:
            recording = getattr(self, "record", None)
            if recording is not None:
                recording("Tensor.get_device")
            return int(self.fake_device)

        def __dlpack_device__(self) -> Any:
            return (2, int(self.fake_device))

    return CudaTensor


def cuda_tensor(gpu: FakeGpu, shape: tuple[int, ...], device: int = 0) -> Any:
    """A float32 tensor of ``shape`` that says it is on CUDA device ``device``, whose queries ``gpu`` records."""
    import torch

    tensor: Any = torch.zeros(shape).as_subclass(_tensor_type())
    tensor.fake_device = device
    tensor.record = gpu.record
    return tensor


@contextlib.contextmanager
def torch_cuda(gpu: FakeGpu) -> Iterator[Any]:
    """PyTorch's CUDA as the interop asks it, for the block: its current stream, ``gpu.torch_stream`` (the raw
    handle; 0, PyTorch's default stream, to start with), through ``torch._C._cuda_getCurrentRawStream`` (recorded),
    and a result bound for a :func:`cuda_tensor`'s library through ``torch.from_dlpack`` as PyTorch 2.13 takes a CuPy
    array: recorded, PyTorch's current stream on the array's device handed to the fake array's ``__dlpack__``, which
    asks what CuPy's asks (the fake CuPy array itself comes back)."""
    import torch

    from wsarena import _interop

    gpu.torch_stream = 0

    def current_raw_stream(device: int) -> int:
        gpu.record("torch._C._cuda_getCurrentRawStream", device)
        return int(gpu.torch_stream)

    def from_dlpack(caller: Any, result: Any) -> Any:
        # torch.from_dlpack (2.13): the exporter's device, PyTorch's current stream there (torch.cuda.current_stream
        # of it, no CUDA call) handed to its export, 1 for PyTorch's default stream
        gpu.record("torch.from_dlpack")
        _, device = result.__dlpack_device__()
        gpu.record("torch.cuda.current_stream", device)
        stream = int(gpu.torch_stream)
        return result.__dlpack__(stream=1 if stream == 0 else stream, max_version=(1, 0))

    saved = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    kind = _tensor_type()
    torch._C._cuda_getCurrentRawStream = current_raw_stream
    _interop._RETURNERS[kind] = from_dlpack
    try:
        yield torch
    finally:
        _interop._RETURNERS.pop(kind, None)
        if saved is None:
            del torch._C._cuda_getCurrentRawStream
        else:
            torch._C._cuda_getCurrentRawStream = saved


class FakePlan:
    """An execution plan of the graph backend's cache that executes through libcudnn's ``cudnnBackendExecute``."""

    numerical_notes: frozenset[str] = frozenset()

    def __init__(self, name: str, workspace_bytes: int) -> None:
        self.name, self.workspace_bytes, self.closed = name, workspace_bytes, False

    def execute(self, handle: Any, x: int, w: int, y: int, workspace: int) -> None:
        from wsarena.cudnn._prototypes import call

        call("cudnnBackendExecute", handle, x, w, y, workspace)

    def close(self) -> None:
        self.closed = True


# Each backend's candidates, best first: one that takes workspace, and one that takes none (what cap_workspace=0 runs)
GRAPH_CANDIDATES = (Candidate("eng0", 1 << 20), Candidate("eng1", 0))
_SIZES = {cand.algo: cand.workspace_bytes for cand in GRAPH_CANDIDATES}
LEGACY_CANDIDATES = {"fwd": (Candidate("implicit_precomp_gemm", 1 << 16), Candidate("implicit_gemm", 0)),
                     "bwd_data": (Candidate("algo_1", 1 << 16), Candidate("algo_0", 0)),
                     "bwd_filter": (Candidate("algo_1", 1 << 16), Candidate("algo_0", 0))}
# libcudnn's per-call functions, and its handle's life, replaced by recorders
CUDNN_CALLS = ("cudnnCreate", "cudnnDestroy", "cudnnSetStream", "cudnnBackendExecute", "cudnnConvolutionForward",
               "cudnnConvolutionBackwardData", "cudnnConvolutionBackwardFilter")


class FakeGpu:
    """What :func:`fake_gpu` yields: the recorder, the fake CuPy, device 0's arena and the two backends."""

    def __init__(self, record: Recorder, cupy: FakeCupy, arena: Any, graph: Any, legacy: Any) -> None:
        self.record, self.cupy, self.arena, self.graph, self.legacy = record, cupy, arena, graph, legacy
        self.torch_stream = 0  # PyTorch's current stream, under torch_cuda()

    @property
    def calls(self) -> collections.Counter[str]:
        return self.record.calls

    def current_device(self) -> int:
        return int(self.cupy.thread().device)


@contextlib.contextmanager
def fake_gpu(devices: int = 2) -> Iterator[FakeGpu]:
    """The fake in place for the block (module docstring); everything it replaced is put back after it, and the
    cuDNN handles made meanwhile are closed with the recorders still in place."""
    from cuda.bindings import runtime as rt

    import wsarena
    from wsarena import _interop, algos, ops
    from wsarena.arena import Arena, set_arena
    from wsarena.arena.providers import CupyProvider
    from wsarena.backends import _backends
    from wsarena.backends._cudnn_backend import CudnnBackend
    from wsarena.backends._cudnn_graph import CudnnGraphBackend
    from wsarena.backends._graph_plans import PlanCache
    from wsarena.cudnn import _prototypes, handle

    record = Recorder()
    cupy = FakeCupy(record, devices)
    saved_modules = {name: sys.modules.get(name) for name in ("cupy",)}
    saved_bound = {name: _prototypes._bound.get(name) for name in CUDNN_CALLS}
    saved = [(rt, "cudaStreamGetId", rt.cudaStreamGetId), (handle, "_current_device", handle._current_device),
             (handle, "_set_device", handle._set_device)]
    saved_backends = {key: _backends.get(key) for key in ("cudnn", "cudnn:graph")}
    arenas = []
    before = set(handle._live)  # the handles made in the block are closed after it, no other
    graph: Any = None
    try:
        sys.modules["cupy"] = cupy
        handles = iter(range(0x1000, 1 << 62, 0x1000))
        for name in CUDNN_CALLS:
            _prototypes.function(name)  # declared for real first, so that bind_all() leaves the recorder in place

            def recorder(*args: Any, name: str = name) -> int:
                if name == "cudnnCreate":  # a handle of its own, written through the byref; logged with its device
                    made = args[0]._obj.value = next(handles)
                    args = (made, cupy.thread().device)
                record(name, *args)
                return 0

            _prototypes._bound[name] = recorder  # type: ignore[assignment,unused-ignore]

        def stream_id(stream: int) -> tuple[int, int]:
            record("cuda.bindings cudaStreamGetId", stream)
            return 0, stream

        rt.cudaStreamGetId = stream_id

        def current_device() -> int:
            record("cuda.core Device()")
            return int(cupy.thread().device)

        handle._current_device = current_device

        def set_device(device: int) -> None:
            record("cuda.core Device.set_current", device)
            cupy.thread().device = device

        handle._set_device = set_device

        class Graph(CudnnGraphBackend):
            def candidates(self, pass_: str, geom: Any) -> list[Candidate]:
                return list(GRAPH_CANDIDATES)

        class Legacy(CudnnBackend):
            def candidates(self, pass_: str, geom: Any) -> list[Candidate]:
                return list(LEGACY_CANDIDATES[pass_])

        graph, legacy = Graph(), Legacy()
        graph._plans = PlanCache(lambda handle, pass_, geom, aligned: ("graph", pass_, geom, aligned),
                                 lambda handle, graph_, name: FakePlan(name, _SIZES[name]))
        _backends["cudnn"], _backends["cudnn:graph"] = legacy, graph
        for device in range(devices):
            arenas.append(set_arena(device, Arena(CupyProvider(device))))
        _interop._KINDS.clear()
        _interop._cupy.cache_clear()  # the interop's CuPy the fake's, and after the block CuPy's again
        _interop._devices = 0  # and the device count the fake's
        yield FakeGpu(record, cupy, wsarena.get_arena(0), graph, legacy)
    finally:
        record.on = False
        for device, previous in enumerate(arenas):
            ours = set_arena(device, previous)
            if ours is not None:
                ours.close()
        for live in set(handle._live) - before:  # destroyed through the recorder, not libcudnn
            live.close()
        if graph is not None:  # its plans closed now: a backend a failed test's traceback holds hands none over later
            graph._plans.clear()
        for key, backend in saved_backends.items():
            if backend is None:
                _backends.pop(key, None)
            else:
                _backends[key] = backend
        for obj, name, value in saved:
            setattr(obj, name, value)
        for name, fn in saved_bound.items():
            if fn is None:
                _prototypes._bound.pop(name, None)
            else:
                _prototypes._bound[name] = fn
        for name, module in saved_modules.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        ops.records_clear()
        algos.cache_clear()
        _interop.NATIVE.discard(cupy.ndarray)
        _interop._cupy.cache_clear()
        _interop._devices = 0
