"""The persistent search cache: where it lives, its round trip, its keys, and its behaviour when files or folders
are bad or several processes write at once."""

import dataclasses
import hashlib
import io
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import wsarena
from wsarena import _searchcache_folder, algos, searchcache
from wsarena._geometry import conv_geometry
from wsarena.backends import Candidate, cpu
from wsarena.backends._cpu_backend import CpuBackend
from wsarena.errors import SearchCacheWarning

from .fake_backend import TableBackend
from .pipe_helpers import unblocked
from .reference import error_for_sums, ref_conv_forward

TABLE = {
    ("fwd", 4): [("implicit", 0, 10.0), ("gemm", 1000, 4.0), ("fft", 8000, 3.0)],
    ("bwd_data", 4): [("implicit", 0, 6.0), ("winograd", 500, None), ("gemm", 2000, 5.0)],
}
GEOM = conv_geometry((2, 3, 8, 8), (4, 3, 3, 3), padding=1)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("WSARENA_CACHE_DIR", str(folder))
    return folder


def search(backend, pass_="fwd", geom=GEOM, cap=None):
    """An exhaustive choice, as the ops and the planner make it; a fresh process's view (the in-process cache
    is emptied first)."""
    algos.cache_clear()

    def operands():
        return tuple(np.zeros(s, dtype="float32") for s in geom.operand_shapes(pass_))

    return algos.select(backend, pass_, geom, cap=cap, search="exhaustive", operands=operands, warn=False)


def entry_files(folder):
    return sorted(p for p in (folder / "search").glob("*.json") if not p.name.startswith(".tmp-"))


def named_as_entry(word):
    """A file name of the entries' form (their key's hash), made from ``word``."""
    return hashlib.sha256(word.encode()).hexdigest()[:40] + ".json"


def named_as_write(word):
    """A file name of the form of a write in progress, made from ``word``."""
    return ".tmp-" + hashlib.sha256(word.encode()).hexdigest()[:16] + ".json"


def test_directory_rule(monkeypatch, tmp_path):
    def folder(value):
        monkeypatch.setenv("WSARENA_CACHE_DIR", value)
        wsarena._config._reset()  # the variable is read once, as every WSARENA_* variable is
        return searchcache.cache_dir()

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert folder("") == tmp_path / "xdg" / "wsarena"  # empty means the default, as for every WSARENA_* variable
    for off in ("off", "OFF", " Off ", "none", "NONE"):
        assert folder(off) is None
    assert folder(str(tmp_path / "mine")) == tmp_path / "mine"
    assert folder("~/wsarena-cache") == Path.home() / "wsarena-cache"


def test_directory_rule_without_platformdirs(monkeypatch, tmp_path):
    monkeypatch.delenv("WSARENA_CACHE_DIR")
    monkeypatch.setattr(wsarena._config, "platformdirs", None)  # what an install without it has
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert searchcache.cache_dir() == tmp_path / "xdg" / "wsarena"
    monkeypatch.delenv("XDG_CACHE_HOME")
    wsarena._config._reset()
    assert searchcache.cache_dir() == Path.home() / ".cache" / "wsarena"


def test_round_trip_times_nothing_a_second_time(cache):
    backend = TableBackend(TABLE)
    read, timed = searchcache.counts()
    first = search(backend)
    assert searchcache.counts() == (read, timed + 1)  # one search, timed
    assert [(c.algo, c.time_ms) for c in first] == [("fft", 3.0), ("gemm", 4.0), ("implicit", 10.0)]
    assert backend.measured == [("fwd", 4)]
    (path,) = entry_files(cache)
    saved = json.loads(path.read_text())
    assert saved["key"]["pass"] == "fwd" and saved["key"]["environment"]["device"] == "fake device 1"
    assert saved["key"]["environment"]["wsarena"] == wsarena.__version__
    assert saved["key"]["geometry"]["input_size"] == [8, 8] and saved["key"]["geometry"]["dtype"] == "float32"
    again = search(backend)
    assert again == first and backend.measured == [("fwd", 4)]
    assert searchcache.counts() == (read + 1, timed + 1)  # one more, answered by the cache


def test_an_entry_is_named_by_the_hash_of_its_key_with_sorted_keys(cache):
    """An entry's name is the SHA-256 of its key written as canonical JSON (keys sorted, no spaces), whatever order
    the key was built in: another installation, or another version of wsarena building the environment in another
    order, finds the entry of the same call."""
    search(TableBackend(TABLE))
    (path,) = entry_files(cache)
    key = json.loads(path.read_text())["key"]
    assert list(key) != sorted(key)  # as built: sorting changes the text hashed
    canonical = json.dumps(key, sort_keys=True, separators=(",", ":"))
    assert path.name == hashlib.sha256(canonical.encode()).hexdigest()[:40] + ".json"


def test_an_entry_serves_a_smaller_cap_and_a_larger_one_adds_to_it(cache):
    backend = TableBackend(TABLE)
    assert search(backend, cap=1000)[0].algo == "gemm"  # timed only what fits: implicit and gemm
    assert search(backend, cap=0)[0].algo == "implicit"
    assert backend.measured == [("fwd", 4)]
    assert search(backend)[0].algo == "fft"  # fft was never timed: this search times again
    assert backend.measured == [("fwd", 4)] * 2
    assert [c.algo for c in search(backend, cap=4000)] == ["gemm", "implicit"]
    assert backend.measured == [("fwd", 4)] * 2
    assert len(entry_files(cache)) == 1


def test_a_rejected_algorithm_is_remembered_as_rejected(cache):
    backend = TableBackend(TABLE)
    assert [c.algo for c in search(backend, "bwd_data")] == ["gemm", "implicit"]  # winograd: rejected
    saved = {e["algo"]: e for e in json.loads(entry_files(cache)[0].read_text())["results"]}
    assert saved["winograd"]["time_ms"] is None and saved["winograd"]["workspace_bytes"] == 500
    assert [c.algo for c in search(backend, "bwd_data")] == ["gemm", "implicit"]
    assert backend.measured == [("bwd_data", 4)]


@pytest.mark.filterwarnings("ignore::wsarena.errors.MemoryFallbackWarning")  # the search is cut short on purpose
def test_candidates_left_untimed_for_memory_are_not_saved(cache):
    backend = TableBackend(TABLE, memory=4000)  # fft's 8000 bytes cannot be had ...
    backend.arena().reserve(2000)  # ... and the search falls back to what the arena holds
    assert [c.algo for c in search(backend)] == ["gemm", "implicit", "fft"]  # fft skipped, last, untimed
    saved = json.loads(entry_files(cache)[0].read_text())["results"]
    assert sorted(e["algo"] for e in saved) == ["gemm", "implicit"]
    search(backend)
    assert backend.measured == [("fwd", 4)] * 2  # fft still unknown: the search runs again


@pytest.mark.parametrize("filled", ["searched here", "read here"])
def test_a_heuristic_order_waiting_for_memory_takes_the_entry_a_search_under_another_cap_filled(cache, tmp_path,
                                                                                                   filled):
    """Memory gives an exhaustive search no workspace for any candidate: the call runs the heuristic order, kept
    until the least workspace it lacked can be had. A search of the same call under another cap (here by a backend
    with memory on the same device) fills the search cache, or reads the entry another process filled: the next call
    searches again, and the entry serves it, timing nothing. The order ran until memory allowed, whatever the entry
    held. Until then, the call that waits reads no file."""
    table = {("fwd", 4): [("implicit", 100, 10.0), ("gemm", 1000, 4.0), ("fft", 8000, 3.0)]}
    starved, other = TableBackend(table, memory=50), TableBackend(table)

    def choice(backend, cap=None):
        got = algos.select(backend, "fwd", GEOM, cap=cap, search="exhaustive", warn=False,
                           operands=tuple(np.zeros(s, dtype="float32") for s in GEOM.operand_shapes("fwd")))
        return [(c.algo, c.time_ms) for c in got]

    heuristic = [("implicit", None), ("gemm", None), ("fft", None)]
    timed = [("fft", 3.0), ("gemm", 4.0), ("implicit", 10.0)]
    if filled == "read here":  # another process's search, whose entry comes into the folder later
        with wsarena.config(cache_dir=tmp_path / "elsewhere"):
            assert choice(other, cap=10**6) == timed
    algos.cache_clear()
    with pytest.warns(wsarena.SearchFallbackWarning):
        assert choice(starved) == heuristic
    if filled == "read here":
        (made,) = entry_files(tmp_path / "elsewhere")
        (cache / "search").mkdir(parents=True, exist_ok=True)
        made.rename(cache / "search" / made.name)
    searched = sum(searchcache.counts())
    assert choice(starved) == heuristic and sum(searchcache.counts()) == searched  # waiting: no search, no file read
    assert choice(other, cap=10**7) == timed
    assert other.measured == [("fwd", 4)]  # timed once, here or elsewhere
    assert choice(starved) == timed and starved.measured == []
    assert algos.is_cached(starved, "fwd", GEOM, cap=None, search="exhaustive")


