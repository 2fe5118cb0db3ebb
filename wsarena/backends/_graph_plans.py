"""What the graph-API backend decides without calling cuDNN: the problem a geometry poses, which engines may run it,
and the cache of its execution plans. Tested on every machine, with fakes and against device properties
(tests/test_graph_backend.py, tests/test_cudnn_graph.py).
"""

from __future__ import annotations

import copy
import os
import warnings
import weakref
from collections.abc import Callable, Hashable
from typing import Any, cast

from .. import _forksafe
from .._config import get_config
from .._lru import LRU
from .._pass import Pass
from ..arena._capture import refuse_in_capture
from ..arena._lifecycle import _no_capture_under_way
from ..arena._pins import GraphPin

__all__ = [
    "ALIGNED", "CANDIDATES", "PlanCache", "alignment", "conv_problem", "is_engine_name", "numerics_refusal",
    "ranked_names", "shortlist", "usable",
]

ALIGNED = (16, 16, 16)  # the operands' alignment candidates are ranked for: what every CuPy allocation has
_MAX_ALIGNMENT = 16  # what tensor-core kernels ask of a pointer at most (PyTorch asks no more either)
# Engine configurations finalized into plans per pass and geometry: the heuristics' first ones (as many as the
# legacy API has algorithms), and the one needing the least workspace, so that a small cap always finds one.
# Finalizing a plan can load kernels; the heuristics list up to about 40 configurations.
CANDIDATES = 8
_PlanKey = tuple[Any, str, Any, str, tuple[int, int, int]]  # handle, pass, geometry, configuration, alignments
_PRUNE_AT = 8  # graphs a plan is kept for before those gone are forgotten (then at each power of two)

# dtype name -> (the tensors' cuDNN data type, the compute type), as cudnn.DataType member names
_TYPES = {
    "float32": ("FLOAT", "FLOAT"),
    "float16": ("HALF", "FLOAT"),
    "bfloat16": ("BFLOAT16", "FLOAT"),
    "float64": ("DOUBLE", "DOUBLE"),
}
# Numerical notes (cudnn.BackendNumericalNote values, as ints: this module loads no cuDNN enums) an engine may not
# carry, per dtype: float32 is computed in full float32 (no TF32 tensor cores, no inputs rounded down), as the
# legacy API's FMA_MATH; float16 and bfloat16 accumulate in float32 (no reduced-precision reduction), as
# TENSOR_OP_MATH does. This is a promise: algo= is held to it too (numerics_refusal).
_TENSOR_CORE, _DOWN_CONVERT, _REDUCED_REDUCTION = 0, 1, 2
_EXCLUDED_NOTES = {
    "float32": frozenset({_TENSOR_CORE, _DOWN_CONVERT}),
    "float64": frozenset({_TENSOR_CORE, _DOWN_CONVERT}),
    "float16": frozenset({_REDUCED_REDUCTION}),
    "bfloat16": frozenset({_REDUCED_REDUCTION}),
}
_NOTE_WORDS = {
    _TENSOR_CORE: "TENSOR_CORE (float32 on tensor cores is TF32)",
    _DOWN_CONVERT: "DOWN_CONVERT_INPUTS (its inputs rounded to a narrower type)",
    _REDUCED_REDUCTION: "REDUCED_PRECISION_REDUCTION (a float16 or bfloat16 accumulator)",
}
_PROMISES = {
    "float32": "float32 is computed in full float32, with no TF32",
    "float64": "float64 is computed in full float64",
    "float16": "float16 is computed in float32",
    "bfloat16": "bfloat16 is computed in float32",
}
# Behaviour notes (cudnn.BackendBehaviorNote) excluded from the candidates: an engine compiled at run time takes
# seconds to finalize. A cost, not a promise: algo= may name one.
_RUNTIME_COMPILATION = 0


def alignment(ptr: int) -> int:
    """The largest power of two up to 16 that divides the address ``ptr`` (16 for NULL)."""
    return min(ptr & -ptr, _MAX_ALIGNMENT) if ptr else _MAX_ALIGNMENT


