"""The public ops on the cpu backend against an independent float64 direct convolution (tests/reference.py).

Tolerance: relative error max|y - ref| / max|ref| <= 1e-5 for float32 and <= 1e-12 for float64.
"""

import collections
import dataclasses
import gc
import os
import re
import subprocess
import sys
import threading
import warnings
import weakref

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wsarena
from wsarena import config, conv_backward_data, conv_backward_filter, conv_forward, ops
from wsarena.arena import Arena, HostProvider
from wsarena.backends import PartlyTimed, cpu
from wsarena.backends._cpu_backend import CpuBackend
from wsarena.errors import MemoryFallbackWarning, WorkspaceCapWarning

from .interrupts import interrupt_at_entry_of
from .reference import error_for_sums, ref_conv_backward_data, ref_conv_backward_filter, ref_conv_forward

TOL = {"float32": 1e-5, "float64": 1e-12}


def rel_err(got, ref):
    scale = float(np.max(np.abs(ref))) or 1.0
    return float(np.max(np.abs(got.astype(np.float64) - ref))) / scale


pytestmark = pytest.mark.usefixtures("fresh_arena")  # from conftest: a host arena of the test's own


@st.composite
def problems(draw):
    nd = draw(st.integers(1, 3))
    groups = draw(st.integers(1, 3))
    cpg = draw(st.integers(1, 3))
    kpg = draw(st.integers(1, 3))
    depthwise = draw(st.booleans())
    if depthwise:
        cpg, kpg = 1, draw(st.integers(1, 2))
        groups = draw(st.integers(2, 4))
    max_size = {1: 12, 2: 8, 3: 5}[nd]
    size = tuple(draw(st.integers(1, max_size)) for _ in range(nd))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(nd))
    padding = []
    for s, k, d in zip(size, kernel, dilation):
        need = max(0, (d * (k - 1) + 1 - s + 1) // 2)
        padding.append(draw(st.integers(need, need + 2)))
    return {
        "batch": draw(st.integers(1, 3)), "c": cpg * groups, "k": kpg * groups, "groups": groups, "size": size,
        "kernel": kernel, "stride": stride, "padding": tuple(padding), "dilation": dilation,
        "layout": draw(st.sampled_from(["NCHW", "NHWC"])), "dtype": draw(st.sampled_from(["float32", "float64"])),
        "seed": draw(st.integers(0, 2**31)),
    }


def make(p):
    rng = np.random.default_rng(p["seed"])
    geom = wsarena._geometry.conv_geometry(
        (p["batch"], p["c"], *p["size"]), (p["k"], p["c"] // p["groups"], *p["kernel"]),
        stride=p["stride"], padding=p["padding"], dilation=p["dilation"], groups=p["groups"],
    )
    x = rng.standard_normal(geom.input_shape)
    w = rng.standard_normal(geom.weight_shape)
    dy = rng.standard_normal(geom.output_shape)
    if p["layout"] == "NHWC":
        to_last = lambda a: np.ascontiguousarray(np.moveaxis(a, 1, -1))
        x, w, dy = to_last(x), to_last(w), to_last(dy)
    return geom, x, w, dy


def params(p):
    return {"stride": p["stride"], "padding": p["padding"], "dilation": p["dilation"], "groups": p["groups"]}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=problems())
def test_three_passes_match_the_reference(p):
    _, x, w, dy = make(p)
    kw = params(p)
    lay = p["layout"]
    xt, wt, dyt = (a.astype(p["dtype"]) for a in (x, w, dy))
    y = conv_forward(xt, wt, **kw, layout=lay)
    dx = conv_backward_data(dyt, wt, xt.shape, **kw, layout=lay)
    dw = conv_backward_filter(xt, dyt, wt.shape, **kw, layout=lay)
    assert y.dtype == dx.dtype == dw.dtype == np.dtype(p["dtype"])
    tol = TOL[p["dtype"]]  # of the sums' magnitude: small random cases can have outputs whose terms cancel
    ax, aw, ady = np.abs(x), np.abs(w), np.abs(dy)
    assert error_for_sums(y, ref_conv_forward(x, w, **kw, layout=lay),
                          ref_conv_forward(ax, aw, **kw, layout=lay)) <= tol
    assert error_for_sums(dx, ref_conv_backward_data(dy, w, x.shape, **kw, layout=lay),
                          ref_conv_backward_data(ady, aw, x.shape, **kw, layout=lay)) <= tol
    assert error_for_sums(dw, ref_conv_backward_filter(x, dy, w.shape, **kw, layout=lay),
                          ref_conv_backward_filter(ax, ady, w.shape, **kw, layout=lay)) <= tol


@pytest.mark.parametrize("pass_", ["fwd", "bwd_data", "bwd_filter"])
def test_every_cpu_algorithm_through_the_public_op(pass_):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4, 9, 7))
    w = rng.standard_normal((6, 2, 3, 3))
    kw = {"stride": (2, 1), "padding": 1, "dilation": (1, 2), "groups": 2}
    dy = rng.standard_normal(ref_conv_forward(x, w, **kw).shape)
    ref = {
        "fwd": lambda: ref_conv_forward(x, w, **kw),
        "bwd_data": lambda: ref_conv_backward_data(dy, w, x.shape, **kw),
        "bwd_filter": lambda: ref_conv_backward_filter(x, dy, w.shape, **kw),
    }[pass_]()
    x32, w32, dy32 = (a.astype(np.float32) for a in (x, w, dy))
    for algo in cpu.ALGORITHMS[pass_]:
        op = {
            "fwd": lambda algo=algo: conv_forward(x32, w32, **kw, algo=algo),
            "bwd_data": lambda algo=algo: conv_backward_data(dy32, w32, x.shape, **kw, algo=algo),
            "bwd_filter": lambda algo=algo: conv_backward_filter(x32, dy32, w.shape, **kw, algo=algo),
        }[pass_]
        assert rel_err(op(), ref) <= 1e-5, algo


def test_cap_zero_never_leases_a_byte(fresh_arena):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 8, 16, 16), dtype=np.float32)
    w = rng.standard_normal((8, 8, 3, 3), dtype=np.float32)
    with config(cap_workspace=0):  # each pass warns: the cap excludes its algorithms that need a workspace
        with pytest.warns(WorkspaceCapWarning):
            y = conv_forward(x, w, padding=1)
        with pytest.warns(WorkspaceCapWarning):
            dx = conv_backward_data(y, w, x.shape, padding=1)
        with pytest.warns(WorkspaceCapWarning):
            dw = conv_backward_filter(x, y, w.shape, padding=1)
    assert fresh_arena.stats()["high_water_bytes"] == 0
    assert fresh_arena.stats()["capacity_bytes"] == 0
    assert rel_err(y, ref_conv_forward(x, w, padding=1)) <= 1e-5
    assert rel_err(dx, ref_conv_backward_data(y, w, x.shape, padding=1)) <= 1e-5
    assert rel_err(dw, ref_conv_backward_filter(x, y, w.shape, padding=1)) <= 1e-5


@pytest.mark.parametrize("search", ["heuristic", "exhaustive"])
@pytest.mark.parametrize("pass_", ["fwd", "bwd_data", "bwd_filter"])
def test_a_cap_warning_names_the_calling_line(pass_, search):
    """The warning is attributed to the line that called the op, not to a line inside wsarena."""
    x, dy = (np.zeros((2, 8, 16, 16), np.float32) for _ in range(2))
    w = np.zeros((8, 8, 3, 3), np.float32)
    op = {
        "fwd": lambda: conv_forward(x, w, padding=1),
        "bwd_data": lambda: conv_backward_data(dy, w, x.shape, padding=1),
        "bwd_filter": lambda: conv_backward_filter(x, dy, w.shape, padding=1),
    }[pass_]
    with config(cap_workspace=0, algo_search=search), pytest.warns(WorkspaceCapWarning) as warned:
        op()
    assert [(r.filename, r.lineno) for r in warned] == [(__file__, op.__code__.co_firstlineno)]  # the lambda's call


