"""The cap-versus-step-time curve and the recommended cap (`wsarena.tune`, `plan(max_slowdown=...)`)."""

import csv
import dataclasses
import io
import json
import math
import re
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wsarena
from wsarena import algos, backends
from wsarena._geometry import describe_geometry
from wsarena._tune_cli import render_curve, tune_output
from wsarena.errors import BackendUnavailableError, WorkspaceCapWarning
from wsarena.models import ConvLayer
from wsarena.tuning import tune

from .fake_backend import TableBackend

# Workspaces in bytes, times in ms. The layer with 8 output channels has an algorithm (fft) that is larger and
# slower than its gemm: the cap that admits it changes no choice, so it is no point of the curve.
TABLE = {
    ("fwd", 4): [("implicit", 0, 10.0), ("gemm", 1000, 4.0), ("fft", 8000, 3.0)],
    ("bwd_data", 4): [("implicit", 0, 6.0), ("gemm", 2000, 5.0)],
    ("fwd", 8): [("implicit", 0, 20.0), ("gemm", 4000, 12.0), ("fft", 16000, 12.5)],
    ("bwd_data", 8): [("implicit", 0, 8.0)],
}
LAYERS = [
    ConvLayer("a", (1, 3, 8, 8), (4, 3, 3, 3), padding=1),
    ConvLayer("b", (1, 4, 8, 8), (8, 4, 3, 3), padding=1),
    ConvLayer("c", (1, 3, 8, 8), (4, 3, 3, 3), padding=1),  # a's geometry again
]
PASSES = ("fwd", "bwd_data")

# Worked out by hand: per cap, a and c take the same algorithms (fwd + bwd_data each), b its own.
#   cap 0:     a, c: 10 + 6;  b: 20 + 8   -> 60 ms, arena 0
#   cap 1000:  a, c: 4 + 6;   b: 20 + 8   -> 48 ms, arena 1000
#   cap 2000:  a, c: 4 + 5;   b: 20 + 8   -> 46 ms, arena 2000
#   cap 4000:  a, c: 4 + 5;   b: 12 + 8   -> 38 ms, arena 4000
#   cap 8000:  a, c: 3 + 5;   b: 12 + 8   -> 36 ms, arena 8000  (cap 16000 admits b's fft: slower, no change)
#   no cap:                                  36 ms, arena 8000
EXPECTED = [(0, 0, 60), (1000, 1000, 48), (2000, 2000, 46), (4000, 4000, 38), (8000, 8000, 36), (None, 8000, 36)]


@pytest.fixture
def fake(monkeypatch):
    """The planner's cpu backend is a TableBackend (a new algorithm cache around it)."""
    backend = TableBackend(TABLE)
    monkeypatch.setitem(backends._backends, "cpu", backend)
    algos.cache_clear()
    yield backend
    algos.cache_clear()


def run(**kwargs):
    args = {"batch": 2, "passes": PASSES, "backend": "cpu", "model": "toy", **kwargs}
    return tune(LAYERS, **args)


def test_the_curve_and_the_recommendation_from_known_times(fake):
    t = run()
    got = [(p.cap_workspace_bytes, p.arena_bytes, p.step_seconds) for p in t.curve]
    assert [g[:2] for g in got] == [e[:2] for e in EXPECTED]
    for (_, _, seconds), (_, _, ms) in zip(got, EXPECTED):
        assert seconds == pytest.approx(ms / 1e3, rel=1e-12)
    assert [p.slowdown for p in t.curve] == pytest.approx([60 / 36 - 1, 48 / 36 - 1, 46 / 36 - 1, 38 / 36 - 1, 0, 0])
    assert t.max_slowdown == 0.02 and t.recommended_cap_bytes == 8000
    assert run(max_slowdown=0.06).recommended_cap_bytes == 4000  # 38/36 - 1 = 5.6 %
    assert run(max_slowdown=0.3).recommended_cap_bytes == 2000
    assert run(max_slowdown=12 / 36).recommended_cap_bytes == 1000  # a threshold met exactly counts
    assert run(max_slowdown=10).recommended_cap_bytes == 0
    # each distinct call timed once: a's measurements serve c
    assert sorted(fake.measured) == [("bwd_data", 4), ("bwd_data", 8), ("fwd", 4), ("fwd", 8)]


def test_the_json_object(fake):
    d = run().to_dict()
    assert {"wsarena_version", "model", "backend", "device", "batch", "dtype", "layout", "curve",
            "recommended_cap_bytes", "max_slowdown"} <= set(d)
    assert (d["model"], d["backend"], d["device"], d["batch"], d["dtype"], d["layout"]) == (
        "toy", "cpu", "fake device 1", 2, "float32", "NCHW")
    assert d["curve"][-1] == {"cap_workspace_bytes": None, "arena_bytes": 8000, "step_seconds": pytest.approx(0.036),
                              "slowdown": 0.0}
    assert set(d["curve"][0]) == {"cap_workspace_bytes", "arena_bytes", "step_seconds", "slowdown"}
    assert d["recommended_cap_bytes"] == 8000 and d["max_slowdown"] == 0.02


def test_streams_multiply_or_split_the_arena(fake):
    assert [p.arena_bytes for p in run(streams=2).curve] == [2 * e[1] for e in EXPECTED]
    # a and c on stream 0, b on stream 1: each stream holds its own layers' largest workspace
    split = run(streams=[0, 1, 0]).curve
    assert [(p.cap_workspace_bytes, p.arena_bytes) for p in split] == [
        (0, 0), (1000, 1000), (2000, 2000), (4000, 6000), (8000, 12000), (None, 12000)]


def test_an_assignment_counts_only_the_streams_it_lists(fake):
    """a and c on stream 0, b on stream 2, stream 1 idle: the curve and every plan are those of streams 0 and 1, two
    streams; an idle stream 1 was one of three in the plans."""
    gap, packed = run(streams=[0, 2, 0]), run(streams=[0, 1, 0])
    assert gap.curve == packed.curve
    assert gap.to_dict()["streams"] == 2
    for point in gap.curve:
        p = gap.plan(point.cap_workspace_bytes)
        assert p.streams == 2 and p.stream_bytes == packed.plan(point.cap_workspace_bytes).stream_bytes
        assert p.arena_bytes == point.arena_bytes


def test_numpy_integers_count_as_ints(fake):
    for kwargs in ({"streams": 2}, {"batch": 3}):
        numpy = run(**{key: np.int64(value) for key, value in kwargs.items()})
        assert numpy.curve == run(**kwargs).curve and numpy.uncapped.to_dict() == run(**kwargs).uncapped.to_dict()