def alignments(x: int, w: int, y: int) -> tuple[int, int, int]:
    """The alignments of the x, w and y pointers (part of a plan's key), each :func:`alignment`'s."""
    if not (x | w | y) & 15:  # all three on 16-byte boundaries, as every allocation is: one test, not three calls
        return ALIGNED
    return alignment(x), alignment(w), alignment(y)


def is_engine_name(algo: str) -> bool:
    """Whether ``algo`` names an engine configuration (``"eng..."``) rather than a legacy algorithm."""
    return algo.startswith("eng")


def usable(dtype: str, numerical: frozenset[int], behaviour: frozenset[int]) -> bool:
    """Whether an engine with these notes is a candidate for ``dtype``: it computes ``dtype`` as wsarena promises
    (:func:`numerics_refusal`) and is not compiled at run time (module comments)."""
    return _RUNTIME_COMPILATION not in behaviour and numerics_refusal(dtype, numerical) is None


def numerics_refusal(dtype: str, numerical: frozenset[int]) -> str | None:
    """Why an engine with these numerical notes does not compute ``dtype`` as wsarena promises; ``None`` if it
    does."""
    broken = sorted(numerical & _EXCLUDED_NOTES[dtype])
    if not broken:
        return None
    notes = ", ".join(_NOTE_WORDS[note] for note in broken)
    return f"its engine's numerical notes include {notes}, and {_PROMISES[dtype]}"


def _contiguous(shape: tuple[int, ...], channels_last: bool) -> tuple[int, ...]:
    """Strides in elements of ``shape`` (N, C, *spatial), stored in that order or as (N, *spatial, C)."""
    order = [0, *range(2, len(shape)), 1] if channels_last else list(range(len(shape)))
    strides = [0] * len(shape)
    step = 1
    for axis in reversed(order):
        strides[axis] = step
        step *= max(shape[axis], 1)
    return tuple(strides)


def conv_problem(pass_: str, geom: Any, aligned: tuple[int, int, int] = ALIGNED) -> Any:
    """The :class:`wsarena.cudnn.graph.ConvProblem` of one pass of ``geom`` with operands of these alignments.

    A 1-D convolution is described as a 2-D one of unit height, as the legacy descriptors do.
    """
    from ..cudnn import DataType, graph

    data, compute = _TYPES[geom.dtype]
    k, cpg = geom.out_channels, geom.in_channels // geom.groups
    shapes = [(geom.batch, geom.in_channels, *geom.input_size), (k, cpg, *geom.kernel_size),
              (geom.batch, k, *geom.output_size)]
    padding, stride, dilation = geom.padding, geom.stride, geom.dilation
    if geom.nd == 1:
        shapes = [(s[0], s[1], 1, s[2]) for s in shapes]
        padding, stride, dilation = (0, *padding), (1, *stride), (1, *dilation)
    channels_last = geom.layout == "NHWC"
    dims = (shapes[0], shapes[1], shapes[2])
    strides = (_contiguous(dims[0], channels_last), _contiguous(dims[1], channels_last),
               _contiguous(dims[2], channels_last))
    return graph.ConvProblem(Pass(pass_), DataType[data], DataType[compute], dims, strides, padding, stride,
                             dilation, aligned)