@pytest.mark.parametrize("how", ["-c", "stdin"])
def test_a_cap_warning_from_a_program_given_on_the_command_line_or_stdin_is_shown_and_the_op_runs(how):
    """Their ``__main__`` has no source a loader can give (its loader is the built-in importer, which raises
    ImportError): the warning names the line without its text, as Python's own warnings do there."""
    program = (
        "import numpy as np, wsarena\n"
        "x, w = np.ones((1, 3, 16, 16), np.float32), np.ones((8, 3, 5, 5), np.float32)\n"
        "with wsarena.config(cap_workspace=0):\n"
        "    y = wsarena.conv_forward(x, w)\n"
        "print(float(y.max()))\n"
    )
    argv, stdin = ([sys.executable, "-c", program], None) if how == "-c" else ([sys.executable, "-"], program)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSARENA_")}
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert (done.returncode, done.stdout) == (0, "75.0\n"), done.stderr
    name = "<string>" if how == "-c" else "<stdin>"
    assert f"{name}:4: WorkspaceCapWarning: " in done.stderr and "Traceback" not in done.stderr


def test_a_cap_warning_at_a_line_whose_loader_fails_is_still_shown_and_the_op_runs():
    class Loader:
        def get_source(self, name):
            raise RuntimeError("no source here")

    x, w = np.ones((1, 3, 16, 16), np.float32), np.ones((8, 3, 5, 5), np.float32)
    scope = {"conv_forward": conv_forward, "x": x, "w": w, "__name__": "generated", "__loader__": Loader()}
    with config(cap_workspace=0), pytest.warns(WorkspaceCapWarning) as warned:
        exec("y = conv_forward(x, w)", scope)  # noqa: S102 - a module whose loader cannot give its source
    assert [(r.filename, r.lineno) for r in warned] == [("<string>", 1)] and float(scope["y"].max()) == 75.0


@pytest.mark.parametrize("action", ["always", "default"])
def test_a_cap_warning_whose_showing_fails_is_shown_once_and_the_failure_comes_out(action):
    """A ``showwarning`` that raises (a log that is down) is called once and its error comes out of the call, as
    from ``warnings.warn``: it is no loader failing to give the line's source, after which the warning is shown."""
    shown = []

    def show(message, category, filename, lineno, file=None, line=None):
        shown.append((filename, lineno))
        raise RuntimeError("the log is down")

    x, w = np.ones((1, 3, 19, 19), np.float32), np.ones((8, 3, 5, 5), np.float32)
    op = lambda: conv_forward(x, w)  # its line is the one the warning names
    with warnings.catch_warnings(), config(cap_workspace=0):
        warnings.simplefilter(action)
        warnings.showwarning = show
        with pytest.raises(RuntimeError, match="the log is down"):
            op()
    assert shown == [(__file__, op.__code__.co_firstlineno)]


# A workspace a message names, pasted back as the cap: 43200 bytes for fwd and bwd_data, 47808 for bwd_filter, which
# format_size writes "42.19 KiB" and "46.69 KiB", no whole number of bytes (cap_workspace refuses them)
X_ODD, DY_ODD, W_ODD = (np.ones(s, np.float32) for s in ((1, 3, 16, 16), (1, 8, 12, 12), (8, 3, 5, 5)))
ODD_OPS = {
    "fwd": lambda **kw: conv_forward(X_ODD, W_ODD, **kw),
    "bwd_data": lambda **kw: conv_backward_data(DY_ODD, W_ODD, X_ODD.shape, **kw),
    "bwd_filter": lambda **kw: conv_backward_filter(X_ODD, DY_ODD, W_ODD.shape, **kw),
}


def runs(monkeypatch):
    """The algorithms the cpu backend runs from now on, in order."""
    ran = []
    real = CpuBackend.run

    def run(self, pass_, candidate, *args):
        ran.append(candidate.algo)
        return real(self, pass_, candidate, *args)

    monkeypatch.setattr(CpuBackend, "run", run)
    return ran


@pytest.mark.parametrize("pass_", ["fwd", "bwd_data", "bwd_filter"])
def test_the_workspace_a_cap_warning_names_is_a_cap_that_admits_its_algorithm(monkeypatch, pass_):
    """Set as cap_workspace, the size the warning gives the algorithm the cap excluded makes the call run it."""
    with config(cap_workspace=0), pytest.warns(WorkspaceCapWarning) as warned:
        ODD_OPS[pass_]()
    algo, shown = re.search(r"excludes (\w+) \(([^)]+)\)", str(warned[0].message)).groups()
    ran = runs(monkeypatch)
    with config(cap_workspace=shown), warnings.catch_warnings():
        warnings.simplefilter("error", WorkspaceCapWarning)  # nothing faster is left out now
        ODD_OPS[pass_]()
    assert ran == [algo]


@pytest.mark.parametrize("pass_", ["fwd", "bwd_data", "bwd_filter"])
def test_the_workspace_a_forced_algorithm_is_refused_for_is_a_cap_that_admits_it(monkeypatch, pass_):
    algo = cpu.ALGORITHMS[pass_][-1]  # the batch column algorithm: the most workspace
    with config(cap_workspace=0), pytest.raises(ValueError, match="above the cap of 0 B") as refused:
        ODD_OPS[pass_](algo=algo)
    shown = re.search(r"needs (.+) of workspace", str(refused.value)).group(1)
    ran = runs(monkeypatch)
    with config(cap_workspace=shown):
        ODD_OPS[pass_](algo=algo)
    assert ran == [algo]


def test_the_workspaces_a_memory_fallback_warning_names_are_caps_that_admit_their_algorithms(monkeypatch):
    """Set as the cap, the workspace of the one that ran makes the call run it, with no fallback; that of the one
    memory denied makes it run where memory allows. At batch 2, gemm_batch (86400 bytes, format_size's "84.38 KiB")
    comes first, gemm_per_image (43200 bytes, "42.19 KiB") next."""

    class Refusing(HostProvider):
        def allocate(self, size, *, stream=None):
            if size > 50000:
                raise MemoryError("no host memory for that")
            return super().allocate(size, stream=stream)

    x, w = np.ones((2, 3, 16, 16), np.float32), np.ones((8, 3, 5, 5), np.float32)
    arena = Arena(Refusing())
    arena.reserve(45000)  # what it holds serves the fallback: the arena grows no more once refused
    monkeypatch.setattr(CpuBackend, "arena", lambda self: arena)
    with pytest.warns(MemoryFallbackWarning) as warned:
        conv_forward(x, w)
    ran_algo, ran_size, first_algo, first_size = re.match(
        r"(\w+) \((.+?) of workspace\) ran in place of (\w+) \((.+?)\)", str(warned[0].message)).groups()
    assert (ran_algo, first_algo) == ("gemm_per_image", "gemm_batch")
    ran = runs(monkeypatch)
    with config(cap_workspace=ran_size), warnings.catch_warnings():
        warnings.simplefilter("error", MemoryFallbackWarning)
        warnings.simplefilter("ignore", WorkspaceCapWarning)
        conv_forward(x, w)
    assert ran == [ran_algo]
    arena.close()
    arena = Arena(HostProvider())
    ran.clear()
    with config(cap_workspace=first_size):
        conv_forward(x, w)
    assert ran == [first_algo]
    arena.close()


