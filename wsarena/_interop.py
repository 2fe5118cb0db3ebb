"""Operands from any array library: zero-copy NumPy or CuPy views in, the caller's library out.

NumPy and CuPy arrays (and their subclasses) go straight to the ops; their types are kept in :data:`NATIVE`, so
that the ops' hot path tells them apart with one set lookup. Any other operand is viewed, without a copy, as a
NumPy array (host memory) or a CuPy array (CUDA memory), by the first of these it has:

1. ``__dlpack__`` and ``__dlpack_device__`` (PyTorch, JAX, CuPy-like libraries, cuda.core buffers), imported with
   ``copy=False``, on the call's stream, so that the producer orders its own work before the call (a PyTorch
   CPU tensor through ``Tensor.numpy()``, the same view at a third of the cost; a PyTorch CUDA tensor, where the
   call runs on PyTorch's current stream and there is nothing to order, as a CuPy array made from its pointer,
   sizes and strides, the same view without the export). ``bfloat16``, which NumPy and CuPy do not import,
   travels as ``int16`` (:mod:`wsarena._dlpack`);
2. ``__cuda_array_interface__`` (Numba device arrays, and the rest of the CUDA Python world);
3. ``__array_interface__`` (host buffers).

What cannot be viewed without a copy is a ``TypeError`` naming the argument: a list, a tensor that requires grad
while autograd records (the ops record no history: use :mod:`wsarena.torch`; under ``torch.no_grad()`` or inference
mode it is taken, as PyTorch's ops take it), a conjugated tensor, a dtype the array library cannot represent, an
``out`` whose DLPack export is read-only (a JAX array: JAX's arrays are immutable, and its legacy DLPack capsules
promise no writes), an exporter whose ``__dlpack_device__`` fails (a JAX array sharded over devices, or deleted) or
gives no (device type, device id) pair of integers, or a CUDA device id below 0, a JAX tracer (inside ``jax.jit`` and
kin). Operands may come from different libraries as long as they are all in host
memory or all on one CUDA device; host beside device memory, or operands that say they are on two devices (a CuPy
array's ``device``, a tensor's, ``__dlpack_device__``; ``__cuda_array_interface__`` names none), would need a copy
and is a ``TypeError``; operands on a CUDA device that CUDA does not count here are a ``ValueError`` naming the
device and the count.

The result comes back in the library of the first operand (``x``, or ``dy`` for ``conv_backward_data``), through
that library's DLPack import (``torch.from_dlpack``, the ``from_dlpack`` of its ``__array_namespace__`` or of
its top-level module, Numba's ``as_cuda_array``); an operand whose library has none (a bare
``__cuda_array_interface__`` holder) gets the CuPy or NumPy array. A host result bound for another library is
allocated on a 64-byte boundary, where JAX (XLA) takes it without a copy. ``out=`` given: the result is ``out``
itself.

With ``stream=None`` and a PyTorch CUDA tensor among the operands, the call runs on PyTorch's current stream
(``torch.cuda.current_stream()``), and the device's arena, when this call makes it, takes its memory from
PyTorch's caching allocator (setting ``allocator="auto"``). Nothing here imports an array library that the
operands do not come from.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ._config import get_config
from ._dlpack import BFLOAT16, INT16, Export, ReadOnlyExport
from ._gpu import no_such_device
from ._pass import Pass
from ._sizes import TEXT_OR_BYTES, as_int, short_repr
from .arena._registry import make_device_arena
from .arena.streams import cupy_stream, stream_handle, stream_to_enter
from .backends import is_masked_type, type_backend_name

__all__ = ["NATIVE", "execute"]

NATIVE: set[type] = set()  # NumPy and CuPy array types seen so far: the ops take these as they are

_HOST_DEVICES = (1, 3)  # DLPack's kDLCPU and kDLCUDAHost (pinned host memory)
_CUDA_DEVICES = (2, 13)  # kDLCUDA and kDLCUDAManaged

Run = Callable[..., Any]

# CUDA's device count as far as known: asked (CuPy's) where an operand names a device at or past it, which after the
# first call on a device is only a device this process does not have; 0 until then. Threads that race store the same
# count, and a forked child keeps it: its devices are the parent's, CUDA having read CUDA_VISIBLE_DEVICES once
_devices = 0
_NO_DEVICE = 100  # cudaErrorNoDevice (and hipErrorNoDevice)


# What a type's instances are, found once per type: NumPy or CuPy arrays (or masked arrays, which the ops refuse
# with their own message), PyTorch tensors, DLPack exporters; "" for the rest, whose instances may still carry an
# interface attribute of their own.
_NATIVE_KIND, _TORCH, _DLPACK = "native", "torch", "dlpack"
_KINDS: dict[type, str] = {}
# Tensor subclasses whose __torch_function__ is their own code, which runs as each tensor method the interop reads
# is called (data_ptr(), __dlpack__()): another library's code within the call, found as the type is
_HOOKED: set[type] = set()


def _kind_of(kind: type) -> str:
    found = _KINDS.get(kind)
    if found is None:
        torch = sys.modules.get("torch")  # a tensor's type means PyTorch is imported already
        if type_backend_name(kind) is not None or is_masked_type(kind):
            found = _NATIVE_KIND
        elif torch is not None and issubclass(kind, torch.Tensor):
            found = _TORCH
            hook: Any = getattr(kind, "__torch_function__", None)
            if getattr(hook, "__func__", hook) not in (torch.Tensor.__torch_function__.__func__,
                                                      torch._C._disabled_torch_function_impl):
                _HOOKED.add(kind)
        elif hasattr(kind, "__dlpack__") and hasattr(kind, "__dlpack_device__"):
            found = _DLPACK
        else:
            found = ""
        _KINDS[kind] = found
    return found


class _Operand:
    """One argument of a call: the caller's object, its name, what it is and where its memory is."""

    __slots__ = ("cuda", "device", "kind", "name", "obj")

    def __init__(self, name: str, obj: Any) -> None:
        self.name = name
        self.obj = obj
        self.kind = kind = _kind_of(type(obj))
        self.device: int | None = None  # a CUDA ordinal, where the operand says which
        if kind == _NATIVE_KIND:
            self.cuda = type_backend_name(type(obj)) == "cudnn"
        elif kind == _TORCH:
            if obj.requires_grad:
                if sys.modules["torch"].is_grad_enabled():
                    raise _requires_grad(name)
                # no history is being recorded (torch.no_grad(), inference mode): as PyTorch's own ops take it,
                # and alike on the host and on a device, where the DLPack export would refuse it
                self.obj = obj = obj.detach()
                _kind_of(type(obj))  # a subclass's detach() may give another type, whose own code is then found
            self.cuda = bool(obj.is_cuda)
            self.device = int(obj.get_device()) if self.cuda else None
        elif kind == _DLPACK:
            try:
                found = obj.__dlpack_device__()
            except (BufferError, RuntimeError, TypeError, ValueError) as exc:  # a JAX array sharded, or deleted
                raise TypeError(
                    f"{name} cannot be viewed: its __dlpack_device__() raised {type(exc).__name__}: {exc}"
                ) from exc
            # a tuple, as every exporter known gives, taken as it is: this runs on each call
            if type(found) is tuple:
                pair = found
            else:
                try:  # not text: "12" would be the pair ('1', '2'); one item past a pair read at most
                    pair = () if isinstance(found, TEXT_OR_BYTES) else tuple(itertools.islice(iter(found), 3))
                except TypeError:
                    pair = ()
            if len(pair) != 2:
                raise TypeError(f"{name} cannot be viewed: its __dlpack_device__() returned {short_repr(found)}, "
                                "not a (device type, device id) pair")
            device_type, ordinal = pair
            # integers of any type (PyTorch's and JAX's device type is an IntEnum, NumPy's and CuPy's an int), never
            # made ones: int() would take (2, 1.7) as CUDA device 1, (1.7, 0) as the host, ('2', '0') as CUDA device 0
            if type(device_type) is not int or type(ordinal) is not int:
                device_type, ordinal = as_int(pair[0]), as_int(pair[1])
                if device_type is None or ordinal is None:
                    what, value = ("device type", pair[0]) if device_type is None else ("device id", pair[1])
                    raise TypeError(f"{name} cannot be viewed: its __dlpack_device__() returned {short_repr(found)}, "
                                    f"whose {what} {short_repr(value)} is not an integer")
            if device_type not in _HOST_DEVICES + _CUDA_DEVICES:
                raise TypeError(
                    f"{name} is in memory of DLPack device type {device_type}; wsarena takes host or CUDA memory"
                )
            self.cuda = device_type in _CUDA_DEVICES
            if self.cuda and ordinal < 0:  # a CUDA ordinal is 0 or more; the host's id is not read
                raise TypeError(f"{name} cannot be viewed: its __dlpack_device__() returned {short_repr(found)}, "
                                f"whose device id {ordinal} is no CUDA device (one is >= 0)")
            self.device = ordinal if self.cuda else None
        elif hasattr(obj, "__cuda_array_interface__"):
            self.cuda = True
        elif hasattr(obj, "__array_interface__"):
            self.cuda = False
        elif _is_jax_tracer(obj):
            raise TypeError(
                f"{name} is a JAX tracer ({type(obj).__name__}: a value inside jax.jit, jax.grad, jax.vmap or another "
                "transformation), with no memory for wsarena to compute on: call wsarena outside the transformation, "
                "or inside it through jax.pure_callback"
            )
        else:
            raise TypeError(
                f"{name} must be an array (NumPy, CuPy, or an object with __dlpack__ and __dlpack_device__, "
                f"__cuda_array_interface__ or __array_interface__), not {type(obj).__name__}"
            )

    def where(self) -> str:
        memory = (f"CUDA device {self.device}" if self.device is not None
                  else "a CUDA device" if self.cuda else "the host")
        return f"{self.name} is a {type(self.obj).__module__.partition('.')[0]} array on {memory}"