def ranked_names(
    graph_api: Any, op_graph: Any, dtype: str, *, properties: Any = None, mode: Any = None, handle: Any = None,
    short: list[MemoryError] | None = None,
) -> list[tuple[str, int]]:
    """``(name, workspace bytes)`` of the usable engine configurations for ``op_graph``: the heuristics' (``mode``,
    default INSTANT) in their order, then those of cuDNN's fallback list not named yet.

    On cuDNN 9.0 and 9.1 a configuration's size is that of a plan finalized for it (``handle``'s device, or that
    of ``properties``; :func:`~wsarena.cudnn.graph.config_workspace`), and one whose plan cuDNN refuses is left
    out. One whose plan cuDNN could not allocate for (a ``MemoryError``) is left out too, its error appended to
    ``short``; without ``short``, the error is raised.
    """
    from ..cudnn import BackendHeurMode

    ranked: dict[str, int] = {}
    modes = (BackendHeurMode.MODE_INSTANT if mode is None else mode, BackendHeurMode.MODE_FALLBACK)
    for heur_mode in dict.fromkeys(modes):
        for cfg in graph_api.engine_configs(op_graph, heur_mode, properties=properties):
            name = graph_api.config_name(cfg)
            if name in ranked or not usable(dtype, *graph_api.engine_notes(cfg)):
                continue
            try:
                nbytes = graph_api.config_workspace(cfg, handle=handle, properties=properties)
            except MemoryError as exc:
                if short is None:
                    raise
                short.append(exc)
                continue
            if nbytes is not None:
                ranked[name] = nbytes
    return list(ranked.items())


def shortlist(ranked: list[tuple[str, int]], limit: int = CANDIDATES) -> list[str]:
    """The names to finalize: the first ``limit``, then the one needing the least workspace if it is not among
    them (the earliest of equals)."""
    names = [name for name, _ in ranked[:limit]]
    if ranked:
        smallest = min(ranked, key=lambda item: item[1])
        if smallest[0] not in names and smallest[1] < min(nbytes for _, nbytes in ranked[:limit]):
            names.append(smallest[0])
    return names


