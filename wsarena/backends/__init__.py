"""Backends: the same three passes on two kinds of arrays.

A backend answers four questions for a checked :class:`~wsarena._geometry.ConvGeometry` and a pass
(``"fwd"``, ``"bwd_data"``, ``"bwd_filter"``): which algorithms it would try, in order of expected speed, with
their workspace sizes (:meth:`Backend.candidates`); how fast each one really is on given operands
(:meth:`Backend.measure`); how to run one with a given workspace (:meth:`Backend.run`); and which arena its
workspaces come from (:meth:`Backend.arena`). Everything else (choice under the cap, caching, fallback when
memory runs out) is shared code in :mod:`wsarena.ops`, which the CPU backend exercises on every machine.

``cpu``   NumPy arrays; Caffe's GEMM convolution, algorithms in :mod:`wsarena.backends.cpu`.
``cudnn`` CuPy arrays; cuDNN through :mod:`wsarena.cudnn`, by the setting ``cudnn_api``: its legacy convolution
          API, or its backend (graph) API with cached execution plans (:mod:`wsarena.backends._cudnn_graph`).
          The two are distinct backend objects of the same name; their ``api`` attribute tells them apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

from .. import _forksafe
from .._gpu import gpu_unusable_reason
from .._sizes import short_repr
from ..errors import BackendUnavailableError

__all__ = [
    "Backend", "Candidate", "PartlyRanked", "PartlyTimed", "array_backend_name", "device_properties_backend",
    "get_backend", "is_masked_type", "reset_backends", "resolve_backend_name", "type_backend_name",
]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One algorithm a backend can run for a pass and geometry.

    ``time_ms`` is set only by an exhaustive search (a measurement); heuristic lists leave it ``None``.
    ``math_type`` is cuDNN's math type for this entry (tensor cores or not); the CPU leaves it ``None``.
    """

    algo: str
    workspace_bytes: int
    time_ms: float | None = None
    math_type: int | None = None


class PartlyTimed(MemoryError):
    """Raised by :meth:`Backend.measure` when some candidates went untimed for reasons of this call alone, not of
    the geometry: ``timed``, fastest first; ``failed``, those that ran out of memory of their own (beside their
    workspace), which a search ranks after the timed ones, as it ranks those it had no workspace to time; and
    ``refused``, those the backend would not time on these operands in this workspace (cuDNN's plan for their
    alignment, a pointer it calls misaligned, a plan needing more than the lease), which a search drops from its
    ranking. Neither is a verdict the search cache keeps: a later process times them again."""

    def __init__(self, timed: list[Candidate], failed: list[Candidate], refused: Sequence[Candidate] = ()) -> None:
        untimed = [("out of memory timing", failed), ("refused to time", refused)]
        super().__init__("; ".join(f"{what} {', '.join(c.algo for c in cands)}" for what, cands in untimed if cands))
        self.timed = timed
        self.failed = failed
        self.refused = list(refused)


class PartlyRanked(MemoryError):
    """Raised by :meth:`Backend.candidates` when memory kept it from ranking some candidates (cuDNN could not allocate
    what finalizing their plans takes): ``ranked``, those it could rank, best first. No verdict on the others: the
    ranking serves the call that asked (and a capture, which cannot rank), and the next one asks again. The first such
    error is its ``__cause__``."""

    def __init__(self, ranked: list[Candidate]) -> None:
        super().__init__(f"ranked {', '.join(c.algo for c in ranked)} alone: memory kept the others from being ranked")
        self.ranked = ranked