def _is_jax_tracer(obj: Any) -> bool:
    # a tracer means JAX is imported already; a "jax" without jax.core.Tracer is another module, or JAX halfway
    # through its import in another thread
    tracer = getattr(getattr(sys.modules.get("jax"), "core", None), "Tracer", None)
    return isinstance(tracer, type) and isinstance(obj, tracer)


def _requires_grad(name: str) -> TypeError:
    """The refusal of a tensor that requires grad while autograd records: the ops would record no history (and
    PyTorch's own ``out=`` refuses such an ``out``), so say what to call instead."""
    use = "" if name == "out" else "for gradients use wsarena.torch (conv2d and kin), which records them; else "
    return TypeError(
        f"{name} requires grad while autograd records, and wsarena's ops record no autograd history: {use}pass "
        f"{name}.detach(), or call under torch.no_grad()"
    )


def execute(
    run: Run, pass_: Pass, a: Any, b: Any, shape_arg: Any, params: Any, out: Any, stream: Any, layout: str,
    algo: str | None,
) -> Any:
    """Run ``run`` (the ops' own body) on NumPy or CuPy views of the operands; the result in the caller's library.

    ``run`` takes the arguments of this function after itself, with ``a``, ``b`` and ``out`` replaced by views.
    """
    names = pass_.names
    first, second = _Operand(names[0], a), _Operand(names[1], b)
    last = None if out is None else _Operand("out", out)
    operands = [first, second] if last is None else [first, second, last]
    if first.kind == _NATIVE_KIND and second.kind == _NATIVE_KIND and (last is None or last.kind == _NATIVE_KIND):
        # first seen, or refused by the ops themselves
        NATIVE.update(type(op.obj) for op in operands if type_backend_name(type(op.obj)) is not None)
        return run(pass_, a, b, shape_arg, params, out, stream, layout, algo)
    cuda = first.cuda
    if second.cuda != cuda or (last is not None and last.cuda != cuda):
        raise TypeError(
            "cannot mix host and device memory in one convolution, which would need a copy ("
            + ", ".join(op.where() for op in operands) + ")"
        )
    torch_out = last is not None and last.kind == _TORCH
    if torch_out:
        _check_torch_out(out)
    if not cuda:
        leaves = out is None and type_backend_name(type(a)) is None  # the result goes to another library
        try:
            result = run(pass_, _view(_NUMPY, first), _view(_NUMPY, second), shape_arg, params,
                         None if last is None else _view(_NUMPY, last), stream, layout, algo,
                         empty=_aligned_empty if leaves else None)
        finally:  # a call that raised may have written out all the same (a warning made an error, after the run)
            if torch_out:
                _written(out)
        return out if out is not None else _returned(a, result)
    for op in operands:
        if op.kind == _NATIVE_KIND:  # a CuPy array beside operands of other libraries: its device too
            op.device = int(op.obj.device.id)
    devices = {op.device for op in operands if op.device is not None}
    if len(devices) > 1:  # one device's view of another's memory: a peer access at best, a fault at worst
        raise TypeError(
            "cannot mix CUDA devices in one convolution, which would need a copy ("
            + ", ".join(op.where() for op in operands) + ")"
        )
    device = next(iter(devices), None)
    if device is not None and device >= _devices:
        _check_device(device, operands)
    if last is not None and last.kind == "" and _says_read_only(out.__cuda_array_interface__):
        # NumPy makes a read-only array of an __array_interface__ that says so, which the ops refuse; CuPy's arrays
        # have no such flag, and it would write this one
        raise ValueError("out is read-only: its __cuda_array_interface__'s data says so; pass a writable array, or "
                         "call without out=")
    direct = False  # torch tensors viewed directly: the call runs on PyTorch's current stream, nothing to order
    if device is not None and (first.kind == _TORCH or second.kind == _TORCH or torch_out):
        _prefer_torch_memory(device)
        if stream is None:
            stream = _torch_current_stream(device)
            direct = True
    # the operands' device current (None: as it is) and `stream` CuPy's current stream there; the device entered only
    # where it is not current, and the ops then asking nothing, where the operands are PyTorch's and CuPy's alone (no
    # tensor subclass's __torch_function__ of its own, nor a torch-function mode's, which runs as the tensors' methods
    # are called and may leave another device current)
    own = all(op.kind in (_TORCH, _NATIVE_KIND) for op in operands) and not (
        _HOOKED and any(type(op.obj) in _HOOKED for op in operands)
    ) and not sys.modules["torch"]._C._is_torch_function_mode_enabled()  # a tensor among them: PyTorch is imported
    library = _cupy()
    with library.scope(device, stream, own):
        views = [_tensor_view(op) if direct and op.kind == _TORCH else _view(library, op) for op in operands]
        try:
            result = run(pass_, views[0], views[1], shape_arg, params, views[2] if out is not None else None,
                         stream, layout, algo)
        finally:  # as on the host
            if torch_out:
                _written(out)
        # inside the scope: the library imports the result on the stream it was computed on, with no extra wait
        return out if out is not None else _returned(a, result)