def test_the_recommended_cap_reproduces_the_plan(fake):
    t = run(max_slowdown=0.06)
    recommended = t.plan()
    assert recommended.cap_workspace == 4000 and recommended.max_slowdown == 0.06
    by_plan = wsarena.plan(LAYERS, batch=2, passes=PASSES, backend="cpu", model="toy", max_slowdown=0.06)
    assert by_plan == recommended
    capped = wsarena.plan(LAYERS, batch=2, passes=PASSES, backend="cpu", model="toy", cap_workspace=4000,
                          search="exhaustive")
    assert capped.layers == recommended.layers and capped.arena_bytes == recommended.arena_bytes == 4000
    assert {k: v for k, v in recommended.to_dict().items() if k != "max_slowdown"} == capped.to_dict()
    assert recommended.to_dict()["max_slowdown"] == 0.06
    for point in t.curve:  # and at every other point: its step time is the plan's, its arena the plan's
        p = t.plan(point.cap_workspace_bytes)
        # only the recommended cap was chosen by max_slowdown: no other plan claims it
        assert p.max_slowdown == (0.06 if point.cap_workspace_bytes == 4000 else None)
        assert ("max_slowdown" in p.to_dict()) == (point.cap_workspace_bytes == 4000)
        step = math.fsum(c.time_ms for lp in p.layers for c in lp.choices.values()) / 1e3
        assert step == pytest.approx(point.step_seconds) and p.arena_bytes == point.arena_bytes


def test_plan_max_slowdown_refuses_a_cap_or_a_heuristic_search(fake):
    with pytest.raises(ValueError, match="cap_workspace or max_slowdown"):
        wsarena.plan(LAYERS, backend="cpu", cap_workspace=0, max_slowdown=0.02)
    with pytest.raises(ValueError, match="search='exhaustive'"):
        wsarena.plan(LAYERS, backend="cpu", search="heuristic", max_slowdown=0.02)
    for bad in (-0.01, math.inf, math.nan):
        with pytest.raises(ValueError, match="max_slowdown"):
            wsarena.plan(LAYERS, backend="cpu", max_slowdown=bad)
    for bad in ("2%", True):
        with pytest.raises(TypeError, match="max_slowdown"):
            tune(LAYERS, backend="cpu", max_slowdown=bad)
    assert fake.measured == []  # refused before anything was timed


def test_a_cap_between_points_plans_as_the_point_below_it(fake):
    t = run()
    caps = [p.cap_workspace_bytes for p in t.curve[:-1]]
    for cap in range(0, 20000, 250):
        below = max(c for c in caps if c <= cap)
        assert t.plan(cap).layers == t.plan(below).layers


def test_the_uncapped_plan_is_the_exhaustive_plan(fake):
    t = run()
    assert t.uncapped == wsarena.plan(LAYERS, batch=2, passes=PASSES, backend="cpu", model="toy",
                                      cap_workspace=None, search="exhaustive")


def test_an_exhaustive_plan_memory_let_time_nothing_plans_as_the_heuristic_one(monkeypatch):
    """Every algorithm needs workspace and the provider grants none: the exhaustive searches time nothing, and the
    plan takes the heuristic order, as the heuristic plan does (a MemoryFallbackWarning says so); tune, which needs
    the times, names the layer. The plan raised NoAlgorithmFitsError, where the heuristic plan planned."""
    from wsarena.errors import NoAlgorithmFitsError

    table = {key: [row for row in rows if row[1]] or [("gemm", 300, 8.0)] for key, rows in TABLE.items()}
    monkeypatch.setitem(backends._backends, "cpu", TableBackend(table, memory=0))
    args = {"batch": 2, "passes": PASSES, "backend": "cpu", "model": "toy"}
    with pytest.warns(wsarena.MemoryFallbackWarning, match="could not time any algorithm"):
        exhaustive = wsarena.plan(LAYERS, search="exhaustive", **args)
    heuristic = wsarena.plan(LAYERS, search="heuristic", **args)
    assert [lp.choices for lp in exhaustive.layers] == [lp.choices for lp in heuristic.layers]
    assert [c.algo for lp in exhaustive.layers for c in lp.choices.values()] == ["gemm"] * 6
    with pytest.raises(NoAlgorithmFitsError, match="^no fwd algorithm of layer 'a' could be timed"):
        run()


def test_a_call_whose_operands_memory_could_not_hold_says_so_where_nothing_could_be_timed(monkeypatch):
    """Memory for the operands, not for a workspace, kept the search from timing anything: the error said only the
    sizes "(requested 0 B, held 0 B, cap none)", which read as a workspace of 0 B not had. It says what memory lacked
    (the class and its sizes as they were); where the operands can be had, it says nothing of them."""
    from wsarena.errors import NoAlgorithmFitsError

    class NoOperands(TableBackend):
        def random(self, shape, dtype):
            raise MemoryError(f"no memory for an array of shape {shape}")

    monkeypatch.setitem(backends._backends, "cpu", NoOperands(TABLE))
    algos.cache_clear()
    try:
        with pytest.warns(wsarena.SearchFallbackWarning, match="could not time any algorithm"), \
                pytest.raises(NoAlgorithmFitsError) as untimed:
            run()
        assert str(untimed.value) == (
            "no fwd algorithm of layer 'a' could be timed: memory for its operands could not be had (no memory for "
            "an array of shape (2, 3, 8, 8)), whatever the workspace (requested 0 B, held 0 B, cap none)")
        assert (untimed.value.requested, untimed.value.held, untimed.value.cap) == (0, 0, None)
        # memory for the workspace alone: the sizes are what it lacked, and the operands are not named
        table = {key: [row for row in rows if row[1]] or [("gemm", 300, 8.0)] for key, rows in TABLE.items()}
        monkeypatch.setitem(backends._backends, "cpu", TableBackend(table, memory=0))
        algos.cache_clear()
        with pytest.warns(wsarena.MemoryFallbackWarning), pytest.raises(NoAlgorithmFitsError) as untimed:
            run()
        said = str(untimed.value)
        assert said == "no fwd algorithm of layer 'a' could be timed (requested 1000 B, held 0 B, cap none)"
    finally:
        algos.cache_clear()


def test_operands_made_again_to_tell_never_raise_in_place_of_the_search_error(monkeypatch):
    """The operands are made again, on the error path alone, to tell whether memory for them stopped the search:
    where that fails otherwise now (a CUDA error, not out of memory), the search's error is raised as it was, not the
    error of making them again, which says nothing of the call that could not be timed."""
    from wsarena.errors import NoAlgorithmFitsError

    class NoOperands(TableBackend):
        def random(self, shape, dtype):  # the search's: out of memory
            raise MemoryError(f"no memory for an array of shape {shape}")

    def failing(*args):  # made again, by tune: another failure
        raise RuntimeError("cudaErrorLaunchFailure")

    monkeypatch.setitem(backends._backends, "cpu", NoOperands(TABLE))
    monkeypatch.setattr(wsarena.tuning, "_operands", failing)
    algos.cache_clear()
    try:
        with pytest.warns(wsarena.SearchFallbackWarning), pytest.raises(NoAlgorithmFitsError) as untimed:
            run()
        assert str(untimed.value) == "no fwd algorithm of layer 'a' could be timed (requested 0 B, held 0 B, cap none)"
    finally:
        algos.cache_clear()


