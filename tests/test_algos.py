"""Algorithm choice, caching and the out-of-memory fallback, against a scripted backend and arena."""

import contextlib
import re
import warnings

import pytest

from wsarena import config, configure, get_config, parse_size
from wsarena._geometry import conv_geometry, describe_geometry
from wsarena.algos import choose, forced, is_cached, is_chosen, run_with_fallback, select
from wsarena.backends import Candidate, PartlyRanked, PartlyTimed
from wsarena.errors import (
    AlignmentWorkspaceError,
    ArenaOutOfMemoryError,
    MemoryFallbackWarning,
    NoAlgorithmFitsError,
    SearchFallbackWarning,
    WorkspaceCapWarning,
)

# Most tests here put the arena under memory pressure to check what is chosen and kept; the warning that says so is
# checked by the tests at the end, whose pytest.warns records it all the same.
pytestmark = pytest.mark.filterwarnings("ignore::wsarena.errors.MemoryFallbackWarning")

GEOM = conv_geometry((2, 3, 8, 8), (4, 3, 3, 3), padding=1)
TIMES = {"fft": 5.0, "gemm": 1.0, "implicit": 9.0}


class FakeWorkspace:
    def __init__(self, nbytes):
        self.nbytes = nbytes
        self.ptr = 0


class FakeArena:
    """Holds one buffer per stream; growth beyond ``memory`` bytes fails like a real provider."""

    refusing = False  # it remembers no refusal (wsarena.arena.Arena.defers_growth)

    def __init__(self, memory):
        self.memory = memory
        self.held = {}
        self.leases = []

    def held_bytes(self, *, stream=None):
        return self.held.get(stream, 0)

    @contextlib.contextmanager
    def lease(self, nbytes, *, stream=None, cap=None):
        assert cap is None or nbytes <= cap, f"a lease of {nbytes} above the cap {cap} it was chosen under"
        if nbytes > self.held_bytes(stream=stream):
            if nbytes > self.memory:
                raise ArenaOutOfMemoryError("grow", requested=nbytes, held=self.held_bytes(stream=stream), cap=None)
            self.held[stream] = nbytes
        self.leases.append(nbytes)
        yield FakeWorkspace(nbytes)


class FakeBackend:
    name = "fake"
    retry_errors = ()

    def __init__(self, table, times=None):
        self.table = table  # algo -> workspace, in heuristic order
        self.times = times or {}
        self.measured = []
        self._arena = FakeArena(memory=1 << 40)

    def device_key(self):
        return id(self)

    def arena(self):
        return self._arena

    def candidates(self, pass_, geom):
        return [Candidate(a, n) for a, n in self.table.items()]

    def algorithms(self, pass_):
        return tuple(self.table)

    def workspace_size(self, pass_, algo, geom):
        return self.table[algo]

    def measure(self, pass_, geom, a, b, out, workspace, candidates, stream):
        assert all(c.workspace_bytes <= workspace.nbytes for c in candidates)
        self.measured.append([c.algo for c in candidates])
        timed = (Candidate(c.algo, c.workspace_bytes, self.times[c.algo]) for c in candidates)
        return sorted(timed, key=lambda c: c.time_ms)


def test_no_cap_takes_the_fastest():
    b = FakeBackend({"fft": 300, "gemm": 100, "implicit": 0})
    assert choose(b, "fwd", GEOM, cap=None)[0].algo == "fft"


