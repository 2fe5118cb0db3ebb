"""The cap-versus-speed curve: what each workspace cap costs in step time, and the cap to pick.

:func:`tune` times every candidate algorithm of every layer and pass once: an exhaustive search with no cap, on
the arena's workspace, as :func:`wsarena.plan` runs it (a geometry seen before is not timed again, and the
persistent search cache serves what an earlier process timed). Under a cap every call takes the fastest timed
algorithm that fits, as the ops do, so for any cap the step time (the sum, over the layers and passes, of the
chosen algorithms' times) and the arena it needs (per stream, the largest chosen workspace) follow from these
measurements without timing anything again.

The curve has one point per cap that changes some choice: from the smallest cap every call fits in (0 when every
pass has a zero-workspace algorithm) up to the smallest cap that changes nothing any more, then the uncapped point
(``cap_workspace_bytes`` ``None``). A point's ``slowdown`` is its step time over the uncapped one, minus 1; where
the uncapped step took no time the timer could measure (0), it is 0 for a point as fast and infinity for a slower
one. The recommended cap is the smallest whose slowdown is within ``max_slowdown``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any

from . import searchcache
from ._config import _given, _named_size, config
from ._geometry import ConvGeometry
from ._pass import PASSES
from ._sizes import short_repr
from .algos import is_partly_ranked, select
from .backends import Candidate, get_backend
from .errors import NoAlgorithmFitsError
from .planner import (
    LayerPlan,
    Plan,
    _operands,
    _stream_bytes,
    _stream_slots,
    _streams,
    checked_layers,
    plan,
    skipped_layers,
)

__all__ = ["CurvePoint", "Tuning", "tune"]

# A slowdown computed as a ratio of float sums can miss a threshold it meets exactly by a rounding error.
_ROUNDING = 1e-12

_Measured = Mapping[tuple[str, ConvGeometry], tuple[Candidate, ...]]


@dataclasses.dataclass(frozen=True)
class CurvePoint:
    """One point of the curve: under ``cap_workspace_bytes`` (``None``: no cap), the arena and the step time."""

    cap_workspace_bytes: int | None
    arena_bytes: int
    step_seconds: float
    slowdown: float

    def to_dict(self) -> dict[str, Any]:
        """The point as JSON takes it: an infinite ``slowdown`` (against an uncapped step of 0) is ``None``."""
        return {**dataclasses.asdict(self), "slowdown": self.slowdown if math.isfinite(self.slowdown) else None}


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The outcome of :func:`tune`. ``to_dict()`` is the JSON object ``wsarena tune --format json`` prints.

    Attributes
    ----------
    uncapped : Plan
        The plan with no cap (the model, backend, device and run it was tuned for).
    measured : mapping
        ``(pass, geometry) -> candidates``: every distinct call's timed algorithms, fastest first.
    curve : tuple of CurvePoint
        Sorted by cap, the uncapped point last.
    max_slowdown : float
        The slowdown the recommendation allows (0.02 for 2 %).
    recommended_cap_bytes : int
        The smallest cap whose slowdown is within ``max_slowdown``.
    search_seconds : float
        How long the measurements took (nothing when the caches held them all).
    timed_calls, cached_calls : int
        Of the distinct calls, how many were timed now and how many the search cache answered; the rest this
        process had searched before (its algorithm cache).
    untimed_calls : int
        Of the distinct calls, how many had algorithms that memory kept from being ranked (the backend ranked the
        others alone) or timed (a :class:`~wsarena.MemoryFallbackWarning` says so, once per arena): the curve leaves
        those algorithms out.
    """

    uncapped: Plan
    measured: _Measured
    curve: tuple[CurvePoint, ...]
    max_slowdown: float
    recommended_cap_bytes: int
    search_seconds: float
    shared_streams: bool = True
    timed_calls: int = 0
    cached_calls: int = 0
    untimed_calls: int = 0

    @property
    def recommended(self) -> CurvePoint:
        """The curve's point at the recommended cap."""
        return next(p for p in self.curve if p.cap_workspace_bytes == self.recommended_cap_bytes)

    def plan(self, cap: Any = "recommended") -> Plan:
        """The plan under ``cap``, from these measurements: bytes, a size (``"8MiB"``) or ``None`` (``"none"``)
        as ``plan(cap_workspace=...)`` takes it; default the recommended cap."""
        if isinstance(cap, str) and cap == "recommended":
            cap = self.recommended_cap_bytes
        else:
            cap = _named_size("cap", cap)
        layers = _layer_plans(self.uncapped.layers, self.uncapped.passes, self.measured, cap)
        if layers is None:
            smallest = self.curve[0].cap_workspace_bytes or 0
            raise NoAlgorithmFitsError("some convolution has no timed algorithm within the cap",
                                       requested=smallest, held=0, cap=cap)
        # max_slowdown says the cap was chosen by it: true of the recommended cap only
        chosen = self.max_slowdown if cap == self.recommended_cap_bytes else None
        return dataclasses.replace(
            self.uncapped, cap_workspace=cap, layers=tuple(layers), max_slowdown=chosen,
            stream_bytes=_stream_bytes(layers, self.uncapped.streams, self.shared_streams,
                                       [lp.stream for lp in layers]),
        )

    def to_dict(self) -> dict[str, Any]:
        head = self.uncapped.to_dict()
        keys = ("wsarena_version", "model", "backend", "device", "batch", "dtype", "layout", "streams", "search")
        return {
            **{k: head[k] for k in keys},
            "passes": list(self.uncapped.passes),
            "curve": [p.to_dict() for p in self.curve],
            "recommended_cap_bytes": self.recommended_cap_bytes,
            "max_slowdown": self.max_slowdown,
            "distinct_calls": len(self.measured),
            "search_seconds": self.search_seconds,
            "timed_calls": self.timed_calls,
            "cached_calls": self.cached_calls,
            "untimed_calls": self.untimed_calls,
            "skipped_layers": head["skipped_layers"],  # the curve leaves these layers out
        }


