"""The ``cudnn`` backend: CuPy arrays, cuDNN's legacy convolution API.

Deliberately thin: descriptors from the cache, the (device, thread) handle bound to the stream, and the cuDNN
call. Argument checks, algorithm choice under the cap, the out-of-memory fallback and the workspace lease are
shared code (:mod:`wsarena.ops`, :mod:`wsarena.algos`, :mod:`wsarena.arena`) that the CPU backend also runs.

Precision: float32 convolutions use ``FMA_MATH`` (full float32, no TF32); float16 and bfloat16 are computed in
float32 with tensor cores allowed (``TENSOR_OP_MATH``), as PyTorch does; float64 in float64.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._geometry import DTYPES
from .._lru import LRU
from .._pass import Pass
from ..arena import get_arena
from ..arena._capture import CURRENT, refuse_in_capture
from ..arena._lifecycle import _no_capture_under_way
from ..arena._scopes import _OnDevice, _within
from ..arena.streams import stream_handle, stream_to_enter
from . import Candidate, PartlyTimed
from ._graph_plans import ALIGNED, alignments

_DESCRIPTOR_SETS = 1024  # (geometry, math type) pairs whose descriptors the backend keeps at hand
# The math types (cudnn.MathType values) a dtype's convolution may run in, as the module docstring promises:
# float32 and float64 on FMA only (DEFAULT_MATH lets an Ampere or later GPU run float32 in TF32); float16 and bfloat16
# with or without tensor cores, accumulating in float32 (the descriptors' compute type), though not down-converting.
_FMA_MATH, _DEFAULT_MATH, _TENSOR_OP_MATH = 3, 0, 1
# FindEx statuses (cudnn.Status values) of an entry that say nothing of the algorithm on this geometry, only of the
# search's call: a pointer it calls misaligned, memory it could not allocate (host or device)
_MISALIGNED = 2003
_OUT_OF_MEMORY = frozenset({4003, 4004})
_MATH_TYPES = {
    "float32": frozenset({_FMA_MATH}),
    "float64": frozenset({_FMA_MATH}),
    "float16": frozenset({_DEFAULT_MATH, _TENSOR_OP_MATH, _FMA_MATH}),
    "bfloat16": frozenset({_DEFAULT_MATH, _TENSOR_OP_MATH, _FMA_MATH}),
}


class CudnnBackend:
    name = "cudnn"
    api = "legacy"  # the cuDNN API path; part of every cache key (algos, the ops' records, the search cache)

    def __init__(self) -> None:
        import cupy

        from .. import cudnn

        self._cupy = cupy
        self._cudnn = cudnn
        cudnn.bind_all()
        # A thread's handle, once the thread has ended, is destroyed (a device synchronisation) by a later creation
        # only while no capture an arena knows of is under way, in any thread
        cudnn.handle.ask_before_destroying(_no_capture_under_way)
        # (pass, algorithm name as the backend reports it) -> cuDNN's enum member, for the per-call lookup
        self._algos: dict[tuple[str, str], Any] = {
            (p, a.name.lower()): a for p in Pass for a in cudnn.conv.algorithms(p)
        }
        # The one cache of cuDNN descriptors: per (geometry, math type), the four a call needs. Building them
        # costs tens of microseconds, as much as a small convolution's kernel, and a training loop repeats them.
        self._descs: LRU[tuple[Any, Any, Any, Any]] = LRU(
            _DESCRIPTOR_SETS, valid=_all_open, discard=_close_all
        )
        # cuDNN's heuristics can list an algorithm its kernel then refuses: a shape it does not support, or an
        # operand pointer without the alignment a tensor-core kernel needs (a view at an odd offset). PyTorch
        # moves on to the next algorithm in both cases, and so does wsarena (for that call only).
        self.retry_errors: tuple[type[BaseException], ...] = (
            cudnn.error_class(cudnn.Status.NOT_SUPPORTED),
            cudnn.error_class(cudnn.Status.BAD_PARAM_MISALIGNED_POINTER),
        )

    # -- where -------------------------------------------------------------------------------------------------
    def _device(self) -> int:
        """The calling thread's current CUDA device: within an op's :meth:`context`, the device it made current,
        asked of no one; else CuPy's (a ``cudaGetDevice``)."""
        device: int | None = getattr(_within, "device", None)
        return device if device is not None else int(self._cupy.cuda.Device().id)

    def device_key(self) -> Any:
        return self._device()

    def device_label(self) -> str:
        dev = self._device()
        name = self._cupy.cuda.runtime.getDeviceProperties(dev)["name"]
        return f"{name.decode() if isinstance(name, bytes) else name} ({dev})"

    def arena(self) -> Any:
        return get_arena(self._device())

    def context(self, arrays: Sequence[Any], stream: Any) -> Any:
        """The arrays' device current, and ``stream`` (when given) CuPy's current stream, for the block
        (:class:`_OnDevice`: an object rather than a generator, as this runs on every call and a
        ``contextlib.contextmanager`` costs microseconds of its own).
        """
        device = arrays[0].device
        for array in arrays[1:]:
            if array.device.id != device.id:
                devices = sorted({int(a.device.id) for a in arrays})
                raise ValueError(f"the arrays are on different devices {devices}; put them on one device")
        cuda = self._cupy.cuda
        return _OnDevice(cuda, device, None if stream is None else stream_to_enter(cuda, stream, device.id))

    def may_share_memory(self, a: Any, b: Any) -> bool:
        return bool(self._cupy.may_share_memory(a, b))

    # -- arrays ------------------------------------------------------------------------------------------------
    def check_dtype(self, dtype: str) -> None:
        if dtype not in DTYPES:
            raise TypeError(f"the cudnn backend computes in {', '.join(DTYPES)}, not {dtype}")

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        return self._cupy.empty(shape, dtype=dtype)

    def graph_allocated(self, array: Any) -> bool:
        """Whether ``array`` is memory of CuPy's ``MemoryAsyncPool`` (``cudaMallocAsync``): made during a capture,
        it is an allocation node of the graph, and freed there a free node, so the graph owns it. (CuPy's
        ``MemoryPool`` hands a block freed during a capture to the next allocation on that stream, captured or not.)"""
        return isinstance(array.data.mem, self._cupy.cuda.memory.MemoryAsync)

    def frees_when_dropped(self, array: Any) -> bool:
        """Whether ``array`` is memory that dropping may free at once: all but a block of CuPy's ``MemoryPool``,
        which goes back to the pool (``cudaFree`` with no pool, ``set_allocator(None)``; what another allocator
        does is its own)."""
        return not isinstance(array.data.mem, self._cupy.cuda.memory.PooledMemory)

    def random(self, shape: tuple[int, ...], dtype: str) -> Any:
        return self._cupy.random.default_rng(0).standard_normal(shape, dtype="float32").astype(dtype)

    def operands_key(self, a: Any, b: Any, out: Any) -> tuple[int, int, int] | None:
        """What of the operands decides which candidates cuDNN refuses to run on them: the alignment of each one's
        address (:func:`~wsarena.backends._graph_plans.alignment`), ``None`` where all three are on 16-byte boundaries,
        as a search's operands are wherever copies can be had (:meth:`timing_operands`). A ranking searched without
        the candidates refused on other operands serves calls whose operands have the same key; one searched on such
        operands is kept for good, whatever it left out (:func:`wsarena.algos.select`)."""
        key = alignments(a.data.ptr, b.data.ptr, out.data.ptr)
        return None if key == ALIGNED else key

    def timing_operands(self, a: Any, b: Any, out: Any) -> tuple[Any, Any, Any]:
        """The operands an exhaustive search times on: these, or, when one is a view off a 16-byte boundary,
        copies at aligned addresses (CuPy allocates at 256). Algorithms and engines that refuse misaligned
        operands would be left out of a search timed on them, and the choice and the search cache are kept per
        geometry: the first call would decide for every later one. (A misaligned call then runs the first
        candidate that takes its operands.) Under memory pressure, the operands themselves."""
        if self.operands_key(a, b, out) is None:
            return a, b, out
        try:
            return a.copy(), b.copy(), self._cupy.empty_like(out)
        except MemoryError:
            return a, b, out

    # -- descriptors -------------------------------------------------------------------------------------------
    def _descriptors(self, geom: Any, math_type: int | None = None) -> tuple[Any, Any, Any, Any]:
        """Descriptors ``(x, w, conv, y)`` of ``geom``; the convolution's math type is ``math_type`` or this
        dtype's default. Cached; one closed by mistake is built again."""
        key = (geom, math_type)
        found = self._descs.lookup(key)  # a hit, every call's case, makes no closure
        return found if found is not None else self._descs.get(key, lambda: self._build_descriptors(*key))

    def _build_descriptors(self, geom: Any, math_type: int | None) -> tuple[Any, Any, Any, Any]:
        c = self._cudnn
        data = c.data_type(geom.dtype)
        compute = c.DataType.DOUBLE if geom.dtype == "float64" else c.DataType.FLOAT
        if math_type is not None:
            math = c.MathType(math_type)
        elif geom.dtype in ("float32", "float64"):
            math = c.MathType.FMA_MATH
        else:
            math = c.MathType.TENSOR_OP_MATH
        k, cpg = geom.out_channels, geom.in_channels // geom.groups
        built: list[Any] = []
        try:
            built.append(c.ConvolutionDescriptor(geom.padding, geom.stride, geom.dilation, geom.groups, compute, math))
            if geom.layout == "NCHW":
                built.append(c.TensorDescriptor(data, geom.input_shape))
                built.append(c.TensorDescriptor(data, geom.output_shape))
                built.append(c.FilterDescriptor(data, c.TensorFormat.NCHW, geom.weight_shape))
            else:  # cuDNN wants dims in N, C, spatial order; channels-last is expressed by the strides and format
                built.append(c.TensorDescriptor(data, *_channels_last(geom.batch, geom.in_channels, geom.input_size)))
                built.append(c.TensorDescriptor(data, *_channels_last(geom.batch, k, geom.output_size)))
                built.append(c.FilterDescriptor(data, c.TensorFormat.NHWC, (k, cpg, *geom.kernel_size)))
        except BaseException:
            _close_all(built)  # a later one failed: destroy the earlier ones now rather than at collection
            raise
        conv, x, y, w = built
        return x, w, conv, y

    def _handle(self, stream: int | None = None) -> Any:
        """This thread's handle for the current device; ``stream``: where it will run (by default CuPy's current
        stream, where the ops run everything), which must not be being captured if the handle is to be created
        (``cudnnCreate`` allocates)."""
        device = self._device()
        if not self._cudnn.has_handle(device):
            refuse_in_capture(CURRENT if stream is None else stream, "create this thread's cuDNN handle")
        return self._cudnn.get_handle(device)

    # -- algorithms --------------------------------------------------------------------------------------------
    def algorithms(self, pass_: str) -> tuple[str, ...]:
        return tuple(a.name.lower() for a in self._cudnn.conv.algorithms(pass_))

    def workspace_size(self, pass_: str, algo: str, geom: Any) -> int:
        value = self._cudnn.conv.algorithm(pass_, algo.upper())
        if not geom.batch:  # nothing to compute, and no tensor of no images that cuDNN takes to ask about
            return 0
        x, w, conv, y = self._descriptors(geom)
        return self._cudnn.conv.workspace_size(pass_, self._handle(), x, w, conv, y, value)

    def candidates(self, pass_: str, geom: Any) -> list[Candidate]:
        x, w, conv, y = self._descriptors(geom)
        perfs = self._cudnn.conv.heuristic_algorithms(pass_, self._handle(), x, w, conv, y)
        return _usable(perfs)

    def measure(
        self, pass_: str, geom: Any, a: Any, b: Any, out: Any, workspace: Any, candidates: Sequence[Candidate],
        stream: Any,
    ) -> list[Candidate]:
        """Time the candidates with cuDNN's FindEx in ``workspace``: its successful entries of the candidates'
        algorithms in their own math types or one the dtype may run in. A candidate FindEx does not support on
        16-byte-aligned operands is left out (the search cache keeps that verdict); one whose entry failed for this
        call's operands or memory alone, :class:`~wsarena.backends.PartlyTimed` names (``refused``, ``failed``)."""
        x, w, conv, y = self._descriptors(geom)  # the dtype's math type: FindEx reports each entry's own
        handle = self._bound_handle(stream, workspace)
        x_ptr, w_ptr, y_ptr = pointers(pass_, a, b, out)
        perfs = self._cudnn.conv.find_algorithms(
            pass_, handle, x, x_ptr, w, w_ptr, conv, y, y_ptr, workspace.ptr, workspace.nbytes
        )
        # A candidate's algorithm, in its own math type or one the dtype may run in (_MATH_TYPES). FindEx reports
        # each entry's own, which need not be the one the heuristics listed it in (an algorithm without tensor cores
        # is tried in DEFAULT_MATH under a TENSOR_OP_MATH descriptor, and reported so), and run() builds the
        # descriptor in it: one the dtype may not run in (TF32 tensor cores for float32) is left out.
        pairs = {(c.algo, c.math_type) for c in candidates}
        names, allowed = {c.algo for c in candidates}, _MATH_TYPES.get(geom.dtype, frozenset())
        timed = [c for c in _usable(perfs, timed=True)
                 if (c.algo, c.math_type) in pairs or (c.algo in names and c.math_type in allowed)]
        # A candidate with no entry of its own pair timed: a failed entry on 16-byte-aligned operands is FindEx's
        # verdict on it for this geometry (NOT_SUPPORTED: left out, rejected), but for a misaligned pointer, or
        # on operands off 16-byte boundaries at all (a search under memory pressure times a view as it is), only
        # on this call's operands, and out of memory only of this call's: neither is a verdict (PartlyTimed). Its
        # entries are those timed ones would be: its own pair's, else (none reported) its algorithm's in a math type
        # the dtype may run in (a half-precision one tried in DEFAULT_MATH is reported so, failed or not)
        ran = {(c.algo, c.math_type) for c in timed}
        statuses: dict[tuple[str, int | None], set[int]] = {}
        for perf in perfs:
            if hasattr(perf.algo, "name"):
                statuses.setdefault((perf.algo.name.lower(), int(perf.math_type)), set()).add(int(perf.status))
        aligned = alignments(x_ptr, w_ptr, y_ptr) == ALIGNED
        failed, refused = [], []
        for cand in candidates:
            if (cand.algo, cand.math_type) in ran:
                continue
            seen = statuses.get((cand.algo, cand.math_type), set())
            if not seen:
                if any(c.algo == cand.algo for c in timed):
                    continue  # timed in another math type
                seen = set().union(*(statuses.get((cand.algo, math), set()) for math in allowed))
            if seen & _OUT_OF_MEMORY:
                failed.append(cand)
            elif not aligned or _MISALIGNED in seen:
                refused.append(cand)
        if failed or refused:
            raise PartlyTimed(timed, failed, refused)
        return timed

    def run(
        self, pass_: str, candidate: Candidate, geom: Any, a: Any, b: Any, out: Any, workspace: Any, stream: Any
    ) -> None:
        # The math type cuDNN reported for this entry, so the kernel that runs is the one whose workspace was sized
        x, w, conv, y = self._descriptors(geom, candidate.math_type)
        x_ptr, w_ptr, y_ptr = pointers(pass_, a, b, out)
        algo = self._algos.get((pass_, candidate.algo))
        if algo is None:  # not a name of this pass: algorithm() raises the error that says so
            algo = self._cudnn.conv.algorithm(pass_, candidate.algo.upper())
        self._cudnn.conv.convolution(
            pass_, self._bound_handle(stream, workspace), x_desc=x, x_ptr=x_ptr, w_desc=w, w_ptr=w_ptr,
            conv_desc=conv, y_desc=y, y_ptr=y_ptr, algo=algo, workspace_ptr=workspace.ptr,
            workspace_bytes=workspace.nbytes,
        )

    def _bound_handle(self, stream: Any, workspace: Any = None) -> Any:
        """This thread's handle for the current device, bound to ``stream``.

        A workspace leased from the arena carries its stream's raw handle (an int) already: resolving ``stream``
        again would cost as much as the lease's own resolution. One leased during a capture carries the graph's pin,
        which keeps the handle while the graph exists: cuDNN does not say a captured call may outlive its handle, and
        a thread's handle is destroyed once the thread has ended (at the next handle created). Dropping it calls no
        CUDA (its finalizer queues it for that).
        """
        raw = getattr(workspace, "cuda_stream", None)
        if raw is None:
            raw = stream_handle(stream)
        handle = self._handle(raw)
        handle.set_stream(raw)
        pin = getattr(workspace, "pin", None)
        if pin is not None and id(handle) not in pin.kept:
            pin.keep([handle], frees=False, counted=False)
        return handle