def test_cap_takes_the_first_that_fits_and_warns_once():
    b = FakeBackend({"fft": 300, "gemm": 100, "implicit": 0})
    with pytest.warns(WorkspaceCapWarning, match="excludes fft") as warned:
        got = choose(b, "fwd", GEOM, cap=150)
    assert [c.algo for c in got] == ["gemm", "implicit"]
    g = GEOM
    assert f"stride {g.stride} padding {g.padding} dilation {g.dilation} groups {g.groups}" in str(warned[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose(b, "fwd", GEOM, cap=150)[0].algo == "gemm"  # cached: no second warning


def test_cap_zero_takes_the_zero_workspace_algorithm():
    b = FakeBackend({"fft": 300, "gemm": 100, "implicit": 0})
    with pytest.warns(WorkspaceCapWarning):
        assert choose(b, "fwd", GEOM, cap=0)[0].algo == "implicit"


def test_cap_is_part_of_the_cache_key():
    b = FakeBackend({"fft": 300, "gemm": 100, "implicit": 0})
    assert choose(b, "fwd", GEOM, cap=None)[0].algo == "fft"
    with pytest.warns(WorkspaceCapWarning):
        assert choose(b, "fwd", GEOM, cap=100)[0].algo == "gemm"
    assert choose(b, "fwd", GEOM, cap=1000)[0].algo == "fft"


def test_geometry_and_pass_are_part_of_the_cache_key():
    b = FakeBackend({"a": 10, "b": 0})
    choose(b, "fwd", GEOM, cap=None)
    b.table = {"b": 0, "a": 10}
    assert choose(b, "fwd", GEOM, cap=None)[0].algo == "a"  # cached
    assert choose(b, "bwd_data", GEOM, cap=None)[0].algo == "b"
    assert choose(b, "fwd", GEOM.with_batch(3), cap=None)[0].algo == "b"


def test_device_is_part_of_the_cache_key():
    """Two devices of one backend (two GPUs of different models) rank the same geometry each their own way."""
    first, second, same = (FakeBackend({"fft": 300, "implicit": 0}) for _ in range(3))
    second.table = same.table = {"implicit": 0, "fft": 300}
    first.device_key = same.device_key = lambda: 0
    second.device_key = lambda: 1
    assert choose(first, "fwd", GEOM, cap=None)[0].algo == "fft"
    assert choose(second, "fwd", GEOM, cap=None)[0].algo == "implicit"
    assert choose(same, "fwd", GEOM, cap=None)[0].algo == "fft"  # the first device's cached choice


def test_the_choices_kept_are_bounded_and_the_least_recently_used_go_first():
    """A sweep over shapes kept every choice, some 2-10 KiB each, for good. Past the bound, the least recently used
    key's choice goes (and whether its cap warning was given), and it is chosen again when asked for."""
    from wsarena import algos

    asked = []

    class Counting(FakeBackend):
        def candidates(self, pass_, geom):
            asked.append(geom.batch)
            return super().candidates(pass_, geom)

    b = Counting({"fft": 300, "implicit": 0})
    bound = algos.CHOICES_MAX
    _sweep_past_the_bound(b)
    assert len(algos._cache) == bound and len(algos._warned) == bound
    assert len(asked) == bound + 10
    choose(b, "fwd", GEOM.with_batch(1), cap=100, warn=False)  # kept
    assert len(asked) == bound + 10 and is_cached(b, "fwd", GEOM.with_batch(1), cap=100, search="heuristic")
    assert not is_chosen(b, "fwd", GEOM.with_batch(2), cap=100, search="heuristic")
    with pytest.warns(WorkspaceCapWarning, match="excludes fft"):  # its warning went with it
        assert choose(b, "fwd", GEOM.with_batch(2), cap=100)[0].algo == "implicit"
    assert asked[-1] == 2 and len(asked) == bound + 11


def _sweep_past_the_bound(b):
    """Choose for 10 more batch sizes than the choices kept, under a cap that excludes ``fft``; batch 1 used again
    once the bound is reached, so that it is then the most recently used."""
    from wsarena import algos

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", WorkspaceCapWarning)
        for n in range(1, algos.CHOICES_MAX + 11):
            choose(b, "fwd", GEOM.with_batch(n), cap=100)
            if n == algos.CHOICES_MAX:
                choose(b, "fwd", GEOM.with_batch(1), cap=100)


def test_a_key_in_steady_use_keeps_its_cap_warning_as_it_keeps_its_choice():
    """The cap warning is given once per key kept: a key used again is the most recently used in both, and later
    keys let go of older ones first. Only a key's choice was made recent by its use, so that a call made all along
    warned again once as many other keys had warned."""
    b = FakeBackend({"fft": 300, "implicit": 0})
    _sweep_past_the_bound(b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose(b, "fwd", GEOM.with_batch(1), cap=100)[0].algo == "implicit"
    with pytest.warns(WorkspaceCapWarning, match="excludes fft"):  # one not used again was let go
        choose(b, "fwd", GEOM.with_batch(11), cap=100)


def test_search_mode_is_part_of_the_cache_key():
    b = FakeBackend({"fft": 300, "gemm": 100, "implicit": 0}, times={"fft": 5.0, "gemm": 1.0, "implicit": 9.0})
    assert choose(b, "fwd", GEOM, cap=None)[0].algo == "fft"
    got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert b.measured == [["fft", "gemm", "implicit"]]  # a heuristic choice does not stand in for a search
    assert [c.algo for c in got] == ["gemm", "fft", "implicit"]
    assert choose(b, "fwd", GEOM, cap=None)[0].algo == "fft"  # nor a search for the heuristic order


def test_a_graph_api_choice_is_ranked_under_the_heuristic_its_key_holds():
    # Another thread's configure() as the backend ranks: the choice it ranked under B was kept under INSTANT, the
    # heuristic the key was made of, and served to every later choice under INSTANT.
    class Graph(FakeBackend):
        api = "graph"

        def candidates(self, pass_, geom):
            configure(cudnn_heuristic="b")  # the other thread's
            ranked = super().candidates(pass_, geom)
            return ranked if get_config().cudnn_heuristic == "instant" else ranked[::-1]

    b = Graph({"fft": 300, "gemm": 100, "implicit": 0})
    assert choose(b, "fwd", GEOM, cap=None)[0].algo == "fft"  # the key and the ranking: INSTANT
    assert choose(b, "fwd", GEOM, cap=None)[0].algo == "implicit"  # B now
    configure(cudnn_heuristic="instant")
    assert choose(b, "fwd", GEOM, cap=None)[0].algo == "fft"


def test_nothing_fits_raises_memory_error_with_numbers():
    b = FakeBackend({"fft": 300, "gemm": 100})
    with pytest.raises(NoAlgorithmFitsError) as info:
        choose(b, "fwd", GEOM, cap=50)
    assert isinstance(info.value, MemoryError)
    assert (info.value.requested, info.value.cap) == (100, 50)


def test_exhaustive_ranks_by_measured_time_and_times_only_what_fits():
    b = FakeBackend({"fft": 300, "gemm": 100, "implicit": 0}, times={"fft": 5.0, "gemm": 1.0, "implicit": 9.0})
    with pytest.warns(WorkspaceCapWarning):
        got = select(b, "fwd", GEOM, cap=200, search="exhaustive", operands=(None, None, None))
    assert [c.algo for c in got] == ["gemm", "implicit"]
    assert b.measured == [["gemm", "implicit"]]
    assert b.arena().leases == [100]  # one lease, sized for the largest candidate under the cap


def test_an_exhaustive_cap_warning_names_a_faster_algorithm_the_cap_keeps_out_where_one_is_known():
    """An uncapped search of this process timed every candidate: under a cap, the warning names one that timed faster
    than the choice (the slowdown), and none where the choice is the fastest. It named the heuristics' first, fft,
    whenever the cap excluded it: at 200 B, where gemm, the fastest, runs, and at 50 B, where gemm is what it costs.
    Where nothing timed those above the cap, it still names the heuristics' first (the test above)."""
    b = FakeBackend({"fft": 300, "gemm": 100, "implicit": 0}, times=TIMES)
    select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = select(b, "fwd", GEOM, cap=200, search="exhaustive", operands=(None, None, None))
    assert [c.algo for c in got] == ["gemm", "implicit"]
    with pytest.warns(WorkspaceCapWarning) as warned:
        got = select(b, "fwd", GEOM, cap=50, search="exhaustive", operands=(None, None, None))
    assert [c.algo for c in got] == ["implicit"]
    (text,) = [str(w.message) for w in warned]
    assert "excludes gemm (100 B, 1 ms) " in text and text.endswith("; using implicit (0 B, 9 ms)"), text


@pytest.mark.parametrize("cache", [False, True])
def test_no_exhaustive_cap_warning_names_an_algorithm_above_the_cap_as_fast_as_the_choice(cache, tmp_path):
    """fft, above a cap of 200 B and the heuristics' first, timed exactly as fast as gemm, the choice under it: the
    cap costs nothing, and nothing is said, whether this process's uncapped search or the search cache (read in a
    new process) timed fft. A microsecond faster, the cap keeps the call from it, and that is said."""
    from wsarena import algos

    for fft, said in ((1.0, None), (0.999, "workspace cap 200 B excludes fft (300 B, 0.999 ms) ")):
        configure(cache_dir=tmp_path / str(fft) if cache else None)
        algos.cache_clear()
        b = FakeBackend({"fft": 300, "gemm": 100, "implicit": 0}, times={**TIMES, "fft": fft})
        select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
        if cache:
            algos.cache_clear()  # as a new process starts
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            got = select(b, "fwd", GEOM, cap=200, search="exhaustive", operands=(None, None, None))
        assert [(c.algo, c.time_ms) for c in got] == [("gemm", 1.0), ("implicit", 9.0)]
        assert len(b.measured) == 2 - cache  # the search cache answered the capped search
        texts = [str(w.message) for w in warned if w.category is WorkspaceCapWarning]
        whole = f"{said}for fwd of {describe_geometry(GEOM)}; using gemm (100 B, 1 ms)"
        assert texts == ([] if said is None else [whole])


class MathTypes(FakeBackend):
    """cuDNN's listing: an algorithm once per math type, each with its own workspace and time."""

    def candidates(self, pass_, geom):
        return [Candidate(a, n, None, m) for (a, m), n in self.table.items()]

    def measure(self, pass_, geom, a, b, out, workspace, candidates, stream):
        self.measured.append([(c.algo, c.math_type) for c in candidates])
        timed = (Candidate(c.algo, c.workspace_bytes, self.times[(c.algo, c.math_type)], c.math_type)
                 for c in candidates)
        return sorted(timed, key=lambda c: c.time_ms)


@pytest.mark.parametrize("cache", [False, True])
def test_a_cap_warning_takes_each_math_type_of_an_algorithm_by_its_own_time(cache, tmp_path):
    """gemm on tensor cores (math type 1, 300 B, 1 ms) above a cap of 200 B, gemm without them (100 B, 4 ms) under
    it: the cap keeps the call from the first, whose time is its own, not the other's, whether this process's
    uncapped search or the search cache (read in a new process) timed it."""
    table = {("gemm", 1): 300, ("gemm", 0): 100, ("implicit", 0): 0}
    b = MathTypes(table, times={("gemm", 1): 1.0, ("gemm", 0): 4.0, ("implicit", 0): 9.0})
    configure(cache_dir=tmp_path if cache else None)
    select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    if cache:
        from wsarena import algos

        algos.cache_clear()  # as a new process starts
    with pytest.warns(WorkspaceCapWarning) as warned:
        got = select(b, "fwd", GEOM, cap=200, search="exhaustive", operands=(None, None, None))
    assert [(c.algo, c.math_type, c.time_ms) for c in got] == [("gemm", 0, 4.0), ("implicit", 0, 9.0)]
    assert len(b.measured) == 2 - cache  # the search cache answered the capped search
    (text,) = [str(w.message) for w in warned]
    assert "excludes gemm (300 B, 1 ms) " in text and text.endswith("; using gemm (100 B, 4 ms)"), text


def test_a_capped_search_the_search_cache_serves_reads_its_entry_once(tmp_path, monkeypatch):
    """A search under a cap that the search cache serves (a job under wsarena tune's cap, in a new process) takes the
    times of those above the cap from the entry the search read. It read the entry again for them: its key made, the
    file opened and parsed, which doubled what the first call of each signature spent on the cache."""
    from wsarena import algos, searchcache

    configure(cache_dir=tmp_path)
    b = FakeBackend({"fft": 300, "gemm": 100, "implicit": 0}, times=TIMES)
    select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    algos.cache_clear()  # as a new process starts
    reads = []
    read = searchcache._read
    monkeypatch.setattr(searchcache, "_read", lambda path, key: reads.append(path) or read(path, key))
    with pytest.warns(WorkspaceCapWarning, match=r"excludes gemm \(100 B, 1 ms\) .*; using implicit \(0 B, 9 ms\)$"):
        select(b, "fwd", GEOM, cap=50, search="exhaustive", operands=(None, None, None))
    assert len(reads) == 1 and b.measured == [["fft", "gemm", "implicit"]]  # timed once, by the uncapped search


def test_a_capped_search_memory_cut_short_names_what_the_cap_keeps_out_not_what_memory_does():
    """Memory keeps a search under a cap of 200 B from timing gemm (1 ms), the fastest under the cap, and implicit
    (9 ms) runs meanwhile, as a MemoryFallbackWarning says: the cap costs nothing, as gemm runs once memory allows.
    It said the cap excluded fft (5 ms, an uncapped search's time), faster than implicit but not than gemm, and said
    nothing once gemm ran (once per call). Where the uncapped search timed fft faster than gemm, the cap keeps fft
    out."""
    for fft, said in ((5.0, None), (0.5, "workspace cap 200 B excludes fft (300 B, 0.5 ms) ")):
        b = FakeBackend({"fft": 300, "gemm": 100, "implicit": 0}, times={**TIMES, "fft": fft})
        select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
        b._arena = FakeArena(memory=50)
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            got = select(b, "fwd", GEOM, cap=200, search="exhaustive", operands=(None, None, None))
        assert [(c.algo, c.time_ms) for c in got] == [("implicit", 9.0), ("gemm", None)]
        assert [w.category for w in warned if w.category is not WorkspaceCapWarning] == [MemoryFallbackWarning]
        texts = [str(w.message) for w in warned if w.category is WorkspaceCapWarning]
        if said is None:
            assert texts == []
        else:
            (text,) = texts
            assert text.startswith(said) and text.endswith("; using implicit (0 B, 9 ms)"), text
        b._arena.memory = 1 << 40
        assert select(b, "fwd", GEOM, cap=200, search="exhaustive", operands=(None, None, None))[0].algo == "gemm"


def test_exhaustive_under_memory_pressure_times_what_the_arena_holds():
    b = FakeBackend({"fft": 300, "gemm": 100, "implicit": 0}, times={"fft": 5.0, "gemm": 1.0, "implicit": 9.0})
    b._arena = FakeArena(memory=150)
    b._arena.held[None] = 120
    got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert [c.algo for c in got] == ["gemm", "implicit", "fft"]  # fft could not be timed: last


def test_forced_algorithm_checks_name_and_cap():
    b = FakeBackend({"fft": 300, "gemm": 100, "implicit": 0})
    assert forced(b, "fwd", GEOM, "gemm", cap=100) == (Candidate("gemm", 100),)
    with pytest.raises(ValueError, match="not a fake fwd algorithm"):
        forced(b, "fwd", GEOM, "winograd", cap=None)
    with pytest.raises(ValueError, match="above the cap"):
        forced(b, "fwd", GEOM, "fft", cap=100)


def test_the_cap_an_algorithm_is_refused_or_kept_from_is_named_as_cap_workspace_takes_it_back():
    """A cap of 4000 bytes, which format_size writes "3.91 KiB" (no whole number of bytes: cap_workspace refuses it),
    is named "4000 B" by the error of algo= above it and by the WorkspaceCapWarning; the algorithm's workspace, 5000
    bytes (format_size's "4.88 KiB"), as the cap that admits it: "5 KiB", rounded up to an eighth of a KiB."""
    b = FakeBackend({"fft": 5000, "gemm": 100, "implicit": 0})
    with pytest.raises(ValueError) as refused:
        forced(b, "fwd", GEOM, "fft", cap=4000)
    assert str(refused.value).endswith("needs 5 KiB of workspace for this fwd, above the cap of 4000 B")
    with pytest.warns(WorkspaceCapWarning) as warned:
        select(b, "fwd", GEOM, cap=4000, search="heuristic")
    assert str(warned[0].message).startswith("workspace cap 4000 B excludes fft (5 KiB) for fwd")
    assert parse_size("4000 B") == 4000
    assert select(b, "fwd", GEOM, cap=parse_size("5 KiB"), search="heuristic")[0].algo == "fft"


@pytest.mark.parametrize(("smallest", "shown"), [(4097, "4.125 KiB"), (43200, "42.25 KiB"), (4096, "4 KiB")])
def test_the_request_a_no_algorithm_fits_error_names_is_a_cap_that_admits_the_smallest(smallest, shown):
    """format_size's "4 KiB" for 4097 bytes is a cap that admits nothing, and its "42.19 KiB" for 43200 no whole
    number of bytes: the request is rounded up, to an eighth of its unit."""
    b = FakeBackend({"fft": 5 * smallest, "gemm": smallest})
    with pytest.raises(NoAlgorithmFitsError) as info:
        choose(b, "fwd", GEOM, cap=smallest - 1)
    assert f"(requested {shown}, held 0 B, cap " in str(info.value)
    with pytest.warns(WorkspaceCapWarning, match=f"excludes fft .*; using gemm \\({re.escape(shown)}\\)"):
        assert choose(b, "fwd", GEOM, cap=parse_size(shown))[0].algo == "gemm"


def test_a_forced_algorithm_with_nothing_to_compute_needs_no_workspace():
    """At batch 0 any algorithm of the pass fits any cap, 0 included, and its size is not asked for (cuDNN cannot
    describe a tensor of no images); the name is still checked."""

    class NoEmptySizes(FakeBackend):
        def workspace_size(self, pass_, algo, geom):
            assert geom.batch, "a size asked for a call with nothing to compute"
            return super().workspace_size(pass_, algo, geom)

    b = NoEmptySizes({"fft": 300, "gemm": 100, "implicit": 0})
    empty = GEOM.with_batch(0)
    for pass_ in ("fwd", "bwd_data", "bwd_filter"):
        assert forced(b, pass_, empty, "fft", cap=0) == (Candidate("fft", 0),)
    with pytest.raises(ValueError, match="not a fake fwd algorithm"):
        forced(b, "fwd", empty, "winograd", cap=0)
    with pytest.raises(ValueError, match="above the cap"):
        forced(b, "fwd", GEOM, "fft", cap=0)


def test_out_of_memory_falls_back_to_what_is_held():
    arena = FakeArena(memory=200)
    arena.held["s"] = 120
    ran = []
    cands = (Candidate("fft", 300), Candidate("gemm_big", 150), Candidate("gemm", 100), Candidate("implicit", 0))
    used = run_with_fallback(arena, cands, lambda c, ws: ran.append((c.algo, ws.nbytes)), stream="s", cap=None)
    # fft cannot grow the arena; gemm_big would still need growth, so the next that fits the 120 held bytes runs
    assert used.algo == "gemm" and ran == [("gemm", 100)]
    assert arena.held["s"] == 120


def test_out_of_memory_with_nothing_that_fits_raises_and_arena_stays_usable():
    arena = FakeArena(memory=50)
    cands = (Candidate("fft", 300), Candidate("gemm", 100))
    with pytest.raises(NoAlgorithmFitsError, match="out of memory") as info:
        run_with_fallback(arena, cands, lambda c, ws: None, stream=None, cap=None)
    assert isinstance(info.value.__cause__, ArenaOutOfMemoryError)
    assert (info.value.requested, info.value.held) == (300, 0)
    ran = run_with_fallback(arena, (Candidate("implicit", 0),), lambda c, ws: None, stream=None, cap=None)
    assert ran.algo == "implicit"


def test_out_of_memory_reports_what_the_stream_holds():
    arena = FakeArena(memory=150)
    arena.held["s"] = 120
    cands = (Candidate("fft", 300), Candidate("gemm", 200))  # neither fits the 120 bytes held, nor can grow
    with pytest.raises(NoAlgorithmFitsError) as info:
        run_with_fallback(arena, cands, lambda c, ws: None, stream="s", cap=None)
    assert (info.value.requested, info.value.held, info.value.cap) == (300, 120, None)


def test_errors_from_the_run_itself_propagate():
    arena = FakeArena(memory=1000)

    def boom(c, ws):
        raise RuntimeError("kernel failed")

    with pytest.raises(RuntimeError, match="kernel failed"):
        run_with_fallback(arena, (Candidate("gemm", 10),), boom, stream=None, cap=None)


def test_a_silent_choice_still_warns_the_first_caller_who_asks():
    b = FakeBackend({"fft": 300, "implicit": 0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        choose(b, "fwd", GEOM, cap=10, warn=False)  # the planner's way: no warning
    with pytest.warns(WorkspaceCapWarning):
        choose(b, "fwd", GEOM, cap=10)


def test_a_search_that_times_nothing_falls_back_to_the_heuristic_order_and_is_not_kept():
    b = FakeBackend({"fft": 300, "gemm": 100, "implicit": 0}, times={"fft": 5.0, "gemm": 1.0, "implicit": 9.0})
    b.measure = lambda *args: []  # e.g. every FindEx entry failed
    got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert [c.algo for c in got] == ["fft", "gemm", "implicit"]
    del b.measure  # the real search works now: it is asked again, since nothing was cached
    got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert [c.algo for c in got] == ["gemm", "fft", "implicit"]


def test_a_search_cut_short_by_memory_keeps_the_untimed_after_the_timed():
    b = FakeBackend({"fft": 300, "gemm": 100, "implicit": 0}, times={"fft": 5.0, "gemm": 1.0, "implicit": 9.0})
    b._arena = FakeArena(memory=150)  # fft's 300 bytes cannot be had, and the arena holds nothing yet
    got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert [c.algo for c in got] == ["implicit", "fft", "gemm"]  # the timed first, then heuristic order
    b._arena.memory = 1000
    got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert [c.algo for c in got] == ["gemm", "fft", "implicit"]  # timed in full this time


def test_a_search_cut_short_is_served_until_what_it_lacked_can_be_had():
    """Timing again on every call what the held workspace serves would cost each call a search: the ranking is
    kept, and a lease of the least that a skipped candidate needs (which the arena refuses cheaply while memory is
    short) decides when to search again."""
    b = FakeBackend({"fft": 300, "gemm": 100, "implicit": 0}, times={"fft": 5.0, "gemm": 1.0, "implicit": 9.0})
    b._arena = FakeArena(memory=150)
    b._arena.held[None] = 120
    for _ in range(3):
        got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
        assert [c.algo for c in got] == ["gemm", "implicit", "fft"]
    assert b.measured == [["gemm", "implicit"]]  # timed once
    assert b.arena().leases == [100]  # the search's one lease (gemm's): each probe of 300 bytes was refused
    assert not is_cached(b, "fwd", GEOM, cap=None, search="exhaustive")
    assert is_chosen(b, "fwd", GEOM, cap=None, search="exhaustive")
    b._arena.memory = 1000
    got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None), search_again=False)
    assert [c.algo for c in got] == ["gemm", "implicit", "fft"] and len(b.measured) == 1  # in a capture: kept
    got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert [c.algo for c in got] == ["gemm", "fft", "implicit"]  # the probe got 300 bytes: timed in full
    assert b.measured[1:] == [["fft", "gemm", "implicit"]] and b.arena().leases[1:] == [300, 300]
    assert is_cached(b, "fwd", GEOM, cap=None, search="exhaustive")
    select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert len(b.measured) == 2 and len(b.arena().leases) == 3  # kept for good: no probe, no search


class _OwnMemory(FakeBackend):
    """A backend whose search runs out of memory of its own (temporaries, not workspace) timing ``failing``."""

    def __init__(self, table, times, failing):
        super().__init__(table, times)
        self.failing = failing

    def measure(self, pass_, geom, a, b, out, workspace, candidates, stream):
        if any(c.algo in self.failing for c in candidates):
            self.measured.append("failed")
            raise MemoryError("the algorithm's own temporaries")
        return super().measure(pass_, geom, a, b, out, workspace, candidates, stream)


def test_a_search_short_of_its_own_memory_is_kept_without_searching_again():
    """The arena held fft's workspace, which its own temporaries outgrew: no lease would change that, so the ranking
    is kept, fft after the timed ones, each listed once."""
    b = _OwnMemory({"fft": 300, "gemm": 100, "implicit": 0}, TIMES, failing={"fft"})
    for _ in range(3):
        got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
        assert [c.algo for c in got] == ["gemm", "implicit", "fft"]
    assert b.measured == ["failed", ["gemm", "implicit"]]  # searched once
    b = _OwnMemory({"fft": 300, "gemm": 100, "implicit": 0}, TIMES, failing={"fft", "gemm"})
    got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert [c.algo for c in got] == ["implicit", "fft", "gemm"]  # two failed searches: each candidate once


def test_a_search_whose_backend_rejected_all_it_could_time_is_not_kept():
    """Memory cut the search short and the backend's own search rejected every candidate the workspace held: the
    call runs them all in the heuristic order, as the heuristic search would, which a MemoryFallbackWarning says, a
    capture (which cannot search) too, and the next searches again. It ran fft alone, which memory then refused as it
    refused the search."""
    b = FakeBackend({"fft": 300, "gemm": 100, "implicit": 0}, times=TIMES)
    b._arena = FakeArena(memory=150)
    b._arena.held[None] = 120
    b.measure = lambda *args: []
    with pytest.warns(MemoryFallbackWarning) as said:
        got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert [c.algo for c in got] == ["fft", "gemm", "implicit"]  # fft skipped for memory; gemm and implicit rejected
    assert (f"an exhaustive search for fwd of {describe_geometry(GEOM)} could not time any algorithm for want of "
            "memory (no workspace could be had for fft; the search rejected gemm, implicit): the call runs them in "
            "the heuristic order") in str(said[0].message)
    assert not is_cached(b, "fwd", GEOM, cap=None, search="exhaustive")
    assert is_chosen(b, "fwd", GEOM, cap=None, search="exhaustive")  # for a capture alone
    del b.measure
    select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert b.measured == [["gemm", "implicit"]]  # searched again


def test_a_search_cut_short_is_read_once_and_never_seen_as_kept_for_good(monkeypatch):
    """Another thread may clear the cache, or finish a search, while one reads it (unlocked reads): a choice and the
    mark of a search cut short are one entry, written and read at once, so that is_cached() never takes it for one
    kept for good (a call would then keep it in its record, and never search again)."""
    from wsarena import algos
    from wsarena._lru import LRU

    b = FakeBackend({"fft": 300, "gemm": 100, "implicit": 0}, times=TIMES)
    b._arena = FakeArena(memory=150)
    b._arena.held[None] = 120
    seen = []

    class Racing(LRU):
        clear_after_read = False

        def put(self, key, value, **kwargs):
            super().put(key, value, **kwargs)
            seen.append(is_cached(b, "fwd", GEOM, cap=None, search="exhaustive"))

        def lookup(self, key):  # another thread clears the cache just after each read
            found = super().lookup(key)
            if self.clear_after_read:
                algos.cache_clear()
            return found

    racing = Racing(8)
    monkeypatch.setattr(algos, "_cache", racing)
    select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert seen == [False]
    racing.clear_after_read = True
    got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert [c.algo for c in got] == ["gemm", "implicit", "fft"]


def test_a_backend_without_any_algorithm_is_not_a_memory_error():
    from wsarena.errors import UnsupportedConvolutionError

    with pytest.raises(UnsupportedConvolutionError, match="no algorithm"):
        choose(FakeBackend({}), "fwd", GEOM, cap=None)


class Refused(Exception):
    pass


def test_a_refused_algorithm_falls_through_to_the_next():
    arena = FakeArena(memory=1000)
    ran = []

    def run(c, ws):
        if c.algo == "winograd":
            raise Refused("not supported for these operands")
        ran.append((c.algo, ws.nbytes))

    cands = (Candidate("winograd", 200), Candidate("gemm", 100), Candidate("implicit", 0))
    assert run_with_fallback(arena, cands, run, stream=None, cap=None, retry=(Refused,)).algo == "gemm"
    assert ran == [("gemm", 100)]
    with pytest.raises(Refused):  # not a retry error for this caller: it propagates
        run_with_fallback(arena, cands, run, stream=None, cap=None)


def test_when_every_algorithm_is_refused_the_last_refusal_is_raised_with_the_memory_story():
    arena = FakeArena(memory=150)

    def run(c, ws):
        raise Refused(c.algo)

    cands = (Candidate("fft", 300), Candidate("gemm", 100), Candidate("implicit", 0))
    with pytest.raises(Refused, match="implicit") as info:
        run_with_fallback(arena, cands, run, stream=None, cap=None, retry=(Refused,))
    assert any("could not get it" in note for note in info.value.__notes__)


class _Refusing(FakeBackend):
    """A backend whose search refuses a workspace holding ``fft`` with one of its retry errors (the algorithm cannot
    run these operands), as cuDNN's FindEx may refuse a call as a whole; ``everything``: every workspace."""

    def __init__(self, table, times, error, everything=False):
        super().__init__(table, times)
        self.retry_errors = (error,)
        self.everything = everything
        self.refusing = True

    def measure(self, pass_, geom, a, b, out, workspace, candidates, stream):
        if self.refusing and (self.everything or any(c.algo == "fft" for c in candidates)):
            self.measured.append("refused")
            if issubclass(self.retry_errors[0], MemoryError):
                raise self.retry_errors[0]("refused", requested=workspace.nbytes, held=workspace.nbytes, cap=None)
            raise self.retry_errors[0]("refused")
        return super().measure(pass_, geom, a, b, out, workspace, candidates, stream)


@pytest.mark.parametrize("error", [Refused, AlignmentWorkspaceError])
def test_a_search_lease_the_backend_refuses_is_not_a_want_of_memory(error):
    """The search's largest lease held fft, and the backend refused to time what it held (a retry error, which an
    AlignmentWorkspaceError is though it is a MemoryError): the next lease times the rest, and fft is left out as a
    candidate the backend's search rejects. Memory stopped nothing: no MemoryFallbackWarning, and the ranking is
    kept. A plain refusal ended the call; an AlignmentWorkspaceError was taken for memory of its own, and said so."""
    b = _Refusing({"fft": 300, "gemm": 100, "implicit": 0}, TIMES, error)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert _memory_warnings(record) == []
    assert [c.algo for c in got] == ["gemm", "implicit"]
    assert b.measured == ["refused", ["gemm", "implicit"]] and b.arena().leases == [300, 100]
    assert is_cached(b, "fwd", GEOM, cap=None, search="exhaustive")


def test_a_search_lease_the_backend_refused_is_no_verdict_the_search_cache_keeps(tmp_path):
    """A refused lease says nothing of the candidate it was sized for alone (FindEx refuses a call as a whole, on
    operands a search under memory pressure takes as they are): this process drops fft, and the search cache keeps
    gemm's and implicit's times but no word of fft, so a new process searches again and times fft. It saved fft as
    rejected, which every later process read back: fft was never timed again until the cache was cleared."""
    from wsarena import algos

    configure(cache_dir=tmp_path)
    b = _Refusing({"fft": 300, "gemm": 100, "implicit": 0}, TIMES, Refused)
    got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert [c.algo for c in got] == ["gemm", "implicit"]
    algos.cache_clear()  # as a new process starts
    b.refusing, b.measured = False, []
    got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert [(c.algo, c.time_ms) for c in got] == [("gemm", 1.0), ("fft", 5.0), ("implicit", 9.0)]
    assert b.measured == [["fft", "gemm", "implicit"]]
    algos.cache_clear()  # a third process: the search cache holds every candidate now, and answers
    got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert [c.algo for c in got] == ["gemm", "fft", "implicit"] and len(b.measured) == 1


def test_a_search_cut_short_by_memory_and_refused_below_says_only_what_memory_stopped():
    """fft's 300 B cannot be had (the arena holds 220 B), the backend refuses the lease of mid (200 B): the search
    times gemm and implicit, keeps fft after them until 300 B can be had, and drops mid."""

    class RefusingMid(FakeBackend):
        retry_errors = (Refused,)

        def measure(self, pass_, geom, a, b, out, workspace, candidates, stream):
            if any(c.algo == "mid" for c in candidates):
                raise Refused("mid")
            return super().measure(pass_, geom, a, b, out, workspace, candidates, stream)

    b = RefusingMid({"fft": 300, "mid": 200, "gemm": 100, "implicit": 0}, times={**TIMES, "mid": 0.5})
    b._arena = FakeArena(memory=250)
    b._arena.held[None] = 220
    with pytest.warns(MemoryFallbackWarning) as said:
        got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert [c.algo for c in got] == ["gemm", "implicit", "fft"]
    assert "timed gemm, implicit, not fft (300 B), for want of memory" in str(said[0].message)
    assert "runs again once 300 B of workspace can be had" in str(said[0].message)
    assert b.arena().leases == [200, 100] and not is_cached(b, "fwd", GEOM, cap=None, search="exhaustive")


@pytest.mark.parametrize("error", [Refused, AlignmentWorkspaceError])
def test_a_search_every_lease_of_which_the_backend_refuses_gives_the_heuristic_order(error):
    """A refused lease moves on to the next, and where every one is refused the search has timed nothing: the call
    runs the candidates in the heuristic order, as the heuristic search would (which raises only where those cannot
    run either), a MemoryFallbackWarning says so with the refusal, and it is kept for a capture alone. The search
    raised the refusal: a call that the heuristic search runs failed under the exhaustive one."""
    b = _Refusing({"fft": 300, "gemm": 100, "implicit": 0}, TIMES, error, everything=True)
    with pytest.warns(MemoryFallbackWarning) as said:
        got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert [(c.algo, c.time_ms) for c in got] == [("fft", None), ("gemm", None), ("implicit", None)]
    assert "could not time any algorithm as the backend refused to time it, not for want of memory (refused" in str(
        said[0].message)
    assert b.measured == ["refused"] * 3 and not is_cached(b, "fwd", GEOM, cap=None, search="exhaustive")


def test_a_search_memory_gave_no_workspace_gives_the_heuristic_order():
    """Every candidate needs workspace and the provider grants none: the search timed nothing, and the call runs as
    the heuristic search runs it (a planner's call is planned; a run raises NoAlgorithmFitsError where memory stops
    it too). The search raised NoAlgorithmFitsError, where a heuristic plan planned."""
    b = FakeBackend({"fft": 300, "gemm": 100}, TIMES)
    b._arena = FakeArena(memory=0)
    with pytest.warns(MemoryFallbackWarning, match=r"could not time any algorithm for want of memory \(out of memory"):
        got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert got == choose(b, "fwd", GEOM, cap=None) and b.measured == []
    assert not is_cached(b, "fwd", GEOM, cap=None, search="exhaustive")


def test_a_search_that_timed_nothing_serves_a_capture_and_leaves_a_ranking_a_search_timed():
    """A search that timed nothing gives its call the heuristic order, and keeps it for a capture, which cannot search
    (search_again=False): the capture raised CaptureError as the first call of its shape. Where a ranking a search
    timed is kept (here one memory cut short, searched again once memory allows), that one stays, for a capture and
    for the next call, and the untimed order serves its own call alone."""
    b = FakeBackend({"fft": 300, "gemm": 100, "implicit": 50}, TIMES)
    capture = {"cap": None, "search": "exhaustive", "operands": (None, None, None), "search_again": False}
    b._arena = FakeArena(memory=0)
    with pytest.warns(MemoryFallbackWarning, match="could not time any algorithm"):
        got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert [(c.algo, c.time_ms) for c in got] == [("fft", None), ("gemm", None), ("implicit", None)]
    assert select(b, "fwd", GEOM, **capture) is got and b.measured == []
    b.operands_key = lambda *operands: None

    def no_operands():
        raise MemoryError("no memory for the operands")

    # The next call searches again, asking no key of operands it has not made: none could be had, and it runs as before
    assert select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=no_operands) == got
    b._arena.held[None] = 150  # cut short: fft untimed
    cut = [("gemm", 1.0), ("implicit", 9.0), ("fft", None)]
    assert [(c.algo, c.time_ms) for c in select(b, "fwd", GEOM, cap=None, search="exhaustive",
                                                 operands=(None, None, None))] == cut
    b._arena.memory = 1000  # fft's workspace can be had: searched again, and timing fails
    b.measure = lambda *args: []
    got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert [c.algo for c in got] == ["fft", "gemm", "implicit"]
    assert [(c.algo, c.time_ms) for c in select(b, "fwd", GEOM, **capture)] == cut


class _RefusingOnOperands(FakeBackend):
    """A backend whose search refuses fft on operands at an address off 16 bytes (PartlyTimed's refused), which its
    ``operands_key`` tells apart, as cuDNN's refuses a tensor-core algorithm on a view. The operands are addresses."""

    def operands_key(self, a, b, out):
        return a % 16, b % 16, out % 16

    def measure(self, pass_, geom, a, b, out, workspace, candidates, stream):
        timed = super().measure(pass_, geom, a, b, out, workspace, candidates, stream)
        if not a % 16:
            return timed
        raise PartlyTimed([c for c in timed if c.algo != "fft"], [], [c for c in candidates if c.algo == "fft"])


def test_a_ranking_without_candidates_refused_on_its_operands_serves_only_operands_alike():
    """A search whose backend refused fft on its operands drops fft, and that ranking serves the calls whose operands
    have the same key, and a capture (which cannot search) whatever its operands; a call on other operands searches
    again, and one on operands nothing is refused on gets every candidate, kept for good. It was kept for good from
    the first search: every later call ran without fft."""
    b = _RefusingOnOperands({"fft": 300, "gemm": 100, "implicit": 0}, TIMES)

    def search(x, again=True):
        got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(x, 0, 0), search_again=again)
        return [c.algo for c in got], len(b.measured)

    assert search(0x1004) == (["gemm", "implicit"], 1)
    assert is_chosen(b, "fwd", GEOM, cap=None, search="exhaustive")
    assert not is_cached(b, "fwd", GEOM, cap=None, search="exhaustive")  # the ops keep no record of it
    assert search(0x2004) == (["gemm", "implicit"], 1)  # operands alike: served
    assert search(0x1002) == (["gemm", "implicit"], 2)  # other operands: searched again
    assert search(0x1000, again=False) == (["gemm", "implicit"], 2)  # captured: the kept ranking runs
    assert search(0x1000) == (["gemm", "fft", "implicit"], 3)
    assert is_cached(b, "fwd", GEOM, cap=None, search="exhaustive")
    assert search(0x1002) == (["gemm", "fft", "implicit"], 3)


def test_a_ranking_for_operands_alike_asked_of_operands_memory_cannot_make_falls_back_as_its_search_would():
    """The ranking kept serves operands alike, and this call's operands cannot be made (no memory for the copies) to
    tell: the call is not served, and runs the heuristic order, as a search without operands does, making them once.
    The ranking kept stays for the calls it serves. The MemoryError ended the call, where the search falls back."""
    b = _RefusingOnOperands({"fft": 300, "gemm": 100, "implicit": 0}, TIMES)
    select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(0x1004, 0, 0))
    asked = []

    def no_operands():
        asked.append(1)
        raise MemoryError("no memory for the operands")

    with pytest.warns(MemoryFallbackWarning, match=r"algorithm for want of memory \(no memory for the operands\)"):
        got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=no_operands)
    assert [(c.algo, c.time_ms) for c in got] == [("fft", None), ("gemm", None), ("implicit", None)]
    assert asked == [1] and len(b.measured) == 1
    got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(0x2004, 0, 0))
    assert [c.algo for c in got] == ["gemm", "implicit"] and len(b.measured) == 1