def test_a_model_without_zero_workspace_algorithms_starts_at_its_smallest_cap(monkeypatch):
    """b's input gradient needs 300 bytes: the curve starts at 300, and a plan under a cap of 299 is refused with
    that smallest cap as the workspace requested, none held, and the cap given."""
    from wsarena.errors import NoAlgorithmFitsError

    table = {**TABLE, ("bwd_data", 8): [("gemm", 300, 8.0)]}
    monkeypatch.setitem(backends._backends, "cpu", TableBackend(table))
    algos.cache_clear()
    t = run()
    assert t.curve[0].cap_workspace_bytes == 300
    with pytest.raises(NoAlgorithmFitsError) as refused:
        t.plan(299)
    assert isinstance(refused.value, MemoryError)
    assert (refused.value.requested, refused.value.held, refused.value.cap) == (300, 0, 299)
    assert t.plan(300).cap_workspace == 300


def test_tunes_defaults_are_batch_1_one_stream_and_a_2_percent_slowdown(fake):
    """Batch 1 and one stream, as plan() takes them, and a 2 % slowdown: the curve of EXPECTED (whose arenas are
    one stream's), recommended at 8000 bytes."""
    t = tune(LAYERS, passes=PASSES, backend="cpu")
    assert t.uncapped.batch == 1 and t.to_dict()["batch"] == 1 and t.uncapped.streams == 1
    assert [(p.cap_workspace_bytes, p.arena_bytes) for p in t.curve] == [e[:2] for e in EXPECTED]
    assert t.max_slowdown == 0.02 and t.recommended_cap_bytes == 8000


def test_search_seconds_is_the_time_the_measurements_took(fake, monkeypatch):
    """On a clock that reads 100 s as the tuning starts and 100.25 s once the plan has searched."""
    import types

    from wsarena import tuning

    readings = iter([100.0, 100.25])
    monkeypatch.setattr(tuning, "time", types.SimpleNamespace(perf_counter=lambda: next(readings)))
    t = run()
    assert t.search_seconds == 0.25 and t.to_dict()["search_seconds"] == 0.25


def test_a_tuning_and_its_points_cannot_be_changed(fake):
    """The recommendation and the plans are read from the curve: neither it nor its points take new values."""
    t = run()
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.recommended_cap_bytes = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.curve[0].step_seconds = 0.0


def test_a_model_without_layers_is_refused():
    with pytest.raises(ValueError, match="layers is empty"):
        tune([], backend="cpu")


def test_float16_without_a_gpu_is_the_environment(monkeypatch):
    """On any machine: no GPU is made to look usable, so that backend "auto" is the CPU's (a GPU machine's would
    tune float16 on cuDNN)."""
    monkeypatch.setattr(backends, "gpu_unusable_reason", lambda: "the CUDA driver sees no device")
    with pytest.raises(BackendUnavailableError, match="float16"):
        tune(LAYERS, dtype="float16")


def test_calls_whose_algorithms_memory_kept_from_being_timed_are_counted_and_said(monkeypatch):
    """Memory grants at most 2000 bytes (the arena asks in whole KiB): a's fwd times gemm and implicit, not fft's
    8000; a's bwd_data implicit, not gemm's 2000; b's fwd implicit alone; b's bwd_data its one. The curve is built
    from what was timed, and says so."""
    backend = TableBackend(TABLE, memory=2000)
    monkeypatch.setitem(backends._backends, "cpu", backend)
    with pytest.warns(wsarena.MemoryFallbackWarning, match="exhaustive search for fwd"):
        tuning = run()
    assert tuning.untimed_calls == 3 and tuning.to_dict()["untimed_calls"] == 3
    geoms = [lp.geometry for lp in tuning.uncapped.layers]
    assert [c.algo for c in tuning.measured[("fwd", geoms[0])]] == ["gemm", "implicit"]
    assert [c.algo for c in tuning.measured[("bwd_data", geoms[0])]] == ["implicit"]
    assert [p.cap_workspace_bytes for p in tuning.curve] == [0, 1000, None]
    assert "; 3 with algorithms memory kept from being ranked or timed, which the curve leaves out" in (
        render_curve(tuning))
    algos.cache_clear()
    monkeypatch.setitem(backends._backends, "cpu", TableBackend(TABLE))
    whole = run()
    assert whole.untimed_calls == 0 and "memory kept" not in render_curve(whole)


def test_calls_the_backend_ranked_without_some_algorithms_are_ranked_and_timed_once(monkeypatch):
    """Memory keeps the backend from ranking fft (PartlyRanked): the plan's ranking is not kept for good, and tune,
    which reads back what the plan searched, ranked each such call again (and, with the search cache off, timed it
    again). It takes the plan's ranking: each distinct call is timed once, and the curve is built without fft, which
    untimed_calls counts (the fwd calls), as the table says: it counted none, as if the curve were whole. The plan
    ranks each distinct call once: c repeats a's fwd, which it ranked again."""
    from wsarena.backends import Candidate, PartlyRanked

    ranked = []

    class Short(TableBackend):
        def candidates(self, pass_, geom):
            ranked.append((pass_, geom.out_channels))
            cands = super().candidates(pass_, geom)
            if any(c.algo == "fft" for c in cands):
                raise PartlyRanked([c for c in cands if c.algo != "fft"])
            return cands

    backend = Short(TABLE)
    monkeypatch.setitem(backends._backends, "cpu", backend)
    t = run()
    distinct = [("bwd_data", 4), ("bwd_data", 8), ("fwd", 4), ("fwd", 8)]
    assert sorted(backend.measured) == distinct
    assert sorted(ranked) == distinct
    assert [p.cap_workspace_bytes for p in t.curve] == [0, 1000, 2000, 4000, None]  # no fft
    geom = t.uncapped.layers[0].geometry
    assert t.measured[("fwd", geom)] == (Candidate("gemm", 1000, 4.0), Candidate("implicit", 0, 10.0))
    assert t.untimed_calls == 2 and t.to_dict()["untimed_calls"] == 2
    assert "; 2 with algorithms memory kept from being ranked or timed, which the curve leaves out" in render_curve(t)


def test_the_recommendation_says_what_it_saves_or_that_no_smaller_arena_is_within_the_slowdown(fake):
    """From the known times: within 10% the 4000-byte cap (+5.56%) saves half the uncapped arena; within 2% only the
    uncapped arena's 8000 bytes are, and the line says what the next smaller one would cost, or that none is. A cap
    is named as --cap-workspace takes it back: 4 KiB for 4000 bytes, 7.875 KiB for 8000."""
    def recommendation(max_slowdown):
        (line,) = [x for x in render_curve(run(max_slowdown=max_slowdown)).splitlines() if x.startswith("recommended")]
        return line

    assert recommendation(0.1) == (
        "recommended cap (slowdown within 10%): 4 KiB: step 38.00 ms (+5.56%), arena 3.91 KiB instead of "
        "7.81 KiB uncapped"
    )
    assert recommendation(0.02) == (
        "recommended cap (slowdown within 2%): 7.875 KiB: step 36.00 ms (+0.00%), arena 7.81 KiB, as uncapped: no "
        "smaller one keeps the slowdown within 2% (the next, 3.91 KiB, costs +5.56%)"
    )
    # b's input gradient has one algorithm, without workspace: no cap gives a smaller arena, within any slowdown
    only = tune([LAYERS[1]], batch=2, passes=("bwd_data",), backend="cpu", model="toy")
    (line,) = [x for x in render_curve(only).splitlines() if x.startswith("recommended")]
    assert line.endswith("arena 0 B, as uncapped: no cap gives a smaller one")