class _AddressBackend(TableBackend):
    """fft refuses operands off a 16-byte boundary, as tensor-core kernels do; the search times on aligned
    copies of such operands (``timing_operands``), as the cudnn backends do."""

    def timing_operands(self, a, b, out):
        if all(x.ctypes.data % 16 == 0 for x in (a, b, out)):
            return a, b, out
        return a.copy(), b.copy(), np.empty_like(out)

    def measure(self, pass_, geom, a, b, out, workspace, candidates, stream):
        timed = super().measure(pass_, geom, a, b, out, workspace, candidates, stream)
        if any(x.ctypes.data % 16 for x in (a, b, out)):
            return [c for c in timed if c.algo != "fft"]
        return timed


def test_a_first_search_on_a_misaligned_view_keeps_what_aligned_operands_run(cache):
    """The choice and the cache entry are per geometry: a first call on a view 4 bytes off its allocation once
    saved the engines that refuse it as rejected, for every later call and process."""
    backend = _AddressBackend(TABLE)
    algos.cache_clear()
    shapes = GEOM.operand_shapes("fwd")
    views = tuple(np.zeros(int(np.prod(s)) + 4, dtype="float32")[1:][: int(np.prod(s))].reshape(s) for s in shapes)
    assert all(v.ctypes.data % 16 == 4 for v in views)
    first = algos.select(backend, "fwd", GEOM, cap=None, search="exhaustive", operands=views, warn=False)
    assert [c.algo for c in first] == ["fft", "gemm", "implicit"]
    saved = {e["algo"]: e["time_ms"] for e in json.loads(entry_files(cache)[0].read_text())["results"]}
    assert saved == {"fft": 3.0, "gemm": 4.0, "implicit": 10.0}
    assert search(backend)[0].algo == "fft" and backend.measured == [("fwd", 4)]  # a later process: from the cache


def test_the_environment_is_part_of_the_key(cache):
    search(TableBackend(TABLE, device="fake device 1"))
    other = TableBackend(TABLE, device="fake device 2")
    search(other)
    assert other.measured == [("fwd", 4)]
    assert len(entry_files(cache)) == 2


def test_every_parameter_of_the_call_is_part_of_the_key(cache):
    backend = TableBackend(TABLE)
    variants = [
        GEOM,
        conv_geometry((2, 3, 8, 8), (4, 3, 3, 3), padding=0),
        conv_geometry((2, 3, 8, 8), (4, 3, 3, 3), padding=1, stride=2),
        conv_geometry((2, 3, 8, 8), (4, 3, 3, 3), padding=1, dtype="float64"),
        conv_geometry((2, 8, 8, 3), (4, 3, 3, 3), padding=1, layout="NHWC"),
        conv_geometry((3, 3, 8, 8), (4, 3, 3, 3), padding=1),
    ]
    for geom in variants:
        search(backend, geom=geom)
    assert len(backend.measured) == len(variants) and len(entry_files(cache)) == len(variants)


def test_off_saves_nothing(tmp_path):
    backend = TableBackend(TABLE)
    search(backend)
    search(backend)
    assert backend.measured == [("fwd", 4)] * 2  # WSARENA_CACHE_DIR=off (the tests' default)


def test_the_ops_and_the_planner_read_it(cache, monkeypatch, fresh_arena):
    x = np.random.default_rng(1).standard_normal((2, 3, 9, 9), dtype="float32")
    w = np.random.default_rng(2).standard_normal((5, 3, 3, 3), dtype="float32")
    with wsarena.config(algo_search="exhaustive"):
        expected = wsarena.conv_forward(x, w, padding=1)
        layers = wsarena.load_model("mobilenet_v2")[:3]
        planned = wsarena.plan(layers, backend="cpu", search="exhaustive")
        algos.cache_clear()

        def refuse(*args, **kwargs):
            raise AssertionError("timed again although the search cache holds the result")

        monkeypatch.setattr(CpuBackend, "measure", refuse)
        np.testing.assert_array_equal(wsarena.conv_forward(x, w, padding=1), expected)
        assert wsarena.plan(layers, backend="cpu", search="exhaustive") == planned