def test_a_search_on_a_view_leaves_the_ranking_another_thread_kept_for_good_meanwhile():
    """A search on a view (fft refused there) is under way when another call of the signature, on aligned operands,
    searches and keeps its ranking for good: the view's ranking, which serves operands alike alone, is its own call's
    and does not replace that one. It did: the next aligned call searched again."""
    b = _RefusingOnOperands({"fft": 300, "gemm": 100, "implicit": 0}, TIMES)
    real = b.measure

    def measure(pass_, geom, a, *rest):
        if a % 16 and len(b.measured) == 0:  # meanwhile, in another thread
            aligned = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(0x1000, 0, 0))
            assert [c.algo for c in aligned] == ["gemm", "fft", "implicit"]
        return real(pass_, geom, a, *rest)

    b.measure = measure
    got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(0x1004, 0, 0))
    assert [c.algo for c in got] == ["gemm", "implicit"] and len(b.measured) == 2
    assert is_cached(b, "fwd", GEOM, cap=None, search="exhaustive")
    for x in (0x2000, 0x1004):  # aligned or not, the ranking kept for good serves: nothing is searched
        got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(x, 0, 0))
        assert [c.algo for c in got] == ["gemm", "fft", "implicit"] and len(b.measured) == 2


@pytest.mark.parametrize("search", ["heuristic", "exhaustive"])
def test_a_ranking_memory_kept_the_backend_from_finishing_serves_that_call_alone(search):
    """A backend that could not rank fft for want of memory (cuDNN could not allocate what finalizing its plan takes)
    says so with PartlyRanked: the call chooses among the others, searched or not, and the next call ranks again
    (timing nothing it timed before), now with fft, and keeps that. No verdict on fft: it was left out for the rest of
    the process. A capture, which cannot rank (search_again=False), runs the ranking without fft, asking the backend
    nothing."""

    class Short(FakeBackend):
        short = True
        ranked = 0

        def candidates(self, pass_, geom):
            cands = super().candidates(pass_, geom)
            self.ranked += 1
            if self.short:
                raise PartlyRanked([c for c in cands if c.algo != "fft"]) from MemoryError("no memory for fft's plan")
            return cands

    b = Short({"fft": 300, "gemm": 100, "implicit": 0}, TIMES)

    def choice(again=True):
        got = select(b, "fwd", GEOM, cap=None, search=search, operands=(0, 0, 0), search_again=again)
        return [c.algo for c in got]

    first = ["gemm", "implicit"]
    assert choice() == first and not is_cached(b, "fwd", GEOM, cap=None, search=search)
    assert is_chosen(b, "fwd", GEOM, cap=None, search=search)  # a capture may run it
    assert choice(again=False) == first and b.ranked == 1
    assert choice() == first and b.ranked == 2
    b.short = False
    assert choice() == (["gemm", "fft", "implicit"] if search == "exhaustive" else ["fft", "gemm", "implicit"])
    assert is_cached(b, "fwd", GEOM, cap=None, search=search) and b.ranked == 3
    assert len(b.measured) == (2 if search == "exhaustive" else 0)  # fft's ranking timed again; not the one without