def _check_device(device: int, operands: list[_Operand]) -> None:
    """Refuse operands on CUDA device ``device`` where CUDA has no such device (another library's id, or one
    beyond what ``CUDA_VISIBLE_DEVICES`` leaves this process), which CuPy would take as an index into its list of
    devices (an IndexError) or fail to make current; the count is asked here, and known after."""
    global _devices
    import cupy

    runtime = cupy.cuda.runtime
    try:
        count = int(runtime.getDeviceCount())
    except runtime.CUDARuntimeError as exc:
        # CUDA counts no device (CUDA_VISIBLE_DEVICES="", none installed) by cudaErrorNoDevice, where CuPy raises;
        # its is_available() takes that error alone as "none" too
        if exc.status != _NO_DEVICE:
            raise
        count = 0
    _devices = count
    if device >= count:
        raise ValueError(
            f"{', '.join(op.where() for op in operands if op.device is not None)}; {no_such_device(device, count)}"
        )


def _says_read_only(interface: Any) -> bool:
    """Whether an array interface's ``data``, ``(address, read_only)``, says read-only (a malformed one is left to
    the library that views it)."""
    data = interface.get("data") if isinstance(interface, dict) else None
    return isinstance(data, tuple) and len(data) == 2 and isinstance(data[1], (bool, np.bool_)) and bool(data[1])