def test_one_mib_cap_bounds_every_lease(fresh_arena):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 16, 32, 32), dtype=np.float32)  # columns: 576 KiB per image, 2.25 MiB per batch
    w = rng.standard_normal((16, 16, 3, 3), dtype=np.float32)
    with config(cap_workspace="1MiB"), warnings.catch_warnings():
        warnings.simplefilter("ignore", WorkspaceCapWarning)
        y = conv_forward(x, w, padding=1)
        conv_backward_data(y, w, x.shape, padding=1)
        conv_backward_filter(x, y, w.shape, padding=1)
    assert 0 < fresh_arena.stats()["high_water_bytes"] <= 1 << 20


def test_without_cap_the_arena_holds_the_largest_not_the_sum(fresh_arena):
    rng = np.random.default_rng(4)
    sizes = []
    for c in (8, 16, 4):
        x = rng.standard_normal((2, c, 12, 12), dtype=np.float32)
        w = rng.standard_normal((c, c, 3, 3), dtype=np.float32)
        conv_forward(x, w, padding=1)
        geom = wsarena._geometry.conv_geometry(x.shape, w.shape, padding=1)
        sizes.append(cpu.workspace_size("fwd", cpu.candidates("fwd", geom)[0], geom))
    stats = fresh_arena.stats()
    assert stats["high_water_bytes"] == max(sizes)
    assert stats["capacity_bytes"] < sum(sizes)


def test_exhaustive_search_gives_the_same_answer():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 4, 10, 10))
    w = rng.standard_normal((3, 4, 3, 3))
    with config(algo_search="exhaustive"):
        y = conv_forward(x, w, stride=2, padding=1)
    assert rel_err(y, ref_conv_forward(x, w, stride=2, padding=1)) <= 1e-12


def test_an_exhaustive_search_times_the_others_when_one_algorithm_is_out_of_memory_of_its_own(monkeypatch):
    """implicit_gemm needs no workspace, so every workspace the search leases holds it: when its NumPy temporaries
    cannot be had, the search times the others and ranks it after them (it used to fail at every lease, and the call
    with it: NoAlgorithmFitsError, though the other algorithms run). Said once, and kept: no search again."""
    from wsarena import algos

    real = cpu.run_unchecked
    tried = []

    def short(pass_, algo, *args):
        tried.append(algo)
        if algo == "implicit_gemm":
            raise MemoryError("no room for the temporaries")
        return real(pass_, algo, *args)

    monkeypatch.setattr(cpu, "run_unchecked", short)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 4, 10, 10))
    w = rng.standard_normal((3, 4, 3, 3))
    with config(algo_search="exhaustive"):
        with pytest.warns(wsarena.MemoryFallbackWarning, match=r"not implicit_gemm \(0 B\).* ranking is kept"):
            y = conv_forward(x, w, stride=2, padding=1)
        assert rel_err(y, ref_conv_forward(x, w, stride=2, padding=1)) <= 1e-12
        timed = len(tried)
        conv_forward(x, w, stride=2, padding=1)
        assert len(tried) == timed + 1  # the kept choice ran, with no search
        from wsarena._geometry import conv_geometry
        from wsarena.backends import get_backend

        geom = conv_geometry(x.shape, w.shape, stride=2, padding=1, dtype="float64")
        assert algos.is_cached(get_backend("cpu"), "fwd", geom, cap=None, search="exhaustive")


def test_out_is_written_and_returned():
    x = np.ones((1, 2, 5, 5), np.float32)
    w = np.ones((3, 2, 3, 3), np.float32)
    out = np.full((1, 3, 3, 3), np.nan, np.float32)
    assert conv_forward(x, w, out=out) is out
    assert np.all(out == 18)


def test_non_contiguous_inputs_are_accepted():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 3, 10, 10))[:, :, ::2, ::2]
    w = np.asfortranarray(rng.standard_normal((4, 3, 3, 3)))
    assert rel_err(conv_forward(x, w, padding=1), ref_conv_forward(x, w, padding=1)) <= 1e-12


class _Scope:
    """A backend's context that logs its entry and exit (the cuDNN backend's makes the call's stream current)."""

    def __init__(self, log):
        self.log = log

    def __enter__(self):
        self.log.append("enter")

    def __exit__(self, *exc):
        self.log.append("exit")


def _log_copies(monkeypatch, log):
    """Have each copy the ops make of an operand append "copy freed" to ``log`` when it is freed."""
    copy_of = ops._copy

    def watched(array):
        made = copy_of(array)
        weakref.finalize(made, log.append, "copy freed")
        return made

    monkeypatch.setattr(ops, "_copy", watched)


@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises"])
def test_the_operands_copies_go_before_the_calls_stream_is_left(monkeypatch, raises):
    """The copies a call makes of non-contiguous operands are dropped inside the backend's context, while the call's
    stream object is current and alive: CuPy's stream-ordered allocator frees them on it, after the convolution that
    reads them, where after the block (the call's return) it freed them on the stream current then, which nothing
    orders after the convolution. The result is the caller's; a call that raises drops them too."""
    log = []
    monkeypatch.setattr(CpuBackend, "context", lambda self, arrays, stream: _Scope(log))
    _log_copies(monkeypatch, log)
    if raises:
        def fails(arena, chosen, run, **kwargs):
            raise RuntimeError("no room")

        monkeypatch.setattr(ops, "run_with_fallback", fails)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 3, 10, 10))[:, :, ::2, ::2]
    w = np.asfortranarray(rng.standard_normal((4, 3, 3, 3)))
    if raises:
        with pytest.raises(RuntimeError, match="no room"):
            conv_forward(x, w, padding=1)
    else:
        y = conv_forward(x, w, padding=1)
        assert rel_err(y, ref_conv_forward(x, w, padding=1)) <= 1e-12
    assert log == ["enter", "copy freed", "copy freed", "exit"]


class _Refused(Exception):
    """A backend's refusal of one algorithm for these operands (cuDNN's NOT_SUPPORTED, say): the next one runs."""


@pytest.mark.parametrize("search", ["heuristic", "exhaustive"])
@pytest.mark.parametrize("refusal", [_Refused, MemoryError], ids=["refused", "own-memory"])
def test_the_operands_copies_go_before_the_calls_stream_is_left_after_a_refusal(monkeypatch, refusal, search):
    """A call whose first algorithm is refused (or runs out of its own memory), in the search or in the run, and
    whose next one runs drops the copies of its operands inside the backend's context too. The refusal, kept by
    run_with_fallback to be raised should every candidate fail, holds in its traceback the frames that ran the first
    one, which hold the copies, and the frame that kept it: a cycle, and the copies went with the garbage collector,
    after the block, on whatever stream was current then. The collector is off for the call."""
    log = []
    monkeypatch.setattr(CpuBackend, "context", lambda self, arrays, stream: _Scope(log))
    monkeypatch.setattr(CpuBackend, "retry_errors", (_Refused,))
    _log_copies(monkeypatch, log)
    refused = []
    # the search times in one workspace after another (the largest first); a call runs one candidate after another
    name = "measure" if search == "exhaustive" else "run"
    method = getattr(CpuBackend, name)

    def first_refused(self, *args):
        if not refused:
            refused.append(name)  # not the operands, which must go
            raise refusal("refused")
        return method(self, *args)

    monkeypatch.setattr(CpuBackend, name, first_refused)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 3, 10, 10))[:, :, ::2, ::2]
    w = np.asfortranarray(rng.standard_normal((4, 3, 3, 3)))
    collecting = gc.isenabled()
    gc.disable()
    try:
        with config(algo_search=search), warnings.catch_warnings():
            warnings.simplefilter("ignore", MemoryFallbackWarning)
            y = conv_forward(x, w, padding=1)
    finally:
        if collecting:
            gc.enable()
    assert refused
    assert rel_err(y, ref_conv_forward(x, w, padding=1)) <= 1e-12
    assert log == ["enter", "copy freed", "copy freed", "exit"]