def test_a_search_on_a_ranking_memory_kept_the_backend_from_finishing_times_only_what_it_had_not():
    """With the search cache off, each call of a signature the backend ranks without fft for want of memory ranks
    again, and finds what the last one timed: nothing is timed again, however many calls. Each call timed every
    candidate again. A ranking with a candidate not timed yet (fft, once memory allows) is timed."""

    class Short(FakeBackend):
        ranked = 0

        def candidates(self, pass_, geom):
            self.ranked += 1
            if self.ranked < 4:
                raise PartlyRanked([Candidate("gemm", 100), Candidate("implicit", 0)])
            return super().candidates(pass_, geom)

    assert get_config().cache_dir is None
    b = Short({"fft": 300, "gemm": 100, "implicit": 0}, TIMES)
    for _ in range(3):
        got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(0, 0, 0))
        assert [(c.algo, c.time_ms) for c in got] == [("gemm", 1.0), ("implicit", 9.0)]
    assert b.ranked == 3 and b.measured == [["gemm", "implicit"]]
    got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(0, 0, 0))
    assert [c.algo for c in got] == ["gemm", "fft", "implicit"] and b.measured[1:] == [["fft", "gemm", "implicit"]]


def test_a_ranking_memory_kept_from_ranking_and_timing_some_searches_again_once_what_it_lacked_can_be_had():
    """The backend ranks fwd without wino for want of memory (PartlyRanked) and the search has no memory for fft's
    300 B: each call ranks again, and takes the times the last search took, fft skipped as a search cut short keeps
    it, until 300 B can be had (one lease asks, as for a search cut short); then fft is timed. Each call timed gemm
    and implicit again, asking the provider for fft's workspace in the search's own lease."""

    class Short(FakeBackend):
        ranked = 0

        def candidates(self, pass_, geom):
            self.ranked += 1
            raise PartlyRanked([c for c in super().candidates(pass_, geom) if c.algo != "wino"])

    class Asked(FakeArena):
        def lease(self, nbytes, *, stream=None, cap=None):
            self.asked.append(nbytes)
            return super().lease(nbytes, stream=stream, cap=cap)

    b = Short({"fft": 300, "gemm": 100, "implicit": 0, "wino": 50}, {**TIMES, "wino": 0.5})
    b._arena = Asked(memory=150)
    b._arena.held[None], b._arena.asked = 120, []
    cut = [("gemm", 1.0), ("implicit", 9.0), ("fft", None)]
    for _ in range(3):
        got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(0, 0, 0))
        assert [(c.algo, c.time_ms) for c in got] == cut
    assert b.ranked == 3 and b.measured == [["gemm", "implicit"]]
    assert b.arena().asked == [300, 100, 300, 300]  # the search's two leases, then one probe a call
    b._arena.memory = 1000
    got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(0, 0, 0))
    assert [c.algo for c in got] == ["gemm", "fft", "implicit"] and b.measured[1:] == [["fft", "gemm", "implicit"]]
    select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(0, 0, 0))
    assert len(b.measured) == 2 and b.ranked == 5  # every candidate ranked is timed: nothing timed, nothing probed
    assert b.arena().asked == [300, 100, 300, 300, 300, 300]