def _check_torch_out(out: Any) -> None:
    """Refuse, as PyTorch refuses its own in-place writes, an inference tensor outside ``torch.inference_mode()``."""
    torch = sys.modules["torch"]  # a tensor among the operands: PyTorch is imported
    if out.is_inference() and not torch.is_inference_mode_enabled():
        raise TypeError("out is an inference tensor, which PyTorch lets be written in place only inside "
                        "torch.inference_mode(); call there, or without out=")


def _written(out: Any) -> None:
    """Count the write into a PyTorch ``out`` as an in-place change, as PyTorch's own ``out=`` does: autograd then
    refuses a backward pass that would use the values it saved before, instead of using the new ones."""
    torch = sys.modules["torch"]  # a tensor among the operands: PyTorch is imported
    torch.autograd.graph.increment_version(out)


_AS_IT_IS: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()  # reusable: it holds nothing


_Scope = contextlib.AbstractContextManager[Any]


class _Library(NamedTuple):
    """How NumPy or CuPy views an operand's memory without a copy, and (CuPy) makes a device and a stream current
    for a block (:func:`_cupy`'s ``scope``); ``None`` for either leaves it as it is."""

    name: str
    from_torch: Callable[[Any], Any]  # a torch tensor (bfloat16 relabelled int16)
    from_dlpack: Callable[[Any], Any]  # an Export
    asarray: Callable[[Any], Any]  # a holder of __array_interface__ or __cuda_array_interface__
    scope: Callable[[int | None, Any, bool], _Scope] = lambda *_: _AS_IT_IS