class PlanCache:
    """The execution plans of one backend, and the operation graphs they are built from, in two bounded LRUs.

    A plan is keyed by what decides it: the handle it is built for (per host thread and device), the pass, the
    geometry, the configuration name and the three operands' alignments; a graph likewise without the name. The
    bound is the setting ``plan_cache_size``, read on every miss. A plan closed by mistake is built again.

    A configuration refused for a key (one of ``refused``: cuDNN's NOT_SUPPORTED, e.g. a tensor-core engine for
    operands aligned below 16 bytes) is remembered under it like a plan: asking again raises a copy of the error
    without finalizing anything. Operands at such an alignment reach every call through the refused candidates
    before the one that runs, and a failed finalize costs some 85 us.

    A plan executed while its stream was captured into a CUDA graph (``plan(..., pin=)``) is kept as long as that
    graph exists, even once evicted: the graph's kernels use what the plan owns, and before cuDNN 9.28 (or with
    ``CUDNN_CUDA_GRAPH_RETENTION=none``) nothing else keeps it (cuDNN's header, on ``cudnnCudaGraphRetention_t``).
    A miss of its key takes it back into the cache, built already (during a capture too). An evicted plan is
    destroyed once nothing refers to it; one kept for graphs, by the first miss that builds after they are all gone
    (a miss builds nothing during a capture, so this never destroys a plan in the middle of one). A cache collected
    while such graphs exist (its backend dropped) leaves the plans to their pins (``_hand_over``); its other plans go
    with it, or, while a capture that an arena knows of is under way in any thread, once none is.

    Parameters
    ----------
    build_graph : callable
        ``build_graph(handle, pass_, geom, aligned)`` -> a finalized operation graph.
    build_plan : callable
        ``build_plan(handle, graph, name)`` -> a finalized plan (with ``closed`` and ``close()``).
    refused : tuple of exception types
        What ``build_plan`` raises when the configuration cannot be built for that key, ever.
    """

    def __init__(
        self, build_graph: Callable[..., Any], build_plan: Callable[..., Any],
        refused: tuple[type[BaseException], ...] = (),
    ) -> None:
        size = get_config().plan_cache_size
        self._build_graph = build_graph
        self._build_plan = build_plan
        self._refused = refused
        self._graphs: LRU[Any] = _lru(size)
        self._plans: LRU[Any] = _lru(size)
        # a plan's key -> (the plan, the pins of the CUDA graphs that captured it: wsarena.arena._pins.GraphPin)
        self._captured: dict[_PlanKey, tuple[Any, list[Any]]] = {}
        # (plan, pins) of the plans clear() found a graph might still use, never destroyed (clear's docstring)
        self._spared: list[tuple[Any, list[Any]]] = []
        self._lock = _forksafe.lock()  # guards _captured, _spared and their lists
        self._stores = [self._plans]  # the plans' LRU, for the finalizer (a forked child's is another)
        _caches.add(self)
        # Collected (its backend dropped: reset_backends()), the cache leaves what graphs may still use to them
        weakref.finalize(self, _hand_over, self._captured, self._spared, self._stores).atexit = False

    def built(self) -> list[Any]:
        """The finalized plans held, least recently used first; the configurations' cached refusals left out."""
        return [plan for plan in self._plans.values() if type(plan) is not _Refusal]

    def graph(self, handle: Any, pass_: str, geom: Any, aligned: tuple[int, int, int] = ALIGNED) -> Any:
        key: Hashable = (handle, pass_, geom, aligned)
        return self._graphs.get(key, lambda: self._miss(self._graphs, self._build_graph, handle, pass_, geom,
                                                        aligned))

    def plan(
        self, handle: Any, pass_: str, geom: Any, name: str, aligned: tuple[int, int, int] = ALIGNED,
        stream: Any = None, pin: Any = None,
    ) -> Any:
        """The finalized plan of engine configuration ``name``.

        ``stream``: where it will run (a raw handle, or :data:`~wsarena.arena._capture.CURRENT`), which must not be
        being captured if the plan is to be built (a finalize can load kernels and allocate). ``pin``: the pin of
        the CUDA graph it is about to be executed into (the lease's), which keeps the plan while it exists.
        """
        key: _PlanKey = (handle, pass_, geom, name, aligned)
        plan = self._plans.lookup(key)
        if plan is None:  # the miss's closure in a function of its own: a hit, every call's case, makes none
            plan = self._get(key, stream)
        if type(plan) is _Refusal:
            raise plan.again()
        if pin is not None:
            self._keep(key, plan, pin)
        return plan

    def _keep(self, key: _PlanKey, plan: Any, pin: Any) -> None:
        with self._lock:
            entry = self._captured.get(key)
            if entry is None or entry[0] is not plan:
                # Another plan of the key was closed (valid= rebuilt it): clear() closes none a graph may still use
                self._captured[key] = (plan, [pin])
                return
            pins = entry[1]
            if pin in pins:
                return
            if len(pins) >= _PRUNE_AT and len(pins) & (len(pins) - 1) == 0:  # a plan captured again and again
                # a generator, not a list comprehension, for the lock: wsarena.arena._interrupts, rule 8
                pins[:] = list(p for p in pins if p.live())  # noqa: C400
            pins.append(pin)

    def kept(self) -> list[Any]:
        """The plans kept for CUDA graphs that may still exist (``plan(..., pin=)``): cached, evicted, or spared by
        :meth:`clear`."""
        with self._lock:
            # a generator, not a list comprehension, for the lock: wsarena.arena._interrupts, rule 8
            kept = [*self._captured.values(), *self._spared]
            return list(plan for plan, pins in kept if any(p.live() for p in pins))  # noqa: C400

    def _let_go(self) -> None:
        """Stop keeping the plans whose graphs are all gone; one evicted meanwhile is destroyed as its last
        reference goes (here, outside the lock)."""
        if not self._captured:
            return
        with self._lock:
            live = _Asked()  # one question per pin: a step's plans share its graph's
            # a generator, not a list comprehension, for the lock: wsarena.arena._interrupts, rule 8
            gone = list(key for key, (_, pins) in self._captured.items() if not any(map(live, pins)))  # noqa: C400
            dropped = [self._captured.pop(key) for key in gone]
        del dropped

    def _get(self, key: _PlanKey, stream: Any) -> Any:
        return self._plans.get(key, lambda: self._build(key, stream))

    def _build(self, key: _PlanKey, stream: Any) -> Any:
        kept = self._captured.get(key)  # evicted while a graph holds it: taken back, not built again
        if kept is not None and not kept[0].closed:
            return kept[0]
        if stream is not None:
            refuse_in_capture(stream, "finalize a cuDNN execution plan (is plan_cache_size smaller than the step?)")
        self._let_go()
        handle, pass_, geom, name, aligned = key
        graph = self.graph(handle, pass_, geom, aligned)
        try:
            return self._miss(self._plans, self._build_plan, handle, graph, name)
        except self._refused as exc:
            return _Refusal(exc)

    def _forget_all(self) -> list[Any]:
        """Start empty, destroying nothing, and return what was held. Takes no lock: it runs in a forked child's
        at-fork hook, where no other thread is (a lock the parent's threads held is freed by :mod:`wsarena._forksafe`'s
        hook, before this one)."""
        held = [self._plans, self._graphs, dict(self._captured), list(self._spared)]
        self._plans, self._graphs = _lru(self._plans.maxsize), _lru(self._graphs.maxsize)
        self._captured.clear()  # in place: the finalizer (_hand_over) holds these three
        self._spared.clear()
        self._stores[:] = [self._plans]
        return held

    @staticmethod
    def _miss(lru: LRU[Any], build: Callable[..., Any], *args: Any) -> Any:
        lru.maxsize = get_config().plan_cache_size
        return build(*args)

    def __len__(self) -> int:
        return len(self._plans)

    @property
    def builds(self) -> int:
        """Misses so far: plans built, or taken back from those kept for graphs (a cached call has none)."""
        return self._plans.builds

    def clear(self) -> None:
        """Destroy every cached plan now, before the handles they were built for, but those a CUDA graph that may
        still exist ran, and forget the graphs. :func:`~wsarena.cudnn.close_all_handles` runs this, at exit or
        when a caller ends all cuDNN use, and then destroys the handles.

        The plans a graph may still use are never destroyed, as the arena never frees a buffer a graph holds: the
        graph may be launched again, or still run after a launch with no synchronisation. Destroyed later, they
        would go after their handles, which no cuDNN documentation allows. They stay until the process ends; a
        bounded cost, only for the graphs alive at the call.
        """
        plans = self._plans.values()
        self._plans.clear()
        self._graphs.clear()
        with self._lock:
            live = _Asked()
            # generators, not list comprehensions, for the lock: wsarena.arena._interrupts, rule 8
            spared = list(entry for entry in self._captured.values() if any(map(live, entry[1])))  # noqa: C400
            gone = list(plan for plan, pins in self._captured.values() if not any(map(live, pins)))  # noqa: C400
            self._captured.clear()
            self._spared += spared
        kept = {id(plan) for plan, _ in spared}
        for plan in plans + gone:
            if id(plan) not in kept:
                _close(plan)