def test_a_search_whose_backend_rejects_some_candidates_is_kept_without_them():
    b = FakeBackend({"fft": 300, "gemm": 100, "implicit": 0}, times={"fft": 5.0, "gemm": 1.0, "implicit": 9.0})
    real = b.measure
    b.measure = lambda *args: [c for c in real(*args) if c.algo != "fft"]  # e.g. FindEx reports fft as failed
    for _ in range(2):
        got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
        assert [c.algo for c in got] == ["gemm", "implicit"]
    assert len(b.measured) == 1  # searched once: the ranking was kept


def test_a_search_keeps_only_entries_the_workspace_held():
    b = FakeBackend({"fft": 300, "gemm": 100, "implicit": 0}, times={"fft": 5.0, "gemm": 1.0, "implicit": 9.0})
    real = b.measure
    b.measure = lambda *args: [Candidate("fft", 300, 0.5), *real(*args)]  # reported, though it could not fit
    with pytest.warns(WorkspaceCapWarning):
        got = select(b, "fwd", GEOM, cap=150, search="exhaustive", operands=(None, None, None))
    assert [c.algo for c in got] == ["gemm", "implicit"]


def _memory_warnings(record):
    return [str(w.message) for w in record if issubclass(w.category, MemoryFallbackWarning)]


