"""The ``cudnn`` backend through cuDNN's backend (graph) API: execution plans built once, cached, and executed.

Selected by the setting ``cudnn_api="graph"``. What it shares with the legacy backend it inherits from it
(devices, streams, arrays); what differs is a candidate: an engine configuration, named ``"eng28:tile_size=3"``
(:func:`wsarena.cudnn.graph.config_name`), whose finalized execution plan gives its exact workspace size. The
shared choice under the cap (:mod:`wsarena.algos`) ranks these candidates as it ranks the legacy algorithms.

Plans are cached (:class:`~wsarena.backends._graph_plans.PlanCache`) per cuDNN handle (one per host thread and
device, as PyTorch keeps its plans per thread), pass, geometry, configuration name and operand alignment. A
cached call finds its plan, binds the handle to the workspace's stream if it changed, and executes it with the
operands' and the workspace's pointers.

A geometry for which no engine configuration is usable runs through the legacy API, with a one-time
:class:`~wsarena.errors.CudnnApiFallbackWarning`; its candidates then carry the legacy algorithm names, and every
method here hands a legacy name to the legacy backend.

Built with device properties instead (``CudnnGraphBackend(properties_json, source)``: JSON captured on a GPU, and
the file it came from, for the errors), the backend plans for that GPU on any machine: operation graphs,
heuristics and plans need no device then, so it answers :meth:`candidates` and :meth:`workspace_size` (what
``wsarena report --device-properties`` asks), and refuses to run or time anything.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import Any

from .. import _callsite
from .._config import get_config
from .._geometry import ITEMSIZES, describe_geometry
from .._sizes import short_repr
from ..arena._capture import CURRENT, refuse_in_capture
from ..errors import AlignmentWorkspaceError, BackendUnavailableError, CudnnApiFallbackWarning
from . import Candidate, PartlyRanked, PartlyTimed
from ._cudnn_backend import CudnnBackend, pointers
from ._graph_plans import (
    ALIGNED,
    PlanCache,
    alignments,
    conv_problem,
    is_engine_name,
    numerics_refusal,
    ranked_names,
    shortlist,
)

_TIMED_RUNS = 3  # executions timed per candidate in an exhaustive search (the fewest counts)


class CudnnGraphBackend(CudnnBackend):
    api = "graph"

    def __init__(self, properties_json: str | None = None, source: str | None = None) -> None:
        super().__init__()
        from ..cudnn import graph
        from ..cudnn._deviceprops import members

        self._graph = graph
        self._fallbacks: set[tuple[str, Any]] = set()  # (pass, geometry) already warned about
        self._properties: Any = None
        self._target = ""
        if properties_json is not None:
            self._properties = graph.device_properties(properties_json, source=source)
            name = (members(properties_json) or {}).get("deviceName", "a GPU")  # as cuDNN reads it
            digest = hashlib.sha256(properties_json.encode()).hexdigest()[:12]
            self._target = f"{name} (device properties {digest})"
        # Builders that do not hold the backend: its bound methods made a cycle (backend, cache, method), so that a
        # dropped backend's plans were destroyed whenever the collector ran, in any thread (a capture's among them)
        self._plans = PlanCache(functools.partial(_operation_graph, graph),
                                functools.partial(_execution_plan, graph, self._properties),
                                refused=self.retry_errors[:1])
        # A plan that needs more workspace for a call's operands than its candidate was leased: the next candidate
        # is tried, and a lone one (algo=) raises it as it is, rather than as "no algorithm fits".
        self.retry_errors = (*self.retry_errors, AlignmentWorkspaceError)
        self._cudnn.handle.on_close_all(self._plans.clear)  # plans go before the handles they were built with

    # -- where -------------------------------------------------------------------------------------------------
    def _handle(self, stream: int | None = None) -> Any:
        return None if self._properties is not None else super()._handle(stream)

    def device_key(self) -> Any:
        return self._target if self._properties is not None else super().device_key()

    def device_label(self) -> str:
        return self._target if self._properties is not None else super().device_label()

    def arena(self) -> Any:
        self._no_device("lease a workspace")
        return super().arena()

    def _bound_handle(self, stream: Any, workspace: Any = None) -> Any:
        self._no_device("run a convolution")
        return super()._bound_handle(stream, workspace)

    def _here(self) -> Any:
        """Where a plan built outside a run would run: CuPy's current stream (the ops make the call's stream
        current), which must not be being captured; planning for device properties, none."""
        return None if self._properties is not None else CURRENT

    def _no_device(self, what: str) -> None:
        if self._properties is not None:
            raise BackendUnavailableError(f"cannot {what} on {self._target}: it plans for that GPU, it has none")

    # -- building (the cuDNN calls) ----------------------------------------------------------------------------
    def _build_graph(self, handle: Any, pass_: str, geom: Any, aligned: tuple[int, int, int]) -> Any:
        return _operation_graph(self._graph, handle, pass_, geom, aligned)

    def _build_plan(self, handle: Any, graph: Any, name: str) -> Any:
        return _execution_plan(self._graph, self._properties, handle, graph, name)

    def _ranked(self, handle: Any, pass_: str, geom: Any) -> list[Candidate]:
        """The shortlisted usable engine configurations, as candidates with their plans' workspace sizes
        (heuristics' order, then cuDNN's fallback list; :func:`~wsarena.backends._graph_plans.shortlist`), and
        last, unless one of them is it, the first configuration that runs operands aligned only to their element
        size (:meth:`_general`).

        A plan cuDNN could not allocate for (host or device memory) is no verdict on its configuration: the
        candidates ranked without it are raised as :class:`~wsarena.backends.PartlyRanked` (the call runs them, as
        does a capture, and the next call ranks again), and where none could be ranked, the first such error, its
        message naming the pass and the geometry."""
        from ..cudnn.backend import has_attribute

        graph = self._plans.graph(handle, pass_, geom)
        here = self._here()
        if here is not None and not has_attribute(self._cudnn.BackendAttributeName.ENGINECFG_WORKSPACE_SIZE):
            # cuDNN 9.0 and 9.1 size each configuration by a plan finalized for it (graph.config_workspace),
            # outside the plan cache and its own refusal
            refuse_in_capture(here, "finalize a cuDNN execution plan")
        mode = self._cudnn.BackendHeurMode.MODE_B if get_config().cudnn_heuristic == "b" else None  # None: INSTANT
        short: list[MemoryError] = []  # what cuDNN could not allocate for, finalizing a plan
        ranked = ranked_names(self._graph, graph, geom.dtype, properties=self._properties, mode=mode, handle=handle,
                              short=short)

        def size(name: str) -> int | None:
            try:
                return self._workspace(handle, pass_, geom, name)
            except MemoryError as exc:
                short.append(exc)
                return None

        sizes = {name: size(name) for name in shortlist(ranked)}
        kept = {name: nbytes for name, nbytes in sizes.items() if nbytes is not None}
        general = self._general(handle, pass_, geom, [*kept, *(name for name, _ in ranked)], short)
        if general is not None:
            name, nbytes = general
            aligned = kept[name] if name in kept else size(name)
            if aligned is not None:  # its lease must hold the plan for either alignment
                kept[name] = max(nbytes, aligned)
        cands = [Candidate(name, nbytes) for name, nbytes in kept.items()]
        if short and not cands:  # cuDNN's error names a descriptor's kind alone: the message names the call
            first = short[0]
            text = (f"cuDNN could not allocate what ranking the engines for {pass_} of {describe_geometry(geom)} "
                    f"takes: {first}")
            if isinstance(first, self._cudnn.CudnnError):
                raise self._cudnn.CudnnError(int(first.status), text, first.func_name, first.context) from first
            raise MemoryError(text) from first
        if short:
            raise PartlyRanked(cands) from short[0]
        return cands

    def _workspace(self, handle: Any, pass_: str, geom: Any, name: str) -> int | None:
        """The workspace size of the (cached) plan of ``name`` for 16-byte-aligned operands; ``None`` when
        cuDNN refuses to finalize it (the heuristics list configurations their kernels then refuse). A
        ``MemoryError`` where cuDNN could not allocate what finalizing it takes: no verdict on it."""
        try:
            return int(self._plans.plan(handle, pass_, geom, name, stream=self._here()).workspace_bytes)
        except self._cudnn.CudnnError as exc:
            if isinstance(exc, (self._cudnn.CudnnNotInitializedError, MemoryError)):
                raise  # the handle or the library, or memory, not this configuration
            return None

    def _general(
        self, handle: Any, pass_: str, geom: Any, names: list[str], short: list[MemoryError] | None = None,
    ) -> tuple[str, int] | None:
        """``(name, workspace bytes)`` of the first of ``names`` (the candidates, then the rest in rank order)
        whose plan finalizes for operands aligned only to their element size; ``None`` if none does.

        The candidates are ranked for 16-byte-aligned operands (what every allocation has). A view at another
        offset is run by the plan for its own alignment (the plan cache's key), which tensor-core engines refuse:
        for float16 NHWC, often every one of the first candidates. This one runs it, where the legacy API would.
        Probed outside the plan cache, so that planning adds nothing to it that a call may never use. A finalize
        cuDNN could not allocate for (a ``MemoryError``) is appended to ``short``, and the probe goes on (without
        ``short``, it is raised).
        """
        smallest = (ITEMSIZES[geom.dtype],) * 3
        here = self._here()
        if here is not None:
            refuse_in_capture(here, "finalize a cuDNN execution plan")
        try:
            graph = self._build_graph(handle, pass_, geom, smallest)
        except self.retry_errors + (self._cudnn.CudnnBadParamError,):
            return None
        except MemoryError as exc:
            if short is None:
                raise
            short.append(exc)
            return None
        for name in dict.fromkeys(names):
            try:
                plan = self._build_plan(handle, graph, name)
            except self._cudnn.CudnnError as exc:
                if isinstance(exc, self._cudnn.CudnnNotInitializedError):
                    raise
                if isinstance(exc, MemoryError):
                    if short is None:
                        raise
                    short.append(exc)
                continue
            plan.close()
            return name, plan.workspace_bytes
        return None

    # -- algorithms --------------------------------------------------------------------------------------------
    def check_algorithm(self, pass_: str, algo: str) -> None:
        """Accept a legacy algorithm name (it runs through the legacy API) or an engine configuration name."""
        if algo in super().algorithms(pass_):
            return
        try:
            self._graph.parse_name(algo)
        except ValueError as exc:
            raise ValueError(f"algo={short_repr(algo)} is neither a cudnn {pass_} algorithm of the legacy API "
                             f"({', '.join(super().algorithms(pass_))}) nor {exc}") from None

    def workspace_size(self, pass_: str, algo: str, geom: Any) -> int:
        """The workspace of ``algo`` (what ``algo=`` leases): a legacy algorithm's, or an engine configuration's
        plan's for 16-byte-aligned operands. A call whose operands are aligned otherwise runs the plan for their
        alignment, and raises :class:`~wsarena.errors.AlignmentWorkspaceError` if that one needs more. A call with
        nothing to compute (batch 0) needs none, and builds no plan.

        Raises
        ------
        ValueError
            The engine does not compute ``geom``'s dtype as wsarena promises (its numerical notes: TF32 tensor
            cores or inputs rounded down for float32, a half-precision accumulator for float16), the engines the
            candidates leave out. There is no opt-in.
        """
        if not is_engine_name(algo):
            return super().workspace_size(pass_, algo, geom)
        if not geom.batch:  # cuDNN takes no tensor of no images to build a plan for
            self.check_algorithm(pass_, algo)
            return 0
        plan = self._plans.plan(self._handle(), pass_, geom, algo, stream=self._here())
        why = numerics_refusal(geom.dtype, plan.numerical_notes)
        if why is not None:
            raise ValueError(f"algo={algo!r} does not compute {geom.dtype} as wsarena promises: {why}; the "
                             f"configurations 'wsarena report' lists for this convolution do")
        return int(plan.workspace_bytes)

    def candidates(self, pass_: str, geom: Any) -> list[Candidate]:
        try:
            cands = self._ranked(self._handle(), pass_, geom)
        except self.retry_errors + (self._cudnn.CudnnBadParamError,) as exc:
            cands, reason = [], f"cuDNN refused its operation graph ({exc})"
        else:
            reason = "no engine configuration is usable"
        if cands or self._properties is not None:  # planning for another GPU: no legacy API to fall back on
            return cands
        key = (pass_, geom)
        if key not in self._fallbacks:
            self._fallbacks.add(key)
            _callsite.warn(
                f"cuDNN's graph API runs no {pass_} of {describe_geometry(geom)}: {reason}; "
                "using the legacy API for it", CudnnApiFallbackWarning,
            )
        return super().candidates(pass_, geom)

    def measure(
        self, pass_: str, geom: Any, a: Any, b: Any, out: Any, workspace: Any, candidates: Sequence[Candidate],
        stream: Any,
    ) -> list[Candidate]:
        """Time each engine configuration's plan for these operands' alignment, on the lease's stream.

        One whose plan cuDNN refuses to finalize or execute for 16-byte-aligned operands is left out: the engine
        cannot run the geometry, which the search cache keeps. What the operands or the lease alone decide, a plan
        refused for a view's alignment, one that needs more workspace than the lease holds, an execution cuDNN refuses
        for a misaligned pointer or on a view, is no verdict on the engine: :class:`~wsarena.backends.PartlyTimed`
        names those (``refused``) beside the timed ones, and those whose plan cuDNN could not allocate for (host or
        device memory, finalizing or running it: ``failed``, out of memory of their own).
        """
        self._no_device("time algorithms")
        if not any(is_engine_name(c.algo) for c in candidates):
            return super().measure(pass_, geom, a, b, out, workspace, candidates, stream)
        handle = self._bound_handle(stream, workspace)
        raw = handle.stream  # the stream it was just bound to: the lease's, or the call's own
        x, w, y = pointers(pass_, a, b, out)
        aligned = alignments(x, w, y)
        runtime = self._cupy.cuda.runtime
        start, end = runtime.eventCreate(), runtime.eventCreate()
        timed: list[Candidate] = []
        refused: list[Candidate] = []  # untimed on these operands or in this lease alone: no verdict (PartlyTimed)
        failed: list[Candidate] = []  # cuDNN could not allocate what finalizing or running its plan takes
        short = (self._cudnn.CudnnInternalErrorHostAllocationFailedError,
                 self._cudnn.CudnnInternalErrorDeviceAllocationFailedError)
        try:
            for cand in candidates:
                try:
                    plan = self._plans.plan(handle, pass_, geom, cand.algo, aligned)
                except self.retry_errors:
                    # cuDNN refuses to finalize it: for 16-byte-aligned operands, those the candidates were ranked
                    # and sized for, a verdict on the engine for this geometry (left out: rejected); for a view's
                    # own alignment (operands a search under memory pressure takes as they are), on these alone
                    if aligned != ALIGNED:
                        refused.append(cand)
                    continue
                except short:
                    failed.append(cand)
                    continue
                if plan.workspace_bytes > workspace.nbytes:  # the plan for these operands' alignment needs more
                    refused.append(cand)
                    continue
                try:
                    plan.execute(handle, x, w, y, workspace.ptr)  # warm-up: loads the kernels
                except self.retry_errors as exc:
                    # A finalized plan refused at execution: for a misaligned pointer (x, w and y aligned, the
                    # workspace's), or on a view's alignment, these pointers alone; else (NOT_SUPPORTED on 16-byte-
                    # aligned operands, in a lease that holds it) the engine's verdict on the geometry: left out
                    if aligned != ALIGNED or isinstance(exc, self._cudnn.CudnnBadParamMisalignedPointerError):
                        refused.append(cand)
                    continue
                except short:
                    failed.append(cand)
                    continue
                best = float("inf")
                try:
                    for _ in range(_TIMED_RUNS):
                        runtime.eventRecord(start, raw)
                        plan.execute(handle, x, w, y, workspace.ptr)
                        runtime.eventRecord(end, raw)
                        runtime.eventSynchronize(end)
                        best = min(best, float(runtime.eventElapsedTime(start, end)))
                except short:  # as in its warm-up: the engine's own, not the rest of this workspace's
                    failed.append(cand)
                    continue
                timed.append(Candidate(cand.algo, cand.workspace_bytes, best, cand.math_type))
        finally:
            runtime.eventDestroy(start)
            runtime.eventDestroy(end)
        timed.sort(key=lambda c: c.time_ms or 0.0)
        if refused or failed:
            raise PartlyTimed(timed, failed, refused)
        return timed

    def run(
        self, pass_: str, candidate: Candidate, geom: Any, a: Any, b: Any, out: Any, workspace: Any, stream: Any
    ) -> None:
        name = candidate.algo
        if not is_engine_name(name):
            super().run(pass_, candidate, geom, a, b, out, workspace, stream)
            return
        handle = self._bound_handle(stream, workspace)
        x, w, y = pointers(pass_, a, b, out)
        aligned = alignments(x, w, y)
        # stream=: checked for a capture before a plan is finalized, the stream the handle was just bound to (the
        # lease's, or the call's own where a workspace carries none), not resolved again. pin=: the
        # CUDA graph being captured, if any (the lease's), for which the plan is kept: its kernel uses what it owns.
        plan = self._plans.plan(handle, pass_, geom, name, aligned, stream=handle.stream, pin=workspace.pin)
        if plan.workspace_bytes > workspace.nbytes:
            # The lease is the candidate's size, which is its plan's for 16-byte-aligned operands; the plan for
            # these operands' alignment must not write past it. One of retry_errors: run_with_fallback moves on.
            raise AlignmentWorkspaceError(
                f"cuDNN's plan {name} for operands aligned to {aligned[0]}, {aligned[1]} and {aligned[2]} bytes (x, "
                f"w, y) needs more workspace than its plan for 16-byte-aligned operands, the size leased for it; "
                f"forced with algo=, it cannot run these operands: copy them to 16-byte-aligned addresses or leave "
                f"algo= out",
                requested=plan.workspace_bytes, held=workspace.nbytes, cap=get_config().cap_workspace,
            )
        plan.execute(handle, x, w, y, workspace.ptr)


def _operation_graph(graph_api: Any, handle: Any, pass_: str, geom: Any, aligned: tuple[int, int, int]) -> Any:
    """The finalized operation graph of one pass of ``geom`` with operands of these alignments."""
    return graph_api.operation_graph(conv_problem(pass_, geom, aligned), handle=handle)


def _execution_plan(graph_api: Any, properties: Any, handle: Any, graph: Any, name: str) -> Any:
    """The finalized plan of engine configuration ``name`` for ``graph``, on ``handle``'s device or for
    ``properties``."""
    cfg = graph_api.engine_config(graph, name, properties=properties)
    return graph_api.execution_plan(cfg, name, handle=handle, properties=properties)
