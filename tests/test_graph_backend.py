"""The graph-API cudnn backend without a GPU: its plan cache with fakes, its routing and fallback with fakes, and
the whole planning path for real against device properties (cuDNN builds plans for an H100 on this machine).

GPU runs of the same backend are in test_cudnn_backend.py and test_planner.py, parametrized over ``cudnn_api``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import subprocess
import sys
import threading
import warnings
import weakref
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import wsarena
from wsarena import algos, config, configure
from wsarena._geometry import conv_geometry, describe_geometry
from wsarena._search_env import api_path
from wsarena.arena import Arena
from wsarena.arena._pins import GraphPin, KeptBytes, let_go_kept
from wsarena.arena.testing import FakeGraph, RecordingProvider
from wsarena.backends import Candidate, PartlyTimed, device_properties_backend, reset_backends
from wsarena.backends._cudnn_backend import CudnnBackend
from wsarena.backends._graph_plans import ALIGNED, PlanCache, alignment, conv_problem, is_engine_name
from wsarena.cli import main
from wsarena.cudnn import Status as cudnn_status
from wsarena.errors import (
    AlignmentWorkspaceError,
    BackendUnavailableError,
    CaptureError,
    CudnnApiFallbackWarning,
    MemoryFallbackWarning,
    NoAlgorithmFitsError,
    WorkspaceMemoryError,
)

from .capture_helpers import S1
from .cudnn_probe import driver
from .forking import fork

H100 = Path(__file__).parent / "data" / "h100-handwritten.json"
GEOM = conv_geometry((2, 4, 9, 9), (6, 4, 3, 3), padding=1)


class FakePlan:
    numerical_notes = frozenset()

    def __init__(self, name):
        self.name, self.closed, self.workspace_bytes = name, False, len(name)

    def close(self):
        self.closed = True


class Builder:
    def __init__(self):
        self.graphs, self.plans = [], []

    def graph(self, handle, pass_, geom, aligned):
        self.graphs.append((handle, pass_, geom, aligned))
        return FakePlan(f"graph{len(self.graphs)}")

    def plan(self, handle, graph, name):
        made = FakePlan(name)
        self.plans.append((handle, graph.name, name, made))
        return made


def test_alignment_and_engine_names():
    assert [alignment(p) for p in (0, 1, 2, 6, 8, 0x1000, 0x1008, 0x100C)] == [16, 1, 2, 2, 8, 16, 8, 4]
    assert is_engine_name("eng0") and is_engine_name("eng28:tile_size=3") and not is_engine_name("implicit_gemm")


def test_the_run_keys_its_plan_by_each_pointers_alignment():
    """The run's one test for three 16-byte-aligned pointers gives what alignment() gives each, for any mix."""
    from itertools import product

    from wsarena.backends._graph_plans import alignments

    pointers = (0, 0x1000, 0x1008, 0x100C, 0x1002, 0x1001, 0x1010, 0x1004)
    for x, w, y in product(pointers, repeat=3):
        assert alignments(x, w, y) == (alignment(x), alignment(w), alignment(y)), (x, w, y)


def test_a_cached_plan_is_built_once_per_handle_pass_geometry_name_and_alignment():
    b = Builder()
    cache = PlanCache(b.graph, b.plan)
    first = cache.plan("h1", "fwd", GEOM, "eng1")
    assert cache.plan("h1", "fwd", GEOM, "eng1") is first and cache.builds == 1
    assert cache.plan("h1", "fwd", GEOM, "eng2") is not first  # another name, same graph
    assert len(b.graphs) == 1
    cache.plan("h2", "fwd", GEOM, "eng1")  # another thread's handle
    cache.plan("h1", "bwd_data", GEOM, "eng1")
    cache.plan("h1", "fwd", GEOM.with_batch(3), "eng1")
    cache.plan("h1", "fwd", GEOM, "eng1", (16, 4, 16))  # a misaligned operand: its own graph and plan
    assert cache.builds == 6 and len(b.graphs) == 5
    assert b.graphs[-1][3] == (16, 4, 16) and b.graphs[0][3] == ALIGNED


def test_a_closed_plan_is_built_again_and_the_bound_is_the_setting():
    b = Builder()
    configure(plan_cache_size=2)
    cache = PlanCache(b.graph, b.plan)
    first = cache.plan("h", "fwd", GEOM, "eng1")
    first.close()
    assert cache.plan("h", "fwd", GEOM, "eng1") is not first
    for name in ("eng2", "eng3", "eng4"):
        cache.plan("h", "fwd", GEOM, name)
    assert len(cache) == 2
    configure(plan_cache_size=3)  # read on the next miss
    cache.plan("h", "fwd", GEOM, "eng5")
    cache.plan("h", "fwd", GEOM, "eng6")
    assert len(cache) == 3


def test_clear_destroys_every_cached_plan():
    b = Builder()
    cache = PlanCache(b.graph, b.plan)
    plans = [cache.plan("h", "fwd", GEOM, f"eng{i}") for i in range(3)]
    cache.clear()
    assert all(p.closed for p in plans) and len(cache) == 0
    assert cache.plan("h", "fwd", GEOM, "eng0") is not plans[0]


def _captured_graph():
    """A graph being captured, holding a pin as CUDA holds the arena's (``close()`` runs the pin's destructor)."""
    graph, pin = FakeGraph(), GraphPin()
    graph.retain(pin)
    return graph, pin


def _weak_builder():
    """A build_plan that keeps only weak references to the plans it makes: they die when the cache lets go."""
    made = []

    def build(handle, graph, name):
        plan = FakePlan(name)
        made.append(weakref.ref(plan))
        return plan

    return build, made


def test_a_plan_a_graph_captured_outlives_its_eviction_until_the_graph_is_gone():
    """A captured kernel uses what its plan owns (before cuDNN 9.28 nothing else keeps it): an evicted plan that a
    graph still holds is neither destroyed nor collected, and it goes at the first miss after the graph is gone."""
    build, made = _weak_builder()
    with config(plan_cache_size=1):
        cache = PlanCache(lambda *args: FakePlan("graph"), build)
        graph, pin = _captured_graph()
        cache.plan("h", "fwd", GEOM, "eng1", pin=pin)
        cache.plan("h", "fwd", GEOM, "eng2")  # evicts eng1
        cache.plan("h", "fwd", GEOM, "eng3")  # a miss while the graph lives
        kept = made[0]()
        assert kept is not None and not kept.closed and cache.kept() == [kept]
        del kept
        assert made[1]() is None  # evicted, and no graph ran it: gone at once
        graph.close()
        assert made[0]() is not None  # nothing built since
        cache.plan("h", "fwd", GEOM, "eng4")
        assert made[0]() is None and cache.kept() == []


def test_a_plan_a_graph_holds_outlives_its_cache_until_the_graph_is_gone():
    """A backend dropped (reset_backends()) takes its plan cache with it: a plan a graph may still replay is left to
    the graph's pin, not destroyed with the cache (a captured kernel uses what its plan owns), and goes once CUDA has
    destroyed the graph and no capture is under way (destroying a plan may unload its kernels). A plan no graph ran
    goes with the cache."""
    build, made = _weak_builder()
    cache = PlanCache(lambda *args: FakePlan("graph"), build)
    graph, pin = FakeGraph(), GraphPin(KeptBytes())  # as the arena's: it counts what it keeps for stats()
    graph.retain(pin)
    cache.plan("h", "fwd", GEOM, "eng1", pin=pin)
    cache.plan("h", "fwd", GEOM, "eng2")
    del cache
    gc.collect()
    assert made[1]() is None
    assert made[0]() is not None and not made[0]().closed and pin.tally.owners == {}  # no array to count
    let_go_kept(lambda: True)  # the graph lives: kept
    assert made[0]() is not None
    graph.close()
    let_go_kept(lambda: False)  # a capture under way: kept
    assert made[0]() is not None
    let_go_kept(lambda: True)
    assert made[0]() is None


def test_a_dropped_backends_plans_go_with_it_not_at_a_later_collection():
    """The backend and its plan cache made a cycle (the cache held the backend's bound methods to build with): a
    dropped backend's plans were destroyed whenever the collector ran next, in any thread, a capture's too. The cache
    holds builders that do not hold the backend: dropped, it goes at once, and its plans with it."""
    from wsarena.backends._cudnn_graph import CudnnGraphBackend

    backend = CudnnGraphBackend()
    plan = FakePlan("eng1")
    backend._plans._plans.put(("h", "fwd", GEOM, "eng1", ALIGNED), plan)
    cache, made = weakref.ref(backend._plans), weakref.ref(plan)
    del plan
    gc.collect()
    gc.disable()
    try:
        del backend
        assert cache() is None and made() is None
    finally:
        gc.enable()


def test_a_collected_caches_plans_wait_for_a_capture_under_way_to_end():
    """Destroying an execution plan may unload the kernels cuDNN compiled for it at run time (cuModuleUnload), which
    breaks a CUDA graph capture under way in any thread (CUDA's global mode). A cache collected (its backend dropped)
    while a capture that an arena knows of is under way destroys none of its plans, those no graph ran too: they go
    at the first trim, stats or growth once it is over (let_go_kept). With none under way, they go with the cache."""
    build, made = _weak_builder()
    provider = RecordingProvider(device_id=0)
    arena = Arena(provider)
    cache = PlanCache(lambda *args: FakePlan("graph"), build)
    graph, pin = _captured_graph()
    cache.plan("h", "fwd", GEOM, "eng1", pin=pin)  # a graph ran it; the graph gone since
    cache.plan("h", "fwd", GEOM, "eng2")
    graph.close()
    capture = provider.begin_capture(S1)
    assert arena.keep_with_capture([np.empty(8)], stream=S1)  # the arena knows of the capture
    del cache
    gc.collect()
    assert all(ref() is not None and not ref().closed for ref in made)
    arena.trim()  # the capture still under way
    assert all(ref() is not None and not ref().closed for ref in made)
    provider.end_capture(capture)
    arena.trim()
    assert all(ref() is None for ref in made)
    cache = PlanCache(lambda *args: FakePlan("graph"), build)
    cache.plan("h", "fwd", GEOM, "eng3")
    del cache
    assert made[-1]() is None
    capture.close()


def test_the_plans_clear_spared_are_never_destroyed_once_their_cache_is_gone():
    """clear() (close_all_handles) spares the plans of graphs that may still exist for good: their handles are
    destroyed next. The cache collected later destroys none of them, even once the graph is gone."""
    build, made = _weak_builder()
    cache = PlanCache(lambda *args: FakePlan("graph"), build)
    graph, pin = _captured_graph()
    cache.plan("h", "fwd", GEOM, "eng1", pin=pin)
    cache.clear()
    del cache
    gc.collect()
    graph.close()
    let_go_kept(lambda: True)
    assert made[0]() is not None and not made[0]().closed


def test_the_plans_clear_spared_are_never_destroyed_when_their_graph_went_before_their_cache():
    """clear() spared a plan for a graph that was destroyed before the cache was collected: the plan's handle is
    destroyed already (close_all_handles destroys the handles next), so the collected cache destroys it neither."""
    build, made = _weak_builder()
    cache = PlanCache(lambda *args: FakePlan("graph"), build)
    graph, pin = _captured_graph()
    cache.plan("h", "fwd", GEOM, "eng1", pin=pin)
    cache.clear()
    graph.close()  # gone before the cache
    del cache
    gc.collect()
    let_go_kept(lambda: True)
    assert made[0]() is not None and not made[0]().closed