def check_max_slowdown(value: Any) -> float:
    """``value`` as a slowdown fraction (``0.02`` for 2 %): any real number, NumPy's included, but not a bool;
    ``ValueError``/``TypeError`` naming the argument."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"max_slowdown must be a number (0.02 for 2 %), not {short_repr(value)}")
    try:
        fraction = float(value)
    except OverflowError:  # an int past float's range
        fraction = math.inf
    if not math.isfinite(fraction) or fraction < 0:
        raise ValueError(f"max_slowdown must be a finite fraction >= 0 (0.02 for 2 %), not {short_repr(value)}")
    return fraction + 0.0  # -0.0 is 0: shown as "-0%" it would read as a slowdown below nothing


def tune(
    layers: Iterable[Any],
    *,
    batch: int = 1,
    dtype: Any = "float32",
    layout: str = "NCHW",
    passes: Sequence[str] = PASSES,
    streams: int | Sequence[int] = 1,
    backend: str | None = None,
    max_slowdown: float = 0.02,
    model: str | os.PathLike[str] = "",
    progress: Callable[[int, int, str], None] | None = None,
) -> Tuning:
    """Time every algorithm of every layer and pass once; the cap-versus-step-time curve and the cap to pick.

    Parameters are those of :func:`wsarena.plan` (the search is exhaustive and there is no cap), plus
    ``max_slowdown``: the slowdown against no cap that the recommended cap may cost (0.02 for 2 %).
    """
    max_slowdown = check_max_slowdown(max_slowdown)
    skipped, layers = skipped_layers(layers), checked_layers(layers)
    shared, _ = _streams(streams, len(layers))
    start, searched_before = time.perf_counter(), searchcache.counts()
    # The settings plan() searches under, the backend included, in one block around the plan and what follows: the
    # same cuDNN API and heuristic whatever another thread configures meanwhile. An invalid variable of a setting
    # given here does not matter, as in plan().
    with config(**_given(algo_search="exhaustive", backend=backend, cap_workspace=None)):
        # The planner checks the arguments and runs the searches (one per distinct call, with progress) ...
        uncapped = plan(layers, batch=batch, dtype=dtype, layout=layout, cap_workspace=None, passes=passes,
                        streams=streams, backend=backend, search="exhaustive", model=model, progress=progress)
        uncapped = dataclasses.replace(uncapped, skipped=skipped) if skipped else uncapped
        seconds = time.perf_counter() - start
        searches = [now - before for now, before in zip(searchcache.counts(), searched_before)]
        # ... whose every candidate the algorithm cache now holds, fastest first (the choice is the first): what the
        # plan ranked is taken as it is (search_again=False), not ranked or timed again where the plan's ranking is not
        # kept for good (memory kept the backend from ranking some candidates, or the search from timing some).
        impl = get_backend(uncapped.backend)
        measured: dict[tuple[str, ConvGeometry], tuple[Candidate, ...]] = {}
        untimed = 0  # calls with algorithms memory kept from being ranked, or a search kept but could not time
        for lp in uncapped.layers:
            for pass_ in uncapped.passes:
                key = (pass_, lp.geometry)
                if key in measured:
                    continue
                operands = functools.partial(_operands, impl, pass_, lp.geometry)
                ranked = select(impl, pass_, lp.geometry, cap=None, search="exhaustive", operands=operands, warn=False,
                                search_again=False)
                timed = tuple(c for c in ranked if c.time_ms is not None)
                untimed += len(timed) < len(ranked) or is_partly_ranked(
                    impl, pass_, lp.geometry, cap=None, search="exhaustive", ranking=ranked)
                if not timed:
                    raise NoAlgorithmFitsError(
                        f"no {pass_} algorithm of layer {short_repr(lp.name)} could be timed{_lacking(operands)}",
                        requested=min(c.workspace_bytes for c in ranked), held=0, cap=None,
                    )
                measured[key] = timed
    curve = _curve(uncapped, measured, shared)
    recommended = next(p.cap_workspace_bytes for p in curve
                       if p.cap_workspace_bytes is not None and _within(p.slowdown, max_slowdown))
    # (Other threads' searches meanwhile would count too; each call is searched once here.)
    cached_calls, timed_calls = (min(n, len(measured)) for n in searches)
    return Tuning(uncapped, measured, curve, max_slowdown, recommended, seconds, shared, timed_calls, cached_calls,
                  untimed)


def _lacking(operands: Callable[[], Any]) -> str:
    """What to add to the error of a call none of whose algorithms could be timed, where memory for its operands was
    the cause: the search had none to time on, and the sizes the error gives (the least workspace requested, none
    held) are not what memory lacked. ``operands``, as the search made them, are made again to tell, on this error
    path alone; where they can be had, the workspace or the backend stopped the search, and nothing is added, as
    where making them fails otherwise now (a CUDA error): no cause to tell, and the error to raise is the search's."""
    try:
        operands()
    except MemoryError as exc:
        return f": memory for its operands could not be had ({str(exc) or type(exc).__name__}), whatever the workspace"
    except Exception:  # noqa: BLE001 - made again only to tell: what else fails is not raised in the search's place
        return ""
    return ""