def _lru(size: int) -> LRU[Any]:
    return LRU(size, valid=_open, discard=_close)


_caches: weakref.WeakSet[PlanCache] = weakref.WeakSet()
_forsaken: list[Any] = []  # never destroyed: in a forked child, the parent's plans and graphs (below); the plans
# clear() spared of a cache collected since (_hand_over)
_handing: dict[int, Any] = {}  # what a collected cache kept for graphs, held while _hand_over hands it over


def _after_fork_in_child() -> None:
    """In a forked child: the parent's plans and graphs are the parent's, and CUDA cannot run here (destroying an
    execution plan may unload the kernels it loaded). They are forgotten, none destroyed, as the handles they were
    built with are (:mod:`wsarena.cudnn.handle`): held here until the process ends, when their finalizers no longer
    run, so that neither the child's exit (close_all_handles) nor a collection destroys them."""
    for cache in list(_caches):
        _forsaken.append(cache._forget_all())


os.register_at_fork(after_in_child=_after_fork_in_child)


def _hand_over(
    captured: dict[_PlanKey, tuple[Any, list[Any]]], spared: list[tuple[Any, list[Any]]], stores: list[LRU[Any]],
) -> None:
    """A plan cache was collected with the plans it kept for CUDA graphs (``captured``, ``spared``) and those it cached
    (``stores``): each that a graph may still use goes to the pins of those graphs
    (:meth:`~wsarena.arena._pins.GraphPin.keep`), which let go of it once CUDA has destroyed them and no capture is
    under way (destroying a plan may unload the kernels it loaded), rather than being destroyed with the cache while a
    graph replays it: through a :class:`_Handed`, which never destroys it after its handle. Those
    :meth:`PlanCache.clear` spared, whose handles are destroyed, are never destroyed (:data:`_forsaken`), their graphs
    gone since or not. The rest go as the cache does, unless a capture that an arena knows of is under way (in any
    thread: CUDA's global mode); then they go to a pin no graph holds, and so once none is, at the first trim, stats or
    growth, capture block's end or eager lease's look (:func:`~wsarena.arena._pins.let_go_kept`).

    A collector's callback: a Ctrl-C in it is lost (reported as ignored), and so would be the plans not handed over
    yet. They are held for good (:data:`_handing`) until every one is."""
    records = (captured, spared, stores)
    _handing[id(records)] = records  # first, one C call: an interrupt from here on leaves them held, never destroyed
    live = _Asked()
    rest: dict[int, tuple[Any, Any]] = {}  # what no graph may use: (plan, its handle), by id
    for store in stores:
        for key, plan in store.items():
            if type(plan) is not _Refusal:
                rest[id(plan)] = (plan, cast(_PlanKey, key)[0])
    for key, (plan, pins) in list(captured.items()):
        held = [pin for pin in pins if live(pin)]
        if held:
            handed = _Handed(plan, key[0])
            for pin in held:
                pin.keep([handed], frees=True, counted=False)
            rest.pop(id(plan), None)
        else:
            rest.setdefault(id(plan), (plan, key[0]))
    if spared:  # their graphs gone or not: their handles are destroyed
        _forsaken.append(spared)
    rest = {key: entry for key, entry in rest.items() if not entry[0].closed}
    if rest and not _no_capture_under_way():
        later = GraphPin()
        later.never_held()  # no graph: let go of once no capture is under way
        later.keep([_Handed(plan, handle) for plan, handle in rest.values()], frees=True, counted=False)
    del _handing[id(records)]