def test_a_fallback_for_want_of_memory_is_said_once_per_arena():
    """Memory, not the cap, chose the algorithm: the call names what ran, what memory denied and why, once per
    arena (while memory stays short every call falls back, and one line says so)."""
    arena = FakeArena(memory=200)
    arena.held["s"] = 120
    cands = (Candidate("fft", 300), Candidate("gemm", 100), Candidate("implicit", 0))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            ran = run_with_fallback(arena, cands, lambda c, ws: None, stream="s", cap=None, warn_for=("fwd", GEOM))
            assert ran.algo == "gemm"
        other = FakeArena(memory=0)  # another arena (another device) says it for itself
        run_with_fallback(other, cands, lambda c, ws: None, stream="s", cap=None, warn_for=("bwd_data", GEOM))
    said = _memory_warnings(record)
    assert len(said) == 2, said
    assert said[0].startswith("gemm (100 B of workspace) ran in place of fft (300 B) for fwd of input (2, 3, 8, 8)")
    assert "refused the arena the growth it needs" in said[0] and "once per arena" in said[0]
    assert said[1].startswith("implicit (0 B of workspace) ran in place of fft (300 B) for bwd_data")


def test_a_fallback_after_the_warning_makes_no_message(monkeypatch):
    """Under lasting pressure every call falls back: once the arena was warned, none of them formats the message
    (the geometry's description costs microseconds)."""
    from wsarena import algos

    made = []
    real = algos._fallback_text
    monkeypatch.setattr(algos, "_fallback_text", lambda *args: made.append(args) or real(*args))
    arena = FakeArena(memory=0)
    cands = (Candidate("fft", 300), Candidate("implicit", 0))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(5):
            run_with_fallback(arena, cands, lambda c, ws: None, stream=None, cap=None, warn_for=("fwd", GEOM))
    assert len(_memory_warnings(record)) == 1 and len(made) == 1


def test_only_memory_makes_a_fallback_warning():
    """Without the call's pass and geometry (a search's own leases), when nothing was denied, when the backend
    refused the first choice for these operands (not memory), or when nothing could run: no warning."""
    cands = (Candidate("fft", 300), Candidate("gemm", 100), Candidate("implicit", 0))

    def refusing_fft(c, ws):
        if c.algo == "fft":
            raise Refused("not supported")

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run_with_fallback(FakeArena(memory=0), cands, lambda c, ws: None, stream=None, cap=None)
        run_with_fallback(FakeArena(memory=1000), cands, lambda c, ws: None, stream=None, cap=None,
                          warn_for=("fwd", GEOM))
        run_with_fallback(FakeArena(memory=1000), cands, refusing_fft, stream=None, cap=None, retry=(Refused,),
                          warn_for=("fwd", GEOM))
        with pytest.raises(NoAlgorithmFitsError):
            run_with_fallback(FakeArena(memory=0), cands[:2], lambda c, ws: None, stream=None, cap=None,
                              warn_for=("fwd", GEOM))
    assert _memory_warnings(record) == []


def test_an_algorithm_out_of_memory_of_its_own_and_a_deferral_are_said_too():
    cands = (Candidate("fft", 300), Candidate("gemm", 100), Candidate("implicit", 0))

    def own(c, ws):
        if c.algo == "fft":
            raise MemoryError("the algorithm's own temporaries")

    class Deferring(FakeArena):
        refusing = True

        def defers_growth(self, nbytes, *, stream=None, fallback=0):
            return nbytes > 100

    with pytest.warns(MemoryFallbackWarning, match=r"gemm .* in place of fft .*ran out of memory of its own"):
        run_with_fallback(FakeArena(memory=1000), cands, own, stream=None, cap=None, warn_for=("fwd", GEOM))
    arena = Deferring(memory=1000)
    arena.held[None] = 100
    with pytest.warns(MemoryFallbackWarning, match=r"gemm .* in place of fft .*that much growth lately"):
        assert run_with_fallback(arena, cands, lambda c, ws: None, stream=None, cap=None,
                                 warn_for=("fwd", GEOM)).algo == "gemm"
    assert arena.leases == [100]  # fft was not asked for


def test_a_search_cut_short_by_memory_is_said_once_per_arena_and_again_after_cache_clear():
    """It names what it timed and what it could not, and when it runs again; the planner's searches (warn=False,
    which silences the cap's warning) say it too: no report shows it."""
    from wsarena import algos

    b = FakeBackend({"fft": 300, "gemm": 100, "implicit": 0}, times=TIMES)
    b._arena = FakeArena(memory=150)
    with pytest.warns(MemoryFallbackWarning) as said:
        select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert str(said[0].message).startswith(
        f"an exhaustive search for fwd of {describe_geometry(GEOM)} timed implicit, not fft (300 B), gemm (100 B), "
        "for want of memory: the fastest it timed runs, and it runs again once 100 B of workspace can be had"
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        select(b, "bwd_data", GEOM, cap=None, search="exhaustive", operands=(None, None, None))  # cut short too
    assert _memory_warnings(record) == []
    planned = FakeBackend(b.table, times=TIMES)
    planned._arena = FakeArena(memory=150)
    with pytest.warns(MemoryFallbackWarning, match="timed implicit, not fft"):
        select(planned, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None), warn=False)
    assert b.measured == [["implicit"]] * 2 and planned.measured == [["implicit"]]
    algos.cache_clear()
    with pytest.warns(MemoryFallbackWarning):
        select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))


