"""Algorithm choice under the workspace cap, shared by every backend, the ops and the planner.

``heuristic`` takes the backend's ranked list (cuDNN's ``_v7`` heuristics; a fixed order on the CPU).
``exhaustive`` times the candidates on real operands (cuDNN's ``Find...AlgorithmEx`` with the arena as its
scratch; on the CPU each algorithm once) and ranks them by measured time. Either way the choice is the first
candidate whose workspace fits the cap. Results are cached per (backend, its cuDNN API path, device, pass,
geometry, search, cap); a search cut short because some workspace could not be had is cached too, and searched
again once that workspace can be had, and one without candidates the backend refused on its operands serves calls
on operands alike (on cuDNN, aligned alike), others searching again, unless those are operands every search times on
where it can (on cuDNN, 16-byte-aligned):
the geometry includes shapes, dtype, layout and every convolution parameter, and the cap is part of the key,
so changing the cap never serves a choice made under another one. The process keeps the choices of the last
:data:`CHOICES_MAX` keys used, as many as the ops keep call signatures (:data:`wsarena._callkeys.RECORDS_MAX`); an older
one is chosen again when asked for. Exhaustive results also outlive the process: :mod:`wsarena.searchcache` keeps each
candidate's time on disk, and a search it already holds times nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from . import _callsite, _forksafe, searchcache
from ._config import Config, get_config, using
from ._geometry import ConvGeometry, describe_geometry
from ._lru import LRU
from ._pass import Pass
from ._sizes import cap_for, exact_cap, format_size, short_repr
from .backends import Backend, Candidate, PartlyRanked, PartlyTimed
from .errors import (
    ArenaOutOfMemoryError,
    CaptureError,
    CaptureFallbackWarning,
    MemoryFallbackWarning,
    NoAlgorithmFitsError,
    SearchFallbackWarning,
    UnsupportedConvolutionError,
    WorkspaceCapWarning,
)

__all__ = [
    "cache_clear", "choose", "forced", "generation", "is_cached", "is_chosen", "is_cut_short", "is_partly_ranked",
    "is_untimed",
    "run_with_fallback", "select",
]

# Keys whose choice the process keeps, the least recently used let go first: some 2 KiB each with ten candidates (the
# graph API's), 8 KiB with forty, so that a sweep over shapes holds some 10-35 MiB at most, where it grew without end.
# As many as the ops keep call signatures, so that a signature they rebuild finds its choice here.
CHOICES_MAX = 4096
# Per key: the usable candidates best first, the candidate the cap keeps from running first (the cap warning's), 0 where
# the choice is kept for good or, for a search cut short by memory, the least workspace it could not get, and None where
# it serves any operands or, for a search the backend refused some candidates in on its operands, their key (the
# backend's operands_key): it serves calls on operands alike, and others search again; a _PartlyRanked where memory kept
# the backend from ranking some candidates (PartlyRanked): it serves a capture alone, which cannot rank, and its times,
# and what its search dropped, the next search of the key (_timed_before); _UNTIMED where a search could time nothing
# (the heuristic order): it serves a capture, which cannot search, and where memory alone stopped it, with the least
# workspace it lacked, the calls that follow until that can be had, as a search cut short does; it replaces no ranking a
# search timed.
_Entry = tuple[tuple[Candidate, ...], Candidate | None, int, Any]


@dataclasses.dataclass(frozen=True)
class _PartlyRanked:
    """The mark of a ranking the backend made without some candidates (:class:`PartlyRanked`): of those its search was
    given, per ``(algorithm, math type)``, the ones it dropped (rejected by the backend's search, or refused in a lease
    of their own or on its operands), and where some were refused, the key of those operands (the backend's
    ``operands_key``; ``None`` where every search times on operands alike, or none was refused)."""

    dropped: frozenset[tuple[str, int | None]] = frozenset()
    refused_on: Any = None


_PARTLY_RANKED = _PartlyRanked()  # a heuristic ranking's, or a search's that dropped nothing
_UNTIMED: Any = object()
# Per (algorithm, math type), what a search timed of a call: its time in ms, None where the backend's search rejected it
_Times = Mapping[tuple[str, int | None], float | None]
_cache: LRU[_Entry] = LRU(CHOICES_MAX)
_warned: LRU[bool] = LRU(CHOICES_MAX)  # the keys a WorkspaceCapWarning was given for
_captures_warned: set[str] = set()  # the streams a CaptureFallbackWarning named, by repr (no object kept alive)
_memory_warned: weakref.WeakSet[Any] = weakref.WeakSet()  # the arenas a MemoryFallbackWarning was given for
_untimed_warned: LRU[bool] = LRU(CHOICES_MAX)  # the keys a SearchFallbackWarning was given for
# The keys whose kept entry is a heuristic order waiting for the workspace memory denied its search (_UNTIMED, with what
# it lacked): a search of the same call under another key that ranks it by times wakes them (_wake). Pruned of keys the
# cache let go once it holds more than the cache does.
_waiting: set[tuple] = set()
# guards the test and mark of _warned and _untimed_warned, the three sets, _generation; never held as a backend runs
_lock = _forksafe.lock()
_generation = 0  # counts cache_clear() calls: whoever keeps a choice of its own checks it is still current


def cache_clear() -> None:
    """Forget every cached choice (and which cap, capture, memory and search warnings were already given)."""
    global _generation
    with _lock:
        _cache.clear()
        _warned.clear()
        _untimed_warned.clear()
        _captures_warned.clear()
        _memory_warned.clear()
        _waiting.clear()
        _generation += 1


def generation() -> int:
    """How many times the cache was cleared: a choice kept elsewhere is stale once this changes."""
    return _generation


def _key(backend: Backend, pass_: str, geom: ConvGeometry, search: str, cap: int | None, settings: Config) -> tuple:
    api = getattr(backend, "api", None)
    ranking = settings.cudnn_heuristic if api == "graph" else None  # what ranks the graph API's candidates
    return (backend.name, api, ranking, backend.device_key(), pass_, geom, search, cap)


def is_cached(
    backend: Backend, pass_: str, geom: ConvGeometry, *, cap: int | None, search: str,
    ranking: tuple[Candidate, ...] | None = None,
) -> bool:
    """Whether the choice for these arguments is cached for good (a search cut short by memory pressure is not, nor
    one that serves only operands like its own: see :func:`is_chosen`); with ``ranking``, what :func:`select` returned,
    whether that is it. A caller that keeps the ranking it got asks so: another thread's choice may have replaced its
    own since, which kept the ranking for good where its own was not."""
    entry = _cache.lookup(_key(backend, pass_, geom, search, cap, get_config()))
    return entry is not None and _for_good(entry) and (ranking is None or entry[0] is ranking)


def _for_good(entry: _Entry) -> bool:
    """Whether ``entry`` is kept for good: no search cut short by memory, and it serves any operands."""
    return not entry[2] and entry[3] is None


def is_chosen(backend: Backend, pass_: str, geom: ConvGeometry, *, cap: int | None, search: str) -> bool:
    """Whether a choice for these arguments is cached, for good, until memory allows a search cut short to be run
    again, for operands like the search's, until the backend can rank every candidate, or until a search times
    something: one that a capture may run without ranking or searching (``search_again=False``)."""
    return _key(backend, pass_, geom, search, cap, get_config()) in _cache


def is_cut_short(
    backend: Backend, pass_: str, geom: ConvGeometry, *, cap: int | None, search: str, ranking: tuple[Candidate, ...]
) -> bool:
    """Whether ``ranking``, what :func:`select` returned for these arguments, is the one kept for them, from a search
    that memory cut short and that serves any operands: the next call searches again once what it lacked can be had,
    which it finds out with a lease, asking for no operands."""
    entry = _cache.lookup(_key(backend, pass_, geom, search, cap, get_config()))
    return entry is not None and entry[0] is ranking and bool(entry[2]) and entry[3] is None


def is_partly_ranked(
    backend: Backend, pass_: str, geom: ConvGeometry, *, cap: int | None, search: str, ranking: tuple[Candidate, ...]
) -> bool:
    """Whether ``ranking``, what :func:`select` returned for these arguments, is the one kept for them, which the
    backend made without some candidates memory kept it from ranking (:class:`PartlyRanked`): no search timed those."""
    entry = _cache.lookup(_key(backend, pass_, geom, search, cap, get_config()))
    return entry is not None and entry[0] is ranking and isinstance(entry[3], _PartlyRanked)


def is_untimed(
    backend: Backend, pass_: str, geom: ConvGeometry, *, cap: int | None, search: str, ranking: tuple[Candidate, ...]
) -> bool:
    """Whether ``ranking``, what :func:`select` returned for these arguments, is the one kept for them, the heuristic
    order given where an exhaustive search could time nothing."""
    entry = _cache.lookup(_key(backend, pass_, geom, search, cap, get_config()))
    return entry is not None and entry[0] is ranking and entry[3] is _UNTIMED


def _fits(cands: list[Candidate], cap: int | None) -> list[Candidate]:
    return [c for c in cands if cap is None or c.workspace_bytes <= cap]


def choose(
    backend: Backend,
    pass_: str,
    geom: ConvGeometry,
    *,
    cap: int | None,
    search: str = "heuristic",
    measure: Callable[[list[Candidate]], searchcache.Found] | None = None,
    warn: bool = True,
    can_have: Callable[[int], bool] | None = None,
    known: Callable[[], _Times] | None = None,
    serves: Callable[[Any], bool] | None = None,
) -> tuple[Candidate, ...]:
    """Return the usable candidates under ``cap``, best first; the first is the choice.

    Parameters
    ----------
    measure
        For ``search="exhaustive"``: a function that times the given candidates on real operands and returns
        ``(timed, skipped)``: those it timed, fastest first, and those it had no memory to time (the ops and
        the planner provide one that leases the workspace from the arena), and may add the largest workspace it
        leased (a skipped candidate that needs no more ran out of memory of its own), and then the key of the operands
        it timed where the backend refused some candidates on them (``serves``). A candidate in neither list was
        rejected by the backend's own search, or refused in a workspace of its own size (one of the backend's
        ``retry_errors``: no want of memory) or on the operands timed (:class:`PartlyTimed`'s ``refused``), and is
        dropped. Without ``measure`` the heuristic order is used.
    can_have
        For a search cut short by memory (some candidates skipped), kept with the timed candidates first:
        ``can_have(n)`` says whether ``n`` bytes of workspace, the least that a skipped one needs, can be had
        now; if so the search runs again, else the kept ranking is served. So is a search that timed nothing where
        memory stopped every candidate of a whole ranking (not :class:`PartlyRanked`), its heuristic order kept with
        the least workspace memory denied, which a search of the same call under another cap that ranks it by times,
        the search cache on, also sends to search again (the search cache's entry may serve it). Without it, a search
        cut short runs again on every call.
    known
        For ``search="exhaustive"`` under a cap that excludes some candidates: a function that returns what searches
        timed of this call, those above the cap included (the search cache's entry, this process's uncapped search),
        per ``(algo, math_type)``: a time in ms, or ``None`` for a candidate the backend's search rejected.
    serves
        For a ranking kept from a search that dropped candidates the backend refused on its operands, kept with their
        key: ``serves(key)`` says whether it serves this call (its operands have that key); if not, the search runs
        again. For one the backend made without candidates memory kept it from ranking (:class:`PartlyRanked`), the
        key is a marker no operands have: it serves a call that cannot rank (a capture's); another call ranks again,
        and its search times only where the backend now ranks a candidate that ranking did not rank, or where what
        memory kept its search from timing can be had (``can_have``); what its search dropped stays dropped, unless
        refused on operands this call's are not alike (``serves`` of their key). Without it, either is ranked again
        on every call.
    warn
        Issue a :class:`WorkspaceCapWarning` (once per cache key) when the cap keeps the fastest algorithm from
        running: the heuristic favourite; for an exhaustive search, one above the cap that ``known`` says is faster
        than the choice and than those under the cap that memory kept the search from timing (the fastest such; one
        as fast costs nothing, and is not named), or where ``known`` has no time for the heuristic favourite, that
        one if the cap excluded it. The planner passes
        ``False``: its report shows the choice already. A search that memory cut short is said whatever ``warn`` is
        (a :class:`MemoryFallbackWarning`, once per arena): no report shows that.

    Raises
    ------
    NoAlgorithmFitsError
        When no algorithm of the pass fits in ``cap``.
    """
    pass_ = Pass(pass_)
    exhaustive = search == "exhaustive" and measure is not None
    settings = get_config()  # read once: the key and the ranking agree whatever another thread configures
    key = _key(backend, pass_, geom, "exhaustive" if exhaustive else "heuristic", cap, settings)
    entry = kept = _cache.lookup(key)  # the choice and whether a search was cut short, read at once
    if entry is not None and entry[3] is not None and not (entry[3] is _UNTIMED and entry[2]) and (
            serves is None or not serves(entry[3])):
        entry = None  # ranked without candidates refused on operands unlike this call's: the search is run again
    if entry is not None and entry[2] and (can_have is None or can_have(entry[2])):
        entry = None  # the workspace it lacked can be had now: the search is run again
    if entry is None:
        timing = measure if exhaustive else None
        if timing is not None and kept is not None and isinstance(kept[3], _PartlyRanked):
            # Ranked again, but not timed again: those memory kept its search from timing wait, as for a search cut
            # short, until what it lacked can be had, and those it dropped stay dropped, as a ranking kept without
            # them is served: unless refused on operands unlike this call's, which a search times again
            again = bool(kept[2]) and (can_have is None or can_have(kept[2]))
            mark = kept[3]
            holds = mark.refused_on is None or (serves is not None and serves(mark.refused_on))
            timing = _timed_before(kept, timing, again, mark if holds else _PARTLY_RANKED)
        with using(settings):  # what the backend reads of them (cudnn_heuristic), as the key has them
            best, excluded, lacked, untimed, only = _rank(backend, pass_, geom, cap, timing, known)
        entry = (best, excluded, lacked, only)
        # A ranking kept for good that another thread's search stored meanwhile stays: this one serves fewer calls; an
        # untimed one (for captures) leaves any ranking a search timed
        went_in = _cache.put(key, entry, keep=_timed if only is _UNTIMED else None if _for_good(entry) else _for_good)
        if only is _UNTIMED:
            if lacked and went_in:
                _wait(key)
        elif timing is not None and settings.cache_dir is not None:
            _wake(key)
        if untimed:
            _warn_memory(backend.arena(), _cut_short_text, pass_, geom, best, len(best) - untimed, lacked)
    best, excluded = entry[0], entry[1]
    # lookup(): a key in use is the most recently used here too, as in _cache, so its warning is not given again
    if warn and excluded is not None and _warned.lookup(key) is None:
        with _lock:
            first = key not in _warned
            _warned.put(key, True)
        if first:
            timed = excluded.time_ms is not None  # an exhaustive search's: the times say what the cap costs
            _callsite.warn(  # at the user's line: the op's caller, or the module call through wsarena.torch
                f"workspace cap {exact_cap(cap or 0)} excludes {_named(excluded, timed)} for {pass_} of "
                f"{describe_geometry(geom)}; using {_named(best[0], timed)}",
                WorkspaceCapWarning,
            )
    return best


def _call(key: tuple) -> tuple:
    """What of an algorithm cache key names the call a search cache entry is kept for: the backend, its API path and
    device, the pass, the geometry, the search; neither the cap nor the heuristic that ranked the candidates."""
    return key[:2] + key[3:7]


def _wait(key: tuple) -> None:
    """Note that ``key``'s entry is a heuristic order waiting for the workspace memory denied its search."""
    with _lock:
        _waiting.add(key)
        if len(_waiting) > CHOICES_MAX:  # those the cache let go wait no longer
            # a generator, not a list comprehension, for the lock: wsarena.arena._interrupts, rule 8
            _waiting.intersection_update(list(k for k in _waiting if k in _cache))  # noqa: C400


def _wake(key: tuple) -> None:
    """A search of ``key``'s call ranked it by times, so the search cache holds what it timed or read: the heuristic
    orders kept for the same call under other keys (another cap, another cuDNN heuristic), which wait for the workspace
    memory denied their search, search again at their next call, not only once that workspace can be had. That search
    reads the entry, and where it holds every candidate under their cap, times nothing and needs no workspace to: the
    entry serves, whether this process's search filled it or another process's, which this one read. Without it the
    order ran until memory allowed, whatever the entry held. A call that waits asks nothing more (no file is read)."""
    if not _waiting:  # the common case: no order waits for memory
        return
    call = _call(key)
    with _lock:
        # a generator, not a list comprehension, for the lock: wsarena.arena._interrupts, rule 8
        woken = list(k for k in _waiting if k != key and _call(k) == call)  # noqa: C400
        _waiting.difference_update(woken)
    for k in woken:
        entry = _cache.lookup(k)
        if entry is not None and entry[3] is _UNTIMED and entry[2]:
            # Still the order it kept, which serves a capture still, unless another thread's search replaced it
            _cache.put(k, (entry[0], entry[1], 0, _UNTIMED), keep=functools.partial(_is_not, entry))


def _is_not(was: _Entry, current: _Entry) -> bool:
    return current is not was


def _timed(entry: _Entry) -> bool:
    """Whether ``entry`` is no search's that timed nothing (:data:`_UNTIMED`)."""
    return entry[3] is not _UNTIMED


def _timed_before(
    kept: _Entry, measure: Callable[[list[Candidate]], searchcache.Found], again: bool, mark: _PartlyRanked
) -> Callable[[list[Candidate]], searchcache.Found]:
    """``measure``, but where ``kept``, the entry kept for the call (ranked by the backend without some candidates,
    :class:`PartlyRanked`, so ranked again by each call), ranked every candidate given but those ``mark`` says its
    search dropped, and timed one: its times, those it could not time skipped again and those it dropped dropped
    again, unless ``again`` (what memory kept its search from timing can be had now: every candidate is timed, as a
    search cut short runs again). Each call ranks again, to rank those left out once memory allows, and without this,
    times again what it timed (with the search cache off, every call; with it on, every call where the search dropped
    a candidate refused, which it does not save) and asks memory again for what it lacked; a ranking kept for good is
    timed once per process. ``mark``: what to drop again (the kept one's, or none where this call's operands are
    unlike those its candidates were refused on)."""
    ranking, lacked = kept[0], kept[2]
    times = {(c.algo, c.math_type): c.time_ms for c in ranking}

    def search(cands: list[Candidate]) -> searchcache.Found:
        fresh = [c for c in cands if (c.algo, c.math_type) not in mark.dropped]
        if again or not fresh or not all((c.algo, c.math_type) in times for c in fresh):
            return measure(cands)
        known = [times[(c.algo, c.math_type)] for c in fresh]
        if all(ms is None for ms in known):  # nothing to rank them by
            return measure(cands)
        timed = [dataclasses.replace(c, time_ms=ms) for c, ms in zip(fresh, known) if ms is not None]
        skipped = [c for c, ms in zip(fresh, known) if ms is None]
        # The largest lease, as a search reports it (_rank): those skipped below what that search lacked ran out of
        # memory of their own, and the ranking waits for what it lacked alone. Those dropped keep the key of the
        # operands they were refused on, for the next search.
        held = max((c.workspace_bytes for c in skipped if not lacked or c.workspace_bytes < lacked), default=0)
        return sorted(timed, key=lambda c: c.time_ms or 0.0), skipped, held, mark.refused_on

    return search


def _named(cand: Candidate, timed: bool) -> str:
    """``cand`` as the cap warning names it: its algorithm and workspace, and with ``timed`` its time."""
    ms = f", {cand.time_ms:.3g} ms" if timed and cand.time_ms is not None else ""
    return f"{cand.algo} ({cap_for(cand.workspace_bytes)}{ms})"


def _cut_short_text(pass_: str, geom: ConvGeometry, ranking: tuple[Candidate, ...], timed: int, lacked: int) -> str:
    """What a MemoryFallbackWarning says of a search that timed the first ``timed`` of ``ranking`` and no more."""
    skipped = ", ".join(f"{c.algo} ({cap_for(c.workspace_bytes)})" for c in ranking[timed:])
    then = (f"it runs again once {cap_for(lacked)} of workspace can be had" if lacked else
            "those the search's workspace held ran out of memory of their own, and the ranking is kept")
    return (f"an exhaustive search for {pass_} of {describe_geometry(geom)} timed "
            f"{', '.join(c.algo for c in ranking[:timed])}, not {skipped}, for want of memory: the fastest it timed "
            f"runs, and {then}")


def _warn_untimed(
    key: tuple, pass_: str, geom: ConvGeometry, memory: bool, refused: bool, why: str, lacked: int = 0
) -> None:
    """A :class:`SearchFallbackWarning`, once per cache key: an exhaustive search could time nothing, for want of
    ``memory``, ``refused`` by the backend, or both (``why`` says what of each candidate); with ``lacked``, the least
    workspace memory denied it, which the next search waits for."""
    if _untimed_warned.lookup(key) is not None:  # lookup(): a key in use is the most recently used here too
        return
    with _lock:
        if key in _untimed_warned:
            return
        _untimed_warned.put(key, True)
    cause = ("as the backend refused to time it in the workspace memory gave" if memory and refused else
             "as the backend refused to time it, not for want of memory" if refused else "for want of memory")
    _callsite.warn(
        f"an exhaustive search for {pass_} of {describe_geometry(geom)} could not time any algorithm {cause} ({why}): "
        "the call runs them in the heuristic order, as algo_search='heuristic' does, and the next call searches "
        f"again{f' once {cap_for(lacked)} of workspace can be had' if lacked else ''} (said once per call: pass, "
        "geometry and cap)",
        SearchFallbackWarning,
    )


def _rank(
    backend: Backend, pass_: str, geom: ConvGeometry, cap: int | None, measure: Callable | None,
    known: Callable[[], _Times] | None = None,
) -> tuple[tuple[Candidate, ...], Candidate | None, int, int, Any]:
    """(usable candidates best first, the candidate the cap keeps from running first (:func:`_kept_out`; without
    a search that timed something, the heuristic favourite if the cap excluded it), what to keep, how many of
    the last a search kept it could not time for want of memory, the operands it serves). What to keep: 0 where all
    were ranked (or memory stopped only candidates that ran out of memory of their own), the least workspace a
    skipped candidate needs where a search was cut short by the arena's memory, or timed nothing for want of it. The
    operands: ``None`` for any, else the key of those a search timed where the backend refused some candidates on
    them (``measure``'s fourth item), a :class:`_PartlyRanked` for a ranking the backend made without those memory
    kept it from ranking (:class:`PartlyRanked`), or :data:`_UNTIMED` where a search timed nothing (the heuristic
    order): either serves a capture, which cannot rank or search, and the next other call ranks again, or, for an
    untimed one with workspace to keep, waits until that can be had."""
    try:
        ranked, keep = backend.candidates(pass_, geom), True
    except PartlyRanked as exc:  # no verdict on those left out: this call's ranking alone
        ranked, keep = exc.ranked, False
    if not ranked:
        raise UnsupportedConvolutionError(
            f"the {backend.name} backend has no algorithm for {pass_} of {describe_geometry(geom)}"
        )
    usable = _fits(ranked, cap)
    if not usable:
        smallest = min((c.workspace_bytes for c in ranked), default=0)
        raise NoAlgorithmFitsError(
            f"no {backend.name} algorithm for {pass_} of {describe_geometry(geom)} fits the workspace cap",
            requested=smallest,
            held=0,
            cap=cap,
        )
    excluded = None if ranked[0] in usable else ranked[0]
    if measure is None:
        return tuple(usable), excluded, 0, 0, None if keep else _PARTLY_RANKED
    timed, skipped, *rest = measure(usable)  # only what fits the cap is ever timed
    # Cut short by the arena's memory: kept until the least that a skipped candidate needs can be had. Those the
    # search's largest lease held (``rest[0]``) ran out of memory of their own: that is no reason to search again.
    lacked = _lacked(skipped, rest[0] if rest else 0)
    if not timed:  # the search timed nothing: the heuristic order, as the heuristic search runs it; searched again,
        # where memory stopped every candidate (none refused or rejected) of a whole ranking, once what it lacked can
        # be had (one the backend made without some is made again by the next call, as PartlyRanked says)
        return tuple(usable), excluded, lacked if keep and len(skipped) == len(usable) else 0, 0, _UNTIMED
    order = tuple(timed) + tuple(skipped)
    if known is not None and len(usable) < len(ranked):  # the cap excludes some: is one of them faster?
        above = [c for c in ranked if cap is not None and c.workspace_bytes > cap]  # those _fits() left out
        excluded = _kept_out(above, order[0], skipped, excluded, known())
    only = rest[1] if len(rest) > 1 else None
    if not keep:  # what the search dropped, for the next search of the call (_timed_before)
        ordered = {(c.algo, c.math_type) for c in order}
        only = _PartlyRanked(frozenset((c.algo, c.math_type) for c in usable) - ordered, only)
    return order, excluded, lacked, len(skipped), only


def _lacked(skipped: list[Candidate], largest: int) -> int:
    """The least workspace that memory denied one of ``skipped``, those a search could not time, ``largest`` the
    largest workspace it leased (one that needs no more ran out of memory of its own); 0 where none was denied."""
    return min((c.workspace_bytes for c in skipped if c.workspace_bytes > largest), default=0)


def _kept_out(
    above: list[Candidate], choice: Candidate, untimed: list[Candidate], favourite: Candidate | None, times: _Times
) -> Candidate | None:
    """Which of ``above``, the candidates above the cap, the cap keeps from running in place of ``choice``, an
    exhaustive search's (timed): the fastest that ``times`` says is faster, with its time; where none is, the heuristic
    favourite if the cap excluded it and ``times`` has nothing of it (a guess, as under the heuristic search).
    ``untimed``: those under the cap that memory kept the search from timing; one that ``times`` says is faster than
    ``choice`` runs once memory allows, so the cap keeps the call only from what is faster still (memory, not the cap,
    runs ``choice`` meanwhile, which a MemoryFallbackWarning says)."""
    fits = [ms for c in untimed if (ms := times.get((c.algo, c.math_type))) is not None]
    bar = min([choice.time_ms or 0.0, *fits])
    faster = [dataclasses.replace(c, time_ms=ms) for c in above
              if (ms := times.get((c.algo, c.math_type))) is not None and ms < bar]
    if faster:
        return min(faster, key=lambda c: c.time_ms or 0.0)
    if favourite is not None and (favourite.algo, favourite.math_type) not in times:
        return favourite
    return None


def select(
    backend: Backend,
    pass_: str,
    geom: ConvGeometry,
    *,
    cap: int | None,
    search: str,
    operands: tuple[Any, Any, Any] | Callable[[], tuple[Any, Any, Any]] | None = None,
    stream: Any = None,
    warn: bool = True,
    search_again: bool = True,
) -> tuple[Candidate, ...]:
    """:func:`choose`, with an exhaustive search timed on ``operands`` (``(a, b, out)`` of the pass).

    ``operands`` may be a function that makes them, called at most once: where the choice is not cached yet, or where a
    ranking kept for operands alike asks whether these are (the planner's random operands; the ops' C-contiguous
    copies). The search leases one workspace from the backend's arena, as large as the largest candidate under the cap
    needs (or, if that cannot be had, what the stream's sub-arena holds), and times every candidate that fits; where the
    backend refuses to time what a lease holds (one of its ``retry_errors``), the next lease times the rest, and the
    candidate that lease was for is dropped, as one its search rejects, and so is one the backend refuses to time on
    these operands (:class:`PartlyTimed`'s ``refused``); neither is saved in the search cache as rejected, and the
    ranking without them serves only later calls whose operands have the same key as those timed (the backend's
    ``operands_key``: on cuDNN their alignments), others searching again; a key of ``None`` (operands every search times
    on where it can: on cuDNN, 16-byte-aligned ones, or a view's aligned copies) keeps it for good. Where nothing could
    be timed (every lease refused, memory for none, no operands to be had), the call gets the heuristic order, as the
    heuristic search would give it, with a :class:`SearchFallbackWarning`, kept for a capture alone (the next other
    call searches again) where no ranking a search timed is kept; where memory alone stopped it (no lease, or out of
    memory of their own in what each held) for every candidate of a whole ranking, kept as a search cut short is. A
    search cut short because the largest could not be had is run again once a lease of what it lacked succeeds
    (:func:`choose`'s ``can_have``), never while ``stream`` is being captured (``search_again=False``, which the ops
    pass then: a search is no graph node). :func:`wsarena.tune` passes it too, to take what the plan it made just before
    ranked.
    """
    if search != "exhaustive" or operands is None:  # a capture runs a ranking the backend made without some (serves)
        return choose(backend, pass_, geom, cap=cap, search="heuristic", warn=warn,
                      serves=None if search_again else lambda kept_for: True)
    arena = backend.arena()

    def can_have(nbytes: int) -> bool:
        # The kept ranking is the fallback: where the provider refused as much lately, it is not asked again yet.
        if not search_again or (arena.refusing and arena.defers_growth(nbytes, stream=stream)):
            return False
        try:
            with arena.lease(nbytes, stream=stream, cap=cap):
                return True
        except (ArenaOutOfMemoryError, CaptureError):  # a capture grows nothing: the kept ranking serves it
            return False

    key_of = getattr(backend, "operands_key", None)  # what of the operands decides the candidates refused on them
    made: list[tuple[Any, Any, Any]] = []
    lacking: list[str] = []  # why they could not be made: not asked for again (the text alone, holding no frames)

    def the_operands() -> tuple[Any, Any, Any]:  # made once, where asked for
        if lacking:
            raise MemoryError(lacking[0])
        if not made:
            try:
                made.append(operands() if callable(operands) else operands)
            except MemoryError as exc:
                lacking.append(str(exc) or type(exc).__name__)
                raise
        return made[0]

    def serves(searched_on: Any) -> bool:
        # A ranking without the candidates refused on the search's operands serves calls on operands alike; a capture,
        # which cannot search, runs it whatever its operands (run_with_fallback passes over those refused there)
        if not search_again:
            return True
        if isinstance(searched_on, _PartlyRanked) or searched_on is _UNTIMED or key_of is None:
            return False
        try:
            return key_of(*the_operands()) == searched_on
        except MemoryError:  # no operands to tell: the search, which has none either, falls back (measure_now)
            return False

    stored: dict[tuple[str, int | None], float | None] = {}  # what the search cache holds of the call, searched

    def measure(cands: list[Candidate]) -> searchcache.Found:
        # What an earlier process (or call under another cap) timed is read back, not timed again. A refused lease
        # is no verdict on the candidate it was sized for alone (cuDNN's FindEx refuses a call as a whole), nor is a
        # candidate the backend refused on these operands (PartlyTimed.refused: their alignment, the lease): that
        # candidate is dropped from this ranking, but neither saved as rejected nor as timed, and searched again.
        refused: list[Candidate] = []
        return searchcache.search(backend, pass_, geom, cands, lambda: measure_now(cands, refused), stored,
                                  unsaved=refused)

    def known() -> _Times:
        # What searches timed of this call above the cap: an earlier process's (the search cache: wsarena tune's),
        # and this process's uncapped search
        times = dict(stored)
        uncapped = _cache.lookup(_key(backend, pass_, geom, "exhaustive", None, get_config()))
        if uncapped is not None:
            times.update({(c.algo, c.math_type): c.time_ms for c in uncapped[0] if c.time_ms is not None})
        return times

    stopped: tuple[type[BaseException], ...] = (MemoryError, *backend.retry_errors)

    def measure_now(cands: list[Candidate], refused: list[Candidate]) -> searchcache.Found:
        try:
            return time_all(cands, refused)
        except stopped as exc:
            # No lease timed anything (memory gave none, or the backend refused to time in each), or there were no
            # operands to time on: the call runs as the heuristic search runs it (choose, for a search that timed
            # nothing), which raises only where that cannot run it either. A candidate the backend did not refuse
            # in its own lease memory stopped (run_with_fallback tried each in turn)
            untimed(any(c not in refused for c in cands), bool(refused), str(exc))
            return [], []

    said: list[tuple[tuple, bool, bool, str]] = []  # a search that timed nothing, said once choose() kept its order

    def untimed(memory: bool, refused: bool, why: str) -> None:
        # Under the settings choose() keyed the call by (it measures in a using() scope of them)
        said.append((_key(backend, pass_, geom, "exhaustive", cap, get_config()), memory, refused, why))

    def time_all(cands: list[Candidate], refused: list[Candidate]) -> searchcache.Found:
        a, b, out = the_operands()
        # The choice (and the search cache) is kept per geometry, whatever the operands' addresses: a backend whose
        # algorithms depend on them times on operands at the addresses every allocation has (timing_operands).
        timing = getattr(backend, "timing_operands", None)
        if timing is not None:
            a, b, out = timing(a, b, out)
        timed: list[Candidate] = []
        failed: list[Candidate] = []  # out of memory of their own, though the workspace held them
        # refused: those whose own lease the backend refused to time these operands in, and those it refused to time
        # on these operands in a lease that held them
        leased = [0, 0]  # the largest workspace leased, and the one the search ran in
        retry = backend.retry_errors

        def time_fitting(largest: Candidate, ws: Any) -> None:
            leased[0] = max(leased[0], ws.nbytes)
            fitting = [c for c in cands if c.workspace_bytes <= ws.nbytes]
            try:
                found = backend.measure(pass_, geom, a, b, out, ws, fitting, stream)
            except retry:  # an AlignmentWorkspaceError too: not out of memory, though a MemoryError
                refused.append(largest)
                raise
            except PartlyTimed as exc:
                found = exc.timed
                failed.extend(exc.failed)
                refused.extend(exc.refused)  # on these operands, in this lease: no verdict either
            # A backend's search may report entries of its own; only those this workspace really holds count. One
            # reported with less workspace than its candidate (cuDNN's FindEx may report less than its heuristics),
            # or, in a math type no candidate has, than the candidates of its algorithm this workspace held, is leased
            # theirs, as a search cache entry read back is (searchcache.search): a plan the same in the process that
            # searched and in the next, which reads it
            needed = searchcache.workspace_needed(cands, fitting)
            sized = (c if (n := needed(c.algo, c.math_type)) <= c.workspace_bytes
                     else dataclasses.replace(c, workspace_bytes=n) for c in found)
            timed.extend(c for c in sized if c.workspace_bytes <= ws.nbytes)
            leased[1] = ws.nbytes

        by_size = tuple(sorted(cands, key=lambda c: c.workspace_bytes, reverse=True))
        # A refused lease moves on to the next, as memory does. One refused in its own lease the backend's search
        # rejects, as it rejects an entry it reports failed: it is dropped, neither timed nor skipped for memory.
        try:
            run_with_fallback(arena, by_size, time_fitting, stream=stream, cap=cap, retry=retry)
        except NoAlgorithmFitsError as exc:
            # Memory stopped every candidate (no refusal: that would be raised): the lease of each, or what ran in the
            # one held. Each is skipped, so that the heuristic order given waits, as a search cut short does, until
            # the least workspace memory denied can be had (_rank), not searched again on every call meanwhile.
            untimed(True, False, str(exc))
            return [], list(cands), leased[0]
        skipped = [c for c in cands if (c.workspace_bytes > leased[1] and c not in refused) or c in failed]
        if not timed and (skipped or refused):  # what ran timed nothing, for reasons of this call too: as above
            said = (("no workspace could be had for", [c for c in skipped if c not in failed]),
                    ("out of memory timing", failed), ("refused to time", refused),
                    ("the search rejected", [c for c in cands if c not in skipped and c not in refused]))
            why = "; ".join(f"{what} {', '.join(c.algo for c in those)}" for what, those in said if those)
            untimed(bool(skipped), bool(refused), why)
        # Without those refused on these operands, the ranking serves only calls on operands alike (serves), unless
        # every search times on such operands where it can (key None: a search again would time them as this one did)
        only = key_of(a, b, out) if refused and key_of is not None else None
        return timed, skipped, leased[0], only

    ranking = choose(backend, pass_, geom, cap=cap, search="exhaustive", measure=measure, warn=warn,
                     can_have=can_have, known=known, serves=serves)
    for key, memory, refused, why in said:
        # What the next call does is what choose() kept: the least workspace memory denied where memory alone stopped
        # a whole ranking (_rank), else nothing to wait for
        kept = _cache.lookup(key)
        lacked = kept[2] if kept is not None and kept[0] is ranking and kept[3] is _UNTIMED else 0
        _warn_untimed(key, pass_, geom, memory, refused, why, lacked)
    return ranking


def forced(backend: Backend, pass_: str, geom: ConvGeometry, algo: str, *, cap: int | None) -> tuple[Candidate, ...]:
    """The single candidate ``algo``, checked against the backend's algorithms (or by its ``check_algorithm``, for
    a backend whose names are not a fixed list) and the cap. A call with nothing to compute (batch 0) needs no
    workspace, whatever the algorithm: its size is not asked for, and it fits any cap."""
    if not isinstance(algo, str):
        raise TypeError(f"algo must be a str, an algorithm's name, not {short_repr(algo)}")
    check = getattr(backend, "check_algorithm", None)
    if check is not None:
        check(pass_, algo)
    else:
        known = backend.algorithms(pass_)
        if algo not in known:
            raise ValueError(f"algo={short_repr(algo)} is not a {backend.name} {pass_} algorithm; known: "
                             f"{', '.join(known)}")
    nbytes = backend.workspace_size(pass_, algo, geom) if geom.batch else 0
    if cap is not None and nbytes > cap:
        raise ValueError(
            f"algo={algo!r} needs {cap_for(nbytes)} of workspace for this {pass_}, "
            f"above the cap of {exact_cap(cap)}"
        )
    return (Candidate(algo, nbytes),)


def _warn_captured(first: Candidate, ran: Candidate, held: int, refusal: CaptureError) -> None:
    """A :class:`CaptureFallbackWarning`, once per stream: a capture ran ``ran`` because its stream's buffer (``held``
    bytes) could not grow for ``first`` (``refusal`` says so, and names the stream)."""
    stream = repr(refusal.stream)
    with _lock:
        if stream in _captures_warned:
            return
        _captures_warned.add(stream)
    _callsite.warn(
        f"captured {ran.algo} ({cap_for(ran.workspace_bytes)} of workspace) in place of the first choice, "
        f"{first.algo} ({cap_for(first.workspace_bytes)}): stream {stream} holds {format_size(held)} of "
        "workspace, and a capture cannot grow it. To capture the first choice, give that stream its workspace "
        "before capturing: run the eager step on it (where memory allows), or "
        "arena.reserve(arena.stats().high_water_bytes, stream=...), or for PyTorch's captures "
        "wsarena.torch.prepare_capture(stream) (warned once per stream)",
        CaptureFallbackWarning,
    )


# Why memory denied a candidate, as a MemoryFallbackWarning says it
_REFUSED = "the memory provider refused the arena the growth it needs (see arena.stats().refused_bytes)"
_DEFERRED = "the memory provider refused the arena that much growth lately (see arena.stats().refused_bytes)"
_OWN_MEMORY = "it ran out of memory of its own, beside its workspace"


def _warn_memory(arena: Any, text: Callable[..., str], *args: Any) -> None:
    """A :class:`MemoryFallbackWarning` saying ``text(*args)``, once per arena (the text made only if said)."""
    if arena in _memory_warned:  # read without the lock first: under lasting pressure every call falls back
        return
    with _lock:
        if arena in _memory_warned:
            return
        with contextlib.suppress(TypeError):  # an arena-like object no weak reference can name: said each time
            _memory_warned.add(arena)
    _callsite.warn(
        f"{text(*args)}; said once per arena: while memory is short, other calls may fall back too",
        MemoryFallbackWarning,
    )


def _fallback_text(ran: Candidate, first: Candidate, why: str, pass_: str, geom: ConvGeometry) -> str:
    """What a MemoryFallbackWarning says of a call that ran ``ran`` where memory denied ``first`` (``why``)."""
    return (f"{ran.algo} ({cap_for(ran.workspace_bytes)} of workspace) ran in place of {first.algo} "
            f"({cap_for(first.workspace_bytes)}) for {pass_} of {describe_geometry(geom)}: {why}")


def _deferred(arena: Any, candidates: tuple[Candidate, ...], cand: Candidate, stream: Any) -> bool:
    """Whether the arena would rather not ask its provider for the workspace of ``cand``, one of ``candidates``,
    which it refused lately, a smaller candidate coming after it (:meth:`wsarena.arena.Arena.defers_growth`)."""
    rest = candidates[candidates.index(cand) + 1:]  # found here, not counted by the loop: this path is rare
    if not rest:
        return False
    least = min(c.workspace_bytes for c in rest)
    return bool(arena.defers_growth(cand.workspace_bytes, stream=stream, fallback=least))


def run_with_fallback(
    arena: Any,
    candidates: tuple[Candidate, ...],
    run: Callable[[Candidate, Any], None],
    *,
    stream: Any,
    cap: int | None,
    retry: tuple[type[BaseException], ...] = (),
    warn_for: tuple[str, ConvGeometry] | None = None,
) -> Candidate:
    """Lease a workspace for the first candidate that gets one and run it; return the candidate that ran.

    Out of memory, either way, moves on to the next candidate: if growing the arena fails, to the next ones that
    fit in what the stream's sub-arena already holds; if the algorithm itself runs out (a ``MemoryError`` from
    NumPy's temporaries, say), to the next one. While the stream is captured into a CUDA graph the arena cannot grow
    at all: a candidate that would need it to moves on, as out of memory does, to those the stream's buffer holds
    (the ones an eager step that ran out of memory fell back to), with a :class:`CaptureFallbackWarning` once per
    stream (a warm-up on another stream may have sized that one's buffer instead). If ``run`` raises one of
    ``retry`` (the backend refuses this algorithm for these operands, e.g. cuDNN's NOT_SUPPORTED), to the next one
    too. Where the provider refused as much lately and a smaller candidate comes after, one the stream's buffer
    holds, the provider is not asked again yet (:meth:`~wsarena.arena.Arena.defers_growth`): as if out of memory.
    With ``warn_for``, the call's ``(pass, geometry)``, a candidate that ran in place of one memory denied gives a
    :class:`MemoryFallbackWarning`, once per arena.
    Raises
    :class:`CaptureError` when the capture stopped every candidate, :class:`NoAlgorithmFitsError` (a
    ``MemoryError``) with the numbers when memory did, or the last refusal when one was refused.
    """
    limit: int | None = None
    failure: MemoryError | None = None
    refused: BaseException | None = None
    captured: CaptureError | None = None
    denied: tuple[Candidate, str] | None = None  # the first candidate memory denied, and how
    try:
        for cand in candidates:
            if limit is not None and cand.workspace_bytes > limit:
                continue
            if arena.refusing and _deferred(arena, candidates, cand, stream):
                limit = arena.held_bytes(stream=stream)
                denied = denied or (cand, _DEFERRED)
                continue
            try:
                with arena.lease(cand.workspace_bytes, stream=stream, cap=cap) as ws:
                    run(cand, ws)
            except ArenaOutOfMemoryError as exc:  # entering: the arena could not grow
                failure = exc
                limit = arena.held_bytes(stream=stream)
                denied = denied or (cand, _REFUSED)
                continue
            except CaptureError as exc:
                # A growth that the capture cannot hold: those the stream's buffer holds may run. A refusal of a lease
                # the buffer holds (or one that `run` raised, whose lease the buffer held) no other candidate changes.
                limit = arena.held_bytes(stream=stream)
                if cand.workspace_bytes <= limit:
                    raise
                captured = captured or exc
                continue
            except retry as exc:
                refused = exc
                continue
            except MemoryError as exc:  # the algorithm's own memory: its workspace was there, the rest was not
                failure = exc
                denied = denied or (cand, _OWN_MEMORY)
                continue
            if captured is not None:
                _warn_captured(candidates[0], cand, limit or 0, captured)
            if denied is not None and warn_for is not None:
                _warn_memory(arena, _fallback_text, cand, *denied, *warn_for)
            return cand
        if captured is not None:
            if refused is not None:
                captured.add_note(f"the algorithms the held workspace serves were refused: {refused}")
            raise captured
        if refused is not None:
            if failure is not None:
                refused.add_note(f"algorithms needing more memory could not get it: {failure}")
            raise refused
        raise NoAlgorithmFitsError(
            "out of memory: no algorithm fits in the workspace and memory the arena could provide",
            requested=candidates[0].workspace_bytes,
            held=arena.held_bytes(stream=stream) if limit is None else limit,
            cap=cap,
        ) from failure
    finally:
        # A refusal's traceback holds the frames that ran the candidate, whose operands may be the call's copies,
        # and this frame, which holds the refusal: a cycle, which would keep them until the garbage collector ran,
        # after the call's stream block (ops._run). Raised, the exception holds its traceback itself.
        failure = refused = captured = None