def _channels_last(n: int, c: int, spatial: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Dims (N, C, *spatial) and the strides of an (N, *spatial, C) array."""
    strides = [1] * len(spatial)
    step = c
    for i in range(len(spatial) - 1, -1, -1):
        strides[i] = step
        step *= spatial[i]
    return (n, c, *spatial), (step, 1, *strides)


def pointers(pass_: str, a: Any, b: Any, out: Any) -> tuple[int, int, int]:
    """Device addresses of x, w and y for the pass's operand order (a, b, out)."""
    x, w, y = Pass.xwy(pass_, a, b, out)
    return x.data.ptr, w.data.ptr, y.data.ptr


def _all_open(descs: Sequence[Any]) -> bool:
    return not any(d.closed for d in descs)


def _close_all(descs: Sequence[Any]) -> None:
    for d in descs:
        d.close()


def _usable(perfs: Sequence[Any], *, timed: bool = False) -> list[Candidate]:
    """Successful entries in cuDNN's order, each (algorithm, math type) once, with its math type.

    cuDNN may list an algorithm once per math type, with different workspace sizes: every entry stays, so
    that a cap which excludes one (say the tensor-core one) still leaves the other. An algorithm number this
    version of wsarena does not know (a newer cuDNN) is skipped: it could not be named or forced.
    """
    seen: dict[tuple[str, int], Candidate] = {}
    for perf in perfs:
        if perf.status != 0 or not hasattr(perf.algo, "name"):
            continue
        key = (perf.algo.name.lower(), int(perf.math_type))
        if key not in seen:
            seen[key] = Candidate(key[0], int(perf.memory), float(perf.time_ms) if timed else None, key[1])
    return list(seen.values())