class _Handle:
    """A cuDNN handle as a plan's key holds it: ``closed`` once destroyed (close_all_handles)."""

    closed = False


def test_a_plan_left_to_a_graph_is_never_destroyed_once_its_handle_is():
    """close_all_handles() (at exit too) destroys every handle, those of the plans a collected cache left to graphs'
    pins included, which it cannot reach to spare: such a plan is never destroyed after its handle, even once the
    graph is gone and let go of it."""
    build, made = _weak_builder()
    handle = _Handle()
    cache = PlanCache(lambda *args: FakePlan("graph"), build)
    graph, pin = _captured_graph()
    cache.plan(handle, "fwd", GEOM, "eng1", pin=pin)
    del cache
    gc.collect()
    handle.closed = True  # close_all_handles()
    graph.close()
    let_go_kept(lambda: True)
    assert pin.kept == {} and made[0]() is not None and not made[0]().closed


def test_a_plan_left_to_a_graph_is_destroyed_before_its_handle_is_let_go():
    """The graph gone, the plan its pin kept is destroyed while its handle is still held: the pin keeps the handle
    too (a thread that ended has no other reference), and the handle it drops first would go to be destroyed by the
    next handle created, another thread's meanwhile."""
    events = []

    class Plan(FakePlan):  # destroyed by close() or, as a descriptor is, once collected
        def __init__(self, name):
            super().__init__(name)
            self.destroy = weakref.finalize(self, events.append, "plan")

        def close(self):
            self.destroy()
            super().close()

    handle = _Handle()
    weakref.finalize(handle, events.append, "handle")
    cache = PlanCache(lambda *args: FakePlan("graph"), lambda handle, graph, name: Plan(name))
    graph, pin = _captured_graph()
    pin.keep([handle], frees=False, counted=False)  # as the call's _bound_handle keeps it
    cache.plan(handle, "fwd", GEOM, "eng1", pin=pin)
    del cache, handle  # the thread ended
    gc.collect()
    graph.close()
    let_go_kept(lambda: True)
    gc.collect()
    assert events == ["plan", "handle"]


def test_a_ctrl_c_as_a_collected_cache_hands_its_plans_over_destroys_none_of_them(monkeypatch):
    """The hand-over runs in the collector's callback, where a KeyboardInterrupt is reported and lost: the plans it
    had not handed over yet stay, never destroyed, rather than going under the graphs that may replay them."""
    build, made = _weak_builder()
    cache = PlanCache(lambda *args: FakePlan("graph"), build)
    graph, pin = _captured_graph()
    cache.plan("h", "fwd", GEOM, "eng1", pin=pin)
    lost = []
    monkeypatch.setattr(sys, "unraisablehook", lambda report: lost.append(report.exc_type))

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(GraphPin, "live", interrupted)  # Ctrl-C as the hand-over asks about the graph
    del cache
    gc.collect()
    monkeypatch.undo()
    assert lost == [KeyboardInterrupt] and pin.kept == {}
    assert made[0]() is not None and not made[0]().closed
    graph.close()


@contextlib.contextmanager
def _held_by_another_thread(*locks):
    """``locks`` held by a thread of their own for the block's duration (in a forked child that thread is gone)."""
    holding, done = threading.Event(), threading.Event()

    def hold():
        with contextlib.ExitStack() as stack:
            for lock in locks:
                stack.enter_context(lock)
            holding.set()
            done.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    holding.wait(30)
    try:
        yield
    finally:
        done.set()
        thread.join()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_a_forked_child_destroys_none_of_the_parents_plans():
    """CUDA cannot run in a child forked after the parent used it, and destroying an execution plan may unload the
    kernels it loaded: neither the child's exit (close_all_handles runs clear()) nor its collections destroy a plan
    of the parent's, cached or kept for a graph, even if another thread was inserting one at the fork. A plan the
    child builds is its own, destroyed as any."""
    build, made = _weak_builder()
    with config(plan_cache_size=2):
        cache = PlanCache(lambda *args: FakePlan("graph"), build)
        graph, pin = _captured_graph()
        cache.plan("h", "fwd", GEOM, "eng1", pin=pin)  # kept for the graph
        for name in ("eng2", "eng3"):  # cached; eng1 evicted
            cache.plan("h", "fwd", GEOM, name)

        def in_the_child():
            mine = cache.plan("h", "fwd", GEOM, "eng4")
            cache.clear()
            gc.collect()
            return [ref() is not None and not ref().closed for ref in made[:3]], mine.closed

        with _held_by_another_thread(cache._plans._lock, cache._graphs._lock):  # as when it inserts at the fork
            wait = fork(in_the_child)
        assert wait() == ([True, True, True], True)
        assert all(ref() is not None and not ref().closed for ref in made)  # the parent's own, untouched
        graph.close()
        cache.clear()


def test_a_miss_takes_back_the_plan_a_graph_keeps_even_during_a_capture(monkeypatch):
    """An evicted plan a graph still holds is finalized already: a miss of its key caches it again, without a
    build, and so without the CaptureError of a build on a captured stream."""
    from wsarena.arena import _capture

    captured = 0x51
    monkeypatch.setattr(_capture, "capture_of", lambda stream: object() if stream == captured else None)
    b = Builder()
    with config(plan_cache_size=1):
        cache = PlanCache(b.graph, b.plan)
        graph, pin = _captured_graph()
        kept = cache.plan("h", "fwd", GEOM, "eng1", pin=pin)
        cache.plan("h", "fwd", GEOM, "eng2")  # evicts eng1
        assert cache.plan("h", "fwd", GEOM, "eng1", stream=captured, pin=pin) is kept
        assert [name for *_, name, _ in b.plans] == ["eng1", "eng2"]
        with pytest.raises(CaptureError, match="finalize a cuDNN execution plan"):
            cache.plan("h", "fwd", GEOM, "eng2", stream=captured)  # evicted, and kept by no graph: a build
        graph.close()  # as CUDA destroys every graph: no pin left live for the tests that follow


def test_a_plan_kept_for_a_graph_stays_cached_once_the_graph_is_gone():
    cache = PlanCache(lambda *args: FakePlan("graph"), lambda handle, graph, name: FakePlan(name))
    graph, pin = _captured_graph()
    plan = cache.plan("h", "fwd", GEOM, "eng1", pin=pin)
    graph.close()
    cache.plan("h", "fwd", GEOM, "eng2")  # lets go of it: the cache still holds it
    assert cache.plan("h", "fwd", GEOM, "eng1") is plan and not plan.closed and cache.builds == 2


def test_a_plan_captured_again_and_again_forgets_the_graphs_that_are_gone():
    cache = PlanCache(lambda *args: FakePlan("graph"), lambda handle, graph, name: FakePlan(name))
    plan = cache.plan("h", "fwd", GEOM, "eng1")
    graphs = []
    for _ in range(200):
        graph, pin = _captured_graph()
        cache.plan("h", "fwd", GEOM, "eng1", pin=pin)
        cache.plan("h", "fwd", GEOM, "eng1", pin=pin)  # the same graph's second call: one entry
        graph.close()
        graphs.append(graph)
    graph, pin = _captured_graph()
    cache.plan("h", "fwd", GEOM, "eng1", pin=pin)
    cache.plan("h", "fwd", GEOM, "eng1", pin=pin)
    ((kept, pins),) = cache._captured.values()
    assert kept is plan and len(pins) <= 16 and pins.count(pin) == 1 and pins[-1] is pin and cache.kept() == [plan]
    graph.close()


def test_clear_spares_the_plans_graphs_may_still_use_for_good():
    """close_all_handles (at exit too) destroys every plan but those a graph that may still be launched (or still
    run) uses, as the arena frees no buffer a graph holds. Those it never destroys: later, they would go after the
    handles close_all_handles destroys next. One whose graph is gone is destroyed with the rest."""
    build, made = _weak_builder()
    with config(plan_cache_size=3):
        cache = PlanCache(lambda *args: FakePlan("graph"), build)
        graph, pin = _captured_graph()
        gone, old_pin = _captured_graph()
        kept = cache.plan("h", "fwd", GEOM, "eng1", pin=pin)
        released = cache.plan("h", "fwd", GEOM, "eng2", pin=old_pin)
        cached = cache.plan("h", "fwd", GEOM, "eng3")
        gone.close()
        cache.clear()
        assert not kept.closed and released.closed and cached.closed and cache.kept() == [kept] and len(cache) == 0
        del kept, released, cached
        graph.close()
        assert cache.kept() == []
        cache.plan("h", "fwd", GEOM, "eng4")  # a miss: it would let go of a plan kept for a graph now gone
        assert made[0]() is not None and not made[0]().closed


def test_a_refused_configuration_is_remembered_and_raised_again_without_a_build():
    class Refused(RuntimeError):
        pass

    built, b = [], Builder()

    def plan(handle, graph, name):
        built.append(name)
        if name == "eng9" and _aligned(b, graph) == (2, 2, 2):
            raise Refused(f"{name} refuses these operands")
        return FakePlan(name)

    cache = PlanCache(b.graph, plan, refused=(Refused,))
    errors = []
    for _ in range(3):
        with pytest.raises(Refused, match="eng9 refuses") as caught:
            cache.plan("h", "fwd", GEOM, "eng9", (2, 2, 2))
        errors.append(caught.value)
    assert built == ["eng9"]  # finalized once; the later calls raise what it said
    assert len({id(e) for e in errors}) == 3  # copies: the cached one's traceback does not grow with each raise
    assert cache.plan("h", "fwd", GEOM, "eng9") is not None and built == ["eng9", "eng9"]  # another alignment
    # what the plans' users walk (variant-pack modes, the GPU tests): the finalized plans, not the refusal beside
    assert [p.name for p in cache.built()] == ["eng9"] and len(cache) == 2
    with pytest.raises(ValueError, match="other"):  # an error not declared a refusal is not remembered
        PlanCache(Builder().graph, lambda *a: (_ for _ in ()).throw(ValueError("other")), refused=(Refused,)).plan(
            "h", "fwd", GEOM, "eng1")
    cache.clear()
    assert len(cache) == 0


@pytest.fixture
def graph_backend(monkeypatch):
    """The graph backend built on the CPU (libcudnn loads without a GPU), its cuDNN calls replaced."""
    from wsarena.backends._cudnn_graph import CudnnGraphBackend

    backend = CudnnGraphBackend()
    monkeypatch.setattr(backend, "_handle", lambda: "handle")
    return backend


def test_no_usable_engine_falls_back_to_the_legacy_api_with_one_warning(monkeypatch, graph_backend):
    legacy = [Candidate("implicit_gemm", 0), Candidate("fft", 4096)]
    monkeypatch.setattr(graph_backend, "_ranked", lambda handle, pass_, geom: [])
    monkeypatch.setattr(CudnnBackend, "candidates", lambda self, pass_, geom: legacy)
    with pytest.warns(CudnnApiFallbackWarning, match="no fwd of input \\(2, 4, 9, 9\\).*legacy API") as caught:
        assert graph_backend.candidates("fwd", GEOM) == legacy
    assert caught[0].filename == __file__  # the line outside wsarena that asked
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert graph_backend.candidates("fwd", GEOM) == legacy  # once per pass and geometry
    ran = []
    monkeypatch.setattr(CudnnBackend, "run", lambda self, *args: ran.append(args[1].algo))
    graph_backend.run("fwd", legacy[1], GEOM, None, None, None, None, None)
    assert ran == ["fft"]  # a legacy name runs through the legacy API