def _view(library: _Library, op: _Operand) -> Any:
    """``op`` as an array of ``library`` over its memory; a ``TypeError`` naming it where that needs a copy."""
    obj = op.obj
    if op.kind == _NATIVE_KIND:
        return obj
    try:
        if op.kind == _TORCH:  # neither library has bfloat16: relabelled int16, and the view's dtype set back
            if op.cuda and not obj.data_ptr() and obj.numel():
                # a wrapper subclass (DTensor's kind) or a fake tensor: its DLPack export names memory not its data's
                raise BufferError("a tensor with no memory of its own (its data pointer is 0): pass a plain tensor")
            if _is_torch_bfloat16(obj):
                return library.from_torch(_torch_int16(obj)).view(_bfloat16())
            return library.from_torch(obj)
        if op.kind == _DLPACK:
            export = _export(op)
            view = library.from_dlpack(export)
            return view.view(_bfloat16()) if export.retyped else view
        return library.asarray(obj)  # an array interface: a view of the exporter's memory
    except ReadOnlyExport as exc:
        raise _read_only(exc) from exc
    except (BufferError, RuntimeError, TypeError, ValueError) as exc:
        raise TypeError(f"{op.name} cannot be viewed as a {library.name} array without a copy: {exc}") from exc


def _tensor_view(op: _Operand) -> Any:
    """A CuPy array over a CUDA tensor's memory, made from its pointer, sizes and strides: what DLPack's import
    gives (``cupy.from_dlpack``), without the Python of PyTorch's export and CuPy's import (bench/RESULTS.md).
    Only where the call runs on PyTorch's current stream (the DLPack export would order nothing there) and on the
    tensor's device, and for a plain dense tensor of a dtype wsarena computes: anything else goes through DLPack,
    which views or refuses it as before. The array keeps the tensor alive."""
    tensor = op.obj
    torch = sys.modules["torch"]  # a tensor among the operands: PyTorch is imported
    if not _CUPY_DTYPES:
        _CUPY_DTYPES.update({torch.float16: "float16", torch.float32: "float32", torch.float64: "float64",
                             torch.bfloat16: "bfloat16"})
    dtype = _CUPY_DTYPES.get(tensor.dtype)
    if dtype is None or tensor.layout is not torch.strided or tensor.is_neg():
        return _view(_cupy(), op)
    try:
        shape, strides, ptr = tuple(tensor.shape), tensor.stride(), tensor.data_ptr()
    except RuntimeError:  # no sizes or no storage to read (a nested tensor, vmap's batched one): DLPack says why
        return _view(_cupy(), op)
    if not ptr or not all(shape):  # no elements (as DLPack gives them), or no memory of its own (refused there)
        return _view(_cupy(), op)
    cupy = sys.modules["cupy"]
    itemsize = tensor.element_size()
    steps = [s * itemsize for s in strides]
    extent = sum([(n - 1) * s for n, s in zip(shape, steps)]) + itemsize  # the bytes from the first element to the last
    memory = cupy.cuda.UnownedMemory(ptr, extent, tensor, device_id=op.device)
    if dtype == "bfloat16":
        dtype = _bfloat16()
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0), tuple(steps))