@pytest.mark.parametrize("given_out", [False, True], ids=["new", "out"])
def test_a_result_never_returned_goes_before_the_calls_stream_is_left(monkeypatch, given_out):
    """A call that raises once its convolution ran (a MemoryFallbackWarning made an error, after the candidate that
    ran in place of the first) drops the result it made inside the backend's context, while the call's stream object
    is current and alive, as it drops the operands' copies: it is returned to no one, and after the block CuPy's
    stream-ordered allocator freed it on the stream current then, which nothing orders after the convolution that
    writes it. An out= array is the caller's, and kept. The collector is off for the call."""
    log = []
    monkeypatch.setattr(CpuBackend, "context", lambda self, arrays, stream: _Scope(log))
    new_output = ops._new_output

    def watched(record, empty):
        made = new_output(record, empty)
        weakref.finalize(made, log.append, "result freed")
        return made

    monkeypatch.setattr(ops, "_new_output", watched)
    run = CpuBackend.run
    ran = []

    def first_out_of_memory(self, pass_, cand, *args):
        ran.append(cand.algo)
        if len(ran) == 1:
            raise MemoryError("the algorithm's own temporaries")
        run(self, pass_, cand, *args)

    monkeypatch.setattr(CpuBackend, "run", first_out_of_memory)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 3, 6, 6))
    w = rng.standard_normal((4, 3, 3, 3))
    out = np.empty((2, 4, 6, 6)) if given_out else None
    collecting = gc.isenabled()
    gc.disable()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", MemoryFallbackWarning)
            with pytest.raises(MemoryFallbackWarning, match="ran in place of"):
                conv_forward(x, w, padding=1, out=out)
    finally:
        if collecting:
            gc.enable()
    assert len(ran) == 2
    if given_out:
        assert log == ["enter", "exit"]
        assert rel_err(out, ref_conv_forward(x, w, padding=1)) <= 1e-12  # written before the warning
    else:
        assert log == ["enter", "result freed", "exit"]


def test_edge_shapes():
    rng = np.random.default_rng(7)
    # batch 1, 1x1 kernel, kernel as large as the padded input
    x = rng.standard_normal((1, 3, 6, 6))
    for w, kw in ((rng.standard_normal((5, 3, 1, 1)), {}), (rng.standard_normal((2, 3, 8, 8)), {"padding": 1})):
        y = conv_forward(x, w, **kw)
        assert rel_err(y, ref_conv_forward(x, w, **kw)) <= 1e-12
    assert conv_forward(x, rng.standard_normal((2, 3, 8, 8)), padding=1).shape == (1, 2, 1, 1)


def test_out_between_strided_input_images_in_one_buffer_is_not_an_overlap():
    big = np.random.default_rng(3).standard_normal((5, 4, 6, 6)).astype(np.float32)
    x, out = big[0::3], big[1:3]  # images 0 and 3 as the input, images 1 and 2 as the output
    w = np.random.default_rng(4).standard_normal((4, 4, 1, 1)).astype(np.float32)
    expected = ref_conv_forward(x.astype(np.float64), w.astype(np.float64))
    conv_forward(x, w, out=out)
    assert rel_err(out, expected) <= 1e-5  # float32 GEMM against the float64 direct convolution
    with pytest.raises(ValueError, match="overlaps an input"):  # an output on top of image 3: refused
        conv_forward(x, w, out=big[2:4])


def test_numpy_subclasses_run_and_masked_arrays_are_refused(tmp_path):
    rng = np.random.default_rng(5)
    images = np.memmap(tmp_path / "x", dtype=np.float32, mode="w+", shape=(4, 3, 8, 8))
    images[:] = rng.standard_normal(images.shape)
    w = rng.standard_normal((2, 3, 3, 3)).astype(np.float32)
    y = conv_forward(images[1:3], w, padding=1)  # a slice of a memmap is a memmap
    expected = ref_conv_forward(np.asarray(images[1:3], np.float64), w.astype(np.float64), padding=1)
    assert rel_err(y, expected) <= 1e-5
    with pytest.raises(TypeError, match="mask would be ignored"):
        conv_forward(np.ma.masked_array(np.asarray(images[:1]), mask=True), w)


def test_zero_batch_gives_empty_results_without_workspace(fresh_arena):
    x = np.zeros((0, 3, 6, 6), np.float32)
    w = np.ones((2, 3, 3, 3), np.float32)
    y = conv_forward(x, w)
    assert y.shape == (0, 2, 4, 4)
    assert conv_backward_data(y, w, x.shape).shape == x.shape
    dw = conv_backward_filter(x, y, w.shape)
    assert dw.shape == w.shape and not dw.any()
    assert fresh_arena.stats()["allocations"] == 0
    with pytest.raises(TypeError, match="stream"):  # checked as in any other call
        conv_forward(x, w, stream=[1])


def test_zero_batch_runs_any_forced_algorithm_under_a_cap_of_zero(fresh_arena):
    """A call with nothing to compute needs no workspace, whichever algorithm is forced: gemm_per_image at batch 0
    was refused under cap 0 as needing one image's column matrix, gemm_batch was not. Its results are the reference's
    (empty, and dw's zeros, exactly); at batch 1 the cap still refuses what needs workspace."""
    rng = np.random.default_rng(3)
    x, w = np.zeros((0, 3, 6, 6)), rng.standard_normal((2, 3, 3, 3))
    dy = np.zeros((0, 2, 4, 4))
    calls = {
        "fwd": (lambda algo: conv_forward(x, w, algo=algo), ref_conv_forward(x, w)),
        "bwd_data": (lambda algo: conv_backward_data(dy, w, x.shape, algo=algo),
                     ref_conv_backward_data(dy, w, x.shape)),
        "bwd_filter": (lambda algo: conv_backward_filter(x, dy, w.shape, algo=algo),
                       ref_conv_backward_filter(x, dy, w.shape)),
    }
    with config(cap_workspace=0):
        for pass_, (call, expected) in calls.items():
            for algo in cpu.ALGORITHMS[pass_]:
                got = call(algo)
                assert got.shape == expected.shape and np.array_equal(got, expected), (pass_, algo)
        with pytest.raises(ValueError, match="algo='gemm_per_image' needs .* above the cap of 0 B"):
            conv_forward(np.zeros((1, 3, 6, 6)), w, algo="gemm_per_image")
    assert fresh_arena.stats()["allocations"] == 0


def test_zero_batch_refuses_what_any_call_refuses_before_writing(monkeypatch):
    """An empty batch enqueues nothing but dw's zeros, yet its zero-byte lease is taken as any call's is: a stream
    whose capture CUDA refuses (one an error invalidated, the legacy stream while another is captured) or a closed
    arena raises as it does for a full batch, before those zeros are written where they would break the capture."""
    from wsarena.arena import Arena, HostProvider
    from wsarena.arena.testing import RecordingProvider
    from wsarena.backends import CpuBackend

    def invalidated(stream):
        raise wsarena.CaptureError(f"the capture on {stream!r} was invalidated")

    provider = RecordingProvider()
    provider.capture = invalidated
    arenas = [Arena(provider)]
    monkeypatch.setattr(CpuBackend, "arena", lambda self: arenas[0])
    dw = np.full((2, 3, 3, 3), 7.0, np.float32)
    for batch in (1, 0):
        x, dy = np.ones((batch, 3, 6, 6), np.float32), np.ones((batch, 2, 4, 4), np.float32)
        with pytest.raises(wsarena.CaptureError, match="'lane' was invalidated"):
            conv_backward_filter(x, dy, dw.shape, out=dw, stream="lane")
        assert (dw == 7).all()
    arenas[0] = Arena(HostProvider())
    arenas[0].close()
    for batch in (1, 0):
        x, dy = np.ones((batch, 3, 6, 6), np.float32), np.ones((batch, 2, 4, 4), np.float32)
        with pytest.raises(RuntimeError, match="closed"):
            conv_backward_filter(x, dy, dw.shape, out=dw)
        assert (dw == 7).all()