def test_a_call_with_nothing_to_compute_needs_no_workspace_for_any_name(graph_backend, monkeypatch):
    """At batch 0 an engine configuration, as a legacy algorithm, needs 0 bytes and fits a cap of 0, with no operation
    graph or plan built (cuDNN refuses a tensor of no images); a name of neither API is still refused."""

    def no_plan(*args, **kwargs):
        raise AssertionError("a plan built for a call with nothing to compute")

    monkeypatch.setattr(graph_backend._plans, "plan", no_plan)
    monkeypatch.setattr(graph_backend, "_handle", lambda stream=None: no_plan())
    empty = GEOM.with_batch(0)
    for pass_, legacy in (("fwd", "implicit_gemm"), ("bwd_data", "algo_0"), ("bwd_filter", "algo_1")):
        for name in ("eng28:tile_size=3", "eng0", legacy):
            assert graph_backend.workspace_size(pass_, name, empty) == 0
            assert algos.forced(graph_backend, pass_, empty, name, cap=0) == (Candidate(name, 0),)
    with pytest.raises(ValueError, match="neither"):
        graph_backend.workspace_size("fwd", "eng1:nosuch=1", empty)


def test_algo_names_of_both_apis_are_accepted_and_others_refused(graph_backend):
    graph_backend.check_algorithm("fwd", "implicit_gemm")
    graph_backend.check_algorithm("fwd", "eng28:tile_size=3")
    with pytest.raises(ValueError, match="algo='winograd_fast' is neither .* nor"):
        graph_backend.check_algorithm("fwd", "winograd_fast")
    with pytest.raises(ValueError, match="neither"):
        algos.forced(graph_backend, "fwd", GEOM, "eng1:nosuch=1", cap=None)


def test_the_api_path_keys_the_caches(graph_backend):
    legacy = CudnnBackend()
    assert (graph_backend.api, legacy.api) == ("graph", "legacy")
    assert api_path(graph_backend) == "graph" and api_path(legacy) == "legacy"
    monkey = {"device_key": lambda: 0}
    for b in (graph_backend, legacy):
        b.__dict__.update(monkey)
    settings = wsarena.get_config()
    assert (algos._key(graph_backend, "fwd", GEOM, "heuristic", None, settings)
            != algos._key(legacy, "fwd", GEOM, "heuristic", None, settings))


# ------------------------------------------------------------------------ for real, against device properties
@pytest.fixture(scope="module")
def finalizing():
    reason = driver.finalize_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def test_device_properties_plan_candidates_with_workspace_sizes(finalizing):
    backend = device_properties_backend(H100.read_text())
    assert device_properties_backend(H100.read_text()) is backend
    assert backend.device_label().startswith("NVIDIA H100 80GB HBM3 (device properties ")
    for pass_ in ("fwd", "bwd_data", "bwd_filter"):
        cands = backend.candidates(pass_, GEOM)
        assert cands and all(is_engine_name(c.algo) for c in cands)
        for c in cands[:3]:
            assert backend.workspace_size(pass_, c.algo, GEOM) == c.workspace_bytes
    chosen = algos.choose(backend, "bwd_filter", GEOM, cap=0)
    assert chosen and all(c.workspace_bytes == 0 for c in chosen)  # the cap holds on the graph API's candidates
    with pytest.raises(BackendUnavailableError, match="device properties"):
        backend.arena()
    with pytest.raises(BackendUnavailableError, match="run a convolution"):
        backend.run("fwd", chosen[0], GEOM, None, None, None, None, None)


def test_device_properties_with_a_byte_order_mark_are_the_same_gpu(finalizing):
    """The text of a file a Windows editor saved, given to device_properties_backend(): cuDNN read it (d3a9a6b), but
    the backend named the GPU "a GPU" (the mark hid its deviceName) and was another one, of another search cache key."""
    text = H100.read_text()
    marked = device_properties_backend("\ufeff" + text)
    assert marked.device_label().startswith("NVIDIA H100 80GB HBM3 (device properties ")
    assert device_properties_backend(text) is marked


def test_only_the_last_device_properties_asked_for_keep_their_plans(finalizing):
    """A backend, with its plans (up to plan_cache_size: some 20 MiB for ResNet-50), was kept for every distinct
    device properties text a process planned for: a sweep over GPUs, or over one property, grew without end. The
    last 8 asked for are kept; an older one is let go, and its plans are destroyed once it is collected."""
    from wsarena.backends import _backends

    members = json.loads(H100.read_text())
    texts = []
    for i in range(10):
        members["l2CacheSize"] = (i + 1) << 20
        texts.append(json.dumps(members))

    def kept():
        return [key.removeprefix("cudnn:properties:") for key in _backends if key.startswith("cudnn:properties:")]

    backends = []
    for text in texts[:8]:
        backends.append(device_properties_backend(text))
        backends[-1].candidates("fwd", GEOM)
    plans = [[weakref.ref(plan.descriptor) for plan in backend._plans.built()] for backend in backends]
    assert all(plans) and kept() == texts[:8]
    assert device_properties_backend(texts[0]) is backends[0]  # asked for again: now the last
    backends.clear()
    device_properties_backend(texts[8])
    gc.collect()

    def destroyed(refs):
        return all(ref() is None for ref in refs)

    assert kept() == [*texts[2:8], texts[0], texts[8]]
    assert destroyed(plans[1]) and not any(ref() is None or ref().closed for ref in plans[0] + plans[2])
    device_properties_backend(texts[9])
    gc.collect()
    assert kept() == [*texts[3:8], texts[0], texts[8], texts[9]] and destroyed(plans[2])


def test_a_real_plan_a_graph_ran_is_destroyed_only_once_the_graph_is_gone(finalizing):
    """What test_capture_gpu.py's eviction test takes for granted, with execution plans cuDNN finalizes here for an
    H100: the plan cache's eviction alone would destroy a plan (its descriptor collected, so destroyed); one a graph
    ran (its pin) outlives its eviction, and goes at the first building miss after the graph is gone."""
    with config(plan_cache_size=1):
        backend = device_properties_backend(H100.read_text())
        names = [c.algo for c in backend.candidates("fwd", GEOM)][:3]
        assert len(names) == 3
        cache = PlanCache(backend._build_graph, backend._build_plan)
        evicted = weakref.ref(cache.plan(None, "fwd", GEOM, names[0]).descriptor)
        cache.plan(None, "fwd", GEOM, names[1])
        gc.collect()
        assert evicted() is None  # no graph ran it: destroyed as it left the cache
        graph, pin = _captured_graph()
        kept = weakref.ref(cache.plan(None, "fwd", GEOM, names[0], pin=pin).descriptor)
        cache.plan(None, "fwd", GEOM, names[1])  # evicts it
        cache.plan(None, "fwd", GEOM, names[2])  # a building miss while the graph lives
        gc.collect()
        assert kept() is not None and not kept().closed
        graph.close()
        cache.plan(None, "fwd", GEOM, names[0])  # taken back, not built: the cache holds it again
        cache.plan(None, "fwd", GEOM, names[1])  # a building miss, the graph gone: no longer kept, and evicted
        gc.collect()
        assert kept() is None and cache.kept() == []


@pytest.mark.parametrize("pass_", ["fwd", "bwd_data", "bwd_filter"])
def test_a_view_aligned_only_to_its_element_size_has_a_candidate_that_runs_it(finalizing, pass_):
    """Candidates are ranked for 16-byte-aligned operands; a view at another offset runs the plan for its own
    alignment. For float16 NHWC the tensor-core engines refuse that, here every one of the heuristics' first
    ones: a candidate must still build for operands aligned to 2 bytes (the legacy API runs them), and within the
    workspace the candidate's lease gives."""
    from wsarena import cudnn

    backend = device_properties_backend(H100.read_text())
    geom = conv_geometry((2, 9, 9, 8), (16, 3, 3, 8), padding=1, layout="NHWC", dtype="float16")
    runs = []
    for cand in backend.candidates(pass_, geom):
        try:
            plan = backend._plans.plan(None, pass_, geom, cand.algo, (2, 2, 2))
        except cudnn.CudnnNotSupportedError:
            continue
        runs.append((cand.algo, plan.workspace_bytes <= cand.workspace_bytes))
    assert runs and all(fits for _, fits in runs), runs


def test_algo_refuses_an_engine_that_would_compute_float32_in_tf32(finalizing):
    """The candidates leave out engines whose numerical notes break the dtype's promise (float32 with no TF32);
    algo= naming one by hand is refused too, saying why, before anything runs."""
    from wsarena.cudnn import BackendNumericalNote, graph

    backend = device_properties_backend(H100.read_text())
    geom = conv_geometry((2, 9, 9, 16), (16, 3, 3, 16), padding=1, layout="NHWC")
    configs = graph.engine_configs(graph.operation_graph(conv_problem("fwd", geom)), properties=backend._properties)
    tf32 = [graph.config_name(c) for c in configs
            if BackendNumericalNote.TENSOR_CORE in graph.engine_notes(c)[0]]
    assert tf32, "the heuristics list tensor-core engines for float32 NHWC on an H100"
    for name in tf32[:3]:
        with pytest.raises(ValueError, match=rf"algo='{name}' does not compute float32 .*TENSOR_CORE.*TF32"):
            algos.forced(backend, "fwd", geom, name, cap=None)
    kept = backend.candidates("fwd", geom)[0].algo
    assert algos.forced(backend, "fwd", geom, kept, cap=None)[0].algo == kept


def _as_cudnn(monkeypatch, version):
    """Simulate an older cuDNN: the loaded library reports ``version``, and reading an attribute newer than it
    fails as it would there (BAD_PARAM)."""
    from wsarena import cudnn
    from wsarena.cudnn import _library
    from wsarena.cudnn.backend import OPTIONAL_ATTRIBUTES

    monkeypatch.setattr(_library, "_loaded", dataclasses.replace(_library.load_library(), version=version))
    real_get = cudnn.BackendDescriptor.get

    def get(self, name, attr_type, count=None):
        if OPTIONAL_ATTRIBUTES.get(name, 0) > version:
            raise cudnn.CudnnBadParamError(int(cudnn_status.BAD_PARAM), f"no attribute {name!r} before this version",
                                           "cudnnBackendGetAttribute")
        return real_get(self, name, attr_type, count)

    monkeypatch.setattr(cudnn.BackendDescriptor, "get", get)


def test_on_cudnn_9_1_the_workspace_sizes_come_from_the_plans(finalizing, monkeypatch):
    """cuDNN 9.0 and 9.1 have no ENGINECFG_WORKSPACE_SIZE: the sizes come from finalized plans
    (EXECUTION_PLAN_WORKSPACE_SIZE), and the candidates are a newer cuDNN's, not none (or the legacy API). (Device
    properties need 9.8: the backend is built before the library turns 9.1, to plan without a GPU.)"""
    geom = GEOM.with_batch(3)
    want = {p: device_properties_backend(H100.read_text()).candidates(p, geom) for p in ("fwd", "bwd_filter")}
    assert all(want.values())
    reset_backends()
    backend = device_properties_backend(H100.read_text())
    _as_cudnn(monkeypatch, 90100)
    for pass_, cands in want.items():
        assert backend.candidates(pass_, geom) == cands, pass_