_CUPY_DTYPES: dict[Any, str] = {}  # a torch dtype -> the name of its CuPy dtype, filled on first use


def _export(op: _Operand) -> Export:
    """``op``'s DLPack export: ``out`` only where the producer allows writes, bfloat16 as int16."""
    return Export(op.obj, writable=op.name == "out", retype=(BFLOAT16, INT16))


def _read_only(exc: ReadOnlyExport) -> TypeError:
    return TypeError(
        f"out cannot be written in place: {exc}; call without out= and use the returned array"
    )


def _numpy_from_dlpack(obj: Any) -> np.ndarray:
    return np.from_dlpack(obj, copy=False)


# a torch tensor through Tensor.numpy(): the view DLPack would give, at a third of the cost (a lambda calls it
# sooner than operator.methodcaller does)
_NUMPY = _Library("NumPy", lambda tensor: tensor.numpy(), _numpy_from_dlpack, np.asarray)
_host_view = functools.partial(_view, _NUMPY)


@functools.cache
def _cupy() -> _Library:
    import cupy

    from .arena._scopes import _OnDevice, _OnDeviceEntered

    cuda = cupy.cuda

    def from_dlpack(obj: Any) -> Any:
        return cupy.from_dlpack(obj, copy=False)  # imported on the current (the call's) stream

    def scope(ordinal: int | None, given: Any, own: bool) -> _Scope:
        """CUDA device ``ordinal`` current (``None``: as it is), and ``given`` CuPy's current stream there, for the
        block: one scope, which leaves what it entered where entering either is interrupted or refused.

        A stream that is CuPy's current one on the device already is not entered (entering CuPy's object asks the
        current device twice, and leaving it once more), as the ops' own scope does not enter it
        (``CudnnBackend.context``, whose choice this is); another library's stream object gets a CuPy object of the
        call's own, which dies with it (arena.streams.cupy_stream says why). ``own``: only PyTorch's, CuPy's and
        wsarena's code runs in the block (no tensor subclass's own ``__torch_function__``, nor a torch-function
        mode's, which run as the tensors' methods are called), which all leave the current device as they found
        it; then the device is entered only where it is not current and the ops' scope knows it current without
        asking (the backend's ``_OnDevice``). Else a library's own code runs there (its ``__dlpack__``, its
        ``from_dlpack`` of the result) and CuPy's ``Device`` is entered whatever is current, which sets the device it
        found again as it leaves, whatever that code did, and the ops ask again (``_OnDeviceEntered``)."""
        if ordinal is None:  # no device to ask for its current stream there: an object of the call's own, entered
            return _AS_IT_IS if given is None else cupy_stream(stream_handle(given))
        on = None if given is None else stream_to_enter(cuda, given, ordinal)
        return (_OnDevice if own else _OnDeviceEntered)(cuda, cuda.Device(ordinal), on)

    return _Library("CuPy", from_dlpack, from_dlpack, cupy.asarray, scope)