def _rewrite(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "spoil",
    [
        pytest.param(lambda p: p.write_text(p.read_text()[: len(p.read_text()) // 2]), id="truncated"),
        pytest.param(lambda p: p.write_bytes(b"\xff\xfe\x00garbage"), id="binary"),
        pytest.param(lambda p: p.write_text("[1, 2, 3]"), id="foreign-json"),
        pytest.param(lambda p: _rewrite(p, lambda d: d["key"]["environment"].update(wsarena="0.0.1")),
                     id="other-wsarena-version"),
        pytest.param(lambda p: _rewrite(p, lambda d: d.update(version=99)), id="other-format-version"),
        pytest.param(lambda p: _rewrite(p, lambda d: d["results"][0].update(workspace_bytes="big")), id="bad-entry"),
        pytest.param(lambda p: _rewrite(p, lambda d: d.update(key=["not", "an", "object"])), id="key-not-an-object"),
        pytest.param(lambda p: _rewrite(p, lambda d: d["key"].update(environment="cpu")),
                     id="environment-not-an-object"),
        pytest.param(lambda p: p.write_text("[" * 100_000), id="nested-too-deep"),  # json.loads: RecursionError
        # json.loads reads Infinity and NaN, and 1e999 as inf: no time a search can measure
        pytest.param(lambda p: _rewrite(p, lambda d: d["results"][0].update(time_ms=float("inf"))), id="infinite-time"),
        pytest.param(lambda p: p.write_text(p.read_text().replace('"time_ms": 10.0', '"time_ms": 1e999')),
                     id="time-past-float"),
        pytest.param(lambda p: p.write_text(p.read_text().replace('"time_ms": 10.0', '"time_ms": 1' + "0" * 400)),
                     id="integer-time-past-float"),  # no float: math.isfinite and float() raise OverflowError
        pytest.param(lambda p: _rewrite(p, lambda d: d["results"][0].update(time_ms=float("nan"))), id="nan-time"),
        pytest.param(lambda p: _rewrite(p, lambda d: d["results"][0].update(time_ms=True)), id="boolean-time"),
        pytest.param(lambda p: _rewrite(p, lambda d: d["results"][0].update(time_ms=86_400_001.0)),
                     id="time-past-a-day"),  # wsarena tune's exact sum of such times passed float's range
    ],
)
def test_a_bad_file_gives_one_warning_and_is_replaced(cache, spoil):
    backend = TableBackend(TABLE)
    first = search(backend)
    (path,) = entry_files(cache)
    spoil(path)
    with pytest.warns(SearchCacheWarning, match="ignoring the search cache file .*; replaced it") as caught:
        assert search(backend) == first
    assert len(caught) == 1 and str(path) in str(caught[0].message)
    assert caught[0].filename == __file__  # the line outside wsarena that made the call
    assert backend.measured == [("fwd", 4)] * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert search(backend) == first  # replaced by a good entry: read back, nothing timed
    assert backend.measured == [("fwd", 4)] * 2


@pytest.mark.parametrize(("spoil", "said"), [
    (lambda d: d["results"][0].update(algo=["x" * 100_000]), "malformed entry {'algo': ['xxx"),
    (lambda d: d.update(version="9" * 100_000), "format version '999"),
    (lambda d: d["key"]["environment"].update(wsarena="9" * 100_000), "it holds another key (written by wsarena 999"),
], ids=["entry", "format-version", "wsarena-version"])
def test_a_bad_file_is_quoted_shortened_in_its_warning(cache, spoil, said):
    """A value of the file's that the warning quotes (an entry, a version) is cut as short_repr cuts it: a 100 kB
    algorithm name gave a 100 kB warning line, and an entry may hold 16 MiB."""
    backend = TableBackend(TABLE)
    first = search(backend)
    (path,) = entry_files(cache)
    _rewrite(path, spoil)
    with pytest.warns(SearchCacheWarning, match="ignoring the search cache file") as caught:
        assert search(backend) == first
    (message,) = [str(w.message) for w in caught]
    assert f"{path}: {said}" in message and "..." in message and len(message) < len(str(path)) + 400, message


@pytest.mark.parametrize(("version", "said"), [("1.2.3", "1.2.3"), (7, "7"), (None, "None")])
def test_a_file_of_another_key_names_the_version_that_wrote_it(cache, version, said):
    """The warning names the wsarena version the file's key names, a string as written (without its quotes), a
    value of another type as Python writes it."""
    backend = TableBackend(TABLE)
    search(backend)
    (path,) = entry_files(cache)
    _rewrite(path, lambda d: d["key"]["environment"].update(wsarena=version))
    with pytest.warns(SearchCacheWarning, match="ignoring the search cache file") as caught:
        search(backend)
    (message,) = [str(w.message) for w in caught]
    assert f"{path}: it holds another key (written by wsarena {said}); " in message, message


def test_an_entry_whose_workspace_is_damaged_below_what_the_algorithm_needs_is_leased_what_it_needs(cache, fresh_arena):
    """An entry that still parses but records less workspace than an algorithm needs (a digit lost on disk): each
    call of the geometry ran in that lease, which the CPU's algorithms cannot reshape (a ValueError at every call),
    and a plan reported that workspace (0 B for every pass)."""
    x = np.random.default_rng(3).standard_normal((2, 3, 16, 16), dtype="float32")
    w = np.random.default_rng(4).standard_normal((4, 3, 3, 3), dtype="float32")
    layers = [wsarena.models.ConvLayer("c", (1, 3, 16, 16), (4, 3, 3, 3), padding=(1, 1))]
    with wsarena.config(algo_search="exhaustive"):
        wsarena.conv_forward(x, w, padding=1)
        wsarena.plan(layers, batch=2, backend="cpu", search="exhaustive")
    # every algorithm recorded with no workspace, and one that needs some as the fastest
    for path in entry_files(cache):
        _rewrite(path, lambda d: [r.update(workspace_bytes=0, time_ms=0.0 if r["algo"] != "implicit_gemm" else 9.0)
                                  for r in d["results"]])
    algos.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with wsarena.config(algo_search="exhaustive"):
            got = wsarena.conv_forward(x, w, padding=1)
            again = wsarena.plan(layers, batch=2, backend="cpu", search="exhaustive").to_dict()["layers"]
    # float32 sums of 27 products: a few ulps of the sums of their magnitudes
    assert error_for_sums(got, ref_conv_forward(x, w, padding=1), ref_conv_forward(abs(x), abs(w), padding=1)) < 1e-6
    assert fresh_arena.stats().high_water_bytes > 0
    geom = layers[0].geometry(batch=2)
    for pass_ in ("fwd", "bwd_data", "bwd_filter"):
        chosen = again[0][pass_]
        assert chosen["workspace_bytes"] == cpu.workspace_size(pass_, chosen["algo"], geom) > 0, (pass_, chosen)


class _OwnSizesBackend(TableBackend):
    """A search that reports workspace sizes of its own, as cuDNN's FindEx does: here gemm's less than its candidate
    (1000 bytes, the heuristics'), implicit's more."""

    def measure(self, pass_, geom, a, b, out, workspace, candidates, stream):
        timed = super().measure(pass_, geom, a, b, out, workspace, candidates, stream)
        reported = {"implicit": 40, "gemm": 600}
        return [Candidate(c.algo, reported.get(c.algo, c.workspace_bytes), c.time_ms) for c in timed]


def test_a_searched_algorithm_is_leased_what_its_candidate_needs_in_the_process_that_searched_and_the_next(cache):
    """A search that reported less workspace than an algorithm's candidate had the process that searched lease that
    much, and the next, reading the entry, the candidate's: a plan made twice gave two sizes (wsarena report
    --search exhaustive, run twice, two arena sizes). Both lease the larger."""
    backend = _OwnSizesBackend(TABLE)
    first = search(backend)
    want = [("fft", 8000), ("gemm", 1000), ("implicit", 40)]  # each the larger of the candidate's and the search's
    assert [(c.algo, c.workspace_bytes) for c in first] == want
    again = search(backend)
    assert again == first and backend.measured == [("fwd", 4)]
    saved = {e["algo"]: e["workspace_bytes"] for e in json.loads(entry_files(cache)[0].read_text())["results"]}
    assert saved == dict(want)
    assert [(c.algo, c.workspace_bytes) for c in search(backend, cap=1000)] == [("gemm", 1000), ("implicit", 40)]


def _recorded(path, algo, math_type, **change):
    """Change the record of ``(algo, math_type)`` in the entry at ``path``."""
    _rewrite(path, lambda d: [r.update(change) for r in d["results"]
                              if (r["algo"], r["math_type"]) == (algo, math_type)])


class _FoundMore(TableBackend):
    """The search reports gemm needing 3000 bytes where its candidate says 1000, as cuDNN's FindEx may report more
    than its heuristics; a lease that cannot hold that much does not time it."""

    def measure(self, pass_, geom, a, b, out, workspace, candidates, stream):
        timed = super().measure(pass_, geom, a, b, out, workspace, candidates, stream)
        found = [dataclasses.replace(c, workspace_bytes=3000) if c.algo == "gemm" else c for c in timed]
        return [c for c in found if c.workspace_bytes <= workspace.nbytes]


@pytest.mark.parametrize("record", ["searched", "damaged"])
def test_an_entry_recording_more_than_the_candidates_under_the_cap_need_is_not_leased_less(cache, record):
    """An uncapped search leases fft's 8000 bytes, in which the search reports gemm needing 3000: the entry records
    that (or a digit added on disk records 10**12). Under a cap of 1000, gemm's candidate says 1000, and a search
    there leaves gemm out, as its lease cannot hold what gemm needs. Read back under that cap, the entry served gemm
    in its candidate's 1000 bytes, less than the search said it needs: a kernel writing past its workspace. A record
    past every candidate under the cap, a wider search's or damage, serves no ranking there, as a search there gives
    none, and the other algorithms the entry holds still serve without a search."""
    backend = _FoundMore(TABLE)
    uncapped = search(backend)
    assert ("gemm", 3000) in [(c.algo, c.workspace_bytes) for c in uncapped]
    if record == "damaged":
        (path,) = entry_files(cache)
        _recorded(path, "gemm", None, workspace_bytes=10**12)
    with wsarena.config(cache_dir=None):
        fresh = search(backend, cap=1000)
    assert [c.algo for c in fresh] == ["implicit"]
    assert search(backend, cap=1000) == fresh and backend.measured == [("fwd", 4)] * 2


class _OtherMathType(TableBackend):
    """Candidates in math type 1; the search reports gemm in math type 0, as cuDNN's FindEx reports an algorithm it ran
    without tensor cores in DEFAULT_MATH, whatever math type its heuristics listed it in."""

    def candidates(self, pass_, geom):
        return [dataclasses.replace(c, math_type=1) for c in super().candidates(pass_, geom)]

    def measure(self, pass_, geom, a, b, out, workspace, candidates, stream):
        timed = super().measure(pass_, geom, a, b, out, workspace, candidates, stream)
        return [dataclasses.replace(c, math_type=0 if c.algo == "gemm" else 1) for c in timed]


@pytest.mark.parametrize("reported", [1000, 10])
def test_a_pair_no_candidate_has_is_leased_what_its_algorithm_s_candidate_needs(cache, reported):
    """An algorithm the search timed in a math type no candidate has (cuDNN's FindEx in DEFAULT_MATH where the
    heuristics listed tensor cores) is leased no less than its algorithm's candidate needs, whether the search reported
    less or its entry records less (a digit lost on disk): the process that searched and the next lease the same. The
    entry's record of it was leased as it stood, 10 bytes where gemm needs 1000."""
    backend = _OtherMathType(TABLE)
    real = backend.measure
    backend.measure = lambda *args: [dataclasses.replace(c, workspace_bytes=reported) if c.algo == "gemm" else c
                                     for c in real(*args)]
    first = search(backend)
    assert [(c.algo, c.workspace_bytes, c.math_type) for c in first] == [
        ("fft", 8000, 1), ("gemm", 1000, 0), ("implicit", 0, 1)]
    (path,) = entry_files(cache)
    _recorded(path, "gemm", 0, workspace_bytes=10)
    assert search(backend) == first and backend.measured == [("fwd", 4)]


def test_a_file_larger_than_any_entry_is_a_bad_file_and_is_not_read_whole(cache):
    """A file named as an entry that holds far more than any entry (damage, or another program's) was read whole by a
    lookup and by cache info: a gigabyte took seconds and its size in memory twice over. Here a good entry with
    whitespace after it, which JSON allows: read whole, it passed for the entry."""
    backend = TableBackend(TABLE)
    first = search(backend)
    (path,) = entry_files(cache)
    with path.open("a") as f:
        f.write(" " * _searchcache_folder.MAX_ENTRY_BYTES)
    info = searchcache.info()
    assert (info["entries"], info["unreadable"]) == (0, 1)
    with pytest.warns(SearchCacheWarning, match="ignoring the search cache file .* holds more than 16 MiB") as caught:
        assert search(backend) == first
    assert len(caught) == 1 and backend.measured == [("fwd", 4)] * 2
    assert path.stat().st_size < 1 << 20  # replaced by the entry searched again
    assert searchcache.info()["entries"] == 1


@pytest.mark.parametrize("kind", ["fifo", "link-to-fifo", "link-to-device", "socket"])
def test_a_file_named_as_an_entry_that_is_no_regular_file_is_replaced_unread(cache, tmp_path, monkeypatch, kind):
    """open() of a FIFO waits until a writer opens it: a FIFO in an entry's place, or a link to one, held the
    lookup (and ``wsarena cache info``) for good. A link to a device was read up to the 16 MiB no entry takes, and a
    socket, which open() refuses, was taken for a folder that cannot be read. Only a regular file is read, as the
    descriptor opened says, and the others are bad files: replaced when their call is searched again (the link, not
    what it leads to). The warning says what each is, where it said "a FIFO, a socket or a device"."""
    backend = TableBackend(TABLE)
    first = search(backend)
    (path,) = entry_files(cache)
    path.unlink()
    fifo = tmp_path / "fifo"
    if kind == "fifo":
        os.mkfifo(path)
        fifo = path
    elif kind == "link-to-fifo":
        os.mkfifo(fifo)
        path.symlink_to(fifo)
    elif kind == "link-to-device":
        path.symlink_to("/dev/zero")
    else:
        listening = socket.socket(socket.AF_UNIX)
        monkeypatch.chdir(path.parent)  # a socket's path is short: at most 107 bytes
        listening.bind(path.name)
        listening.close()
    info = unblocked(searchcache.info, fifo)
    assert (info["entries"], info["unreadable"]) == (0, 1)
    # what it is, as the descriptor says, or the path looked at again where open() refused it (ENXIO: a socket)
    what = {"link-to-device": "a character device", "socket": "a socket"}.get(kind, r"a FIFO \(named pipe\)")
    says = f"ignoring the search cache file .*: it is {what}, not a regular file;"
    with pytest.warns(SearchCacheWarning, match=says) as caught:
        assert unblocked(lambda: search(backend), fifo) == first
    assert len(caught) == 1 and backend.measured == [("fwd", 4)] * 2
    assert path.is_file() and not path.is_symlink()  # replaced by the entry searched again
    assert search(backend) == first and len(backend.measured) == 2
    if kind == "link-to-fifo":
        assert fifo.is_fifo()


def test_a_link_loop_named_as_an_entry_is_replaced_as_a_dangling_link_is(cache):
    """A link that leads nowhere, its target gone or a loop, is no entry, and the write replaces it. A loop was
    taken for a folder this process cannot read, with a warning that said so and was the folder's one: a real
    failure to read it afterwards went unsaid."""
    backend = TableBackend(TABLE)
    first = search(backend)
    (path,) = entry_files(cache)
    path.unlink()
    path.symlink_to(path.name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert search(backend) == first
    assert path.is_file() and not path.is_symlink() and len(backend.measured) == 2
    assert search(backend) == first and len(backend.measured) == 2


def test_an_unwritable_directory_gives_one_warning_and_goes_on(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("WSARENA_CACHE_DIR", str(blocker / "cache"))  # unwritable even for root
    backend = TableBackend(TABLE)
    with pytest.warns(SearchCacheWarning, match="cannot save to the search cache") as caught:
        assert search(backend)[0].algo == "fft"
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        assert search(backend, "bwd_data")[0].algo == "gemm"
        assert search(backend)[0].algo == "fft"
    assert len(caught) == 1 and later == [] and caught[0].filename == __file__
    assert len(backend.measured) == 3


def test_a_bad_file_that_cannot_be_replaced_gives_one_warning_that_says_so(cache, monkeypatch):
    """A bad file in a folder that cannot be written: the warning said it would be replaced, and the next that it
    could not be saved. One warning says both: the file is ignored, and cannot be replaced."""
    backend = TableBackend(TABLE)
    first = search(backend)
    (path,) = entry_files(cache)
    path.write_text("not an entry")
    real_open = os.open

    def denied(name, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", str(name))
        return real_open(name, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)  # what a folder of another user's gives (root writes anything)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert search(backend) == first
        assert search(backend, "bwd_data")[0].algo == "gemm"  # its write fails too: said already
    assert [w.category for w in caught] == [SearchCacheWarning], [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert message.startswith(f"ignoring the search cache file {path}: ") and "will be" not in message
    assert re.search(r"; it cannot be replaced: .*Permission denied.*; going on without saving$", message), message
    assert path.read_text() == "not an entry" and len(backend.measured) == 3
    monkeypatch.setattr(os, "open", real_open)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert search(backend) == first  # replaced now, said once already
    assert json.loads(path.read_text())["format"] == "wsarena-search-cache"


def test_a_bad_file_a_search_leaves_for_want_of_times_is_said_to_be_ignored_only(cache):
    """A search that timed nothing (every candidate skipped for memory) saves nothing: the bad file stays, and the
    warning says it is ignored, not that it is replaced."""
    backend = TableBackend(TABLE)
    search(backend)
    (path,) = entry_files(cache)
    path.write_text("not an entry")
    candidates = [Candidate("implicit", 0), Candidate("gemm", 1000)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert searchcache.search(backend, "fwd", GEOM, candidates, lambda: ([], candidates)) == ([], candidates)
    said = (f"ignoring the search cache file {path}: Expecting value: line 1 column 1 (char 0); any other bad file "
            "in this folder is ignored without another warning")
    assert [str(w.message) for w in caught] == [said]
    assert path.read_text() == "not an entry"


def test_an_unreadable_directory_gives_one_warning(cache, monkeypatch):
    backend = TableBackend(TABLE)
    search(backend)
    search(backend, "bwd_data")

    real_open = os.open

    def denied(path, flags, *args, **kwargs):
        if str(cache) in str(path) and flags & (os.O_WRONLY | os.O_RDWR) == 0:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)  # what a folder of another user's gives (root reads anything)
    with pytest.warns(SearchCacheWarning, match="cannot read the search cache") as caught:
        search(backend)
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        search(backend, "bwd_data")
    assert len(caught) == 1 and later == [] and len(backend.measured) == 4


_WRITER = textwrap.dedent(
    """
    import sys
    from wsarena import searchcache
    from wsarena._geometry import conv_geometry
    from wsarena.backends import Candidate

    class Backend:
        name = "fake"
        def device_key(self):
            return "writer"
        def search_environment(self):
            return {"device": "writer"}

    start, stop, ms = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    backend = Backend()
    for repeat in range(3):
        for k in range(start, stop):
            geom = conv_geometry((1, 3, 8, 8), (k, 3, 3, 3))
            cands = [Candidate("a", 0), Candidate("b", k)]
            timed = [Candidate("a", 0, ms), Candidate("b", k, ms + k)]
            searchcache.search(backend, "fwd", geom, cands, lambda: (timed, []))
    """
)


def test_two_processes_writing_at_once_lose_no_entry(cache):
    env = {**os.environ, "WSARENA_CACHE_DIR": str(cache), "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, "1", "121", "1.5"], env=env, stderr=subprocess.PIPE),
        subprocess.Popen([sys.executable, "-c", _WRITER, "41", "161", "2.5"], env=env, stderr=subprocess.PIPE),
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and not err, err
    files = entry_files(cache)
    assert len(files) == 160
    assert not [p for p in (cache / "search").iterdir() if p.name.startswith(".tmp-")]
    seen = set()
    for path in files:
        data = json.loads(path.read_text())  # every file whole
        k = data["key"]["geometry"]["out_channels"]
        seen.add(k)
        times = {e["algo"]: e["time_ms"] for e in data["results"]}
        assert times["a"] in (1.5, 2.5) and times["b"] == times["a"] + k  # one writer's whole result
    assert seen == set(range(1, 161))


def test_info_and_clear(cache):
    assert searchcache.info()["entries"] == 0 and searchcache.clear()["removed"] == 0
    backend = TableBackend(TABLE)
    search(backend)
    search(backend, "bwd_data")
    search(TableBackend(TABLE, device="fake device 2"))
    (cache / "notes.txt").write_text("a file of the user's")
    killed = cache / "search" / named_as_write("left by a killed writer")
    killed.write_text("{")
    os.utime(killed, (time.time() - 7200, time.time() - 7200))
    info = searchcache.info()
    assert info["directory"] == str(cache) and info["enabled"] and info["entries"] == 3
    assert info["size_bytes"] == entries_size(cache)
    assert [(e["device"], e["entries"]) for e in info["environments"]] == [("fake device 1", 2), ("fake device 2", 1)]
    killed_size = on_disk(killed)
    cleared = searchcache.clear()
    assert (cleared["removed"], cleared["unreadable"]) == (3, 0)
    assert cleared["freed_bytes"] == info["size_bytes"] + killed_size
    assert entry_files(cache) == [] and (cache / "notes.txt").exists()
    assert list((cache / "search").iterdir()) == []


def test_clear_counts_the_files_that_are_no_readable_entry_apart(cache):
    """clear() counted them among the entries it removed (a corrupt file, a link that leads nowhere, a FIFO), where
    info() counts them apart: it says how many of each it removed."""
    backend = TableBackend(TABLE)
    search(backend)
    search(backend, "bwd_data")
    folder = cache / "search"
    (folder / named_as_entry("corrupt")).write_text("{")
    (folder / named_as_entry("dangling")).symlink_to(cache / "gone.json")
    os.mkfifo(folder / named_as_entry("fifo"))
    info = searchcache.info()
    assert (info["entries"], info["unreadable"]) == (2, 3)
    cleared = searchcache.clear()
    assert (cleared["removed"], cleared["unreadable"]) == (2, 3) and list(folder.iterdir()) == []


def test_entries_begin_and_end_as_clear_tells_them_without_parsing(cache):
    """clear() takes a file that begins and ends as the cache writes an entry for one; the written layout is that."""
    search(TableBackend(TABLE))
    search(CpuBackend())  # the CPU's API path is null
    for path in entry_files(cache):
        text = path.read_text()
        assert text.startswith(_searchcache_folder.ENTRY_HEAD) and text.endswith(_searchcache_folder.ENTRY_TAIL)


def test_clear_parses_no_entry_written_whole_and_parses_any_other_file(cache, monkeypatch):
    """Parsing each entry to tell it from a file that is none made wsarena cache clear five times slower (20,000
    entries: 2.0 s against 0.45 s before it counted them apart). A file in another layout is parsed, and counts as
    info() counts it; one that begins and ends as written but is damaged in between counts among the entries, where
    info(), which parses each file, counts it unreadable: removed either way."""
    backend = TableBackend(TABLE)
    search(backend)
    search(backend, "bwd_data")
    folder = cache / "search"
    first, second = entry_files(cache)
    compact = folder / named_as_entry("compact")  # a good entry written in another layout
    compact.write_text(json.dumps(json.loads(first.read_text())))
    text = second.read_text()
    middle = text.index('"results"')
    damaged = folder / named_as_entry("damaged")
    damaged.write_text(text[:middle] + "\0" * 40 + text[middle + 40:])
    (folder / named_as_entry("foreign")).write_text('{"key": {"environment": ["not", "a", "dict"]}}')
    (folder / named_as_entry("truncated")).write_text(text[:-10])
    info = searchcache.info()
    assert (info["entries"], info["unreadable"]) == (3, 3)  # the two entries and the compact one
    parsed = []
    loads = json.loads
    monkeypatch.setattr(_searchcache_folder.json, "loads", lambda text, **kw: parsed.append(text) or loads(text, **kw))
    cleared = searchcache.clear()
    assert (cleared["removed"], cleared["unreadable"]) == (4, 2) and list(folder.iterdir()) == []
    assert len(parsed) == 3  # the compact, foreign and truncated files


def test_reading_an_entry_takes_memory_of_its_size_not_of_the_bound(cache):
    """A read of the bound (MAX_ENTRY_BYTES + 1) took 16 MiB for each entry read, in a lookup, info() and clear(): some
    15 of the 20 us that a read of a 2.5 kB entry took."""
    import tracemalloc

    backend = TableBackend(TABLE)
    first = search(backend)
    tracemalloc.start()
    try:
        for step in (lambda: search(backend), searchcache.info, searchcache.clear):
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            step()
            assert tracemalloc.get_traced_memory()[1] - before < 1 << 20, step
    finally:
        tracemalloc.stop()
    assert backend.measured == [("fwd", 4)] and first  # the lookup read the entry


def test_an_entry_read_past_the_size_its_status_gave_is_read_to_its_end(cache, monkeypatch):
    """The size fstat() gave is a hint (the file may grow as it is read): the read goes on to the end, to the bound."""
    backend = TableBackend(TABLE)
    search(backend)
    (path,) = entry_files(cache)
    real = os.fstat

    def smaller(fd):
        st = real(fd)
        return os.stat_result((st.st_mode, *st[1:6], 10, *st[7:]))  # st_size 10

    monkeypatch.setattr(_searchcache_folder.os, "fstat", smaller)
    assert _searchcache_folder.read_entry(path)[0] == path.read_text()
    monkeypatch.setattr(_searchcache_folder, "MAX_ENTRY_BYTES", 100)
    with pytest.raises(ValueError, match="holds more than 100 B"):
        _searchcache_folder.read_entry(path)


def test_info_and_clear_when_off():
    assert searchcache.info() == {"directory": None, "enabled": False, "source": "environment", "entries": 0,
                                  "size_bytes": 0, "max_size_bytes": 64 << 20, "unreadable": 0, "environments": []}
    assert searchcache.clear() == {"directory": None, "removed": 0, "unreadable": 0, "freed_bytes": 0}


def test_the_cpu_environment(monkeypatch):
    from wsarena import _search_env

    monkeypatch.setattr(_search_env, "_known", {})
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    env = _search_env.environment(CpuBackend())
    assert env["backend"] == "cpu" and env["api"] is None and env["wsarena"] == wsarena.__version__
    assert isinstance(env["device"], str) and env["device"] and env["cpus"] >= 1
    assert env["numpy"] == np.__version__ and "name" in env["blas"]
    assert env["threads"] == {"OPENBLAS_NUM_THREADS": "1"}  # a BLAS thread setting changes every time
    json.dumps(env)


_X86 = """processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n\
model name\t: AMD EPYC 9654 96-Core Processor\nstepping\t: 1\ncpu MHz\t\t: 2400.000\ncpu cores\t: 96\n\n\
processor\t: 1\nmodel name\t: another\n"""
_ARM = """processor\t: 0\nBogoMIPS\t: 2000.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid\n\
CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x{variant}\nCPU part\t: 0x{part}\n\
CPU revision\t: {revision}\n\n"""


@pytest.mark.parametrize("cpuinfo", [
    pytest.param({"a53": _ARM.format(variant=0, part="d03", revision=4),
                  "a72": _ARM.format(variant=0, part="d08", revision=3),
                  "a72 r1": _ARM.format(variant=1, part="d08", revision=3)}, id="arm"),
    pytest.param({"power9": "processor\t: 0\ncpu\t\t: POWER9 (architected), altivec supported\nrevision\t: 2.2\n\n",
                  "power10": "processor\t: 0\ncpu\t\t: POWER10 (architected), altivec supported\nrevision\t: 2.0\n\n"},
                 id="power"),
])
def test_the_cpu_environment_names_the_processor_of_every_architecture(monkeypatch, cpuinfo):
    """Arm's /proc/cpuinfo has no model name: every Arm processor was named as platform.processor() names them all
    ("aarch64"), and the times one measured were served to another (two machines sharing a home folder). x86's name
    is as it was, so that the entries saved before still serve."""
    from wsarena import _search_env

    def reading(text):
        def fake_open(path, *args, **kwargs):
            assert path == "/proc/cpuinfo"
            return io.StringIO(text)
        return fake_open

    names = {}
    for what, text in {"x86": _X86, **cpuinfo}.items():
        monkeypatch.setattr(_search_env, "open", reading(text), raising=False)
        names[what] = _search_env._processor()
    assert names["x86"] == "AMD EPYC 9654 96-Core Processor AuthenticAMD 25 17 1"
    assert len(set(names.values())) == len(names), names


def test_the_cudnn_environment(monkeypatch):
    """Device name, compute capability, driver, CUDA runtime and cuDNN versions, and the API path (queried
    through CuPy and wsarena.cudnn, which are stood in for here)."""
    import cupy

    import wsarena.cudnn
    from wsarena import _search_env

    runtime = cupy.cuda.runtime
    props = {0: {"name": b"NVIDIA H100 80GB HBM3", "major": 9, "minor": 0},
             1: {"name": b"NVIDIA A100-SXM4-40GB", "major": 8, "minor": 0}}
    monkeypatch.setattr(runtime, "getDeviceProperties", props.__getitem__)
    monkeypatch.setattr(runtime, "driverGetVersion", lambda: 13000)
    monkeypatch.setattr(runtime, "runtimeGetVersion", lambda: 13000)
    monkeypatch.setattr(wsarena.cudnn, "library_info", lambda: {"version": 91900})
    monkeypatch.setattr(_search_env, "_known", {})

    class Cudnn:
        name = "cudnn"

        def __init__(self, device):
            self.device = device

        def device_key(self):
            return self.device

    env = _search_env.environment(Cudnn(0))
    assert env == {"backend": "cudnn", "device": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0",
                   "driver": 13000, "cuda_runtime": 13000, "cudnn": 91900, "wsarena": wsarena.__version__,
                   "api": "legacy"}
    assert _search_env.environment(Cudnn(1))["compute_capability"] == "8.0"
    graph = Cudnn(0)
    graph.api = "graph"  # a backend that can take another API path says which, and the key follows
    assert _search_env.environment(graph)["api"] == "graph"


# ------------------------------------------------------------------------------------------------- the size limit


class Plain:
    """The least a backend needs to key the cache; the writers of the concurrent tests use the same."""

    name = "fake"

    def device_key(self):
        return "writer"

    def search_environment(self):
        return {"device": "writer"}


PLAIN = Plain()


def put(k, backend=PLAIN):
    """Search (and so save) the call with ``k`` output channels."""
    geom = conv_geometry((1, 3, 8, 8), (k, 3, 3, 3))
    searchcache.search(backend, "fwd", geom, [Candidate("a", 0)], lambda: ([Candidate("a", 0, 1.0)], []))


def held(k, backend=PLAIN):
    """Whether the cache serves the call with ``k`` output channels (a lookup: nothing is searched or saved)."""
    def refuse():
        raise LookupError

    try:
        searchcache.search(backend, "fwd", conv_geometry((1, 3, 8, 8), (k, 3, 3, 3)), [Candidate("a", 0)], refuse)
    except LookupError:
        return False
    return True


def files_by_channels(folder):
    return {json.loads(p.read_text())["key"]["geometry"]["out_channels"]: p for p in entry_files(folder)}


def on_disk(path):
    """The disk space a file takes, as the limit counts it, worked out here from st_blocks and st_size."""
    st = path.stat()
    return max(st.st_blocks * 512, st.st_size)


def entries_size(folder):
    return sum(on_disk(p) for p in entry_files(folder))


@pytest.fixture
def limit(monkeypatch):
    """A limit of some thirty entries: each takes a 4 KiB block on the usual file systems."""
    monkeypatch.setenv("WSARENA_SEARCH_CACHE_MAX_SIZE", "128KiB")
    wsarena._config._reset()
    return 128 << 10


def test_the_size_limit_holds_after_every_write_and_the_least_recently_used_go(cache, limit):
    written = {}  # k -> modification time of its entry, just written
    for k in range(1, 401):
        before = set(entry_files(cache))
        put(k)
        (new,) = set(entry_files(cache)) - before
        written[k] = new.stat().st_mtime_ns
        assert entries_size(cache) <= limit, k
    kept = set(files_by_channels(cache))
    gone = set(written) - kept
    assert gone and kept
    assert min(written[k] for k in kept) >= max(written[k] for k in gone)  # the least recently used went first
    biggest = max(on_disk(p) for p in entry_files(cache))
    assert entries_size(cache) >= 0.9 * limit - 10 * biggest  # a trim stops near 90 %: it does not empty the cache


def test_a_limit_of_exactly_one_entry_keeps_the_most_recent(cache, monkeypatch):
    """The most recently used entry stays where it fits the limit alone, a limit of exactly its disk space too."""
    put(1)
    put(2)
    sizes = {on_disk(p) for p in entry_files(cache)}
    assert len(sizes) == 1  # entries of one block each (or of one size)
    old = time.time() - 7200
    for k, path in files_by_channels(cache).items():
        os.utime(path, (old + k, old + k))  # used before the entry written next, in order
    monkeypatch.setenv("WSARENA_SEARCH_CACHE_MAX_SIZE", str(sizes.pop()))
    wsarena._config._reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn of: the entry fits
        put(3)
    assert list(files_by_channels(cache)) == [3]
    assert held(3)


def test_writes_list_the_folder_only_when_the_limit_may_be_passed(cache, limit, monkeypatch):
    listings = []
    real_scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path: listings.append(path) or real_scandir(path))
    for k in range(1, 401):
        put(k)
    # the first write lists the folder, then one write in (a tenth of the limit / an entry's size) ~ 1 in 5
    entry = entries_size(cache) / len(entry_files(cache))
    assert 1 < len(listings) <= 400 * entry / (0.1 * limit) + 2


def test_an_entry_read_outlives_entries_last_used_before_it(cache, limit):
    for k in range(1, 21):
        put(k)
    old = time.time() - 7200  # two hours ago, the oldest first
    for k, path in files_by_channels(cache).items():
        os.utime(path, (old + k, old + k))
    algos.cache_clear()
    assert held(1)  # a restarted job reads the oldest entry: now the most recently used of these twenty
    assert files_by_channels(cache)[1].stat().st_mtime > time.time() - 60
    for k in range(100, 400):  # write until a trim removes something
        put(k)
        kept = files_by_channels(cache)
        if len(kept) < 20 + k - 99:
            break
    assert 1 in kept and 2 not in kept  # without the read, entry 1 would have been the first to go


def test_a_lookup_neither_lists_the_folder_nor_writes_a_fresh_entry(cache, limit, monkeypatch):
    put(1)
    path = entry_files(cache)[0]
    written = path.stat().st_mtime_ns

    def refuse(*args, **kwargs):
        raise AssertionError("a lookup touched the folder")

    monkeypatch.setattr(os, "scandir", refuse)
    monkeypatch.setattr(os, "utime", refuse)  # read within the hour of its write: nothing to mark
    assert held(1) and held(1)
    assert path.stat().st_mtime_ns == written


@pytest.mark.parametrize("fault", ["unlink", "scandir"])
def test_a_cache_that_cannot_be_trimmed_gives_one_warning_and_goes_on(cache, monkeypatch, fault):
    """The warning names the limit as the setting takes it back: format_size's "126.95 KiB" for 130000 bytes is no
    whole number of bytes."""
    monkeypatch.setenv("WSARENA_SEARCH_CACHE_MAX_SIZE", "130000")  # some thirty entries, as the limit fixture's
    wsarena._config._reset()
    real = getattr(os, fault)

    def denied(path, *args, **kwargs):
        if str(cache) in str(path) and not Path(path).name.startswith(".tmp-"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, fault, denied)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(1, 201):
            put(k)
    assert [w.category for w in caught] == [SearchCacheWarning]
    assert re.search("cannot trim the search cache .* to 130000 B: .*Permission denied", str(caught[0].message))
    assert wsarena.parse_size("130000 B") == 130000
    assert all(held(k) for k in range(1, 201))  # nothing could be removed; every entry still serves


def test_processes_writing_at_once_under_the_limit_leave_a_readable_cache(cache, limit):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}  # the limit and the folder too
    ranges = [("1", "151", "1.5"), ("51", "201", "2.5"), ("101", "251", "3.5")]
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, *r], env=env, stderr=subprocess.PIPE) for r in ranges]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and not err, err  # no warning: nothing unreadable, nothing untrimmable
    assert not [p for p in (cache / "search").iterdir() if p.name.startswith(".tmp-")]
    files = entry_files(cache)
    biggest = max(on_disk(p) for p in files)
    # each process counts what it writes itself; the others' writes since its last listing can pass the limit
    assert entries_size(cache) <= limit + len(procs) * (limit // 10 + biggest)
    for path in files:
        data = json.loads(path.read_text())  # every file whole, one writer's whole result
        k = data["key"]["geometry"]["out_channels"]
        times = {e["algo"]: e["time_ms"] for e in data["results"]}
        assert times["a"] in (1.5, 2.5, 3.5) and times["b"] == times["a"] + k
    kept = sorted(files_by_channels(cache))
    assert len(kept) == len(files) < 250 and all(k in range(1, 251) for k in kept)  # trimmed, no two files a call
    assert all(held(k) for k in kept)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        put(1000)  # this process's first write lists the folder and trims it
    assert entries_size(cache) <= limit


def test_info_keeps_a_null_api_path_and_counts_any_foreign_file_as_unreadable(cache):
    from wsarena._tune_cli import cache_output

    search(CpuBackend())  # the CPU has no cuDNN API path: null in the key
    (cache / "search" / named_as_entry("foreign")).write_text('{"key": {"environment": ["not", "a", "dict"]}}')
    (cache / "search" / named_as_entry("deep")).write_text("[" * 100_000)  # json.loads: RecursionError
    info = searchcache.info()
    assert [(e["backend"], e["api"], e["entries"]) for e in info["environments"]] == [("cpu", None, 1)]
    assert info["unreadable"] == 2
    text = cache_output("info", "text")
    assert "None" not in text and re.search(r"\(wsarena [^,)]+\)$", text.splitlines()[-1])


def test_info_counts_no_entry_that_another_process_removed_after_the_listing(cache, monkeypatch):
    # another process's trim or clear removes an entry between info's listing and its reading of the file: the
    # entry is gone, not unreadable (a dangling link named as an entry stays unreadable, as it is still there)
    backend = TableBackend(TABLE)
    search(backend)
    search(backend, "bwd_data")
    gone, kept = entry_files(cache)
    kept_size = on_disk(kept)
    (cache / "search" / named_as_entry("dangling")).symlink_to(cache / "nowhere")
    listed = _searchcache_folder._entry_files(cache)

    def listing_then_a_trim(root):
        gone.unlink()
        return listed

    monkeypatch.setattr(_searchcache_folder, "_entry_files", listing_then_a_trim)
    info = searchcache.info()
    assert (info["entries"], info["unreadable"], info["size_bytes"]) == (1, 1, kept_size)


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_entries_take_the_permissions_the_umask_leaves(cache, umask):
    """As any file the user writes: a cache folder shared with others (a team's, another installation's) can be
    read by them when the umask lets it, which private temporary files (mode 0600) renamed into place would not."""
    old = os.umask(umask)
    try:
        put(1)
    finally:
        os.umask(old)
    (path,) = entry_files(cache)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_clear_spares_a_write_in_progress(cache):
    """Another process's temporary file, not yet renamed into place: clearing it would cost that process its entry
    (and a warning that it cannot save)."""
    put(1)
    fd, tmp = searchcache._temporary(cache / "search")  # a writer midway
    with os.fdopen(fd, "wb") as f:
        f.write(b"{}")
    assert searchcache.clear()["removed"] == 1
    os.replace(tmp, cache / "search" / "entry.json")  # the writer finishes


def test_many_bad_files_give_one_warning(cache):
    """A crash or a full disk can spoil every entry: the job that replaces them says so once, not once a file."""
    backend = TableBackend(TABLE)
    search(backend)
    search(backend, "bwd_data")
    for path in entry_files(cache):
        path.write_text(path.read_text()[:100])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        search(backend)
        search(backend, "bwd_data")
    assert [w.category for w in caught] == [SearchCacheWarning] and "without another warning" in str(caught[0].message)
    assert len(backend.measured) == 4  # both searched again, and replaced
    assert all(json.loads(p.read_text())["format"] == "wsarena-search-cache" for p in entry_files(cache))


def test_the_limit_counts_the_disk_space_an_entry_takes(cache, monkeypatch):
    """An entry of a kilobyte or so takes a whole block: counted by their sizes alone, entries could take two or
    three times the limit on disk."""
    put(1)
    (path,) = entry_files(cache)
    block = path.stat().st_blocks * 512
    if block <= path.stat().st_size:
        pytest.skip(f"this file system stores a {path.stat().st_size}-byte file in {block} bytes")
    monkeypatch.setenv("WSARENA_SEARCH_CACHE_MAX_SIZE", str(10 * block))
    wsarena._config._reset()
    for k in range(2, 60):
        put(k)
        assert sum(p.stat().st_blocks * 512 for p in entry_files(cache)) <= 10 * block, k
    assert 5 <= len(entry_files(cache)) <= 10
    assert searchcache.info()["size_bytes"] == len(entry_files(cache)) * block


@pytest.mark.parametrize(("given", "shown"), [("1KiB", "1 KiB"), ("2000", "2000 B")])
def test_a_limit_below_one_entry_keeps_none_and_says_so_once(cache, monkeypatch, given, shown):
    """Every write's trim removes the entry it wrote: the cache is off in all but name, which one warning says. It
    names the limit as the setting takes it back: format_size's "1.95 KiB" for 2000 bytes is no whole number of
    bytes."""
    monkeypatch.setenv("WSARENA_SEARCH_CACHE_MAX_SIZE", given)
    wsarena._config._reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(1, 6):
            put(k)
    assert entry_files(cache) == [] and not held(1)  # the limit holds
    assert [w.category for w in caught] == [SearchCacheWarning] and caught[0].filename == __file__
    assert re.search(r"a search cache entry takes [\d.]+ [KM]iB on disk in .*, more than search_cache_max_size "
                     rf"\({shown}\): the cache keeps no entry", str(caught[0].message))
    assert wsarena.parse_size(shown) == wsarena.parse_size(given)


def test_a_limit_of_about_one_entry_keeps_the_newest(cache, monkeypatch):
    """A trim goes down to 90 % of the limit, least recently used first: under a limit of less than 1/0.9 entries,
    it removed the entry just written too, at every other write. The most recently used stays where it fits."""
    put(1)
    (path,) = entry_files(cache)
    monkeypatch.setenv("WSARENA_SEARCH_CACHE_MAX_SIZE", str(on_disk(path) * 21 // 20))
    wsarena._config._reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn of: an entry fits
        for k in range(2, 8):
            put(k)
            assert list(files_by_channels(cache)) == [k], k


def test_writes_made_without_a_limit_count_when_one_is_set_again(cache, limit):
    """The process's count of the folder's size runs ahead of it, never behind: what it wrote while the limit was
    off (configure(search_cache_max_size=None), a config() block) still counts, so the next write under a limit
    trims the folder instead of letting it stay past the limit for as much again."""
    put(1)  # the first write under a limit lists the folder: the count starts
    wsarena.configure(search_cache_max_size=None)
    for k in range(2, 120):
        put(k)
    assert entries_size(cache) > limit  # no limit: nothing trimmed
    wsarena.configure(search_cache_max_size=limit)
    put(120)
    assert entries_size(cache) <= limit


def test_one_folder_reached_through_a_symlink_counts_once(tmp_path, limit):
    """The size the process knows is the folder's, whatever path leads to it: counted once per path, writes through
    a link and through the real path would each count about half, and the folder would grow to twice the limit."""
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    for k in range(1, 201):
        wsarena.configure(cache_dir=real if k % 2 else link)
        put(k)
        assert entries_size(real) <= limit, k


def test_the_trim_removes_a_killed_writers_file_and_leaves_a_write_in_progress_uncounted(cache, limit):
    put(1)
    folder = cache / "search"
    killed, writing = folder / named_as_write("killed an hour ago"), folder / named_as_write("writing now")
    for path in (killed, writing):
        path.write_bytes(b"{" * 20_000)
    os.utime(killed, (time.time() - 7200, time.time() - 7200))
    algos.cache_clear()
    _searchcache_folder.known_size.clear()  # a fresh process: its first write lists the folder
    put(2)
    assert not killed.exists() and writing.exists()
    assert list(_searchcache_folder.known_size.values()) == [entries_size(cache)]  # the write's bytes are not its


def test_a_dangling_symlink_in_the_folder_is_removed_by_the_trim_and_by_clear(cache, limit):
    """A link whose target is gone is no entry, and nothing reads it or replaces it: left alone, it would stay in
    the folder for good."""
    put(1)
    folder = cache / "search"
    for name in (named_as_entry("dangling"), named_as_write("dangling")):
        (folder / name).symlink_to(cache / "gone" / name)
    algos.cache_clear()
    _searchcache_folder.known_size.clear()  # a fresh process: its first write lists the folder
    put(2)
    assert sorted(p.name for p in folder.iterdir() if p.is_symlink()) == []
    (folder / named_as_entry("dangling")).symlink_to(cache / "gone.json")
    cleared = searchcache.clear()
    assert (cleared["removed"], cleared["unreadable"]) == (2, 1) and list(folder.iterdir()) == []


def test_a_link_that_leads_nowhere_is_removed_as_a_dangling_one_is_and_only_the_link(cache, limit, tmp_path):
    """A link into a loop, or through a file as if it were a folder, resolves to nothing either: stat() fails with
    ELOOP or ENOTDIR, not ENOENT. Left alone, such a link made every ``wsarena cache clear`` fail (exit 3) for
    good. A link to a file or folder outside is removed like an entry, and its target is kept."""
    put(1)
    folder = cache / "search"
    outside = tmp_path / "outside.json"
    outside.write_text("not the cache's")
    (tmp_path / "elsewhere").mkdir()
    to_file, to_folder = named_as_entry("to a file"), named_as_entry("to a folder")
    loop, loop_write = named_as_entry("loop"), named_as_write("loop")
    links = {loop: folder / loop, loop_write: folder / loop_write, named_as_entry("through a file"): outside / "x.json",
             to_file: outside, to_folder: tmp_path / "elsewhere"}

    def make_links():
        for name, target in links.items():
            (folder / name).symlink_to(target)

    make_links()
    algos.cache_clear()
    _searchcache_folder.known_size.clear()  # a fresh process: its first write lists the folder
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and nothing to warn of
        put(2)
    left = sorted(p.name for p in folder.iterdir() if p.is_symlink())
    assert left == sorted([to_file, to_folder])  # resolved, they count as entries (under the limit)
    for name in left:
        (folder / name).unlink()
    make_links()
    cleared = searchcache.clear()
    assert (cleared["removed"], cleared["unreadable"]) == (2, 4) and list(folder.iterdir()) == []
    assert outside.read_text() == "not the cache's" and (tmp_path / "elsewhere").is_dir()


def test_files_not_named_as_the_cache_names_them_are_neither_counted_nor_removed(cache, limit):
    """A cache directory set to a folder that has a ``search`` folder of the user's own: its files are not the
    cache's, whatever their suffix; the trim, ``info`` and ``clear`` look only at the names the cache writes (a
    key's hash, a write in progress)."""
    put(1)
    folder = cache / "search"
    theirs = ["notes.json", "results.JSON", ".tmp-mine.json", named_as_entry("x")[:-5] + ".json.bak",
              named_as_entry("x").upper(), "0" * 39 + ".json"]
    for name in theirs:
        (folder / name).write_text("x" * (limit // 2))  # over the limit: a trim that counted them would remove some
    old = time.time() - 7200  # older than any entry, and than a killed writer's file
    for name in theirs:
        os.utime(folder / name, (old, old))
    algos.cache_clear()
    _searchcache_folder.known_size.clear()  # a fresh process: its first write lists the folder
    put(2)
    ours = [p for p in folder.iterdir() if p.name not in theirs]
    info = searchcache.info()
    assert len(ours) == 2 and info["entries"] == 2 and info["unreadable"] == 0
    assert info["size_bytes"] == sum(on_disk(p) for p in ours)
    cleared = searchcache.clear()
    assert cleared["removed"] == 2
    assert sorted(p.name for p in folder.iterdir()) == sorted(theirs)


def test_a_folder_with_an_entry_s_name_is_left_alone_by_the_trim_and_by_clear(cache, limit):
    """A folder named like an entry is no entry: the trim neither counts nor removes it, and
    ``wsarena cache clear`` removes the entries around it instead of failing on it (exit 3)."""
    put(1)
    folder = cache / "search"
    named = named_as_entry("someone else's")
    (folder / named).mkdir()
    (folder / named / "kept").write_text("x")
    algos.cache_clear()
    _searchcache_folder.known_size.clear()  # a fresh process: its first write lists the folder
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing failed to be removed
        put(2)
    cleared = searchcache.clear()
    assert cleared["removed"] == 2
    assert [p.name for p in folder.iterdir()] == [named]
    assert (folder / named / "kept").read_text() == "x"


def test_a_folder_with_an_entry_s_name_gives_one_warning_that_names_it_and_hides_no_other(cache, monkeypatch):
    """A folder in an entry's place cannot be replaced, nor is it the cache's to remove: its call goes unsaved, and
    one warning says so and names it. Each search of it gave two warnings that put the whole folder at fault (cannot
    read the search cache, cannot save to it), each said once per folder, so that a real failure to save later went
    unsaid; and ``wsarena cache info`` counted it among the unreadable files, which it says a search replaces."""
    backend = TableBackend(TABLE)
    first = search(backend)
    (path,) = entry_files(cache)
    path.unlink()
    path.mkdir()
    (path / "kept").write_text("x")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert search(backend) == first
        assert search(backend) == first
    assert [w.category for w in caught] == [SearchCacheWarning] and caught[0].filename == __file__
    assert re.fullmatch(f"cannot save to the search cache file {re.escape(str(path))}: a folder of that name stands "
                        "in its place; .*", str(caught[0].message))
    assert backend.measured == [("fwd", 4)] * 3 and (path / "kept").read_text() == "x"
    info = searchcache.info()
    assert (info["entries"], info["unreadable"], info["size_bytes"]) == (0, 0, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        search(backend, "bwd_data")  # the folder's other calls are saved, and read back
        search(backend, "bwd_data")
    assert len(backend.measured) == 4 and searchcache.info()["entries"] == 1

    def refused(src, dst):
        raise PermissionError(13, "Permission denied", str(dst))

    monkeypatch.setattr(os, "replace", refused)
    with pytest.warns(SearchCacheWarning, match="cannot save to the search cache in .*Permission denied"):
        search(TableBackend(TABLE, device="fake device 2"))


def test_info_names_the_setting_in_force(cache, monkeypatch, tmp_path):
    """``wsarena cache info`` says where its folder comes from: a folder configure() or config() set in the process
    is not the environment variable's, nor is a cache they turned off."""
    from wsarena._tune_cli import cache_output

    assert cache_output("info", "text").splitlines()[0] == f"search cache: {cache} (from WSARENA_CACHE_DIR)"
    mine = tmp_path / "mine"
    wsarena.configure(cache_dir=mine)
    assert cache_output("info", "text").splitlines()[0] == f"search cache: {mine} (from configure())"
    with wsarena.config(cache_dir=tmp_path / "block"):
        line = cache_output("info", "text").splitlines()[0]
        assert line == f"search cache: {tmp_path / 'block'} (from config())"
    assert json.loads(cache_output("info", "json"))["source"] == "configure"
    wsarena.configure(cache_dir=None)
    assert cache_output("info", "text") == "the search cache is off (set by configure())\n"
    monkeypatch.delenv("WSARENA_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    wsarena._config._reset()
    line = cache_output("info", "text").splitlines()[0]
    assert line == f"search cache: {tmp_path / 'xdg' / 'wsarena'} (from the user cache folder)"
    for word in ("off", "none", " None"):  # the variable as the user wrote it, which turned the cache off
        monkeypatch.setenv("WSARENA_CACHE_DIR", word)
        wsarena._config._reset()
        assert cache_output("info", "text") == f"the search cache is off (WSARENA_CACHE_DIR={word.strip()})\n"


@pytest.mark.parametrize("variable", ["a folder", "off", "unset"])
def test_the_source_in_a_block_that_set_no_folder_is_the_setting_of_the_folder_it_holds(
    monkeypatch, tmp_path, variable
):
    """A config() block that sets no cache folder holds the folder in force as it began. A configure() inside it
    changes the process-wide folder, not the block's: source() names the setting that gives the folder in force (the
    environment variable, or the user's cache folder), neither config() (the block set no folder) nor configure()
    (its folder is not in force there). Once, it said "config"."""
    if variable == "unset":
        monkeypatch.delenv("WSARENA_CACHE_DIR")
    else:
        monkeypatch.setenv("WSARENA_CACHE_DIR", str(tmp_path / "env") if variable == "a folder" else "off")
    wsarena._config._reset()
    before = (searchcache.cache_dir(), "default" if variable == "unset" else "environment")
    assert (searchcache.cache_dir(), searchcache.source()) == before
    with wsarena.config(algo_search="exhaustive"):
        wsarena.configure(cache_dir=tmp_path / "mine")
        assert (searchcache.cache_dir(), searchcache.source()) == before
        assert searchcache.info()["source"] == before[1]
        with wsarena.config(cache_dir=tmp_path / "block"):
            assert searchcache.source() == "config"
    assert (searchcache.cache_dir(), searchcache.source()) == (tmp_path / "mine", "configure")


def test_the_source_is_the_setting_that_gave_the_folder_even_where_another_gives_the_same(monkeypatch, tmp_path):
    """The setting is told by what set the folder, not by comparing folders: a block that sets the environment's
    folder is config()'s, a configure() of that same folder is configure()'s, and a block that set none holds
    configure()'s folder as it began, whatever configure() does inside it. The settings carry it to where using()
    takes them (PyTorch's autograd thread)."""
    import threading

    from wsarena import _config

    env, y, z = tmp_path / "env", tmp_path / "y", tmp_path / "z"
    monkeypatch.setenv("WSARENA_CACHE_DIR", str(env))
    wsarena._config._reset()
    wsarena.configure(cache_dir=y)
    with wsarena.config(cache_dir=env):
        assert (searchcache.cache_dir(), searchcache.source()) == (env, "config")
    with wsarena.config(algo_search="exhaustive"):
        wsarena.configure(cache_dir=z)
        assert (searchcache.cache_dir(), searchcache.source()) == (y, "configure")
        block = _config.overridden()
    seen = []

    def elsewhere():
        with _config.using(block):
            seen.append((searchcache.cache_dir(), searchcache.source()))

    worker = threading.Thread(target=elsewhere)
    worker.start()
    worker.join()
    assert seen == [(y, "configure")]
    wsarena.configure(cache_dir=env)
    assert (searchcache.cache_dir(), searchcache.source()) == (env, "configure")


def test_a_block_begun_as_another_thread_configures_names_the_setting_of_the_folder_it_holds(monkeypatch, tmp_path):
    """A block takes its settings and their origins from one reading of the process-wide settings: a configure()
    of another thread that lands while the block begins gives the block neither its folder nor its origin."""
    import threading

    from wsarena import _config

    env = tmp_path / "env"
    monkeypatch.setenv("WSARENA_CACHE_DIR", str(env))
    wsarena._config._reset()
    replace = _config._replace

    def configured_meanwhile(base, changes):
        new = replace(base, changes)
        if changes == {"algo_search": "exhaustive"}:  # the block's own, not configure()'s
            other = threading.Thread(target=wsarena.configure, kwargs={"cache_dir": tmp_path / "other"})
            other.start()
            other.join()
        return new

    monkeypatch.setattr(_config, "_replace", configured_meanwhile)
    with wsarena.config(algo_search="exhaustive"):
        assert (searchcache.cache_dir(), searchcache.source()) == (env, "environment")
    assert (searchcache.cache_dir(), searchcache.source()) == (tmp_path / "other", "configure")


def test_the_source_is_the_environment_as_the_settings_read_it(monkeypatch, tmp_path):
    """The settings read the environment once: a variable set, changed or removed later moves no folder, and is no
    configure() call either (the folder was credited to configure())."""
    monkeypatch.setenv("WSARENA_CACHE_DIR", str(tmp_path / "env"))
    wsarena._config._reset()
    assert (searchcache.cache_dir(), searchcache.source()) == (tmp_path / "env", "environment")
    for later in (str(tmp_path / "later"), None):
        if later is None:
            monkeypatch.delenv("WSARENA_CACHE_DIR")
        else:
            monkeypatch.setenv("WSARENA_CACHE_DIR", later)
        assert (searchcache.cache_dir(), searchcache.source()) == (tmp_path / "env", "environment")
    wsarena._config._reset()  # read with no variable: the user cache folder
    default = searchcache.cache_dir()
    monkeypatch.setenv("WSARENA_CACHE_DIR", str(tmp_path / "later"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-later"))
    assert (searchcache.cache_dir(), searchcache.source()) == (default, "default")
    wsarena.configure(cache_dir=tmp_path / "later")  # the folder the variable names now, given by configure()
    assert searchcache.source() == "configure"



def test_a_search_of_another_call_leaves_a_heuristic_order_waiting_for_memory_waiting(cache):
    """A heuristic order kept until memory allows its search waits on when a search of another call (another
    geometry) fills the search cache: that entry holds nothing of its call, so it searches nothing and reads no
    file. A search of its own call, under another cap, sends it to search again."""
    table = {
        ("fwd", 4): [("implicit", 100, 10.0), ("gemm", 1000, 4.0), ("fft", 8000, 3.0)],
        ("fwd", 8): [("implicit", 100, 20.0), ("gemm", 1000, 8.0)],
    }
    starved, other = TableBackend(table, memory=50), TableBackend(table)
    geom8 = conv_geometry((2, 3, 8, 8), (8, 3, 3, 3), padding=1)

    def choice(backend, geom=GEOM, cap=None):
        got = algos.select(backend, "fwd", geom, cap=cap, search="exhaustive", warn=False,
                           operands=tuple(np.zeros(s, dtype="float32") for s in geom.operand_shapes("fwd")))
        return [(c.algo, c.time_ms) for c in got]

    heuristic = [("implicit", None), ("gemm", None), ("fft", None)]
    with pytest.warns(wsarena.SearchFallbackWarning):
        assert choice(starved) == heuristic
    assert choice(other, geom8, cap=10**7) == [("gemm", 8.0), ("implicit", 20.0)]
    searched = sum(searchcache.counts())
    assert choice(starved) == heuristic and sum(searchcache.counts()) == searched  # still waiting
    assert choice(other, cap=10**7) == [("fft", 3.0), ("gemm", 4.0), ("implicit", 10.0)]
    assert choice(starved) == [("fft", 3.0), ("gemm", 4.0), ("implicit", 10.0)] and starved.measured == []