@pytest.mark.parametrize("version", [None, 90100])
@pytest.mark.parametrize("where", ["sizing", "views", "everywhere"])
def test_an_engine_cudnn_could_not_allocate_for_while_ranking_is_left_out_of_that_ranking_alone(finalizing, monkeypatch,
                                                                                             version, where):
    """Ranking finalizes plans: to size the shortlisted configurations (on cuDNN 9.0 and 9.1, each one the heuristics
    list), and to find the one that runs views aligned only to their element size. A finalize cuDNN could not allocate
    for (device memory) is no verdict on the configuration: the ranking made without it serves that call (and a capture,
    which cannot rank) but is not kept for good, and the next call ranks again, with it. Taken as a configuration cuDNN
    will not finalize, it was left out of a ranking kept for the rest of the process. Where nothing could be ranked for
    want of memory, the call raises cuDNN's allocation failure, a MemoryError, its message naming the pass and the
    geometry (cuDNN's names a descriptor's kind alone), and keeps nothing: it ran the legacy API for good."""
    from wsarena import cudnn
    from wsarena.cudnn import graph

    geom = GEOM.with_batch(3)
    want = [c.algo for c in device_properties_backend(H100.read_text()).candidates("fwd", geom)]
    reset_backends()
    backend = device_properties_backend(H100.read_text())
    if version is not None:
        _as_cudnn(monkeypatch, version)
    short = [True]  # until memory comes back
    real_finalize, real_build = graph._finalize_plan, backend._build_plan

    def finalize(plan, cfg, handle, properties):
        name = graph.config_name(cfg)
        if short[0] and (where == "everywhere" or where == "sizing" and name == "eng1"):
            raise cudnn.CudnnError(int(cudnn_status.INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED), f"{name}: no memory")
        return real_finalize(plan, cfg, handle, properties)

    def build_for_views(handle, op_graph, name):  # the plan cache builds with its own: the views' probe comes here
        if short[0] and where == "views" and name == want[0]:  # the first candidate runs views aligned to 4 bytes
            raise cudnn.CudnnError(int(cudnn_status.INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED), f"{name}: no memory")
        return real_build(handle, op_graph, name)

    monkeypatch.setattr(graph, "_finalize_plan", finalize)
    monkeypatch.setattr(backend, "_build_plan", build_for_views)

    def choose():
        return [c.algo for c in algos.choose(backend, "fwd", geom, cap=None)]

    def chosen():
        return algos.is_chosen(backend, "fwd", geom, cap=None, search="heuristic")

    if where == "everywhere":
        with warnings.catch_warnings():
            warnings.simplefilter("error", CudnnApiFallbackWarning)
            with pytest.raises(MemoryError, match="no memory") as raised:
                choose()
        # cuDNN's own error, its message naming the call: the text of a finalize names a descriptor's kind alone
        assert type(raised.value) is cudnn.error_class(cudnn_status.INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED)
        assert f"ranking the engines for fwd of {describe_geometry(geom)} takes" in str(raised.value)
    else:
        assert choose() == [name for name in want if where != "sizing" or name != "eng1"]
    assert chosen() == (where != "everywhere")  # a capture, which cannot rank, runs what was ranked
    assert not algos.is_cached(backend, "fwd", geom, cap=None, search="heuristic")
    short[0] = False
    assert choose() == want and algos.is_cached(backend, "fwd", geom, cap=None, search="heuristic")


def test_on_cudnn_before_9_8_device_properties_are_unavailable(finalizing, monkeypatch):
    _as_cudnn(monkeypatch, 90700)
    with pytest.raises(BackendUnavailableError, match=r"cuDNN 9\.7\.0 has no device properties.*9\.8"):
        device_properties_backend(H100.read_text())


def test_a_plan_for_an_h100_from_its_properties(finalizing):
    # the whole model: which layers' engines take a workspace is cuDNN's choice (before 9.27, none of the first six)
    layers = wsarena.load_model("resnet50")
    p = wsarena.plan(layers, batch=8, device_properties=H100)
    assert p.backend == "cudnn" and p.device.startswith("NVIDIA H100")
    assert all(is_engine_name(c.algo) for lp in p.layers for c in lp.choices.values())
    assert p.arena_bytes == max(lp.largest_bytes for lp in p.layers) > 0
    assert wsarena.plan(layers, batch=8, device_properties=H100.read_text()).to_dict() == p.to_dict()
    capped = wsarena.plan(layers, batch=8, device_properties=H100, cap_workspace="64KiB")
    assert capped.arena_bytes <= 64 << 10
    with pytest.raises(ValueError, match="cannot time"):
        wsarena.plan(layers, device_properties=H100, search="exhaustive")
    with pytest.raises(ValueError, match="backend must be 'cudnn'"):
        wsarena.plan(layers, device_properties=H100, backend="cpu")