def test_a_slowdown_reads_on_the_side_of_the_limit_that_judged_it(monkeypatch):
    """A cap refused at 2.003 % under a 2 % limit read "+2.00%" in its row and in "the next ... costs", as if within
    it; one taken at 1.2358 % under 1.236 % read "+1.24%", as if over it. Each gets the digits that tell it."""
    def curve(capped_ms, max_slowdown):
        table = {("fwd", 4): [("implicit", 0, capped_ms), ("gemm", 1000, 10.0)]}
        monkeypatch.setitem(backends._backends, "cpu", TableBackend(table))
        algos.cache_clear()
        return tune(LAYERS[:1], batch=2, passes=("fwd",), backend="cpu", model="toy", max_slowdown=max_slowdown)

    t = curve(10.2003, 0.02)  # 10.2003 / 10 - 1: 2.003 %
    assert t.recommended_cap_bytes == 1000
    text = render_curve(t).splitlines()
    assert text[6].endswith(" +2.003%") and text[7].endswith(" +0.00%  <- recommended")
    assert text[10].endswith("no smaller one keeps the slowdown within 2% (the next, 0 B, costs +2.003%)")
    t = curve(10.12358, 0.01236)  # 1.2358 %
    assert t.recommended_cap_bytes == 0
    text = render_curve(t).splitlines()
    assert text[6].endswith(" +1.236%  <- recommended")
    assert "step 10.12 ms (+1.236%)" in text[10]
    assert render_curve(curve(10.3, 0.02)).splitlines()[6].endswith(" +3.00%")  # two decimals tell it: as ever


def test_the_plots_recommended_slowdown_reads_within_the_limit(monkeypatch):
    """As the table's: a cap taken at 1.2358 % under 1.236 % read "+1.24%" in the legend."""
    pytest.importorskip("matplotlib")
    from wsarena import plot

    drawn = []
    monkeypatch.setattr(plot, "_save", lambda plt, fig, path: (drawn.append(fig), plt.close(fig)))
    monkeypatch.setitem(backends._backends, "cpu", TableBackend({("fwd", 4): [("implicit", 0, 10.12358),
                                                                               ("gemm", 1000, 10.0)]}))
    algos.cache_clear()
    plot.plot_curve(tune(LAYERS[:1], batch=2, passes=("fwd",), backend="cpu", max_slowdown=0.01236), "unused.png")
    (ax,) = drawn.pop().axes
    assert "recommended cap 0 B (+1.236%, max slowdown 1.236%)" in [x.get_text() for x in ax.get_legend().texts]


def test_the_device_is_shown_escaped_in_the_header(monkeypatch):
    """As report's header shows it: a newline or an escape sequence in the device's name broke the line of tune's
    header or drove the terminal."""
    monkeypatch.setitem(backends._backends, "cpu", TableBackend(TABLE, device="gpu\n\x1b[2J 0"))
    algos.cache_clear()
    t = run()
    assert render_curve(t).splitlines()[1].startswith("backend cpu (gpu\\n\\x1b[2J 0)  dtype float32")


def test_the_device_is_shown_escaped_in_the_plots_title(monkeypatch):
    """As the header: the font has no glyph for a newline or an escape."""
    pytest.importorskip("matplotlib")
    from wsarena import plot

    monkeypatch.setitem(backends._backends, "cpu", TableBackend(TABLE, device="gpu\n\x1b[2J 0"))
    algos.cache_clear()
    drawn = []
    monkeypatch.setattr(plot, "_save", lambda plt, fig, path: (drawn.append(fig), plt.close(fig)))
    plot.plot_curve(run(), "unused.png")
    (ax,) = drawn.pop().axes
    assert ax.get_title() == "toy: batch 2, float32, cpu (gpu\\n\\x1b[2J 0), fwd+bwd_data"


def test_against_an_uncapped_step_timed_at_0_a_slower_point_has_no_slowdown(monkeypatch):
    """A model too small for the timer (or a search cache's 0): the workspace algorithms time 0 ms, the others 1 ms.
    Worked out as EXPECTED is: cap 0: a, c: 1 + 1; b: 1 + 0 -> 5 ms; cap 1000: 3 ms; cap 2000: 1 ms; cap 4000 and
    no cap: 0. Every slowdown read 0 (0 over 0), so the 5 ms cap 0 was recommended within 0 %; a slower point's
    slowdown is infinite, within no max_slowdown, and says so in the table, the JSON (null) and the CSV (empty)."""
    table = {key: [(a, n, 1.0 if n == 0 else 0.0) for a, n, _ in rows] for key, rows in TABLE.items()}
    table[("bwd_data", 8)] = [("implicit", 0, 0.0)]
    monkeypatch.setitem(backends._backends, "cpu", TableBackend(table))
    algos.cache_clear()
    t = run(max_slowdown=10.0)
    assert [(p.cap_workspace_bytes, p.step_seconds) for p in t.curve] == [
        (0, pytest.approx(0.005)), (1000, pytest.approx(0.003)), (2000, pytest.approx(0.001)), (4000, 0.0),
        (None, 0.0)]
    assert [p.slowdown for p in t.curve] == [math.inf, math.inf, math.inf, 0.0, 0.0]
    assert t.recommended_cap_bytes == 4000  # the smallest as fast, whatever slowdown is allowed
    assert wsarena.plan(LAYERS, batch=2, passes=PASSES, backend="cpu", max_slowdown=10.0).cap_workspace == 4000
    d = json.loads(json.dumps(t.to_dict(), allow_nan=False))  # strict JSON: no Infinity
    assert [p["slowdown"] for p in d["curve"]] == [None, None, None, 0.0, 0.0]
    assert [type(p["slowdown"]) for p in d["curve"]] == [type(None)] * 3 + [float] * 2  # a float where not null
    rows = list(csv.DictReader(io.StringIO(tune_output(t, "csv"))))
    assert [r["slowdown"] for r in rows] == ["", "", "", "0.0", "0.0"]
    text = render_curve(t).splitlines()
    assert [line.split()[-1] for line in text[6:9]] == ["n/a"] * 3 and text[9].endswith("+0.00%  <- recommended")
    assert text[11] == "n/a: slower than the uncapped step, which timed at 0.0 us; no --max-slowdown admits it"
    assert text[13].endswith("as uncapped: no smaller one keeps the slowdown within 1000% (the next, 1.95 KiB, takes "
                             "1.00 ms)")
    # every step timed at 0: equal times, no slowdown, and the smallest cap is recommended
    table = {key: [(a, n, 0.0) for a, n, _ in rows] for key, rows in TABLE.items()}
    monkeypatch.setitem(backends._backends, "cpu", TableBackend(table))
    algos.cache_clear()
    t = run(max_slowdown=0.0)
    assert [p.slowdown for p in t.curve] == [0.0, 0.0] and t.recommended_cap_bytes == 0
    assert "n/a" not in render_curve(t)