def test_a_search_short_of_its_own_memory_is_said_and_kept():
    b = _OwnMemory({"fft": 300, "gemm": 100, "implicit": 0}, TIMES, failing={"fft"})
    with pytest.warns(MemoryFallbackWarning, match=r"timed gemm, implicit, not fft \(300 B\), .*ran out of memory "
                                                   r"of their own, and the ranking is kept"):
        select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert is_cached(b, "fwd", GEOM, cap=None, search="exhaustive")


def test_an_arena_no_weak_reference_can_name_is_warned_on_each_fallback():
    class Slotted:
        __slots__ = ("held", "leases", "memory")
        refusing = False
        held_bytes = FakeArena.held_bytes
        lease = FakeArena.lease

    arena = Slotted()
    arena.memory, arena.held, arena.leases = 0, {}, []
    cands = (Candidate("fft", 300), Candidate("implicit", 0))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            assert run_with_fallback(arena, cands, lambda c, ws: None, stream=None, cap=None,
                                     warn_for=("fwd", GEOM)).algo == "implicit"
    assert len(_memory_warnings(record)) == 2


def test_a_search_that_could_time_nothing_is_said_once_per_call_whatever_memory_warnings_said_before():
    """Memory gives no workspace: each exhaustive search falls back to the heuristic order, and a SearchFallbackWarning
    (a MemoryFallbackWarning) names each call once, though a fallback of another call had said the arena was short
    already; a call under another cap is another call, and cache_clear() lets each be said again. Said once per
    arena, the first memory warning hid every such search after it."""
    from wsarena import algos
    from wsarena.errors import SearchFallbackWarning

    b = FakeBackend({"fft": 300, "gemm": 100}, TIMES)
    b._arena = FakeArena(memory=0)
    b._arena.held[None] = 100

    def search(pass_, cap=None):
        return select(b, pass_, GEOM, cap=cap, search="exhaustive", operands=(None, None, None))

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run_with_fallback(b.arena(), tuple(choose(b, "fwd", GEOM, cap=None)), lambda c, ws: None, stream=None,
                          cap=None, warn_for=("bwd_filter", GEOM))  # gemm ran in place of fft: said for the arena
        b._arena.held.clear()
        for pass_, cap in [("fwd", None), ("fwd", None), ("bwd_data", None), ("fwd", 200), ("fwd", None)]:
            assert [c.algo for c in search(pass_, cap)] == (["fft", "gemm"] if cap is None else ["gemm"])
        algos.cache_clear()
        search("fwd")
    said = [(w.category, str(w.message)) for w in record if issubclass(w.category, MemoryFallbackWarning)]
    assert [c for c, _ in said] == [MemoryFallbackWarning] + [SearchFallbackWarning] * 4
    assert issubclass(SearchFallbackWarning, MemoryFallbackWarning)
    assert [text.split(" of ")[0] for _, text in said[1:]] == [
        "an exhaustive search for fwd", "an exhaustive search for bwd_data", "an exhaustive search for fwd",
        "an exhaustive search for fwd",
    ]
    assert all("could not time any algorithm for want of memory (out of memory" in text for _, text in said[1:])
    assert b.measured == []


def test_a_search_the_backend_refused_to_time_in_what_memory_gave_says_both():
    """fft's 300 B cannot be had (nor then gemm's, above what the arena holds), and the backend refuses to time in the
    lease memory gives: the search could time nothing for both reasons, and says so."""
    from wsarena.errors import SearchFallbackWarning

    b = _Refusing({"fft": 300, "gemm": 100, "implicit": 0}, TIMES, Refused, everything=True)
    b._arena = FakeArena(memory=200)
    with pytest.warns(SearchFallbackWarning) as said:
        got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert [c.algo for c in got] == ["fft", "gemm", "implicit"] and b.measured == ["refused"]
    assert "could not time any algorithm as the backend refused to time it in the workspace memory gave (refused)" in (
        str(said[0].message))


class _AskedArena(FakeArena):
    """Records every lease asked for, granted or not."""

    def __init__(self, memory):
        super().__init__(memory)
        self.asked = []

    def lease(self, nbytes, *, stream=None, cap=None):
        self.asked.append(nbytes)
        return super().lease(nbytes, stream=stream, cap=cap)


def test_a_search_memory_stopped_every_candidate_of_waits_for_the_least_it_lacked():
    """No workspace for fft or gemm, and implicit (none needed) out of memory of its own: the search times nothing and
    the call gets the heuristic order. The calls that follow take that order, asking only whether gemm's 100 B can be
    had, as for a search cut short, making no operands and timing nothing; a capture takes it asking nothing. Once
    memory allows, the next call searches and times for real, and keeps that. Each call made its operands, asked for
    every lease and timed implicit again."""
    from wsarena.errors import SearchFallbackWarning

    b = _OwnMemory({"fft": 300, "gemm": 100, "implicit": 0}, TIMES, failing={"implicit"})
    b._arena = _AskedArena(memory=0)
    made = []

    def operands():
        made.append(1)
        return (None, None, None)

    def choice(again=True):
        got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=operands, search_again=again)
        return [(c.algo, c.time_ms) for c in got]

    heuristic = [("fft", None), ("gemm", None), ("implicit", None)]
    with pytest.warns(SearchFallbackWarning, match="the next call searches again once 100 B of workspace can be had"):
        assert choice() == heuristic
    asked = list(b.arena().asked)
    assert made == [1] and b.measured == ["failed"] and asked[0] == 300
    for _ in range(3):
        assert choice() == heuristic
    assert choice(again=False) == heuristic
    assert made == [1] and b.measured == ["failed"] and b.arena().asked == [*asked, 100, 100, 100]
    assert is_chosen(b, "fwd", GEOM, cap=None, search="exhaustive")
    assert not is_cached(b, "fwd", GEOM, cap=None, search="exhaustive")
    b._arena.memory = 1000
    b.failing = set()
    assert choice() == [("gemm", 1.0), ("fft", 5.0), ("implicit", 9.0)]
    assert made == [1, 1] and b.measured[1:] == [["fft", "gemm", "implicit"]]
    assert is_cached(b, "fwd", GEOM, cap=None, search="exhaustive")


def test_a_search_that_timed_nothing_for_want_of_its_own_memory_alone_searches_again():
    """Every lease was granted and each candidate ran out of memory of its own: no workspace would change that, and
    the next call searches again, as before."""
    b = _OwnMemory({"fft": 300, "gemm": 100, "implicit": 0}, TIMES, failing={"fft", "gemm", "implicit"})
    for _ in range(2):
        got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
        assert [(c.algo, c.time_ms) for c in got] == [("fft", None), ("gemm", None), ("implicit", None)]
    assert b.measured == ["failed"] * 6  # three leases a search


class _ShortRefusing(_Refusing):
    """A backend that ranks fwd without wino for want of memory (PartlyRanked) while ``short``, and refuses to time a
    workspace holding fft (:class:`_Refusing`)."""

    short = True

    def candidates(self, pass_, geom):
        cands = super().candidates(pass_, geom)
        if self.short:
            raise PartlyRanked([c for c in cands if c.algo != "wino"])
        return cands


@pytest.mark.parametrize("cached", [False, True])
def test_a_search_on_a_partial_ranking_drops_again_what_the_backend_refused_without_timing_the_rest(cached, tmp_path):
    """The backend ranks fwd without wino for want of memory, so each call ranks again, and it refuses to time fft's
    own lease: the search drops fft, and the calls that follow take its times, dropping fft again, timing nothing and
    asking for no lease, with the search cache off or on (which saves no word of fft). Each timed every candidate
    again, fft's refused lease first. Once the backend ranks wino, the call searches again."""
    b = _ShortRefusing({"fft": 300, "gemm": 100, "implicit": 0, "wino": 50}, {**TIMES, "wino": 0.5}, Refused)
    b._arena = _AskedArena(memory=1000)
    with config(cache_dir=tmp_path if cached else None):
        for _ in range(3):
            got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
            assert [(c.algo, c.time_ms) for c in got] == [("gemm", 1.0), ("implicit", 9.0)]
        assert b.measured == ["refused", ["gemm", "implicit"]] and b.arena().asked == [300, 100]
        assert not is_cached(b, "fwd", GEOM, cap=None, search="exhaustive")
        b.short = False
        got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert [c.algo for c in got] == ["wino", "gemm", "implicit"]
    assert b.measured[2:] == ["refused", ["gemm", "implicit", "wino"]]