def test_report_device_properties(finalizing, capsys, tmp_path):
    with config(cudnn_api="legacy"):  # the flag needs no setting: it always takes the graph API
        assert main(["report", "resnet50", "--batch", "4", "--device-properties", str(H100), "--format", "json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert err == "" and report["backend"] == "cudnn" and report["device"].startswith("NVIDIA H100")
    assert report["layers"][0]["fwd"]["algo"].startswith("eng") and report["arena_bytes"] > 0
    assert main(["report", "resnet50", "--device-properties", "/nonexistent.json"]) == 2
    assert "nonexistent" in capsys.readouterr().err
    binary = tmp_path / "props.bin"
    binary.write_bytes(b"\xff\xfe{}")
    assert main(["report", "resnet50", "--device-properties", str(binary)]) == 2
    assert f"device properties {str(binary)!r} are not a JSON text file (not UTF-8" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "says"), [
    (["--backend", "cpu"], "leave out --backend cpu"),
    (["--search", "exhaustive"], "leave out --search exhaustive"),
    (["--max-slowdown", "2%"], "leave out --max-slowdown"),
    (["--cudnn-api", "legacy"], "leave out --cudnn-api legacy"),
])
def test_report_device_properties_refuses_flags_it_would_ignore(capsys, flags, says):
    """plan() refuses these with device_properties; the command line gave them as settings, which the planner
    then overrode: a CPU or exhaustive report came out as cuDNN's heuristic choices."""
    assert main(["report", "resnet50", "--device-properties", str(H100), *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


@pytest.mark.parametrize("edit", ["not json", "[1, 2]", "drop maxCtasPerSM", "warpSize as text"])
def test_device_properties_cudnn_refuses_are_bad_input(finalizing, capsys, tmp_path, edit):
    """A file this cuDNN does not read (not JSON, another version's members): a ValueError that says so (exit 2,
    bad input, not 3), and still the CudnnBadParamError it was; nothing is cached for it."""
    from wsarena import cudnn
    from wsarena.backends import _backends

    members = json.loads(H100.read_text())
    if edit == "drop maxCtasPerSM":
        del members["maxCtasPerSM"]
    elif edit == "warpSize as text":
        members["warpSize"] = "32"
    text = json.dumps(members) if edit.startswith(("drop", "warpSize")) else edit
    before = dict(_backends)
    with pytest.raises(ValueError, match="refuses these device properties") as caught:
        device_properties_backend(text)
    assert isinstance(caught.value, cudnn.CudnnBadParamError) and "cuDNN 9." in str(caught.value)
    assert _backends == before
    path = tmp_path / "props.json"
    path.write_text(text)
    assert main(["report", "resnet50", "--device-properties", str(path)]) == 2
    assert "refuses these device properties" in capsys.readouterr().err


@pytest.mark.parametrize(("member", "value"), [
    ("multiProcessorCount", 0), ("multiProcessorCount", -3), ("totalGlobalMem", -1), ("deviceVer", 0),
    ("maxGridSize", [0, 0, 0]), ("maxBlockSize", [1024, 1024]), ("warpSize", 0), ("l2CacheSize", -5),
    ("deviceVer", 300),  # a compute capability this cuDNN does not plan for: cuDNN's NOT_SUPPORTED_ARCH_MISMATCH
])
def test_device_properties_no_gpu_has_blame_the_file_and_the_member(finalizing, capsys, tmp_path, member, value):
    """Values cuDNN reads without complaint, or with an answer that names neither (zero SMs, a grid of no blocks,
    compute capability 0.0), ended in "no algorithm" or in plans for no device: a DevicePropertiesError (bad input,
    exit 2) naming the file and the member instead; nothing is cached for them."""
    from wsarena.backends import _backends
    from wsarena.cudnn.graph import DevicePropertiesError

    members = json.loads(H100.read_text())
    members[member] = value
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(members))
    before = dict(_backends)
    layers = wsarena.load_model("resnet50")[:2]
    with pytest.raises(DevicePropertiesError, match=rf"^{path}: .*\b{member}\b") as caught:
        wsarena.plan(layers, batch=2, device_properties=path)
    assert (caught.value.source, caught.value.member) == (str(path), member) and isinstance(caught.value, ValueError)
    with pytest.raises(DevicePropertiesError, match=rf"^(device properties member|cuDNN).*\b{member}\b"):
        wsarena.plan(layers, batch=2, device_properties=json.dumps(members))  # JSON text: no file to name
    assert _backends == before
    assert main(["report", "resnet50", "--device-properties", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and member in err and err.count("\n") == 1


def test_device_properties_no_gpu_has_are_bad_input_where_the_driver_library_is_missing(monkeypatch, tmp_path, capsys):
    """Where libcuda.so.1 is missing, the check for it (made before cuDNN loads its engine libraries) came before
    wsarena's check of the values: zero SMs exited 3 saying the driver library is missing, where it exits 2 naming
    the member, as with the driver library (the test process has a stand-in for it; here it reads as missing)."""
    from wsarena.backends import _backends
    from wsarena.cudnn import _library
    from wsarena.cudnn.graph import DevicePropertiesError

    monkeypatch.setattr(_library, "missing_driver_library", lambda path: "libcuda.so.1: cannot open shared object")
    members = json.loads(H100.read_text()) | {"multiProcessorCount": 0}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(members))
    with pytest.raises(DevicePropertiesError, match=r"multiProcessorCount is 0: a GPU has at least 1"):
        device_properties_backend(json.dumps(members), str(path))
    assert main(["report", "resnet50", "--device-properties", str(path)]) == 2
    assert "multiProcessorCount" in capsys.readouterr().err
    before = dict(_backends)
    gpu = json.dumps(members | {"multiProcessorCount": 132, "deviceName": "no driver library here"})  # not cached
    with pytest.raises(BackendUnavailableError, match=r"libcuda\.so\.1, which is missing here .*: libcuda"):
        device_properties_backend(gpu)  # values a GPU has: what the machine lacks is said
    assert _backends == before


def test_device_properties_errors_pickle_with_their_file_and_member():
    import pickle

    from wsarena.cudnn._deviceprops import DevicePropertiesError, check_members

    with pytest.raises(DevicePropertiesError) as caught:
        check_members(json.dumps({"multiProcessorCount": 0}), "gpu.json")
    again = pickle.loads(pickle.dumps(caught.value))
    assert (type(again), str(again), again.source, again.member) == (
        DevicePropertiesError, str(caught.value), "gpu.json", "multiProcessorCount")
    check_members(H100.read_text())  # a real GPU's pass
    check_members("not json")  # cuDNN's to refuse, with its own reason
    check_members(json.dumps({"warpSize": "32", "maxGridSize": "x"}))  # types too


def test_device_properties_that_start_with_a_byte_order_mark_plan_as_without_it(finalizing, capsys, tmp_path):
    """A file saved with a byte order mark (as Windows editors save UTF-8), as a JSON layer list may be: cuDNN was
    handed the mark and refused the file as no JSON."""
    bom = tmp_path / "gpu.json"
    bom.write_bytes(b"\xef\xbb\xbf" + H100.read_bytes())
    reports = []
    for path in (H100, bom):
        assert main(["report", "resnet50", "--device-properties", str(path), "--format", "json"]) == 0
        reports.append(json.loads(capsys.readouterr().out)["layers"])
    assert reports[0] == reports[1]


def _report_in_child(tmp_path, properties):
    """``wsarena report`` of one small layer against the ``properties`` file, in a child process (which loads the
    tests' stand-in for libcuda.so.1 where this one did): what cuDNN may crash on must not crash the tests."""
    model = tmp_path / "one.json"
    model.write_text(json.dumps([{"name": "c", "input_shape": [1, 8, 16, 16], "weight_shape": [16, 8, 3, 3]}]))
    stand_ins = [lib._name for lib in driver._loaded]
    code = ("import ctypes, sys\n"
            "for path in sys.argv[1:-2]: ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)\n"
            "from wsarena.cli import main\n"
            "sys.exit(main(['report', sys.argv[-2], '--device-properties', sys.argv[-1], '--format', 'json']))\n")
    return subprocess.run([sys.executable, "-c", code, *stand_ins, str(model), str(properties)], capture_output=True,
                          text=True, timeout=120, check=False, cwd=Path(__file__).parents[1])


@pytest.mark.parametrize("name", ["x" * 256, "\u00e9" * 128, "x" * 60_000])
def test_a_device_name_longer_than_cudnn_holds_is_refused_before_it_overruns_cudnn(finalizing, tmp_path, name):
    """cuDNN copies deviceName into 256 bytes (cudaDeviceProp's name, its NUL included): 256 bytes or more of UTF-8
    overran them, and the command died (std::bad_alloc, a double free, a segmentation fault) or planned on. Now
    bad input naming the member; 255 bytes still plan."""
    members = json.loads(H100.read_text())
    members["deviceName"] = name
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(members))
    result = _report_in_child(tmp_path, path)
    assert result.returncode == 2 and result.stdout == "", result.stderr[-2000:]
    assert result.stderr.startswith(f"wsarena: error: {path}: device properties member deviceName is ")
    assert "at most 255 bytes" in result.stderr and result.stderr.count("\n") == 1
    members["deviceName"] = "\u00e9" * 127 + "x"  # 255 bytes
    path.write_text(json.dumps(members))
    result = _report_in_child(tmp_path, path)
    assert result.returncode == 0 and result.stderr == ""
    assert json.loads(result.stdout)["device"].startswith(members["deviceName"] + " (device properties ")


def test_a_device_name_with_control_characters_is_shown_escaped(finalizing, capsys, tmp_path):
    """The device's name comes from the properties file: a newline or an escape sequence in it broke the table's
    header line and reached the terminal, where a layer's name is shown escaped; the JSON keeps it as it is."""
    members = json.loads(H100.read_text())
    members["deviceName"] = "H100\n\x1b[31mred\t"
    path, model = tmp_path / "gpu.json", tmp_path / "one.json"
    path.write_text(json.dumps(members))
    model.write_text(json.dumps([{"name": "c", "input_shape": [1, 8, 16, 16], "weight_shape": [16, 8, 3, 3]}]))
    assert main(["report", str(model), "--device-properties", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\t" not in out
    assert out.splitlines()[1].startswith("backend cudnn (H100\\n\\x1b[31mred\\t (device properties ")
    assert main(["report", str(model), "--device-properties", str(path), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["device"].startswith("H100\n\x1b[31mred\t (device properties ")


@pytest.mark.parametrize("value", [[2147483647.0, 65535, 65535], [1.5, 2, 3], ["1", 1, 1], [True, 1, 1],
                                   [None, 1, 1], [2**31, 1, 1], [2**32, 65535, 65535]])
@pytest.mark.parametrize("member", ["maxGridSize", "maxBlockSize"])
def test_grid_and_block_dimensions_cudnn_would_misread_are_refused(finalizing, tmp_path, member, value):
    """cuDNN takes any JSON value in these arrays (a float, a string, a number past 32 bits) and plans with what it
    makes of it: an H100's grid written [2147483647, 65535.0, 65535] changed 75 of ResNet-50's 159 choices, all
    floats left a layer with no engine. Each must be an integer from 1 to 2147483647, as a GPU reports them."""
    from wsarena.cudnn.graph import DevicePropertiesError

    members = json.loads(H100.read_text())
    members[member] = value
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(members))
    with pytest.raises(DevicePropertiesError, match=rf"^{path}: device properties member {member} is ") as caught:
        wsarena.plan(wsarena.load_model("resnet50")[:1], device_properties=path)
    assert caught.value.member == member and "each an integer from 1 to 2147483647" in str(caught.value)


@pytest.mark.parametrize(("edit", "named"), [
    ({"warpSize": None}, [("warpSize", "no member warpSize")]),
    ({"deviceName": None}, [("deviceName", "no member deviceName")]),
    ({"warpSize": "32"}, [("warpSize", 'member warpSize is "32", where cuDNN reads an integer from -2147483648')]),
    ({"maxCtasPerSM": 32.0}, [("maxCtasPerSM", "member maxCtasPerSM is 32.0, where")]),
    ({"l2CacheSize": 2**31}, [("l2CacheSize", "member l2CacheSize is 2147483648, where")]),
    ({"totalGlobalMem": 2**64}, [("totalGlobalMem", "to 18446744073709551615")]),
    ({"deviceName": 5}, [("deviceName", "member deviceName is 5, where cuDNN reads a string")]),
    ({"maxBlockSize": "x"}, [("maxBlockSize", 'member maxBlockSize is "x", where cuDNN reads 3 integers')]),
    ({"memoryBusWidth": None, "deviceVer": "900"}, [("memoryBusWidth", "no member memoryBusWidth"),
                                                    ("deviceVer", 'member deviceVer is "900", where')]),
    ({"smCountOrigin": None, "oversizedSharedMemoryPerBlock": None, "isTccDriver": False},
     [("isTccDriver", "member isTccDriver is false, where")]),  # the two cuDNN 9.28 does without are not named
])
def test_the_members_cudnn_refuses_are_named(finalizing, capsys, tmp_path, edit, named):
    """cuDNN's refusal of a member missing or of another type names none (``!json_object.HasMember(key)``,
    ``!json_object.Is<T>()``): the error names each member that made it refuse, in the order cuDNN reads them, and
    only those (``member``: the first)."""
    from wsarena.cudnn import load_library
    from wsarena.cudnn.graph import DevicePropertiesError

    if load_library().version < 92800:
        pytest.skip("the members read are cuDNN 9.28's")
    members = json.loads(H100.read_text())
    for key, value in edit.items():
        if value is None:
            del members[key]
        else:
            members[key] = value
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(members))
    with pytest.raises(DevicePropertiesError, match="refuses these device properties") as caught:
        wsarena.plan(wsarena.load_model("resnet50")[:1], device_properties=path)
    message = str(caught.value)
    assert caught.value.member == named[0][0]
    assert message.count("no member ") + message.count(", where cuDNN reads ") == len(named), message
    at = [message.index(says) for _, says in named]
    assert at == sorted(at), message
    assert main(["report", "resnet50", "--device-properties", str(path)]) == 2
    err = capsys.readouterr().err
    assert all(says in err for _, says in named) and err.count("\n") == 1


def test_another_versions_capture_names_the_member_this_cudnn_misses(finalizing):
    """cuDNN 9.19 wrote no smCountOrigin, oversizedSharedMemoryPerBlock or memoryBusWidth; 9.28 needs only the
    last: that one is named."""
    from wsarena.cudnn import load_library
    from wsarena.cudnn.graph import DevicePropertiesError

    if load_library().version < 92800:
        pytest.skip("the members read are cuDNN 9.28's")
    captured = Path(__file__).parent / "data" / "h200-cudnn91900.json"
    with pytest.raises(DevicePropertiesError, match=r"refuses these device properties \(no member memoryBusWidth\)"):
        device_properties_backend(captured.read_text(), str(captured))


@pytest.mark.parametrize("text", ["[" * 100_000, '{"a": ' * 100_000])
def test_device_properties_nested_too_deep_are_left_to_cudnn(text):
    # the check of the members raised json's RecursionError: `wsarena report --device-properties` exited 3 with it
    from wsarena.cudnn._deviceprops import check_members, members

    assert members(text) is None
    check_members(text, "deep.json")  # no JSON object: cuDNN's to refuse, as "not json"


def test_the_device_is_named_as_cudnn_reads_the_properties(finalizing):
    """JSON with a member twice: cuDNN reads the first, Python's json the last; the label is the device cuDNN
    plans for."""
    text = H100.read_text().rstrip().rstrip("}") + ', "deviceName": "not what cuDNN reads"}'
    assert device_properties_backend(text).device_label().startswith("NVIDIA H100 80GB HBM3 (device properties ")


def test_report_device_properties_without_the_driver_library_says_why():
    """A machine with no libcuda.so.1 at all (this one, outside the tests' stand-in): exit 3, one clear line, where
    cuDNN's engine library links it (9.27 on)."""
    if driver.real_driver_library():
        pytest.skip("this machine has the NVIDIA driver library")
    result = subprocess.run(
        [sys.executable, "-m", "wsarena", "report", "resnet50", "--device-properties", str(H100)],
        capture_output=True, text=True, timeout=120, check=False, cwd=Path(__file__).parents[1],
    )
    if not driver.engines_link_the_driver():  # before cuDNN 9.27: it plans without the driver library
        assert result.returncode == 0 and result.stderr == "" and "workspace per stream:" in result.stdout
        return
    assert result.returncode == 3 and result.stdout == ""
    assert "wsarena: error: planning against device properties needs" in result.stderr
    assert "libcuda.so.1" in result.stderr.splitlines()[-1]


def test_the_cudnn_api_flag(capsys):
    assert main(["report", "resnet50", "--backend", "cpu", "--cudnn-api", "graph", "--passes", "fwd"]) == 0
    capsys.readouterr()
    assert main(["report", "resnet50", "--cudnn-api", "v8"]) == 2
    assert "--cudnn-api" in capsys.readouterr().err


# ----------------------------------------------------- run() and measure() with fakes for the plans and the GPU
class AlignedBuilder(Builder):
    """Plans whose workspace depends on the operands' alignment: ``sizes[(name, aligned)]``, else 64 bytes."""

    def __init__(self, sizes):
        super().__init__()
        self.sizes, self.executed = sizes, []

    def plan(self, handle, graph, name):
        aligned = _aligned(self, graph)
        made = FakePlan(name)
        made.workspace_bytes = self.sizes.get((name, aligned), 64)
        made.execute = lambda *args: self.executed.append((name, aligned, args))
        return made


def _aligned(builder, graph):
    """The operands' alignment a Builder's fake graph was built for."""
    return builder.graphs[int(graph.name[len("graph"):]) - 1][3]


def _array(ptr):
    return SimpleNamespace(data=SimpleNamespace(ptr=ptr))


def _lease(nbytes, stream=0x77):
    """A device lease: one that takes bytes carries its stream's raw handle, as the arena's do; a zero-byte one none,
    as a workspace of the caller's own may not (the arena's zero-byte leases carry theirs too)."""
    return SimpleNamespace(ptr=0x100000 if nbytes else 0, nbytes=nbytes, cuda_stream=stream if nbytes else None,
                           pin=None)


class _BoundHandle:
    """A thread's handle as the backend binds it: one object (hashed as itself) bound to the stream last set."""

    stream = 0

    def set_stream(self, raw):
        self.stream = raw


@pytest.fixture
def faked(monkeypatch, graph_backend):
    from wsarena.arena import _capture

    handle = _BoundHandle()

    def bound(stream, workspace=None):  # the lease's stream, else the call's (None: CuPy's current, the null one)
        raw = getattr(workspace, "cuda_stream", None)
        handle.set_stream(raw if raw is not None else stream or 0)
        return handle

    monkeypatch.setattr(graph_backend, "_bound_handle", bound)
    monkeypatch.setattr(_capture, "capture_of", lambda stream: None)  # no stream is being captured
    return graph_backend


def test_run_refuses_a_plan_that_needs_more_workspace_than_was_leased(faked):
    """The lease is the candidate's size (its plan for 16-byte-aligned operands); the plan for a view's own
    alignment must never be given a workspace it would write past."""
    b = AlignedBuilder({("eng1", (2, 16, 16)): 128})
    faked._plans = PlanCache(b.graph, b.plan)
    x, w, y = _array(0x1000), _array(0x2000), _array(0x3000)
    faked.run("fwd", Candidate("eng1", 64), GEOM, x, w, y, _lease(64), None)
    assert [e[:2] for e in b.executed] == [("eng1", ALIGNED)]
    with pytest.raises(WorkspaceMemoryError, match="eng1 for operands aligned to 2, 16 and 16 bytes") as caught:
        faked.run("fwd", Candidate("eng1", 64), GEOM, _array(0x1002), w, y, _lease(64), None)
    assert isinstance(caught.value, MemoryError)  # run_with_fallback moves on to the next candidate
    assert (caught.value.requested, caught.value.held) == (128, 64) and len(b.executed) == 1


def test_an_alignment_workspace_error_gives_the_cap_in_force(faked):
    """Its ``cap`` is the workspace cap in force, as every WorkspaceMemoryError's, not None while one is set."""
    b = AlignedBuilder({("eng1", (2, 16, 16)): 128})
    faked._plans = PlanCache(b.graph, b.plan)
    x, w, y = _array(0x1002), _array(0x2000), _array(0x3000)
    with config(cap_workspace=4096), pytest.raises(AlignmentWorkspaceError) as caught:
        faked.run("fwd", Candidate("eng1", 64), GEOM, x, w, y, _lease(64), None)
    assert caught.value.cap == 4096 and str(caught.value).endswith("cap 4 KiB)")
    with pytest.raises(AlignmentWorkspaceError) as caught:
        faked.run("fwd", Candidate("eng1", 64), GEOM, x, w, y, _lease(64), None)
    assert caught.value.cap is None and b.executed == []


class _Arena:
    refusing = False  # it remembers no refusal

    @contextlib.contextmanager
    def lease(self, nbytes, stream=None, cap=None):
        yield _lease(nbytes)

    def held_bytes(self, stream=None):
        return 0


def test_a_forced_engine_whose_plan_for_a_view_needs_more_workspace_says_so(faked, monkeypatch):
    """algo= leases the plan's workspace for 16-byte-aligned operands; a view whose own plan needs more is refused
    with an error that says so, not with "no algorithm fits in the workspace and memory"."""
    monkeypatch.setattr(faked, "_here", lambda: None)  # no CuPy stream to check for a capture
    b = AlignedBuilder({("eng1", (2, 16, 16)): 128})
    faked._plans = PlanCache(b.graph, b.plan)
    (forced,) = algos.forced(faked, "fwd", GEOM, "eng1", cap=None)
    assert forced.workspace_bytes == 64
    w, y = _array(0x2000), _array(0x3000)
    with pytest.raises(AlignmentWorkspaceError,
                       match=r"eng1 for operands aligned to 2, 16 and 16 bytes.*algo=") as caught:
        algos.run_with_fallback(_Arena(), (forced,),
                                lambda c, ws: faked.run("fwd", c, GEOM, _array(0x1002), w, y, ws, None),
                                stream=None, cap=None, retry=faked.retry_errors)
    assert not isinstance(caught.value, NoAlgorithmFitsError) and isinstance(caught.value, MemoryError)
    assert (caught.value.requested, caught.value.held) == (128, 64) and b.executed == []
    ran = algos.run_with_fallback(_Arena(), (forced,), lambda c, ws: faked.run("fwd", c, GEOM, _array(0x1000), w, y,
                                                                               ws, None),
                                  stream=None, cap=None, retry=faked.retry_errors)
    assert ran is forced and [e[:2] for e in b.executed] == [("eng1", ALIGNED)]


def test_run_with_fallback_passes_a_refused_or_too_large_plan_to_the_next_candidate(faked):
    refused = faked.retry_errors[0]

    def plan(handle, graph, name):
        if name == "eng1" and _aligned(b, graph) != ALIGNED:
            raise refused(int(cudnn_status.NOT_SUPPORTED), "eng1 needs 16-byte-aligned operands")
        return b.plan(handle, graph, name)

    b = AlignedBuilder({("eng2", (2, 16, 16)): 4096})
    faked._plans = PlanCache(b.graph, plan, refused=(refused,))
    cands = (Candidate("eng1", 64), Candidate("eng2", 64), Candidate("eng3", 64))
    x, w, y = _array(0x1002), _array(0x2000), _array(0x3000)
    for _ in range(2):
        ran = algos.run_with_fallback(_Arena(), cands, lambda c, ws: faked.run("fwd", c, GEOM, x, w, y, ws, None),
                                      stream=None, cap=None, retry=faked.retry_errors)
        assert ran.algo == "eng3"
    assert [e[:2] for e in b.executed] == [("eng3", (2, 16, 16))] * 2


def test_a_plan_built_for_a_zero_byte_lease_is_refused_on_a_captured_stream(faked, monkeypatch):
    """A zero-byte lease carries no stream handle (its cuda_stream is None). A call whose plan is not cached (operands
    at an alignment no earlier call had, a plan the cache evicted) finalizes one: on the call's stream while it is
    captured, that is the CaptureError of any other lease, before cuDNN finalizes anything into the capture."""
    from wsarena.arena import _capture

    captured = 0x51
    monkeypatch.setattr(_capture, "capture_of", lambda stream: object() if stream == captured else None)
    b = AlignedBuilder({("eng1", (2, 16, 16)): 0})  # an engine that takes no workspace
    faked._plans = PlanCache(b.graph, b.plan)
    x, w, y = _array(0x1002), _array(0x2000), _array(0x3000)
    with pytest.raises(CaptureError, match="finalize a cuDNN execution plan"):
        faked.run("fwd", Candidate("eng1", 0), GEOM, x, w, y, _lease(0), captured)
    assert b.plans == [] and b.executed == []
    faked.run("fwd", Candidate("eng1", 0), GEOM, x, w, y, _lease(0), 0x52)  # a stream not captured: built and run
    assert [e[:2] for e in b.executed] == [("eng1", (2, 16, 16))]


@pytest.mark.parametrize("nbytes", [64, 0])
def test_a_call_whose_lease_carries_a_graphs_pin_keeps_its_plan_for_that_graph(faked, nbytes):
    """A lease taken during a capture carries the graph's pin (one of no bytes too): the plan executed into the
    capture is kept while the graph exists; an eager call's lease, which carries none, keeps nothing."""
    b = AlignedBuilder({("eng1", ALIGNED): nbytes})
    faked._plans = PlanCache(b.graph, b.plan)
    x, w, y = _array(0x1000), _array(0x2000), _array(0x3000)
    graph, pin = _captured_graph()
    lease = _lease(nbytes)
    lease.pin = pin
    faked.run("fwd", Candidate("eng1", nbytes), GEOM, x, w, y, lease, None)
    (kept,) = faked._plans.kept()
    assert kept.name == "eng1" and b.executed
    faked.run("fwd", Candidate("eng1", nbytes), GEOM, x, w, y, _lease(nbytes), None)  # eager: nothing more kept
    assert faked._plans.kept() == [kept]
    graph.close()
    assert faked._plans.kept() == []


def test_a_legacy_call_captured_into_a_graph_keeps_its_cudnn_handle_while_the_graph_exists(monkeypatch):
    """A thread's handle is destroyed once the thread has ended (at the next handle created), and cuDNN does not say a
    captured call may outlive its handle: a lease taken during a capture carries the graph's pin, which keeps the
    handle of each call captured into it until CUDA has destroyed the graph (dropping it calls no CUDA). An eager
    call keeps nothing."""
    backend = CudnnBackend()
    handles, ran = [_BoundHandle()], []  # the thread's handle (its thread-local reference), what each call ran with
    monkeypatch.setattr(backend, "_handle", lambda stream=None: handles[-1])
    monkeypatch.setattr(backend, "_descriptors", lambda geom, math_type=None: ("x", "w", "conv", "y"))
    monkeypatch.setattr(backend._cudnn.conv, "convolution", lambda pass_, h, **kw: ran.append(id(h)))
    x, w, y = _array(0x1000), _array(0x2000), _array(0x3000)
    graph, pin = FakeGraph(), GraphPin(KeptBytes())  # as the arena's: it counts what it keeps for stats()
    graph.retain(pin)
    lease = _lease(64)
    lease.pin = pin
    backend.run("fwd", Candidate("implicit_gemm", 64), GEOM, x, w, y, lease, None)
    backend.run("fwd", Candidate("implicit_gemm", 64), GEOM, x, w, y, lease, None)  # the graph's second call
    handles.append(_BoundHandle())  # another thread's, say: an eager call
    backend.run("fwd", Candidate("implicit_gemm", 64), GEOM, x, w, y, _lease(64), None)
    captured, uncaptured = map(weakref.ref, handles)
    assert ran == [id(handles[0])] * 2 + [id(handles[1])] and list(pin.kept.values()) == [handles[0]]
    assert pin.tally.owners == {} and pin.tally.nbytes == 0  # no array: nothing for kept_bytes to count
    handles.clear()  # the threads ended
    gc.collect()
    assert captured() is not None and uncaptured() is None  # the thread's own reference gone: the graph's remains
    graph.close()
    let_go_kept(None)
    assert captured() is None


def test_a_call_on_a_zero_byte_lease_asks_its_stream_for_its_handle_once(graph_backend, monkeypatch):
    """A zero-byte workspace that carries no stream handle: the call's stream is resolved for the handle's binding, and
    that binding is the stream checked for a capture, not resolved a second time (an object with __cuda_stream__ is
    asked once per call, as CuPy's current stream is read once)."""
    from wsarena.arena import _capture

    handle = _BoundHandle()
    monkeypatch.setattr(graph_backend, "_handle", lambda stream=None: handle)
    checked, asked = [], []
    monkeypatch.setattr(_capture, "capture_of", lambda stream: checked.append(stream))
    stream = type("Stream", (), {"__cuda_stream__": lambda self: asked.append(1) or (0, 0x52)})()
    b = AlignedBuilder({("eng1", (16, 16, 16)): 0})
    graph_backend._plans = PlanCache(b.graph, b.plan)
    x, w, y = _array(0x1000), _array(0x2000), _array(0x3000)
    graph_backend.run("fwd", Candidate("eng1", 0), GEOM, x, w, y, _lease(0), stream)
    assert checked == [0x52] and handle.stream == 0x52 and len(asked) == 1
    graph_backend.run("fwd", Candidate("eng1", 0), GEOM, x, w, y, _lease(0), stream)  # its plan cached
    assert checked == [0x52] and len(asked) == 2 and len(b.executed) == 2


def test_measure_skips_a_plan_that_needs_more_workspace_than_was_leased(faked, monkeypatch):
    clock, recorded = iter(range(1, 100)), set()
    runtime = SimpleNamespace(eventCreate=lambda: object(), eventRecord=lambda event, stream: recorded.add(stream),
                              eventSynchronize=lambda event: None, eventDestroy=lambda event: None,
                              eventElapsedTime=lambda start, end: float(next(clock)))
    monkeypatch.setattr(faked, "_cupy", SimpleNamespace(cuda=SimpleNamespace(runtime=runtime)))
    b = AlignedBuilder({("eng2", (2, 16, 16)): 4096})
    faked._plans = PlanCache(b.graph, b.plan)
    cands = [Candidate("eng1", 64), Candidate("eng2", 64)]
    with pytest.raises(PartlyTimed) as caught:  # eng2 is refused in this lease, on these operands only
        faked.measure("fwd", GEOM, _array(0x1002), _array(0x2000), _array(0x3000), _lease(64, 0x77), cands, None)
    assert [c.algo for c in caught.value.timed] == ["eng1"] and caught.value.refused == [cands[1]]
    assert {e[0] for e in b.executed} == {"eng1"}
    assert recorded == {0x77}  # timed on the lease's stream, where the plans ran


class RefusingBuilder(AlignedBuilder):
    """An AlignedBuilder whose cuDNN refuses: to finalize ``unbuilt`` (``(name, alignment)`` pairs, as cuDNN's
    NOT_SUPPORTED), and to execute the plans of ``unrun`` names for operands off 16-byte boundaries (as
    BAD_PARAM_MISALIGNED_POINTER). Each execution is timed ``times[name]`` ms (the runtime stand-in,
    :func:`_timing_runtime`, reads the last one). ``short[name]``: where cuDNN cannot allocate what that plan takes
    (``"finalize"``, ``"execute"``, or ``"timed"``: every execution after the first)."""

    def __init__(self, sizes, unbuilt=(), unrun=(), times=None, short=()):
        super().__init__(sizes)
        self.unbuilt, self.unrun, self.times, self.short = set(unbuilt), set(unrun), times or {}, dict(short)

    def plan(self, handle, graph, name):
        from wsarena import cudnn

        aligned = _aligned(self, graph)
        if (name, aligned) in self.unbuilt:
            raise cudnn.CudnnNotSupportedError(int(cudnn_status.NOT_SUPPORTED), f"{name} for {aligned}")
        if self.short.get(name) == "finalize":
            raise cudnn.CudnnError(int(cudnn_status.INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED), name)
        made = super().plan(handle, graph, name)
        if self.short.get(name) in ("execute", "timed"):
            runs = [] if self.short[name] == "execute" else [made.execute]

            def out_of_memory(*args):
                if runs:
                    return runs.pop()(*args)
                raise cudnn.CudnnError(int(cudnn_status.INTERNAL_ERROR_HOST_ALLOCATION_FAILED), name)
            made.execute = out_of_memory
        if name in self.unrun and aligned != ALIGNED:
            def refuse(*args):
                raise cudnn.CudnnBadParamMisalignedPointerError(int(cudnn_status.BAD_PARAM_MISALIGNED_POINTER),
                                                                f"{name} at {args[1:4]}")
            made.execute = refuse
        return made


# eng1 finalizes for 16-byte-aligned operands only, eng5 for none
UNBUILT = {("eng1", (2, 16, 16)), ("eng5", (2, 16, 16)), ("eng5", ALIGNED)}


def _timing_runtime(builder):
    """CuPy's runtime as the graph backend's measure uses it: events whose elapsed time is the builder's time of
    the plan executed last."""
    return SimpleNamespace(
        eventCreate=lambda: object(), eventRecord=lambda event, stream: None, eventSynchronize=lambda event: None,
        eventDestroy=lambda event: None,
        eventElapsedTime=lambda start, end: float(builder.times.get(builder.executed[-1][0], 1.0)))


def _stand_in_builder(faked, monkeypatch, builder):
    faked._plans = PlanCache(builder.graph, builder.plan, refused=faked.retry_errors[:1])
    monkeypatch.setattr(faked, "_cupy", SimpleNamespace(cuda=SimpleNamespace(runtime=_timing_runtime(builder))))


def test_measure_says_which_engines_it_refused_on_these_operands_alone(faked, monkeypatch):
    """What the search cache may keep of an engine measure skips (PartlyTimed's refused: no verdict, searched again
    by a later process) and what it may not: a plan cuDNN refuses to finalize for 16-byte-aligned operands, those
    every candidate was ranked and sized for, is the engine's verdict on the geometry, left out (rejected); one
    refused for a view's own alignment, a plan for it that needs more than the lease, and an execution refused for a
    misaligned pointer are verdicts on this call's operands and lease only."""
    b = RefusingBuilder({("eng2", (2, 16, 16)): 4096}, unbuilt=UNBUILT,
                        unrun={"eng3"}, times={"eng1": 1, "eng2": 2, "eng3": 3, "eng4": 4})
    _stand_in_builder(faked, monkeypatch, b)
    cands = [Candidate(f"eng{i}", 64) for i in range(1, 6)]
    w, y = _array(0x2000), _array(0x3000)
    with pytest.raises(PartlyTimed) as caught:  # x off a 16-byte boundary, as a search under memory pressure takes it
        faked.measure("fwd", GEOM, _array(0x1002), w, y, _lease(64), cands, None)
    assert [(c.algo, c.time_ms) for c in caught.value.timed] == [("eng4", 4.0)]
    assert caught.value.refused == [*cands[:3], cands[4]] and caught.value.failed == []
    timed = faked.measure("fwd", GEOM, _array(0x1000), w, y, _lease(64), cands, None)  # all on 16-byte boundaries
    assert [(c.algo, c.time_ms) for c in timed] == [("eng1", 1.0), ("eng2", 2.0), ("eng3", 3.0), ("eng4", 4.0)]


def test_measure_names_the_engines_cudnn_had_no_memory_for_as_out_of_memory_of_their_own(faked, monkeypatch):
    """A plan cuDNN could not allocate for, finalizing it (device memory) or running it (host memory), is out of memory
    of its own (PartlyTimed's failed: ranked after the timed ones, no verdict the search cache keeps), not an error
    that ends measure(): the search would lose every engine of the lease with it."""
    b = RefusingBuilder({}, times={"eng1": 1, "eng2": 2, "eng3": 3}, short={"eng1": "finalize", "eng3": "execute"})
    _stand_in_builder(faked, monkeypatch, b)
    cands = [Candidate(f"eng{i}", 64) for i in range(1, 4)]
    with pytest.raises(PartlyTimed) as caught:
        faked.measure("fwd", GEOM, _array(0x1000), _array(0x2000), _array(0x3000), _lease(64), cands, None)
    assert [(c.algo, c.time_ms) for c in caught.value.timed] == [("eng2", 2.0)]
    assert caught.value.failed == [cands[0], cands[2]] and caught.value.refused == []


def test_measure_takes_an_engine_cudnn_had_no_memory_for_in_a_timed_run_as_out_of_memory_of_its_own(faked,
                                                                                                  monkeypatch):
    """A plan whose warm-up ran but one of whose timed runs cuDNN could not allocate for is out of memory of its own,
    as one whose warm-up it could not allocate for: named in PartlyTimed's failed, the next engines timed. The error
    ended measure(), and the search lost every engine of that workspace with it."""
    b = RefusingBuilder({}, times={"eng1": 1, "eng2": 2, "eng3": 3}, short={"eng2": "timed"})
    _stand_in_builder(faked, monkeypatch, b)
    cands = [Candidate(f"eng{i}", 64) for i in range(1, 4)]
    with pytest.raises(PartlyTimed) as caught:
        faked.measure("fwd", GEOM, _array(0x1000), _array(0x2000), _array(0x3000), _lease(64), cands, None)
    assert [(c.algo, c.time_ms) for c in caught.value.timed] == [("eng1", 1.0), ("eng3", 3.0)]
    assert caught.value.failed == [cands[1]] and caught.value.refused == []


@pytest.mark.parametrize("where", ["finalize", "execute"])
def test_a_call_runs_the_next_engine_where_cudnn_could_not_allocate_for_the_first(faked, where):
    """Outside a search too, a plan cuDNN could not allocate for, finalizing it (device memory) or running it (host
    memory), is out of memory of its own, as the search takes it: the next candidate runs, a MemoryFallbackWarning says
    why, and where none can, a NoAlgorithmFitsError (a MemoryError) says so. cuDNN's allocation failures were no
    MemoryError: the call raised the first one."""
    b = RefusingBuilder({}, short={"eng1": where})
    faked._plans = PlanCache(b.graph, b.plan, refused=faked.retry_errors[:1])
    cands = (Candidate("eng1", 64), Candidate("eng2", 64))
    x, w, y = _array(0x1000), _array(0x2000), _array(0x3000)

    def run(cand, ws):
        faked.run("fwd", cand, GEOM, x, w, y, ws, None)

    with pytest.warns(MemoryFallbackWarning, match="eng2 .* in place of eng1 .*out of memory of its own"):
        ran = algos.run_with_fallback(_Arena(), cands, run, stream=None, cap=None, retry=faked.retry_errors,
                                      warn_for=("fwd", GEOM))
    assert ran is cands[1] and [e[0] for e in b.executed] == ["eng2"]
    with pytest.raises(NoAlgorithmFitsError) as caught:
        algos.run_with_fallback(_Arena(), cands[:1], run, stream=None, cap=None, retry=faked.retry_errors)
    assert isinstance(caught.value.__cause__, wsarena.cudnn.CudnnInternalError)


def test_an_exhaustive_search_saves_no_verdict_on_engines_refused_on_its_operands_alone(faked, monkeypatch,
                                                                                        tmp_path):
    """A search timed on operands off a 16-byte boundary (copies could not be had: memory pressure) drops the engines
    refused on them, and the search cache keeps only what it timed; a later process (the choices and plans gone, the
    entry read back from disk) searches again on aligned operands and times them; the engine whose plan cuDNN
    refuses for those is saved as rejected, and a third process reads every verdict back, timing nothing. Saved as
    rejected by the first process, the refused engines were never timed again until the cache was cleared."""
    from wsarena import _search_env

    arena = _Arena()
    cands = [Candidate(f"eng{i}", 64) for i in range(1, 6)]
    monkeypatch.setattr(faked, "_ranked", lambda handle, pass_, geom: list(cands))
    monkeypatch.setattr(faked, "arena", lambda: arena)
    monkeypatch.setattr(faked, "device_key", lambda: "stand-in")
    monkeypatch.setattr(faked, "search_environment", lambda: {"device": "stand-in GPU"}, raising=False)
    monkeypatch.setattr(_search_env, "_known", {})
    configure(cache_dir=tmp_path)
    times = {"eng1": 1, "eng2": 2, "eng3": 3, "eng4": 4}

    def process(x_ptr):
        """A new process's search: no choice kept, no plan built, the search cache on disk as the last one left it."""
        algos.cache_clear()
        b = RefusingBuilder({("eng2", (2, 16, 16)): 4096}, unbuilt=UNBUILT,
                            unrun={"eng3"}, times=times)
        _stand_in_builder(faked, monkeypatch, b)

        def short_of_memory():
            raise MemoryError("no copy at an aligned address")

        x = SimpleNamespace(data=SimpleNamespace(ptr=x_ptr), copy=short_of_memory)
        got = algos.select(faked, "fwd", GEOM, cap=None, search="exhaustive", operands=(x, _array(0x2000),
                                                                                         _array(0x3000)))
        (entry,) = (tmp_path / "search").glob("*.json")
        saved = {r["algo"]: r["time_ms"] for r in json.loads(entry.read_text())["results"]}
        return [(c.algo, c.time_ms) for c in got], saved, {e[0] for e in b.executed}

    got, saved, ran = process(0x1002)
    assert got == [("eng4", 4.0)] and saved == {"eng4": 4.0} and ran == {"eng4"}
    got, saved, ran = process(0x1000)
    assert got == [("eng1", 1.0), ("eng2", 2.0), ("eng3", 3.0), ("eng4", 4.0)]
    assert saved == {"eng1": 1.0, "eng2": 2.0, "eng3": 3.0, "eng4": 4.0, "eng5": None} and ran == set(times)
    assert process(0x1002) == (got, saved, set())  # read back whole: nothing timed, on any operands


class RunRefusingBuilder(RefusingBuilder):
    """A RefusingBuilder whose cuDNN refuses to execute the plans of ``refusals``' names, on any operands, with the
    status each names."""

    def __init__(self, sizes, refusals, times):
        super().__init__(sizes, times=times)
        self.refusals = refusals

    def plan(self, handle, graph, name):
        from wsarena import cudnn

        made = super().plan(handle, graph, name)
        if name in self.refusals:
            def refuse(*args):
                raise cudnn.CudnnError(int(self.refusals[name]), f"{name} at {args[1:5]}")
            made.execute = refuse
        return made


def test_measure_leaves_out_an_engine_cudnn_will_not_run_on_aligned_operands(faked, monkeypatch, tmp_path):
    """A finalized plan whose execution cuDNN refuses (NOT_SUPPORTED) on 16-byte-aligned operands, those every
    candidate is ranked and sized for, in a lease that holds it, is the engine's verdict on the geometry, as a plan
    cuDNN will not finalize for them and a FindEx entry failed on them are: left out, saved as rejected, and a later
    process reads it back, timing nothing. Taken as refused on these operands alone, it was saved neither way, and every
    process searched the call again. A misaligned pointer (x, w and y aligned: the workspace's) is still refused, and
    off 16-byte boundaries any refusal."""
    from wsarena import _search_env

    refusals = {"eng1": cudnn_status.NOT_SUPPORTED, "eng2": cudnn_status.BAD_PARAM_MISALIGNED_POINTER}
    times = {"eng1": 1, "eng2": 2, "eng3": 3}
    b = RunRefusingBuilder({}, refusals, times)
    _stand_in_builder(faked, monkeypatch, b)
    cands = [Candidate(f"eng{i}", 64) for i in range(1, 4)]
    w, y = _array(0x2000), _array(0x3000)
    with pytest.raises(PartlyTimed) as caught:
        faked.measure("fwd", GEOM, _array(0x1000), w, y, _lease(64), cands, None)
    assert [(c.algo, c.time_ms) for c in caught.value.timed] == [("eng3", 3.0)]
    assert caught.value.refused == [cands[1]] and caught.value.failed == []
    with pytest.raises(PartlyTimed) as caught:
        faked.measure("fwd", GEOM, _array(0x1002), w, y, _lease(64), cands, None)
    assert caught.value.refused == cands[:2]

    arena = _Arena()
    monkeypatch.setattr(faked, "_ranked", lambda handle, pass_, geom: [cands[0], cands[2]])
    monkeypatch.setattr(faked, "arena", lambda: arena)
    monkeypatch.setattr(faked, "device_key", lambda: "stand-in")
    monkeypatch.setattr(faked, "search_environment", lambda: {"device": "stand-in GPU"}, raising=False)
    monkeypatch.setattr(_search_env, "_known", {})
    configure(cache_dir=tmp_path)

    def process():
        """A new process's search on aligned operands: no choice kept, no plan built, the search cache on disk."""
        algos.cache_clear()
        b = RunRefusingBuilder({}, {"eng1": cudnn_status.NOT_SUPPORTED}, times)
        _stand_in_builder(faked, monkeypatch, b)
        got = algos.select(faked, "fwd", GEOM, cap=None, search="exhaustive", operands=(_array(0x1000), w, y))
        (entry,) = (tmp_path / "search").glob("*.json")
        saved = {r["algo"]: r["time_ms"] for r in json.loads(entry.read_text())["results"]}
        return [(c.algo, c.time_ms) for c in got], saved, len(b.graphs), {e[0] for e in b.executed}

    assert process() == ([("eng3", 3.0)], {"eng1": None, "eng3": 3.0}, 1, {"eng3"})
    assert process() == ([("eng3", 3.0)], {"eng1": None, "eng3": 3.0}, 0, set())  # read back: nothing built or run


def test_the_heuristic_setting_picks_cudnns_mode_and_keys_the_choices(finalizing, monkeypatch):
    """cudnn_heuristic="b" ranks with cuDNN's mode B, for real against the H100's properties; a choice made under
    one mode is not the other's (the algorithm cache is keyed by it)."""
    from wsarena.backends import _cudnn_graph
    from wsarena.cudnn import BackendHeurMode

    backend = device_properties_backend(H100.read_text())
    modes = []
    real = _cudnn_graph.ranked_names

    def spy(*args, mode=None, **kwargs):
        modes.append(mode)
        return real(*args, mode=mode, **kwargs)

    monkeypatch.setattr(_cudnn_graph, "ranked_names", spy)
    algos.cache_clear()
    geom = GEOM.with_batch(5)
    algos.select(backend, "fwd", geom, cap=None, search="heuristic")
    assert modes == [None] and algos.is_cached(backend, "fwd", geom, cap=None, search="heuristic")
    with config(cudnn_heuristic="b"):
        assert not algos.is_cached(backend, "fwd", geom, cap=None, search="heuristic")
        ranked = algos.select(backend, "fwd", geom, cap=None, search="heuristic")
        assert modes == [None, BackendHeurMode.MODE_B] and ranked and all(is_engine_name(c.algo) for c in ranked)
    with pytest.raises(ValueError, match="cudnn_heuristic must be one of"):
        configure(cudnn_heuristic="a")


def test_report_takes_the_heuristic_flag(finalizing, capsys, monkeypatch):
    assert main(["report", "resnet50", "--device-properties", str(H100), "--cudnn-heuristic", "b", "--format",
                 "json"]) == 0
    assert json.loads(capsys.readouterr().out)["layers"][0]["fwd"]["algo"].startswith("eng")
    monkeypatch.setenv("WSARENA_CUDNN_HEURISTIC", "c")
    wsarena._config._reset()
    assert main(["report", "resnet50", "--device-properties", str(H100)]) == 2
    assert "WSARENA_CUDNN_HEURISTIC='c'" in capsys.readouterr().err
    assert main(["report", "resnet50", "--device-properties", str(H100), "--cudnn-heuristic", "instant"]) == 0


def _searching_process(faked, monkeypatch, cands):
    """The graph backend with ``cands`` as its ranking, a host of stand-ins for its arena and device, and no search
    cache: what one process keeps of its searches."""
    arena = _Arena()
    monkeypatch.setattr(faked, "_ranked", lambda handle, pass_, geom: list(cands))
    monkeypatch.setattr(faked, "arena", lambda: arena)
    monkeypatch.setattr(faked, "device_key", lambda: "stand-in")


def _short_of_memory():
    raise MemoryError("no copy at an aligned address")


@pytest.mark.parametrize("lazy", [False, True], ids=["operands", "made-when-asked"])
def test_a_ranking_searched_on_a_view_serves_views_alike_and_an_aligned_call_searches_again(faked, monkeypatch, lazy):
    """A search on x off a 16-byte boundary (no copies could be had: memory pressure) drops the engines refused on
    it. That ranking serves later calls on operands aligned alike, timing nothing, but not a call on 16-byte-aligned
    operands in the same process: it searches again, gets every engine, and that ranking is kept for good, the view
    then running the first that takes it. The process kept its choice per geometry alone: every later call, aligned
    ones too, ran the view's ranking for the rest of the process. The ops hand their operands as a function that
    makes them (copies once the algorithm is chosen): served alike."""
    cands = [Candidate(f"eng{i}", 64) for i in range(1, 6)]
    _searching_process(faked, monkeypatch, cands)
    b = RefusingBuilder({("eng2", (2, 16, 16)): 4096}, unbuilt=UNBUILT, unrun={"eng3"},
                        times={"eng1": 1, "eng2": 2, "eng3": 3, "eng4": 4})
    _stand_in_builder(faked, monkeypatch, b)

    def search(x_ptr):
        x = SimpleNamespace(data=SimpleNamespace(ptr=x_ptr), copy=_short_of_memory)
        b.executed.clear()
        operands = (x, _array(0x2000), _array(0x3000))
        got = algos.select(faked, "fwd", GEOM, cap=None, search="exhaustive",
                           operands=(lambda: operands) if lazy else operands)
        return [(c.algo, c.time_ms) for c in got], {e[0] for e in b.executed}

    def kept():
        return algos.is_cached(faked, "fwd", GEOM, cap=None, search="exhaustive")

    assert search(0x1002) == ([("eng4", 4.0)], {"eng4"}) and not kept()
    assert search(0x1002) == ([("eng4", 4.0)], set())  # operands aligned alike: served, nothing timed
    full = [("eng1", 1.0), ("eng2", 2.0), ("eng3", 3.0), ("eng4", 4.0)]
    assert search(0x1000) == (full, {"eng1", "eng2", "eng3", "eng4"}) and kept()
    assert search(0x1002) == (full, set())  # kept for good: any operands
    assert search(0x1004) == (full, set())


@pytest.mark.parametrize("x_ptr", [0x1000, 0x1002], ids=["aligned", "view-copied"])
def test_a_ranking_searched_on_aligned_operands_without_an_engine_refused_there_is_kept_for_good(faked, monkeypatch,
                                                                                               x_ptr):
    """An engine refused on 16-byte-aligned operands for a misaligned pointer (the workspace's) is dropped, as
    refused on these operands alone; but operands aligned so, or a view's aligned copies, are what every search times
    on where it can: the ranking is kept for good, and no later call searches again. It served only operands aligned
    as those timed: a view, whose search timed its aligned copies, searched again on every call, and an aligned call
    was never kept for good (the ops asked algos every time)."""
    cands = [Candidate(f"eng{i}", 64) for i in range(1, 4)]
    _searching_process(faked, monkeypatch, cands)
    b = RunRefusingBuilder({}, {"eng2": cudnn_status.BAD_PARAM_MISALIGNED_POINTER}, {"eng1": 1, "eng2": 2, "eng3": 3})
    _stand_in_builder(faked, monkeypatch, b)
    faked._cupy.empty_like = lambda out: _array(0x6000)

    def copyable(ptr):  # a copy is at an aligned address
        return SimpleNamespace(data=SimpleNamespace(ptr=ptr), copy=lambda: _array(0x5000))

    def search(ptr):
        b.executed.clear()
        got = algos.select(faked, "fwd", GEOM, cap=None, search="exhaustive",
                           operands=lambda: (copyable(ptr), copyable(0x2000), _array(0x3000)))
        return [(c.algo, c.time_ms) for c in got], {e[0] for e in b.executed}

    ranking = [("eng1", 1.0), ("eng3", 3.0)]
    assert search(x_ptr) == (ranking, {"eng1", "eng3"})
    assert algos.is_cached(faked, "fwd", GEOM, cap=None, search="exhaustive")
    assert search(x_ptr) == (ranking, set())  # nothing timed again
    assert search(0x1000) == (ranking, set()) and search(0x1004) == (ranking, set())