class Backend(Protocol):
    name: str
    # Errors from run() that mean "this algorithm cannot run these operands": the next candidate is tried.
    retry_errors: tuple[type[BaseException], ...]

    def device_label(self) -> str:
        """What the report prints as the device (``"cpu"``, ``"NVIDIA H100 80GB HBM3 (0)"``)."""

    def device_key(self) -> Any:
        """A hashable that tells this backend's devices apart in the algorithm cache."""

    def arena(self) -> Any:
        """The arena this backend's workspaces are leased from (for the current device)."""

    def context(self, arrays: Sequence[Any], stream: Any) -> Any:
        """A context manager: the arrays' device current (``ValueError`` if they differ) and ``stream`` current."""

    def may_share_memory(self, a: Any, b: Any) -> bool:
        """Whether two arrays may overlap in memory."""

    def algorithms(self, pass_: str) -> tuple[str, ...]:
        """Every algorithm name of ``pass_`` (for ``algo=``)."""

    def workspace_size(self, pass_: str, algo: str, geom: Any) -> int:
        """Exact workspace bytes of one algorithm."""

    def random(self, shape: tuple[int, ...], dtype: str) -> Any:
        """Random operands, for timing algorithms."""

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        """A new uninitialised array of this backend's kind."""

    def graph_allocated(self, array: Any) -> bool:
        """Whether ``array``, made during a CUDA graph capture, is memory the graph allocates and frees itself (an
        allocation node), which the ops then leave alone, rather than memory they keep while the graph exists
        (:meth:`~wsarena.arena.Arena.keep_with_capture`)."""

    def frees_when_dropped(self, array: Any) -> bool:
        """Whether dropping ``array`` (the last reference to its memory) may free device memory at once
        (``cudaFree``), which a CUDA graph capture under way forbids: not where the memory goes back to a pool, nor
        for host memory. What a graph kept so waits to be let go until no capture is under way."""

    def check_dtype(self, dtype: str) -> None:
        """Raise ``TypeError`` if this backend cannot compute in ``dtype``."""

    def candidates(self, pass_: str, geom: Any) -> list[Candidate]:
        """Usable algorithms for ``pass_`` on ``geom``, fastest expected first, with exact workspace sizes;
        :class:`PartlyRanked` where memory kept some from being ranked (a ``MemoryError`` where it kept all)."""

    def measure(
        self, pass_: str, geom: Any, a: Any, b: Any, out: Any, workspace: Any, candidates: Sequence[Candidate],
        stream: Any,
    ) -> list[Candidate]:
        """Time ``candidates`` (all fit in ``workspace``) on real operands; return them sorted by time. Those it
        rejects (it cannot run the geometry: a verdict the search cache keeps) are left out; when some ran out of
        memory of their own, or were refused on this call's operands or workspace alone, :class:`PartlyTimed` says
        which (the CPU backend raises a plain ``MemoryError`` where memory let it time none)."""

    def run(
        self, pass_: str, candidate: Candidate, geom: Any, a: Any, b: Any, out: Any, workspace: Any, stream: Any
    ) -> None:
        """Run one pass with ``candidate``, writing ``out``, using ``workspace`` (a leased :class:`Workspace`)."""


_KINDS: dict[type, str | None] = {}  # array type -> backend name, filled as types are seen


def array_backend_name(array: Any) -> str | None:
    """``"cpu"`` for a NumPy array, ``"cudnn"`` for a CuPy array, ``None`` for anything else."""
    return type_backend_name(type(array))


def is_masked_type(kind: type) -> bool:
    """Whether ``kind`` is a NumPy masked array type (or derives from one)."""
    return any(base.__module__.startswith("numpy.ma") for base in kind.__mro__)


def type_backend_name(kind: type) -> str | None:
    """:func:`array_backend_name` for an array type."""
    try:
        return _KINDS[kind]
    except KeyError:
        pass
    found: str | None = None
    # Subclasses too (a slice of a numpy.memmap is one), found by name so that CuPy is never imported here;
    # except masked arrays, whose mask a convolution would silently ignore.
    if not is_masked_type(kind):
        for base in kind.__mro__:
            if base.__name__ == "ndarray" and (base.__module__ == "numpy" or base.__module__.startswith("cupy")):
                found = "cpu" if base.__module__ == "numpy" else "cudnn"
                break
    _KINDS[kind] = found
    return found


def resolve_backend_name(name: str) -> str:
    """Turn ``"auto"`` into ``"cudnn"`` when a GPU is usable, else ``"cpu"``; check other names."""
    if name == "auto":
        return "cudnn" if gpu_unusable_reason() is None else "cpu"
    if name not in ("cpu", "cudnn"):
        raise ValueError(f"backend must be 'auto', 'cudnn' or 'cpu', not {short_repr(name)}")
    return name


_backends: dict[str, Backend] = {}
_lock = _forksafe.lock()  # guards _backends: each backend is built once per process
_PROPERTIES = "cudnn:properties:"  # the key of a device properties backend: this, then the JSON text
_PROPERTIES_KEPT = 8  # device properties backends kept, each with its plans: those asked for last