def _layer_plans(
    layers: Sequence[LayerPlan], passes: Sequence[str], measured: _Measured, cap: int | None
) -> list[LayerPlan] | None:
    """Every layer with, per pass, the fastest timed algorithm within ``cap``; ``None`` if some call has none."""
    chosen: dict[tuple[str, ConvGeometry], Candidate] = {}
    for key, cands in measured.items():
        fits = next((c for c in cands if cap is None or c.workspace_bytes <= cap), None)
        if fits is None:
            return None
        chosen[key] = fits
    return [dataclasses.replace(lp, choices={p: chosen[(p, lp.geometry)] for p in passes}) for lp in layers]


def _curve(uncapped: Plan, measured: _Measured, shared: bool) -> tuple[CurvePoint, ...]:
    """The caps swept upwards: a call's choice changes only at the workspace of an algorithm faster than the one
    it has, so the step time and the arena follow from these changes, each counted once for every layer that makes
    the call, not from every layer's choices at every cap (a model of thousands of layers has thousands of caps)."""
    calls: Counter[tuple[str, ConvGeometry]] = Counter()
    lanes: dict[tuple[str, ConvGeometry], set[int]] = {}  # the streams that make each call, by their stream_bytes entry
    slots = _stream_slots(lp.stream for lp in uncapped.layers)
    for lp in uncapped.layers:
        for pass_ in uncapped.passes:
            calls[(pass_, lp.geometry)] += 1
            lanes.setdefault((pass_, lp.geometry), set()).add(0 if shared else slots[lp.stream])
    changes: dict[int, list[tuple[tuple[str, ConvGeometry], Candidate]]] = {}
    for key, cands in measured.items():
        best = len(cands)  # under a cap a call takes the first of its candidates (fastest first) that fits
        for rank, cand in sorted(enumerate(cands), key=lambda rc: (rc[1].workspace_bytes, rc[0])):
            if rank < best:
                best = rank
                changes.setdefault(cand.workspace_bytes, []).append((key, cand))
    chosen: dict[tuple[str, ConvGeometry], Candidate] = {}
    total = Fraction(0)  # the step's milliseconds, exact: rounded once, as math.fsum of every call's time would be
    largest = [0] * uncapped.streams  # per stream the largest chosen workspace: a call's only grows with the cap
    steps: list[tuple[int | None, int, float]] = []
    for cap in sorted(changes):
        for key, cand in changes[cap]:
            before = chosen.get(key)
            if before is not None:
                total -= calls[key] * Fraction(before.time_ms or 0.0)
            total += calls[key] * Fraction(cand.time_ms or 0.0)
            chosen[key] = cand
            for lane in lanes[key]:
                largest[lane] = max(largest[lane], cand.workspace_bytes)
        if len(chosen) == len(calls):  # from the smallest cap every call fits in
            arena = largest[0] * uncapped.streams if shared else sum(largest)
            steps.append((cap, arena, float(total) / 1e3))
    steps.append((None, *steps[-1][1:]))  # every algorithm fits the largest cap
    fastest = steps[-1][2]
    return tuple(CurvePoint(cap, arena, step, _slowdown(step, fastest)) for cap, arena, step in steps)


def _within(slowdown: float, max_slowdown: float) -> bool:
    """Whether a point of ``slowdown`` is within ``max_slowdown``, as the recommendation judges it."""
    return slowdown <= max_slowdown + _ROUNDING


def _slowdown(step: float, fastest: float) -> float:
    """``step`` over ``fastest`` minus 1; against a step timed at 0 (below the timer's resolution, or a search
    cache's 0), 0 for a step as fast and infinity for a slower one, which no ``max_slowdown`` admits."""
    if fastest > 0:
        return step / fastest - 1.0
    return 0.0 if step <= fastest else math.inf