def test_caps_a_few_bytes_apart_are_shown_each_as_it_is_taken_back(monkeypatch):
    """Caps 4 bytes apart all read "1 MiB": a row shows a cap that --cap-workspace takes back for its choices, in
    bytes where an eighth of a MiB more would reach the next cap; the recommendation names it so."""
    mib = 2**20
    table = {
        ("fwd", 4): [("implicit", 0, 10.0), ("gemm", mib, 4.0), ("fft", mib + 8, 3.0)],
        ("bwd_data", 4): [("implicit", 0, 6.0), ("gemm", mib + 4, 5.0)],
        ("fwd", 8): [("implicit", 0, 20.0), ("gemm", 3 * mib, 12.0)],
        ("bwd_data", 8): [("implicit", 0, 8.0)],
    }
    monkeypatch.setitem(backends._backends, "cpu", TableBackend(table))
    algos.cache_clear()
    t = run(max_slowdown=0.25)  # steps 60, 48, 46, 44, 36, 36 ms: 44 / 36 - 1 is 22 %
    assert [p.cap_workspace_bytes for p in t.curve] == [0, mib, mib + 4, mib + 8, 3 * mib, None]
    text = render_curve(t).splitlines()
    assert [re.split(r"\s{2,}", line.strip())[0] for line in text[6:12]] == [
        "0 B", "1 MiB", "1048580 B", "1.125 MiB", "3 MiB", "none"]
    assert text[9].endswith("<- recommended")
    assert text[13].startswith("recommended cap (slowdown within 25%): 1.125 MiB: step 44.00 ms (+22.22%)")


def _shown_caps(t):
    """The cap column of render_curve's table, row by row."""
    lines = render_curve(t).splitlines()
    rows = lines[lines.index(next(x for x in lines if x.lstrip().startswith("---"))) + 1:][:len(t.curve)]
    return [re.split(r"\s{2,}", row.strip())[0] for row in rows]


def _check_caps_taken_back(caps, shown):
    """Each cap shown, parsed as --cap-workspace and WSARENA_CAP_WORKSPACE parse it, is at least the row's cap and
    below the next row's (the same choices); with at most three decimals."""
    for cap, below, text in zip(caps, [*caps[1:], None], shown):
        if cap is None:
            assert text == "none"
            continue
        n = wsarena.parse_size(text)
        assert cap <= n and (below is None or n < below), (cap, text, below)
        assert re.fullmatch(r"[0-9]+(\.[0-9]{1,3})? (B|KiB|MiB|GiB|TiB)", text), text


@pytest.mark.parametrize("model", ["resnet50", "googlenet", "mobilenet_v2"])
def test_each_cap_the_table_shows_is_taken_back_for_the_same_choices(model):
    """The table showed format_size's rounding ("55.12 MiB" for 55.125 MiB): given back to --cap-workspace it is no
    whole number of bytes, and a cap rounded down ("1.5 MiB" for a few bytes more) is below the row's, whose
    choices it refuses. On the built-in models' forward passes, as the cpu backend times them."""
    algos.cache_clear()
    t = tune(wsarena.load_model(model), batch=1, passes=("fwd",), backend="cpu", model=model)
    caps = [p.cap_workspace_bytes for p in t.curve]
    shown = _shown_caps(t)
    _check_caps_taken_back(caps, shown)
    for cap, text in zip(caps[:-1], shown):
        assert t.plan(text.replace(" ", "")).layers == t.plan(cap).layers
    best = shown[caps.index(t.recommended_cap_bytes)]
    assert f"recommended cap (slowdown within 2%): {best}: " in render_curve(t)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**45), min_size=1, max_size=12, unique=True))
def test_caps_shown_are_taken_back_for_any_caps(caps):
    from wsarena._tune_cli import cap_texts
    from wsarena.tuning import CurvePoint

    caps = [*sorted(caps), None]
    shown = cap_texts([CurvePoint(cap, 0, 0.0, 0.0) for cap in caps])
    _check_caps_taken_back(caps, [shown[cap] for cap in caps])