def test_padding_strings():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((1, 2, 7, 7))
    w = rng.standard_normal((2, 2, 3, 3))
    assert conv_forward(x, w, padding="same").shape == (1, 2, 7, 7)
    assert conv_forward(x, w, padding="valid").shape == (1, 2, 5, 5)


def _fake_cupy_array(shape):
    cls = type("ndarray", (), {"__module__": "cupy._core.core"})
    a = cls()
    a.shape, a.dtype = shape, np.dtype("float32")
    return a


def _read_only(shape: tuple[int, ...]) -> np.ndarray:
    a = np.zeros(shape, np.float32)
    a.flags.writeable = False
    return a


def _over(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A C-contiguous array of ``shape`` on the memory of ``a``'s first elements."""
    return a.reshape(-1)[: int(np.prod(shape))].reshape(shape)


X = np.zeros((1, 4, 6, 6), np.float32)
W = np.zeros((2, 4, 3, 3), np.float32)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: conv_forward(X.tolist(), W), TypeError, "x must be an array"),
        (lambda: conv_forward(X, _fake_cupy_array(W.shape)), TypeError, "cannot mix NumPy and CuPy"),
        (lambda: conv_forward(X.astype(np.int32), W.astype(np.int32)), TypeError, "floating-point"),
        (lambda: conv_forward(X, W.astype(np.float64)), TypeError, "dtypes differ"),
        (lambda: conv_forward(X.astype(np.float16), W.astype(np.float16)), TypeError, "cpu backend computes"),
        (lambda: conv_forward(X, W[:, :3]), ValueError, "input channels per group"),
        (lambda: conv_forward(X, W, groups=3), ValueError, "groups=3"),
        (lambda: conv_forward(X, np.zeros((5, 2, 3, 3), np.float32), groups=2), ValueError, r"output channels \(5\)"),
        (lambda: conv_backward_filter(X, np.zeros((1, 5, 4, 4), np.float32), (5, 2, 3, 3), groups=2), ValueError,
         r"output channels \(5\)"),
        (lambda: conv_forward(X, W, stride=0), ValueError, "stride"),
        (lambda: conv_forward(X, W, dilation=-1), ValueError, "dilation"),
        (lambda: conv_forward(X, W, padding=-1), ValueError, "padding"),
        (lambda: conv_forward(X, np.zeros((2, 4, 9, 9), np.float32)), ValueError, "larger than the padded input"),
        (lambda: conv_forward(X[0, 0], W[0, 0]), ValueError, "3, 4 or 5"),
        (lambda: conv_forward(X, W, out=np.zeros((1, 2, 5, 5), np.float32)), ValueError, "out has shape"),
        (lambda: conv_forward(X, W, out=np.zeros((1, 2, 4, 4), np.float64)), TypeError, "out has dtype"),
        (lambda: conv_forward(X, W, out=np.zeros((1, 2, 4, 4, 2), np.float32)[..., 0]), ValueError, "C-contiguous"),
        (lambda: conv_forward(X, W, out=_read_only((1, 2, 4, 4))), ValueError, "out is read-only"),
        (lambda: conv_forward(X, W, out=np.ma.zeros((1, 2, 4, 4), np.float32)), TypeError,
         "^out must be a NumPy array, not MaskedArray$"),
        (lambda: conv_forward(X, W, algo="winograd"), ValueError, "algo='winograd'"),
        (lambda: conv_forward(X, np.zeros((4, 4, 1, 1), np.float32), out=X), ValueError, "overlaps an input"),
        (lambda: conv_forward(X, w := W.copy(), out=_over(w, (1, 2, 4, 4))), ValueError, "overlaps an input"),
        (lambda: conv_backward_filter(X, _over(dw := W.copy(), (1, 2, 4, 4)), W.shape, out=dw), ValueError,
         "overlaps an input"),
        (lambda: conv_backward_data(np.zeros((1, 2, 5, 5), np.float32), W, X.shape), ValueError, "dy has shape"),
        (lambda: conv_backward_data(np.zeros((1, 2, 4, 4), np.float32), W, "1,4,6,6"), TypeError, "input_shape"),
        (lambda: conv_backward_filter(X, np.zeros((1, 3, 4, 4), np.float32), W.shape), ValueError, "dy has shape"),
        (lambda: conv_backward_filter(X, np.zeros((1, 2, 4, 4), np.float32), (2, 4, 3)), ValueError, "weight_shape"),
    ],
)
def test_bad_input_is_rejected_before_any_lease(fresh_arena, call, error, match):
    before = fresh_arena.stats()
    with pytest.raises(error, match=match):
        call()
    assert fresh_arena.stats() == before


def test_a_shape_argument_is_any_sequence_of_ints(fresh_arena):
    """input_shape and weight_shape take a tuple's or list's subclass (torch.Size, a PyTorch tensor's .shape) and any
    other sequence (a UserList) as the tuple of their values, as a tuple is taken; text is refused."""

    class Size(tuple):
        pass

    rng = np.random.default_rng(11)
    x, w, dy = (rng.standard_normal(s) for s in ((2, 4, 6, 5), (6, 2, 3, 3), (2, 6, 2, 2)))
    for as_shape in (Size, collections.UserList, lambda s: Size(np.int64(d) for d in s)):
        dx = conv_backward_data(dy, w, as_shape(x.shape), stride=2, groups=2)
        assert rel_err(dx, ref_conv_backward_data(dy, w, x.shape, stride=2, groups=2)) <= TOL["float64"]
        dw = conv_backward_filter(x, dy, as_shape(w.shape), stride=2, groups=2)
        assert rel_err(dw, ref_conv_backward_filter(x, dy, w.shape, stride=2, groups=2)) <= TOL["float64"]
    for name, call in (("input_shape", lambda: conv_backward_data(dy, w, "2,4,6,5", stride=2, groups=2)),
                       ("weight_shape", lambda: conv_backward_filter(x, dy, b"\x06\x02\x03\x03", stride=2, groups=2))):
        with pytest.raises(TypeError, match=rf"^{name} must be a sequence of ints, not "):
            call()


@pytest.mark.parametrize("bad", [True, 1.0, [1, True]])
def test_invalid_parameters_are_rejected_after_a_valid_call_with_equal_values(bad):
    conv_forward(X, W, stride=1)  # remembered geometry; True == 1.0 == 1 must not hit it
    with pytest.raises(TypeError, match="stride"):
        conv_forward(X, W, stride=tuple(bad) if isinstance(bad, list) else bad)


def test_forced_algorithm_above_the_cap_is_a_value_error():
    x = np.zeros((2, 4, 8, 8), np.float32)
    w = np.zeros((4, 4, 3, 3), np.float32)
    geom = wsarena._geometry.conv_geometry(x.shape, w.shape)
    big = max(cpu.ALGORITHMS["fwd"], key=lambda a: cpu.workspace_size("fwd", a, geom))
    with config(cap_workspace=16), pytest.raises(ValueError, match="above the cap"):
        conv_forward(x, w, algo=big)


@pytest.mark.parametrize("library", ["NumPy", "PyTorch"])
def test_configured_backend_must_match_the_arrays(library):
    # said by their memory: PyTorch's tensors were "NumPy" arrays, told to be CuPy's
    x, w = (X, W)
    if library == "PyTorch":
        torch = pytest.importorskip("torch")
        x, w = torch.from_numpy(X), torch.from_numpy(W)
    with config(backend="cudnn"), pytest.raises(TypeError) as info:
        conv_forward(x, w)
    assert str(info.value) == ("backend='cudnn' is configured but the arrays are in host memory; pass arrays on a CUDA "
                               "device (CuPy's, or another library's) or configure backend='auto'")