class _Handed:
    """A plan a collected cache left to the pins of the graphs that may still use it, or, while a capture is under
    way, to a pin no graph holds (:func:`_hand_over`). Let go of by the last of them, it destroys the plan while it
    still holds the plan's handle, unless that handle was destroyed already (:func:`~wsarena.cudnn.close_all_handles`,
    at exit too): that plan is never destroyed (:data:`_forsaken`), as :meth:`PlanCache.clear` spares it."""

    __slots__ = ("__weakref__",)

    def __init__(self, plan: Any, handle: Any) -> None:
        weakref.finalize(self, _let_go_handed, plan, handle).atexit = False


def _let_go_handed(plan: Any, handle: Any) -> None:
    if getattr(handle, "closed", False):
        _forsaken.append(plan)
        return
    try:
        plan.close()  # here, where the handle is held: dropped first, it could be destroyed first
    except Exception as exc:  # noqa: BLE001 - a finalizer: warn, never raise
        warnings.warn(f"wsarena: destroying an execution plan failed: {exc}", ResourceWarning, stacklevel=1)


class _Asked:
    """``live(pin)``: whether ``pin``'s graph may still exist, asked of each pin once."""

    def __init__(self) -> None:
        self._answers: dict[int, bool] = {}

    def __call__(self, pin: Any) -> bool:
        answer = self._answers.get(id(pin))
        if answer is None:
            answer = self._answers[id(pin)] = pin.live()
        return answer


class _Refusal:
    """A configuration's refusal, cached in place of its plan."""

    __slots__ = ("error",)
    closed = False

    def __init__(self, error: BaseException) -> None:
        self.error = error.with_traceback(None)

    def again(self) -> BaseException:
        """A copy of the error, so that raising it does not lengthen the cached one's traceback."""
        return copy.copy(self.error)

    def close(self) -> None:
        pass


def _open(value: Any) -> bool:
    return not value.closed


def _close(value: Any) -> None:
    value.close()