def test_the_report_header_names_its_cap_as_it_is_taken_back(fake):
    """The report's header (report --max-slowdown's chosen cap as any) named the cap as format_size rounds it,
    "3.91 KiB" for 4000 bytes, which --cap-workspace refuses (no whole number of bytes): it names it exactly."""
    from wsarena._report_cli import render_table

    t = run(max_slowdown=0.1)
    p = t.plan()
    assert (p.cap_workspace, p.max_slowdown) == (4000, 0.1)
    (cap,) = re.findall(r"  cap (.+?) \(the smallest within a 10% slowdown\)  ", render_table(p))
    assert cap == "4000 B"
    for asked in (1_000_000, 3 * 2**20 // 2, 0, 2**40 + 1):  # a cap given, exactly as it was given
        (text,) = re.findall(r"  cap (.+?)  streams", render_table(t.plan(asked)))
        assert wsarena.parse_size(text) == asked, text
    assert re.search(r"  cap none  ", render_table(t.plan(None)))


def test_arenas_that_read_alike_in_the_recommendation_show_their_bytes(monkeypatch):
    """Arenas 8 bytes apart both read "1 MiB": the recommendation gave "arena 1 MiB instead of 1 MiB uncapped", as if
    it saved nothing, and "arena 1 MiB ... (the next, 1 MiB, ...)" for the next smaller one."""
    mib = 2**20
    table = {
        ("fwd", 4): [("implicit", 0, 10.0), ("gemm", mib, 4.0), ("fft", mib + 8, 3.9)],
        ("bwd_data", 4): [("implicit", 0, 6.0)],
        ("fwd", 8): [("implicit", 0, 20.0)],
        ("bwd_data", 8): [("implicit", 0, 8.0)],
    }
    monkeypatch.setitem(backends._backends, "cpu", TableBackend(table))
    algos.cache_clear()
    t = run(max_slowdown=0.01)  # steps 60, 48 and 47.8 ms: the 1 MiB cap costs 0.42 %
    assert [(p.cap_workspace_bytes, p.arena_bytes) for p in t.curve] == [(0, 0), (mib, mib), (mib + 8, mib + 8),
                                                                         (None, mib + 8)]
    (line,) = [x for x in render_curve(t).splitlines() if x.startswith("recommended")]
    assert line.endswith(", arena 1 MiB (1048576 B) instead of 1 MiB (1048584 B) uncapped"), line
    (line,) = [x for x in render_curve(run(max_slowdown=0.001)).splitlines() if x.startswith("recommended")]
    assert line.endswith(", arena 1 MiB (1048584 B), as uncapped: no smaller one keeps the slowdown within 0.1% (the "
                         "next, 1 MiB (1048576 B), costs +0.42%)"), line
    # sizes that read apart are shown as ever
    (line,) = [x for x in render_curve(run(max_slowdown=0.3)).splitlines() if x.startswith("recommended")]
    assert line.endswith(", arena 0 B instead of 1 MiB uncapped"), line


def test_the_persistent_cache_serves_a_second_tuning(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("WSARENA_CACHE_DIR", str(tmp_path))
    first = run()
    algos.cache_clear()  # as a new process would start
    fake.measured.clear()
    second = run()
    assert fake.measured == [] and second.curve == first.curve
    distinct = len(first.measured)
    assert (first.timed_calls, first.cached_calls) == (distinct, 0) and distinct == 4
    assert (second.timed_calls, second.cached_calls) == (0, distinct)
    third = run()  # this process's algorithm cache answers: neither timed nor read
    assert (third.timed_calls, third.cached_calls) == (0, 0)
    assert second.to_dict()["cached_calls"] == distinct and second.to_dict()["timed_calls"] == 0
    assert "4 distinct calls (pass and geometry): 0 timed, 4 from the search cache;" in render_curve(second)
    assert "0 timed, 0 from the search cache, 4 searched before in this process" in render_curve(third)


@pytest.mark.parametrize("max_slowdown", [0.02, 0.06, 0.3, 10])
def test_under_the_tuned_cap_a_cap_warning_names_each_call_it_slows_and_no_other(fake, tmp_path, monkeypatch,
                                                                                  max_slowdown):
    """The job tune --apply sets up: an exhaustive search under the recommended cap, in a new process that reads the
    search cache tune filled. A WorkspaceCapWarning names each call the cap keeps from its fastest algorithm (the
    slowdown the curve counts), with that algorithm; the calls it does not slow say nothing. It compared the cap with
    the heuristics' first candidate instead, which here fits every cap (each call's zero-workspace one): no call
    said anything, whatever the cap slowed."""
    monkeypatch.setenv("WSARENA_CACHE_DIR", str(tmp_path))
    t = run(max_slowdown=max_slowdown)
    cap = t.recommended_cap_bytes
    capped, fastest = t.plan(cap), t.plan(None)
    slowed = {(p, lp.geometry): (lp.choices[p], best.choices[p])
              for lp, best in zip(capped.layers, fastest.layers) for p in PASSES
              if lp.choices[p].time_ms > best.choices[p].time_ms}
    assert len(slowed) == {0.02: 0, 0.06: 1, 0.3: 2, 10: 3}[max_slowdown]
    algos.cache_clear()  # as the job's new process starts
    fake.measured.clear()
    with wsarena.config(cap_workspace=cap, algo_search="exhaustive"), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for lp in capped.layers:
            for p in PASSES:
                got = algos.select(fake, p, lp.geometry, cap=cap, search="exhaustive", operands=(None, None, None))
                assert got[0] == lp.choices[p]  # the curve's choice under the cap
    assert fake.measured == []  # every call read from the search cache
    warned = sorted(str(w.message) for w in said if w.category is WorkspaceCapWarning)
    assert len(warned) == len(slowed)
    for (p, geom), (ran, best) in slowed.items():
        (line,) = [text for text in warned if f" for {p} of {describe_geometry(geom)};" in text]
        assert f"excludes {best.algo} (" in line and f"; using {ran.algo} (" in line
        assert f"{best.time_ms:.3g} ms" in line and f"{ran.time_ms:.3g} ms" in line


def test_the_curve_is_timed_on_the_cudnn_api_the_plan_searched_whatever_another_thread_configures(monkeypatch):
    """Another thread's configure(cudnn_api=...) as tune plans: its curve came from the backend of the API configured
    by the time the plan was made, which timed every call again, under the plan of the API tune began with."""
    on = {}
    for key, api in (("cudnn:graph", "graph"), ("cudnn", "legacy")):
        on[api] = TableBackend(TABLE, device=f"fake {api} device")
        on[api].api = api
        monkeypatch.setitem(backends._backends, key, on[api])

    def progress(done, total, name):
        wsarena.configure(cudnn_api="legacy")  # the other thread's

    assert wsarena.get_config().cudnn_api == "graph"
    t = tune(LAYERS, batch=2, passes=PASSES, backend="cudnn", model="toy", progress=progress)
    assert on["legacy"].measured == [] and len(on["graph"].measured) == 4
    assert t.uncapped.device == "fake graph device"
    assert [(p.cap_workspace_bytes, p.arena_bytes) for p in t.curve] == [e[:2] for e in EXPECTED]


@st.composite
def tables(draw):
    """Random workspaces and times for the toy model's four calls; every call has some algorithm."""
    table = {}
    for key in TABLE:
        n = draw(st.integers(1, 5))
        table[key] = [
            (f"algo{i}", draw(st.integers(0, 10_000)), draw(st.floats(0.01, 100, allow_nan=False)))
            for i in range(n)
        ]
    return table


@settings(max_examples=60, deadline=None)
@given(table=tables(), max_slowdown=st.floats(0, 1))
def test_a_larger_cap_never_gives_a_slower_step(table, max_slowdown):
    saved = backends._backends.get("cpu")
    backends._backends["cpu"] = TableBackend(table)
    algos.cache_clear()
    try:
        t = run(max_slowdown=max_slowdown)
    finally:
        backends._backends["cpu"] = saved
        algos.cache_clear()
    finite = [p for p in t.curve if p.cap_workspace_bytes is not None]
    caps = [p.cap_workspace_bytes for p in finite]
    assert caps == sorted(set(caps)) and t.curve[-1].cap_workspace_bytes is None
    for before, after in zip(t.curve, t.curve[1:]):
        assert after.step_seconds <= before.step_seconds
        assert after.arena_bytes >= before.arena_bytes
    for p in finite:
        assert p.arena_bytes <= p.cap_workspace_bytes and p.slowdown >= 0
    assert t.curve[-1].slowdown == 0 and dataclasses.replace(finite[-1], cap_workspace_bytes=None) == t.curve[-1]
    chosen = t.recommended
    assert chosen.slowdown <= max_slowdown + 1e-12
    assert all(p.slowdown > max_slowdown for p in finite if p.cap_workspace_bytes < chosen.cap_workspace_bytes)


@pytest.mark.gpu
def test_tuning_on_cudnn_and_its_cache(tmp_path, monkeypatch):
    """The curve from cuDNN's own search (FindEx times, every math type), and a second tuning from the cache."""
    from wsarena._search_env import environment
    from wsarena.backends import get_backend

    monkeypatch.setenv("WSARENA_CACHE_DIR", str(tmp_path))
    wsarena.configure(cudnn_api="legacy")  # cuDNN's FindEx search: the legacy API path, not the default (graph)
    algos.cache_clear()
    env = environment(get_backend("cudnn"))
    assert env["api"] == "legacy" and env["compute_capability"] and env["cudnn"] and env["driver"]
    layers = [ConvLayer("a", (1, 16, 28, 28), (32, 16, 3, 3), padding=1),
              ConvLayer("b", (1, 32, 28, 28), (32, 32, 5, 5), padding=2)]
    t = tune(layers, batch=8, backend="cudnn", max_slowdown=0.05)
    steps = [p.step_seconds for p in t.curve]
    assert steps == sorted(steps, reverse=True) and t.curve[-1].cap_workspace_bytes is None
    assert t.recommended.slowdown <= 0.05 + 1e-12
    assert wsarena.plan(layers, batch=8, backend="cudnn", cap_workspace=t.recommended_cap_bytes,
                        search="exhaustive").layers == t.plan().layers
    algos.cache_clear()
    assert tune(layers, batch=8, backend="cudnn", max_slowdown=0.05).curve == t.curve


def test_a_cap_and_a_slowdown_are_taken_as_the_rest_of_wsarena_takes_them(fake):
    """NumPy numbers and size strings, as plan(cap_workspace=...) and configure() take them."""
    np = pytest.importorskip("numpy")
    t = run(max_slowdown=np.float32(0.06))
    assert t.max_slowdown == pytest.approx(0.06) and type(t.max_slowdown) is float
    assert t.recommended_cap_bytes == 4000
    assert t.plan(np.int64(4000)) == t.plan(4000) == t.plan("4000") == t.plan(" 4000 B")
    assert t.plan("none") == t.plan(None)
    assert wsarena.plan(LAYERS, batch=2, passes=PASSES, backend="cpu", model="toy",
                        max_slowdown=np.float64(0.06)).cap_workspace == 4000
    for bad, error in (("lots", ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="cap"):
            t.plan(bad)
    for bad, error in ((np.bool_(True), TypeError), (10**400, ValueError), (np.float64("nan"), ValueError),
                       (10**5000, ValueError), (-(10**5000), ValueError)):  # past what repr() shows
        with pytest.raises(error, match="max_slowdown") as caught:
            run(max_slowdown=bad)
        assert len(str(caught.value)) < 200  # the value shortened, as in the rest of wsarena's errors
    assert math.copysign(1, run(max_slowdown=-0.0).max_slowdown) == 1  # no "-0%" in the table or -0.0 in the JSON


def test_a_curve_of_one_cap_plots_without_a_warning(monkeypatch, tmp_path):
    """Every call's fastest algorithm needs no workspace: the curve is cap 0 and no cap."""
    pytest.importorskip("matplotlib")
    import warnings

    from wsarena.plot import plot_curve

    table = {key: [("implicit", 0, 1.0), ("gemm", 1000, 2.0)] for key in TABLE}
    monkeypatch.setitem(backends._backends, "cpu", TableBackend(table))
    algos.cache_clear()
    t = run()
    assert [p.cap_workspace_bytes for p in t.curve] == [0, None]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot_curve(t, str(tmp_path / "curve.png"))
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_the_plots_give_sizes_and_times_as_the_tables_do(fake, monkeypatch):
    """The legends and titles name the recommended cap, the arenas and the step as the tables print them, where
    fixed decimals of MiB made the 3.91 KiB cap "0.00 MiB"; and the caps as --cap-workspace takes them back, where
    format_size's "3.91 KiB" for 4000 bytes it refuses: the recommended cap as the tune table names it (4 KiB, which
    chooses as 4000 bytes does), a plan's own cap exactly."""
    pytest.importorskip("matplotlib")
    from wsarena import plot

    drawn = []
    monkeypatch.setattr(plot, "_save", lambda plt, fig, path: (drawn.append(fig), plt.close(fig)))

    def texts():
        (ax,) = drawn.pop().axes
        return ax.get_title(), [x.get_text() for x in ax.get_legend().get_texts()]

    t = run(max_slowdown=0.1)
    plot.plot_curve(t, "unused.png")
    _, legend = texts()
    assert legend[1:] == ["no cap: 36.00 ms, arena 7.81 KiB", "recommended cap 4 KiB (+5.56%, max slowdown 10%)"]
    plot.plot_plan(t.plan(), "unused.png")
    title, legend = texts()
    # unshared: a and c, gemm 1000 + gemm 2000 each; b, gemm 4000 + implicit 0: 10000 bytes
    assert title.endswith("cap 4000 B - unshared 9.77 KiB vs arena 3.91 KiB")
    assert "arena per stream (1 stream: total 3.91 KiB)" in legend


def test_the_curves_axis_says_what_the_arena_needs_at_a_cap_on_several_streams(fake, monkeypatch):
    """At each point's cap one stream's arena needs that cap; on K streams each running any layer, the arena needs K
    times it (the table's arena column): the axis said "the arena needs the same" whatever the streams."""
    pytest.importorskip("matplotlib")
    from wsarena import plot

    drawn = []
    monkeypatch.setattr(plot, "_save", lambda plt, fig, path: (drawn.append(fig), plt.close(fig)))

    def label(t):
        plot.plot_curve(t, "unused.png")
        (ax,) = drawn.pop().axes
        return ax.get_xlabel()

    one, shared, split = run(), run(streams=2), run(streams=[0, 1, 0])
    assert all(q.arena_bytes == q.cap_workspace_bytes for q in one.curve[:-1])
    assert label(one) == "workspace cap (MiB; the arena needs the same)"
    assert all(q.arena_bytes == 2 * q.cap_workspace_bytes for q in shared.curve[:-1])
    assert label(shared) == "workspace cap (MiB; the arena needs as much on each of its 2 streams)"
    # b alone on stream 1: at the 1000-byte cap stream 1 holds nothing
    assert any(q.arena_bytes < 2 * q.cap_workspace_bytes for q in split.curve[:-1])
    assert label(split) == "workspace cap (MiB; the arena needs up to as much on each of its 2 streams)"


def test_a_plan_of_a_thousand_layers_plots_as_wide_as_one_of_sixty(tmp_path):
    """report's plot names each layer up to 60 layers, growing wider with each; past that it names none and stays as
    wide. A plan of 1,000 layers (one pass) drew a PNG 21,600 pixels wide (of 1,200 layers and three passes 77,760,
    of 40,000 2.6 million, in minutes)."""
    pytest.importorskip("matplotlib")
    import struct
    import warnings

    from wsarena.plot import plot_plan

    def size(n):
        layers = [ConvLayer(f"l{i}", (1, 4, 8, 8), (4, 4, 3, 3), padding=1) for i in range(n)]
        path = tmp_path / f"{n}.png"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            plot_plan(wsarena.plan(layers, backend="cpu", passes=("fwd",)), str(path))
        return struct.unpack(">II", path.read_bytes()[16:24])  # the PNG's IHDR: width, height

    assert size(1000) == size(60) == (1296, 540)  # 0.18 inches a layer and pass, at 120 dpi
    assert size(50)[0] == 1080


def test_a_backend_given_replaces_an_invalid_variable(monkeypatch):
    """As plan() does: a setting given as an argument needs no valid environment variable."""
    monkeypatch.setenv("WSARENA_BACKEND", "bogus")
    wsarena._config._reset()
    layers = [wsarena.ConvLayer("c", (1, 3, 8, 8), (4, 3, 3, 3), padding=(1, 1))]
    assert wsarena.tune(layers, backend="cpu").uncapped.backend == "cpu"
    with pytest.raises(ValueError, match="WSARENA_BACKEND"):
        wsarena.tune(layers)


def test_the_curves_work_grows_with_the_layers_not_with_layers_times_caps(monkeypatch):
    """One call with 200 algorithms, each larger and faster than the one before: 200 caps, each a point. Repeating
    its layer adds the same work per layer however many caps there are (counted in hashes of the layer's geometry,
    as tests time nothing): working out every layer's choices at every cap took half a minute for 2,000 layers."""
    from wsarena._geometry import ConvGeometry

    monkeypatch.setitem(backends._backends, "cpu",
                        TableBackend({("fwd", 4): [(f"algo{i}", 1000 * i, 300.0 - i) for i in range(200)]}))
    real = ConvGeometry.__hash__
    hashes = [0]

    def counted(self):
        hashes[0] += 1
        return real(self)

    def work(n):
        algos.cache_clear()
        hashes[0] = 0
        monkeypatch.setattr(ConvGeometry, "__hash__", counted)
        t = tune([LAYERS[0]] * n, passes=("fwd",), backend="cpu")
        monkeypatch.setattr(ConvGeometry, "__hash__", real)
        assert len(t.curve) == 201 and t.curve[0].step_seconds == pytest.approx(n * 0.3)
        return hashes[0]

    assert (work(200) - work(100)) / 100 < 20


@st.composite
def models(draw):
    """Random workspaces and times (ties among both likely) for the calls of layers of 4, 8 and 16 output channels,
    and a model of those layers, each repeated, over some of the passes and streams."""
    sizes = draw(st.lists(st.integers(0, 5000), min_size=1, max_size=4))
    times = draw(st.lists(st.floats(0.001, 100), min_size=1, max_size=4))
    table = {(p, ch): [(f"algo{i}", draw(st.sampled_from(sizes)), draw(st.sampled_from(times)))
                       for i in range(draw(st.integers(1, 4)))]
             for p in ("fwd", "bwd_data", "bwd_filter") for ch in (4, 8, 16)}
    repeats = draw(st.lists(st.tuples(st.sampled_from((4, 8, 16)), st.integers(1, 12)), min_size=1, max_size=4))
    layers = [ConvLayer(f"l{i}.{j}", (1, 3, 8, 8), (ch, 3, 3, 3), padding=1)
              for i, (ch, n) in enumerate(repeats) for j in range(n)]
    passes = draw(st.sampled_from([("fwd",), ("bwd_filter",), ("fwd", "bwd_data"), ("fwd", "bwd_data", "bwd_filter")]))
    streams = draw(st.one_of(st.integers(1, min(3, len(layers))),
                             st.lists(st.integers(0, min(2, len(layers) - 1)), min_size=len(layers),
                                      max_size=len(layers))))
    return table, layers, passes, streams


@settings(max_examples=150, deadline=None)
@given(model=models(), max_slowdown=st.sampled_from([0.0, 0.02, 0.1, 1 / 3, 1.0]))
def test_the_curve_against_every_cap_worked_out_layer_by_layer(model, max_slowdown):
    """Brute force: at every cap each layer's pass takes the fastest algorithm that fits (the first of equal times, in
    the table's order, as TableBackend ranks them); the step is the sum over the layers, the arena per stream the
    largest workspace of its layers (every stream any layer's, for a number of streams). The curve has a point where
    some choice changes, and the recommended cap is the smallest whose step is within max_slowdown of no cap's
    (relative tolerance 1e-12, the rounding of the sums)."""
    table, layers, passes, streams = model
    saved = backends._backends.get("cpu")
    backends._backends["cpu"] = TableBackend(table)
    algos.cache_clear()
    try:
        t = tune(layers, passes=passes, streams=streams, backend="cpu", max_slowdown=max_slowdown)
    finally:
        backends._backends["cpu"] = saved
        algos.cache_clear()

    def choices(cap):
        picked = []
        for layer in layers:
            row = []
            for p in passes:
                fits = [r for r in table[(p, layer.weight_shape[0])] if cap is None or r[1] <= cap]
                if not fits:
                    return None
                row.append(min(fits, key=lambda r: r[2]))  # min keeps the first of equal times
            picked.append(row)
        return picked

    def point(cap):
        picked = choices(cap)
        step = math.fsum(r[2] for row in picked for r in row) / 1e3
        largest = [max(r[1] for r in row) for row in picked]
        if isinstance(streams, int):
            arena = streams * max(largest)
        else:
            lanes = range(max(streams) + 1)
            arena = sum(max((b for b, s in zip(largest, streams) if s == k), default=0) for k in lanes)
        return step, arena

    caps = sorted({0} | {r[1] for rows in table.values() for r in rows})
    fitting = [c for c in caps if choices(c) is not None]
    changes = [c for i, c in enumerate(fitting) if i == 0 or choices(c) != choices(fitting[i - 1])]
    assert [p.cap_workspace_bytes for p in t.curve] == [*changes, None]
    for p in t.curve:
        step, arena = point(p.cap_workspace_bytes)
        assert p.step_seconds == pytest.approx(step, rel=1e-12) and p.arena_bytes == arena
    fastest = point(None)[0]
    within = [c for c in fitting if point(c)[0] <= fastest * (1 + max_slowdown) * (1 + 1e-12)]
    assert t.recommended_cap_bytes == within[0]


def test_a_layer_no_algorithm_of_which_could_be_timed_is_named_shortened(monkeypatch):
    """The error quoted the layer's name whole (a JSON layer list's names may be of any length)."""
    from wsarena import tuning
    from wsarena.backends import Candidate
    from wsarena.errors import NoAlgorithmFitsError

    def select(*args, **kwargs):  # memory kept every candidate from being timed
        return [Candidate("gemm", 1024, None)]

    monkeypatch.setattr(tuning, "select", select)
    layer = ConvLayer("n" * 10_000, (1, 3, 8, 8), (4, 3, 3, 3))
    cut = f"'{'n' * 27}...{'n' * 28}'"
    with pytest.raises(NoAlgorithmFitsError, match=f"^no fwd algorithm of layer {re.escape(cut)} could be timed"):
        tune([layer], backend="cpu", passes=("fwd",))