def get_backend(name: str, api: str | None = None) -> Backend:
    """The process's backend ``"cpu"`` or ``"cudnn"`` (``"auto"`` resolved first).

    For ``"cudnn"``, ``api`` (``"legacy"`` or ``"graph"``; default: the setting ``cudnn_api`` in force) says which
    API path the backend takes. Raises :class:`~wsarena.errors.BackendUnavailableError` for ``"cudnn"`` when no
    GPU is usable.
    """
    name = resolve_backend_name(name)
    if name == "cudnn":
        if api is None:
            from .._config import get_config

            api = get_config().cudnn_api
        if api not in ("legacy", "graph"):
            raise ValueError(f"api must be 'legacy' or 'graph', not {short_repr(api)}")
        key = name if api == "legacy" else f"{name}:{api}"
    else:
        key = name
    backend = _backends.get(key)
    if backend is not None:
        return backend
    if name == "cudnn":
        reason = gpu_unusable_reason()
        if reason is not None:
            raise BackendUnavailableError(f"the cudnn backend needs a usable CUDA GPU: {reason}")
    with _lock:
        if key not in _backends:
            if name == "cpu":
                _backends[key] = CpuBackend()
            elif key == "cudnn":
                from ._cudnn_backend import CudnnBackend

                _backends[key] = CudnnBackend()
            else:
                from ._cudnn_graph import CudnnGraphBackend

                _backends[key] = CudnnGraphBackend()
        return _backends[key]


def device_properties_backend(properties_json: str, source: str | None = None) -> Backend:
    """A cudnn backend on cuDNN's graph API that plans for the GPU these device properties describe (JSON that
    cuDNN serialised on that GPU, ``bench/gpu_check.py`` captures it first of all), on any machine: it ranks engine
    configurations and gives their workspace sizes, and runs nothing. Cached per JSON text, for the last
    :data:`_PROPERTIES_KEPT` texts asked for: an older one is let go, and its plans destroyed once collected
    (each backend keeps up to ``plan_cache_size`` of them, some 20 MiB for ResNet-50); a byte order mark the text
    starts with is dropped first, as :func:`wsarena.plan` drops it. ``source``: the file the JSON came from, which
    the errors name.

    Raises
    ------
    BackendUnavailableError
        cuDNN cannot finalize descriptors here: from cuDNN 9.27 on, its engine libraries need the NVIDIA driver
        library ``libcuda.so.1``, even without a GPU (docs/deviceless.md); or the loaded cuDNN is older than 9.8,
        which has no device properties.
    wsarena.cudnn.graph.DevicePropertiesError
        The properties describe no GPU this cuDNN plans for (not JSON, not the members this cuDNN version reads,
        a value no GPU has, naming the member): a ``CudnnBadParamError`` and a ``ValueError``.
    """
    from ..cudnn._deviceprops import check_members, without_bom

    properties_json = without_bom(properties_json)  # one GPU, one backend: its name read, its cache key the same
    key = _PROPERTIES + properties_json
    backend = _backends.get(key)
    if backend is not None:
        with _lock:
            if _backends.get(key) is backend:  # the most recently asked for last
                _backends[key] = _backends.pop(key)
        return backend
    from .. import cudnn
    from ..cudnn._library import load_library, missing_driver_library
    from ._cudnn_graph import CudnnGraphBackend

    needs = ("planning against device properties needs cuDNN's engine libraries, and one of them links the NVIDIA "
             "driver library libcuda.so.1, which is missing here (a GPU is not needed)")
    check_members(properties_json, source)  # a value no GPU has is bad input, said before what this machine lacks
    why = missing_driver_library(load_library().path)  # found before cuDNN prints its own line of it to stderr
    if why is not None:
        raise BackendUnavailableError(f"{needs}: {why}")
    try:
        made = CudnnGraphBackend(properties_json, source)
    except cudnn.CudnnSublibraryLoadingFailedError as exc:
        raise BackendUnavailableError(f"{needs}: {exc}") from None
    with _lock:
        if key not in _backends:
            # a generator, not a list comprehension, for the lock: wsarena.arena._interrupts, rule 8
            held = list(k for k in _backends if k.startswith(_PROPERTIES))  # noqa: C400
            for older in held[: max(len(held) - _PROPERTIES_KEPT + 1, 0)]:
                del _backends[older]  # its plans are destroyed with it, once no thread still plans with it
            _backends[key] = made
        return _backends[key]


def reset_backends() -> None:
    """Forget the backends built so far, and with them what they cached (the cuDNN descriptor sets); for tests."""
    with _lock:
        _backends.clear()


# Imported with the package, not on first use, like the rest of the CPU convolution path (see wsarena/__init__.py);
# last, because it builds on the names above.
from ._cpu_backend import CpuBackend