def test_a_search_on_a_partial_ranking_times_what_was_refused_on_operands_unlike_the_calls():
    """The backend ranks fwd without wino for want of memory and refuses fft on operands off 16 bytes: a call on
    operands alike drops fft again, timing nothing; one on aligned operands, which fft takes, times every candidate,
    as a search of a ranking kept for operands alike does. Each call on operands alike timed every candidate again."""

    class Short(_RefusingOnOperands):
        def candidates(self, pass_, geom):
            raise PartlyRanked([c for c in super().candidates(pass_, geom) if c.algo != "wino"])

    b = Short({"fft": 300, "gemm": 100, "implicit": 0, "wino": 50}, {**TIMES, "wino": 0.5})

    def search(x):
        got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(x, 0, 0))
        return [c.algo for c in got]

    for x in (0x1004, 0x2004, 0x1004):
        assert search(x) == ["gemm", "implicit"]
    assert b.measured == [["fft", "gemm", "implicit"]]
    assert search(0x1000) == ["gemm", "fft", "implicit"]
    assert b.measured[1:] == [["fft", "gemm", "implicit"]]
    assert search(0x2000) == ["gemm", "fft", "implicit"]  # nothing dropped: its times serve
    assert len(b.measured) == 2


def test_a_search_of_a_partial_ranking_that_memory_stopped_for_every_candidate_ranks_again_on_the_next_call():
    """The backend ranks fwd without wino for want of memory, and memory stops the search for every candidate: the
    next call ranks again, as the backend's ranking asks, and searches again, rather than wait for the workspace."""

    class Short(_OwnMemory):
        ranked = 0

        def candidates(self, pass_, geom):
            self.ranked += 1
            raise PartlyRanked([c for c in super().candidates(pass_, geom) if c.algo != "wino"])

    b = Short({"fft": 300, "gemm": 100, "implicit": 0, "wino": 50}, TIMES, failing={"implicit"})
    b._arena = FakeArena(memory=0)
    for _ in range(2):
        got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
        assert [c.algo for c in got] == ["fft", "gemm", "implicit"]
    assert b.ranked == 2 and b.measured == ["failed"] * 2


class _EntriesOutOfMemory(FakeBackend):
    """A backend whose search reports ``failing`` out of memory of their own entry by entry (PartlyTimed's failed), as
    cuDNN's FindEx and graph search do, where the cpu backend raises for a search that timed none."""

    def __init__(self, table, times, failing):
        super().__init__(table, times)
        self.failing = failing

    def measure(self, pass_, geom, a, b, out, workspace, candidates, stream):
        timed = super().measure(pass_, geom, a, b, out, workspace, candidates, stream)
        failed = [c for c in candidates if c.algo in self.failing]
        if failed:
            raise PartlyTimed([c for c in timed if c.algo not in self.failing], failed)
        return timed


def test_a_search_memory_stopped_entry_by_entry_says_it_waits_for_the_least_it_lacked():
    """No workspace for fft or gemm, and implicit (none needed) out of memory of its own, reported by the backend's
    search entry by entry: the heuristic order is kept until gemm's 100 B can be had, and the SearchFallbackWarning
    says so. It said that the next call searches again, which it did not."""
    b = _EntriesOutOfMemory({"fft": 300, "gemm": 100, "implicit": 0}, TIMES, failing={"implicit"})
    b._arena = FakeArena(memory=0)
    with pytest.warns(SearchFallbackWarning) as said:
        got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert [c.algo for c in got] == ["fft", "gemm", "implicit"] and len(b.measured) == 1
    assert "the next call searches again once 100 B of workspace can be had" in str(said[0].message)
    select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert len(b.measured) == 1  # not searched again


def test_a_partial_ranking_memory_stopped_every_candidate_of_says_the_next_call_searches_again():
    """The backend ranks fwd without wino for want of memory, and memory stops the search for every candidate: the
    next call searches again, which the SearchFallbackWarning says. It said the next call waits for gemm's 100 B."""

    class Short(_OwnMemory):
        def candidates(self, pass_, geom):
            raise PartlyRanked([c for c in super().candidates(pass_, geom) if c.algo != "wino"])

    b = Short({"fft": 300, "gemm": 100, "implicit": 0, "wino": 50}, TIMES, failing={"implicit"})
    b._arena = FakeArena(memory=0)
    with pytest.warns(SearchFallbackWarning) as said:
        select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    message = str(said[0].message)
    assert "the next call searches again (said once" in message and "can be had" not in message
    select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert b.measured == ["failed"] * 2  # searched again


def test_a_cap_warning_another_thread_gave_meanwhile_is_not_given_again(monkeypatch):
    """Two threads that both find no cap warning given yet for a key (read without the lock) give it once: the one
    that marks it second gives none. Simulated by a first read that always finds nothing."""
    from wsarena import algos

    monkeypatch.setattr(algos._warned, "lookup", lambda key: None)
    b = FakeBackend({"fft": 300, "gemm": 100, "implicit": 0})
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        choose(b, "fwd", GEOM, cap=150)
        choose(b, "fwd", GEOM, cap=150)
    assert [w.category for w in warned] == [WorkspaceCapWarning]


def test_an_exhaustive_search_without_operands_is_the_heuristic_order_and_times_nothing():
    """With no operands to time on, select() gives the heuristic choice (kept under the heuristic search's key), as
    under algo_search='heuristic', and calls no search."""
    b = FakeBackend({"fft": 300, "gemm": 100, "implicit": 0}, times=TIMES)
    got = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=None)
    assert [c.algo for c in got] == ["fft", "gemm", "implicit"] and b.measured == []
    assert is_chosen(b, "fwd", GEOM, cap=None, search="heuristic")
    assert not is_chosen(b, "fwd", GEOM, cap=None, search="exhaustive")


def test_a_capture_error_of_a_lease_the_buffer_holds_exactly_stops_the_fallback():
    """A CaptureError from a candidate whose workspace is exactly what the stream's buffer holds is no want of growth:
    another candidate cannot change it, so it is raised, and the smaller candidate after it does not run."""
    from wsarena.errors import CaptureError

    arena = FakeArena(memory=1 << 40)
    arena.held["s"] = 100
    ran = []

    def refuse(cand, ws):
        ran.append(cand.algo)
        if cand.algo == "gemm":
            raise CaptureError("this call would create a handle")

    with pytest.raises(CaptureError, match="create a handle"):
        run_with_fallback(arena, (Candidate("gemm", 100), Candidate("implicit", 0)), refuse, stream="s", cap=None)
    assert ran == ["gemm"]


def test_a_capped_search_names_the_heuristic_favourite_an_uncapped_search_could_not_time():
    """An uncapped search that memory cut short timed gemm and implicit, not fft (the heuristics' first): under a cap
    that excludes fft, its time is unknown, so the warning names it as the heuristic search does, a guess, not as an
    algorithm the search rejected."""
    b = FakeBackend({"fft": 300, "gemm": 100, "implicit": 0}, times=TIMES)
    b._arena = FakeArena(memory=150)
    b._arena.held[None] = 120
    uncapped = select(b, "fwd", GEOM, cap=None, search="exhaustive", operands=(None, None, None))
    assert [(c.algo, c.time_ms) for c in uncapped] == [("gemm", 1.0), ("implicit", 9.0), ("fft", None)]
    with pytest.warns(WorkspaceCapWarning) as warned:
        got = select(b, "fwd", GEOM, cap=200, search="exhaustive", operands=(None, None, None))
    assert [c.algo for c in got] == ["gemm", "implicit"]
    (text,) = [str(w.message) for w in warned]
    assert text.startswith("workspace cap 200 B excludes fft (300 B) for fwd"), text
    assert text.endswith("; using gemm (100 B)"), text  # no time of fft to set the choice's against


def test_a_choice_of_a_backend_without_the_graph_api_is_kept_whatever_cudnn_heuristic_says():
    """cudnn_heuristic ranks the graph API's candidates alone: a backend without it (the CPU's, cuDNN's legacy path)
    keeps its choice, and its cap warning, when the setting changes, ranking nothing again."""

    class Counting(FakeBackend):
        ranked = 0

        def candidates(self, pass_, geom):
            self.ranked += 1
            return super().candidates(pass_, geom)

    b = Counting({"fft": 300, "gemm": 100, "implicit": 0})
    with pytest.warns(WorkspaceCapWarning):
        choose(b, "fwd", GEOM, cap=150)
    with config(cudnn_heuristic="b"), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert is_chosen(b, "fwd", GEOM, cap=150, search="heuristic")
        assert choose(b, "fwd", GEOM, cap=150)[0].algo == "gemm"
    assert b.ranked == 1


def test_a_capture_error_whose_fallbacks_were_refused_says_so():
    """A capture stops the first candidate (its lease would grow the stream's buffer) and the backend refuses the one
    the buffer holds: the CaptureError is raised, with a note naming the refusal."""
    from wsarena.errors import CaptureError

    class Refused(Exception):
        pass

    class Captured(FakeArena):
        @contextlib.contextmanager
        def lease(self, nbytes, *, stream=None, cap=None):
            if nbytes > self.held_bytes(stream=stream):
                raise CaptureError("a lease needs the arena to grow")
            with super().lease(nbytes, stream=stream, cap=cap) as ws:
                yield ws

    def refuse(cand, ws):
        raise Refused(f"{cand.algo} is not supported here")

    arena = Captured(memory=1 << 40)
    arena.held["s"] = 100
    with pytest.raises(CaptureError, match="needs the arena to grow") as info:
        run_with_fallback(arena, (Candidate("fft", 300), Candidate("gemm", 100)), refuse, stream="s", cap=None,
                          retry=(Refused,))
    assert info.value.__notes__ == ["the algorithms the held workspace serves were refused: gemm is not supported here"]