def test_a_remembered_call_still_checks_what_changed():
    rng = np.random.default_rng(8)
    x, w = rng.standard_normal(X.shape, dtype=np.float32), rng.standard_normal(W.shape, dtype=np.float32)
    ref = ref_conv_forward(x, w)
    y = conv_forward(x, w)  # what these arguments determine is now remembered
    assert rel_err(y, ref) <= TOL["float32"]
    with pytest.raises(TypeError, match="x must be a floating-point array"):
        conv_forward(x.astype(np.int32), w)
    with pytest.raises(TypeError, match="x must be an array .*, not list"):
        conv_forward(x.tolist(), w)
    with pytest.raises(TypeError, match="dtypes differ"):
        conv_forward(x, w.astype(np.float64))
    with config(backend="cudnn"), pytest.raises(TypeError, match="backend='cudnn'"):
        conv_forward(x, w)
    # Valid arguments that cannot key the cache (a NumPy int, a list) take the checked path to the same result.
    again = conv_forward(x, w, stride=np.int64(1), padding=[0, 0])
    np.testing.assert_array_equal(again, y)
    assert rel_err(again, ref) <= TOL["float32"]


class RankedByHeuristic(CpuBackend):
    """The cpu backend as if on cuDNN's graph API: its candidates ranked by the cudnn_heuristic in force (B reverses
    the order), and ``between()`` run where a call looks up its algorithm, after it read the settings."""

    api = "graph"

    def __init__(self, between):
        self.between = between
        self.ran = []

    def device_key(self):
        self.between()
        return super().device_key()

    def candidates(self, pass_, geom):
        ranked = super().candidates(pass_, geom)
        return ranked if wsarena.get_config().cudnn_heuristic == "instant" else ranked[::-1]

    def run(self, pass_, candidate, *args):
        self.ran.append(candidate.algo)
        super().run(pass_, candidate, *args)


def test_a_call_chooses_under_the_heuristic_it_read_whatever_another_thread_configures(monkeypatch):
    # Another thread's configure() between a call's read of the settings and its choice: the algorithm cache's key
    # and the ranking read cudnn_heuristic again, and the choice B ranked was kept for the call's signature under
    # INSTANT, and served to every later call under INSTANT.
    switched = []

    def other_thread():
        if not switched:
            switched.append(wsarena.configure(cudnn_heuristic="b"))

    backend = RankedByHeuristic(other_thread)
    monkeypatch.setattr(ops, "get_backend", lambda name, api=None: backend)
    rng = np.random.default_rng(9)
    x, w = rng.standard_normal(X.shape, dtype=np.float32), rng.standard_normal(W.shape, dtype=np.float32)
    instant = [c.algo for c in CpuBackend().candidates("fwd", wsarena._geometry.conv_geometry(x.shape, w.shape))]
    assert instant[0] != instant[-1]
    ref = ref_conv_forward(x, w)
    assert rel_err(conv_forward(x, w), ref) <= TOL["float32"]  # read INSTANT; B configured as it chooses
    assert switched and backend.ran == [instant[0]]
    conv_forward(x, w)  # under B
    assert backend.ran[-1] == instant[-1]
    wsarena.configure(cudnn_heuristic="instant")
    assert rel_err(conv_forward(x, w), ref) <= TOL["float32"]
    assert backend.ran == [instant[0], instant[-1], instant[0]]


class OnApi(CpuBackend):
    """The cpu backend as if on one of cuDNN's two APIs, which records what it ran."""

    def __init__(self, api, ran):
        self.api = api
        self.ran = ran

    def run(self, pass_, candidate, *args):
        self.ran.append(self.api)
        super().run(pass_, candidate, *args)


def test_a_call_runs_on_the_cudnn_api_it_read_whatever_another_thread_configures(monkeypatch):
    """Another thread's configure(cudnn_api=...) between a call's read of the settings and its backend's: the record
    of the call's signature, kept under the API the call read, held the other API's backend, which then ran every
    later call under the API read (as CuPy arrays take the backend of the setting in force)."""
    ran = []
    on = {api: OnApi(api, ran) for api in ("graph", "legacy")}
    switched = []

    def get_backend(name, api=None):
        if not switched:
            switched.append(wsarena.configure(cudnn_api="legacy"))  # the other thread's
        return on[api or wsarena.get_config().cudnn_api]

    monkeypatch.setattr(ops, "get_backend", get_backend)
    rng = np.random.default_rng(10)
    x, w = rng.standard_normal(X.shape, dtype=np.float32), rng.standard_normal(W.shape, dtype=np.float32)
    ref = ref_conv_forward(x, w)
    assert wsarena.get_config().cudnn_api == "graph"
    assert rel_err(conv_forward(x, w), ref) <= TOL["float32"]  # read graph; legacy configured as it checks
    assert switched and ran == ["graph"]
    assert rel_err(conv_forward(x, w), ref) <= TOL["float32"]  # under legacy now
    wsarena.configure(cudnn_api="graph")
    conv_forward(x, w)
    assert ran == ["graph", "legacy", "graph"]