def _is_torch_bfloat16(tensor: Any) -> bool:
    return tensor.dtype is sys.modules["torch"].bfloat16


def _torch_int16(tensor: Any) -> Any:
    """A bfloat16 tensor relabelled int16 by PyTorch: what :class:`Export` does to any DLPack capsule, at less than
    half its cost for a torch tensor (bench/RESULTS.md)."""
    torch = sys.modules["torch"]  # a tensor among the operands: PyTorch is imported
    return tensor.view(torch.int16)


def _bfloat16() -> Any:
    import ml_dtypes  # NumPy's and CuPy's bfloat16

    return ml_dtypes.bfloat16


def _aligned_empty(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """A new host array on a 64-byte boundary: XLA (JAX) imports host memory without a copy only there, and
    NumPy's own allocations promise 16 bytes."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    buffer = np.empty(nbytes + _ALIGN - 1, dtype=np.uint8)
    start = -buffer.ctypes.data % _ALIGN
    return buffer[start:start + nbytes].view(dtype).reshape(shape)


_ALIGN = 64


def _prefer_torch_memory(device: int) -> None:
    if get_config().allocator == "auto":
        make_device_arena(device, "torch")


def _torch_current_stream(device: int) -> int:
    """PyTorch's current stream on CUDA device ``device``, as a raw handle, asked on every call (the caller may
    switch streams between calls): straight from PyTorch's C++ where it says it (the function torch.compile's
    generated code asks), else through ``torch.cuda.current_stream``, which builds a ``Stream`` object first."""
    torch = sys.modules["torch"]  # a CUDA tensor among the operands: PyTorch is imported
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(device))
    return int(torch.cuda.current_stream(device).cuda_stream)


# -- the way back --------------------------------------------------------------------------------------------------
_RETURNERS: dict[type, Callable[[Any, Any], Any]] = {}


def _returned(caller: Any, result: Any) -> Any:
    """``result`` (a NumPy or CuPy array) in the library of ``caller``, the call's first operand."""
    kind = type(caller)
    if type_backend_name(kind) is not None:
        return result
    back = _RETURNERS.get(kind)
    if back is None:
        back = _RETURNERS[kind] = _returner(kind)
    return back(caller, result)


def _returner(kind: type) -> Callable[[Any, Any], Any]:
    top = kind.__module__.partition(".")[0]
    if _kind_of(kind) == _TORCH:
        return _to_torch
    if hasattr(kind, "__array_namespace__"):  # the array API standard: JAX, and libraries built to it
        return lambda caller, result: caller.__array_namespace__().from_dlpack(_exported(result))
    module = sys.modules.get(top)
    from_dlpack = getattr(module, "from_dlpack", None)
    if callable(from_dlpack):
        return lambda caller, result: from_dlpack(_exported(result))
    if top == "numba" and module is not None:
        cuda = module.cuda
        return lambda caller, result: cuda.as_cuda_array(result)
    return lambda caller, result: result


def _is_bfloat16(result: Any) -> bool:
    return bool(result.dtype.kind == "V" and result.dtype.itemsize == 2)  # (str(dtype) costs microseconds)


def _exported(result: Any) -> Any:
    """``result`` as a DLPack exporter: itself, or (bfloat16, which NumPy and CuPy do not export) its int16 view
    relabelled bfloat16."""
    return Export(result.view(np.int16), retype=(INT16, BFLOAT16)) if _is_bfloat16(result) else result


def _to_torch(caller: Any, result: Any) -> Any:
    """``result`` as a tensor over its memory: a NumPy array through ``torch.from_numpy`` (the same tensor as
    DLPack's, at less than half the cost), a CuPy array through DLPack."""
    torch = sys.modules["torch"]
    bfloat16 = _is_bfloat16(result)
    if bfloat16:
        result = result.view(np.int16)
    tensor = torch.from_numpy(result) if type(result) is np.ndarray else torch.from_dlpack(result)
    return tensor.view(torch.bfloat16) if bfloat16 else tensor