def test_lanes_on_threads_give_the_serial_results():
    rng = np.random.default_rng(9)
    jobs = [(rng.standard_normal((2, c, 10, 10)), rng.standard_normal((c, c, 3, 3))) for c in (2, 3, 4, 5)]
    serial = [conv_forward(x, w, padding=1) for x, w in jobs]
    results = [None] * len(jobs)

    def work(i):
        for _ in range(5):
            results[i] = conv_forward(*jobs[i], padding=1, stream=f"lane{i}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want, (x, w) in zip(results, serial, jobs):
        np.testing.assert_array_equal(got, want)
        assert rel_err(got, ref_conv_forward(x, w, padding=1)) <= TOL["float64"]


@pytest.mark.parametrize("kwargs", [{"algo": "winograd"}, {"algo": "gemm_batch", "cap": 16}])
def test_a_bad_forced_algorithm_is_rejected_before_any_memory_is_touched(monkeypatch, kwargs):
    """Nothing is allocated or copied (on a GPU: enqueued) before the forced algorithm is checked."""
    from wsarena.backends._cpu_backend import CpuBackend

    def no_allocation(self, shape, dtype):
        raise AssertionError("output allocated before the arguments were checked")

    monkeypatch.setattr(CpuBackend, "empty", no_allocation)
    with config(cap_workspace=kwargs.pop("cap", None)), pytest.raises(ValueError, match="algo="):
        conv_forward(np.zeros((2, 4, 8, 8), np.float32)[:, :, ::1, ::-1], W, **kwargs)


@pytest.mark.parametrize("algo", [3, b"gemm_batch", ["gemm_batch"], True])
@pytest.mark.parametrize("op", [conv_forward, conv_backward_data, conv_backward_filter])
def test_a_forced_algorithm_of_the_wrong_type_is_a_type_error_naming_algo(monkeypatch, op, algo):
    """As the package's other arguments of the wrong type: algo=3 was a ValueError, as an unknown name is."""
    from wsarena.backends._cpu_backend import CpuBackend

    def no_allocation(self, shape, dtype):
        raise AssertionError("output allocated before the arguments were checked")

    monkeypatch.setattr(CpuBackend, "empty", no_allocation)
    x = np.zeros((2, 4, 8, 8), np.float32)
    a, b, shape = {conv_forward: (x, W, None), conv_backward_data: (np.zeros((2, 2, 6, 6), np.float32), W, x.shape),
                   conv_backward_filter: (x, np.zeros((2, 2, 6, 6), np.float32), W.shape)}[op]
    with pytest.raises(TypeError, match=r"^algo must be a str, an algorithm's name, not "):
        op(a, b, algo=algo) if shape is None else op(a, b, shape, algo=algo)


def test_an_algorithm_the_backend_refuses_is_skipped_for_the_next(monkeypatch):
    """As cuDNN's NOT_SUPPORTED at run time: the call moves on to the next candidate and still gets it right."""
    from wsarena.backends._cpu_backend import CpuBackend

    class Refused(Exception):
        pass

    x = np.random.default_rng(3).standard_normal((2, 3, 9, 9))
    w = np.random.default_rng(4).standard_normal((4, 3, 3, 3))
    geom = wsarena._geometry.conv_geometry(x.shape, w.shape, padding=1, dtype="float64")
    order = cpu.candidates("fwd", geom)
    real_run, ran = CpuBackend.run, []

    def refusing(self, pass_, cand, *args):
        if cand.algo == order[0]:
            raise Refused(order[0])
        ran.append(cand.algo)
        real_run(self, pass_, cand, *args)

    monkeypatch.setattr(CpuBackend, "run", refusing)
    monkeypatch.setattr(CpuBackend, "retry_errors", (Refused,))
    y = conv_forward(x, w, padding=1)
    assert ran == [order[1]]
    assert rel_err(y, ref_conv_forward(x, w, padding=1)) <= TOL["float64"]


def test_ctrl_c_as_the_lease_is_given_back_leaves_the_stream_usable(fresh_arena):
    """CPython may deliver Ctrl-C on a function's first instruction; on Workspace.__exit__'s it used to leave the
    lease live, and every later call of the thread on that lane failed with 'already holds a lease'."""
    from wsarena.arena import Workspace

    x, w = np.ones((1, 2, 6, 6), np.float32), np.ones((3, 2, 3, 3), np.float32)
    with config(cap_workspace=None):
        conv_forward(x, w)  # choose the algorithm (one with a workspace) first
        with interrupt_at_entry_of(Workspace.__exit__), pytest.raises(KeyboardInterrupt, match="at Workspace.__exit__"):
            conv_forward(x, w)
        assert fresh_arena.stats()["leases"] == 0
        assert fresh_arena.stats()["high_water_bytes"] > 0  # the interrupted call did hold a workspace
        np.testing.assert_allclose(conv_forward(x, w), ref_conv_forward(x, w), rtol=1e-5)


def test_out_and_stream_are_keyword_only():
    y = np.empty((1, 2, 4, 4), np.float32)
    for op, args in ((conv_forward, (X, W)), (conv_backward_data, (y, W, X.shape)),
                     (conv_backward_filter, (X, y, W.shape))):
        with pytest.raises(TypeError, match="positional"):
            op(*args, 1, 0, 1, 1, None)


def test_a_remembered_call_follows_a_cleared_algorithm_cache(monkeypatch):
    """The ops keep each call's choice in their per-signature record; algos.cache_clear() must reach it."""
    from wsarena import algos
    from wsarena.backends._cpu_backend import CpuBackend

    x = np.random.default_rng(5).standard_normal((2, 3, 9, 9))
    w = np.random.default_rng(6).standard_normal((4, 3, 3, 3))
    geom = wsarena._geometry.conv_geometry(x.shape, w.shape, padding=1, dtype="float64")
    real_run, ran = CpuBackend.run, []
    monkeypatch.setattr(CpuBackend, "run",
                        lambda self, p, cand, *a: ran.append(cand.algo) or real_run(self, p, cand, *a))
    conv_forward(x, w, padding=1)
    conv_forward(x, w, padding=1)
    first = cpu.candidates("fwd", geom)[0]
    assert ran == [first, first]
    last = cpu.candidates("fwd", geom)[-1]
    monkeypatch.setattr(cpu, "candidates", lambda pass_, g: [last])  # what a new choice would now give
    conv_forward(x, w, padding=1)
    assert ran[-1] == first  # still remembered
    algos.cache_clear()
    y = conv_forward(x, w, padding=1)
    assert ran[-1] == last
    assert rel_err(y, ref_conv_forward(x, w, padding=1)) <= TOL["float64"]


def test_under_lasting_memory_pressure_a_call_asks_the_provider_again_only_now_and_then(monkeypatch, refusal_clock):
    """A first choice whose workspace the provider refuses: every call runs the algorithm that fits (and matches
    the reference), and after the second refusal the provider, whose refusal is costly on a GPU, is asked again
    only once 100 times a refusal's duration has passed (or after trim())."""
    from wsarena.arena import Arena
    from wsarena.arena.testing import RecordingProvider
    from wsarena.backends._cpu_backend import CpuBackend

    from .arena_helpers import refusing

    provider = RecordingProvider()
    asked = refusing(provider, refusal_clock, 0.01)  # each refusal takes 10 ms: then 1 s without asking
    arena = Arena(provider)
    monkeypatch.setattr(CpuBackend, "arena", lambda self: arena)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 8, 16, 16))
    w = rng.standard_normal((8, 8, 3, 3))
    ref = ref_conv_forward(x, w, padding=1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(100):
            assert rel_err(conv_forward(x, w, padding=1), ref) <= TOL["float64"]
    assert len(asked) == 2 and all(n > 4096 for n in asked)  # the first two calls; the other 98 fell back at once
    assert [w.category for w in said] == [wsarena.MemoryFallbackWarning]  # said once, at the caller's line
    assert said[0].filename == __file__ and "for fwd of input (2, 8, 16, 16)" in str(said[0].message)
    assert arena.stats().refused_bytes == min(asked)
    refusal_clock.now += 1.01
    conv_forward(x, w, padding=1)
    assert len(asked) == 3  # the wait is over: asked, and refused again
    arena.trim()  # what a caller who freed memory of their own may do: the next call asks at once
    conv_forward(x, w, padding=1)
    assert len(asked) == 4


def test_once_the_wait_is_over_a_cached_call_does_not_ask_the_arena_about_refusals(monkeypatch, refusal_clock):
    """A record of refusals long past (say two searches' largest candidates, never asked for again) costs the
    cached calls nothing: the arena's cheap gate says no, and defers_growth is not asked."""
    from wsarena.arena import Arena
    from wsarena.arena.testing import RecordingProvider
    from wsarena.backends._cpu_backend import CpuBackend

    from .arena_helpers import refusing

    provider = RecordingProvider()
    arena = Arena(provider)
    monkeypatch.setattr(CpuBackend, "arena", lambda self: arena)
    x = np.random.default_rng(0).standard_normal((2, 8, 16, 16))
    w = np.ones((8, 8, 3, 3))
    conv_forward(x, w, padding=1)
    refusing(provider, refusal_clock, 0.01, limit=1 << 20)
    for _ in range(2):
        with pytest.raises(wsarena.ArenaOutOfMemoryError), arena.lease(1 << 30, stream="elsewhere"):
            pass
    asked = []
    real = arena.defers_growth
    monkeypatch.setattr(arena, "defers_growth", lambda *a, **k: asked.append(a) or real(*a, **k))
    conv_forward(x, w, padding=1)
    assert len(asked) == 1  # within the wait: asked, and no (the first choice needs no growth)
    refusal_clock.now += 120
    for _ in range(5):
        conv_forward(x, w, padding=1)
    assert len(asked) == 1


class RefusingOffBoundaries(CpuBackend):
    """The cpu backend as if its search, on operands off 16-byte boundaries, refused the algorithm it times fastest
    (PartlyTimed's refused: cuDNN's tensor-core kernels refuse such views), which ``operands_key`` tells apart as the
    cudnn backends' does. Times are fixed: each algorithm's place in the heuristic order, in ms. It records what ran."""

    def __init__(self):
        self.ran = []

    def operands_key(self, a, b, out):
        key = tuple(arr.ctypes.data % 16 for arr in (a, b, out))
        return None if key == (0, 0, 0) else key

    def measure(self, pass_, geom, a, b, out, workspace, candidates, stream):
        order = [c.algo for c in self.candidates(pass_, geom)]
        timed = sorted((dataclasses.replace(c, time_ms=order.index(c.algo) + 1.0) for c in candidates),
                       key=lambda c: c.time_ms)
        if self.operands_key(a, b, out) is None:
            return timed
        raise PartlyTimed(timed[1:], [], timed[:1])

    def run(self, pass_, candidate, *args):
        self.ran.append(candidate.algo)
        super().run(pass_, candidate, *args)


def _at(array, offset):
    """A C-contiguous copy of ``array`` whose address is ``offset`` past a 16-byte boundary."""
    flat = np.empty(array.size + 16, array.dtype)
    skip = (offset - flat.ctypes.data) % 16 // array.itemsize
    placed = flat[skip:skip + array.size].reshape(array.shape)
    placed[...] = array
    assert placed.ctypes.data % 16 == offset
    return placed


def test_a_call_whose_search_another_thread_outran_keeps_no_ranking_that_is_not_kept_for_good(monkeypatch):
    """A call on x off a 16-byte boundary whose search dropped the fastest algorithm (refused there) gets a ranking
    that serves operands alike only; another thread's call of the same signature on aligned operands, between the
    first's search and its look at the algorithm cache, keeps the full ranking for good. The first call's record kept
    its own ranking: every later call of the signature, aligned ones too, ran without the fastest algorithm."""
    backend = RefusingOffBoundaries()
    monkeypatch.setattr(ops, "get_backend", lambda name, api=None: backend)
    rng = np.random.default_rng(11)
    x, w = rng.standard_normal(X.shape, dtype=np.float32), rng.standard_normal(W.shape, dtype=np.float32)
    aligned, view, w, ref = _at(x, 0), _at(x, 4), _at(w, 0), ref_conv_forward(x, w)
    outs = [_at(np.empty_like(ref, np.float32), 0) for _ in range(3)]
    first, second = (c.algo for c in backend.candidates("fwd", wsarena._geometry.conv_geometry(x.shape, w.shape))[:2])
    select, raced = ops.select, []

    def racing(*args, **kwargs):
        chosen = select(*args, **kwargs)
        if not raced:  # the other thread's call, all of it, between this one's search and its look at the cache
            raced.append(outs[0])
            conv_forward(aligned, w, out=outs[0])
        return chosen

    monkeypatch.setattr(ops, "select", racing)
    with config(algo_search="exhaustive"):
        assert rel_err(conv_forward(view, w, out=outs[1]), ref) <= TOL["float32"]
        assert backend.ran == [first, second] and rel_err(raced[0], ref) <= TOL["float32"]
        assert rel_err(conv_forward(aligned, w, out=outs[2]), ref) <= TOL["float32"]
    assert backend.ran[-1] == first


class RefusingEverySearch(CpuBackend):
    """The cpu backend as if its search refused every workspace it was given, as cuDNN's FindEx refuses a call as a
    whole (on a view at a misaligned address, timed as it is where memory kept aligned copies from being made); its
    runs refuse the algorithms in ``refuse``. It records what ran."""

    retry_errors = (_Refused,)

    def __init__(self):
        self.refuse, self.ran = set(), []

    def measure(self, *args):
        raise _Refused("the search's call was refused")

    def run(self, pass_, candidate, *args):
        if candidate.algo in self.refuse:
            raise _Refused(f"{candidate.algo} was refused")
        self.ran.append(candidate.algo)
        super().run(pass_, candidate, *args)


def test_a_call_whose_search_timed_nothing_runs_as_the_heuristic_search_runs_it(monkeypatch):
    """Every lease of the exhaustive search refused: the call runs the heuristic order (its first candidate, here),
    with a MemoryFallbackWarning that the search could time nothing, and is right (against float64, 1e-5 of the
    output's largest magnitude); where the heuristic search raises (every algorithm refused), so does it. It raised
    the search's refusal."""
    backend = RefusingEverySearch()
    monkeypatch.setattr(ops, "get_backend", lambda name, api=None: backend)
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal(X.shape, dtype=np.float32), rng.standard_normal(W.shape, dtype=np.float32)
    ref = ref_conv_forward(x, w, padding=1)
    order = [c.algo for c in backend.candidates("fwd", wsarena._geometry.conv_geometry(x.shape, w.shape, padding=1))]
    with config(algo_search="exhaustive"):
        with pytest.warns(MemoryFallbackWarning, match="exhaustive search for fwd of .* could not time any algorithm"):
            assert rel_err(conv_forward(x, w, padding=1), ref) <= TOL["float32"]
        assert backend.ran == order[:1]
        with warnings.catch_warnings():
            warnings.simplefilter("error", MemoryFallbackWarning)  # searched again, said once
            assert rel_err(conv_forward(x, w, padding=1), ref) <= TOL["float32"]
    backend.refuse = set(order)
    for search in ("heuristic", "exhaustive"):
        with config(algo_search=search), pytest.raises(_Refused, match=f"{order[-1]} was refused"):
            conv_forward(x, w, padding=1)


def test_a_dtype_in_the_other_byte_order_is_refused_by_the_ops_and_the_planner_alike():
    """dtype_name(np.dtype(">f4")) named it float32 (NumPy's name hides the byte order), so plan() and conv_geometry
    took the dtype the ops refuse an array of: both refuse it now, and say what it is."""
    other = np.dtype("float32").newbyteorder()  # ">f4" on a little-endian machine, "<f4" on a big-endian one
    note = " (float32 in the other byte order from this machine's, which no backend computes in)"
    x, w = np.ones((1, 2, 5, 5), other), np.ones((3, 2, 3, 3), other)
    with pytest.raises(TypeError) as info:
        conv_forward(x, w)
    assert str(info.value) == (
        f"x must be a floating-point array (float16, bfloat16, float32 or float64), not {other}{note}")
    with pytest.raises(ValueError) as info:
        wsarena.plan([wsarena.ConvLayer("c", (1, 2, 5, 5), (3, 2, 3, 3))], dtype=other, backend="cpu")
    assert str(info.value) == ("dtype must be one of float32, float16, bfloat16, float64, or their NumPy or PyTorch "
                               f"dtype, not {other!r}{note}")
    y = conv_forward(x.astype(np.float32), w.astype(np.float32))  # converted, as the note asks
    with pytest.raises(TypeError) as info:
        conv_forward(x.astype(np.float32), w.astype(np.float32), out=y.astype(other))
    assert str(info.value) == f"out has dtype {other}{note}; this convolution writes float32"
    # a dtype in the machine's byte order is one name to both
    native = np.dtype("float32").newbyteorder("=")
    assert ops._dtype_name("x", native) == wsarena._geometry.dtype_name(native) == "float32"


def test_a_repeated_call_chooses_its_algorithm_once_until_the_algorithm_cache_is_cleared(monkeypatch):
    """A call signature's record keeps the choice: a repeated call asks select() nothing, until cache_clear()
    forgets every choice, records' included."""
    chose = []
    select = ops.select
    monkeypatch.setattr(ops, "select", lambda *args, **kwargs: chose.append(args[1]) or select(*args, **kwargs))
    x, w = np.ones((1, 2, 5, 5), np.float32), np.ones((3, 2, 3, 3), np.float32)
    for _ in range(3):
        np.testing.assert_array_equal(conv_forward(x, w), np.full((1, 3, 3, 3), 18, np.float32))
    assert chose == ["fwd"]
    wsarena.algos.cache_clear()
    np.testing.assert_array_equal(conv_forward(x, w), np.full((1, 3, 3, 3), 18, np.float32))
    np.testing.assert_array_equal(conv_forward(x, w), np.full((1, 3, 3, 3), 18, np.float32))
    assert chose == ["fwd", "fwd"]
