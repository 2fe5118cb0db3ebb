"""The graph-API path on a GPU: plans and variant packs, algo= by engine name, device properties captured against
the live device, and a clean exit. (The reference comparisons, the cap, the exhaustive search, the streams and
the planner's honesty run for both API paths in test_cudnn_backend.py and test_planner.py.)"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from wsarena import config, configure, conv_forward
from wsarena._geometry import conv_geometry
from wsarena.backends import device_properties_backend, get_backend
from wsarena.errors import CudnnApiFallbackWarning

from .reference import ref_conv_forward

pytestmark = pytest.mark.gpu

GEOMS = [
    conv_geometry((8, 64, 28, 28), (64, 64, 3, 3), padding=1),
    conv_geometry((4, 32, 14, 14), (64, 32, 1, 1), stride=2),
    conv_geometry((2, 16, 9, 9, 9), (16, 16, 3, 3, 3), padding=1),
    conv_geometry((4, 28, 28, 32), (32, 3, 3, 1), padding=1, groups=32, layout="NHWC", dtype="float16"),
]


@pytest.fixture
def cp():
    import cupy

    cupy.cuda.Device(0).use()
    configure(cudnn_api="graph")
    return cupy


def _operands(cp, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4, 16, 20, 20))
    w = rng.standard_normal((32, 16, 3, 3))
    return x, w, cp.asarray(x, dtype="float32"), cp.asarray(w, dtype="float32")


def _rel(got, ref):
    return float(np.max(np.abs(got - ref))) / float(np.max(np.abs(ref)))


@pytest.mark.parametrize("reuse", [True, False])
def test_both_variant_pack_modes_compute_the_convolution(cp, monkeypatch, reuse):
    from wsarena.cudnn import graph

    monkeypatch.setattr(graph, "REUSE_VARIANT_PACKS", reuse)
    x, w, xd, wd = _operands(cp)
    ref = ref_conv_forward(x, w, padding=1)
    y = cp.empty(ref.shape, "float32")
    for _ in range(3):  # the same pointers: one pack, reused or rebuilt
        conv_forward(xd, wd, padding=1, out=y)
    assert _rel(cp.asnumpy(y), ref) <= 1e-5
    other = cp.empty_like(y)
    conv_forward(xd, wd, padding=1, out=other)  # new pointers: a new pack
    assert _rel(cp.asnumpy(other), ref) <= 1e-5
    backend = get_backend("cudnn")
    plans = backend._plans.built()
    assert plans and all(len(p._packs) <= graph._VARIANT_PACKS_KEPT for p in plans)
    assert any(len(p._packs) == 2 for p in plans) == reuse


def test_algo_by_engine_name_and_the_cap(cp):
    x, w, xd, wd = _operands(cp)
    backend = get_backend("cudnn")
    geom = conv_geometry(xd.shape, wd.shape, padding=1)
    cands = backend.candidates("fwd", geom)
    assert cands[0].algo.startswith("eng")
    for cand in cands[:3]:
        y = conv_forward(xd, wd, padding=1, algo=cand.algo)
        assert _rel(cp.asnumpy(y), ref_conv_forward(x, w, padding=1)) <= 1e-5
    big = max(cands, key=lambda c: c.workspace_bytes)
    if big.workspace_bytes:
        arena = backend.arena()
        before = arena.stats()
        with config(cap_workspace=big.workspace_bytes - 1), pytest.raises(ValueError, match="above the cap"):
            conv_forward(xd, wd, padding=1, algo=big.algo)
        assert arena.stats() == before  # refused before anything was leased
    y = conv_forward(xd, wd, padding=1, algo="implicit_gemm")  # a legacy name runs through the legacy API
    assert _rel(cp.asnumpy(y), ref_conv_forward(x, w, padding=1)) <= 1e-5


@pytest.mark.parametrize("geom", GEOMS, ids=["3x3", "1x1-strided", "3d", "depthwise-nhwc-half"])
def test_captured_device_properties_plan_what_the_device_plans(cp, geom):
    """The workspace sizes a machine without the GPU computes from its captured properties are the live ones."""
    from wsarena.cudnn import get_handle, graph

    text = graph.device_properties_json(graph.device_properties(handle=get_handle(0)))
    offline = device_properties_backend(text)
    live = get_backend("cudnn")
    for pass_ in ("fwd", "bwd_data", "bwd_filter"):
        got = [(c.algo, c.workspace_bytes) for c in offline.candidates(pass_, geom)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CudnnApiFallbackWarning)
            want = [(c.algo, c.workspace_bytes) for c in live.candidates(pass_, geom)]
        if not all(name.startswith("eng") for name, _ in want):
            want = []  # the device runs it through the legacy API; planning offline finds no engine either
        assert got == want, pass_


def test_views_aligned_to_two_bytes_run_on_the_graph_api(cp):
    """Half NHWC operands at a 2-byte offset: the heuristics' tensor-core engines refuse them (found without a
    GPU: tests/test_graph_backend.py), and a candidate that runs them is among the candidates. The refusals are
    remembered: a second round builds no plan."""
    from wsarena import conv_backward_data, conv_backward_filter

    from .reference import ref_conv_backward_data, ref_conv_backward_filter

    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((2, 9, 9, 8)), rng.standard_normal((16, 3, 3, 8))
    dy = rng.standard_normal((2, 9, 9, 16))

    def shifted(a):  # C-contiguous, 2 bytes past a 16-byte boundary
        base = cp.empty(a.size + 1, "float16")
        view = base[1:].reshape(a.shape)
        view[...] = cp.asarray(a, "float16")
        assert view.data.ptr % 16 == 2
        return view

    xd, wd, dyd = shifted(x), cp.asarray(w, "float16"), shifted(dy)
    x64, w64, dy64 = (cp.asnumpy(a).astype(np.float64) for a in (xd, wd, dyd))
    kw = {"padding": 1, "layout": "NHWC"}
    refs = (ref_conv_forward(x64, w64, **kw), ref_conv_backward_data(dy64, w64, x.shape, **kw),
            ref_conv_backward_filter(x64, dy64, w.shape, **kw))
    backend = get_backend("cudnn")
    builds = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", CudnnApiFallbackWarning)  # on the graph API itself
        for _ in range(2):
            got = (conv_forward(xd, wd, **kw), conv_backward_data(dyd, wd, xd.shape, **kw),
                   conv_backward_filter(xd, dyd, wd.shape, **kw))
            builds.append(backend._plans.builds)
    for y, ref in zip(got, refs):
        assert _rel(cp.asnumpy(y).astype(np.float64), ref) <= 2e-2
    assert builds[1] == builds[0]


def test_algo_runs_a_shifted_view_or_says_why_and_never_tf32(cp):
    """algo= with each candidate on a half NHWC view 2 bytes off a boundary: it runs and matches the reference, or
    is refused for these operands (cuDNN's refusal, or AlignmentWorkspaceError when the view's plan needs more
    workspace than was leased), never as "no algorithm fits". A float32 engine on TF32 tensor cores is refused."""
    from wsarena import cudnn
    from wsarena.backends._graph_plans import conv_problem
    from wsarena.cudnn import graph
    from wsarena.errors import AlignmentWorkspaceError

    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((2, 9, 9, 8)), rng.standard_normal((16, 3, 3, 8))
    base = cp.empty(x.size + 1, "float16")
    xd = base[1:].reshape(x.shape)
    xd[...] = cp.asarray(x, "float16")
    wd = cp.asarray(w, "float16")
    ref = ref_conv_forward(cp.asnumpy(xd).astype(np.float64), cp.asnumpy(wd).astype(np.float64), padding=1,
                           layout="NHWC")
    backend = get_backend("cudnn")
    geom = conv_geometry(xd.shape, wd.shape, padding=1, layout="NHWC", dtype="float16")
    ran, refused = [], []
    for cand in backend.candidates("fwd", geom):
        try:
            y = conv_forward(xd, wd, padding=1, layout="NHWC", algo=cand.algo)
        except (AlignmentWorkspaceError, *backend.retry_errors) as exc:
            refused.append((cand.algo, type(exc).__name__))
            continue
        assert _rel(cp.asnumpy(y).astype(np.float64), ref) <= 2e-2, cand.algo
        ran.append(cand.algo)
    assert ran, refused
    single = conv_geometry((2, 9, 9, 16), (16, 3, 3, 16), padding=1, layout="NHWC")
    op_graph = graph.operation_graph(conv_problem("fwd", single), handle=cudnn.get_handle(0))
    tf32 = [graph.config_name(c) for c in graph.engine_configs(op_graph)
            if cudnn.BackendNumericalNote.TENSOR_CORE in graph.engine_notes(c)[0]]
    if not tf32:
        pytest.skip("cuDNN lists no tensor-core engine for float32 on this GPU")
    xs, ws = cp.ones((2, 9, 9, 16), "float32"), cp.ones((16, 3, 3, 16), "float32")
    with pytest.raises(ValueError, match="does not compute float32 .*TF32"):
        conv_forward(xs, ws, padding=1, layout="NHWC", algo=tf32[0])


def test_the_workspace_query_agrees_with_the_plan_attribute(cp):
    from wsarena import cudnn
    from wsarena.cudnn import graph

    if not cudnn.available("cudnnGetExecutionPlanWorkspaceSize"):
        pytest.skip(f"cuDNN {cudnn.load_library().version_string} has no cudnnGetExecutionPlanWorkspaceSize (9.23+)")
    _, _, xd, wd = _operands(cp)
    y = conv_forward(xd, wd, padding=1)
    handle = cudnn.get_handle(0)
    for plan in get_backend("cudnn")._plans.built():
        pack = graph._variant_pack((xd.data.ptr, wd.data.ptr, y.data.ptr, 0))
        assert cudnn.plan_workspace_size(plan.descriptor, handle, pack) == plan.workspace_bytes


def test_plans_go_before_the_handles(cp):
    from wsarena.cudnn import close_all_handles

    _, _, xd, wd = _operands(cp)
    conv_forward(xd, wd, padding=1)
    # This test's own backend (conftest resets them for each test), whose plans no CUDA graph ran: clear() spares
    # none. A plan a live graph ran, which it spares, is test_capture_gpu.py's child process after close_all_handles.
    cache = get_backend("cudnn")._plans
    plans = cache.built()
    assert plans and cache.kept() == []
    close_all_handles()
    assert all(p.closed for p in plans)
    conv_forward(xd, wd, padding=1)  # and the next call builds them again, with a new handle
    assert get_backend("cudnn")._plans.built()


def test_a_process_on_the_graph_api_exits_cleanly():
    code = (
        "import cupy, wsarena\n"
        "wsarena.configure(cudnn_api='graph')\n"
        "x = cupy.ones((2, 8, 16, 16), cupy.float32); w = cupy.ones((8, 8, 3, 3), cupy.float32)\n"
        "s = cupy.cuda.Stream(non_blocking=True)\n"
        "y = wsarena.conv_forward(x, w, padding=1, stream=s)\n"
        "wsarena.conv_backward_filter(x, y, w.shape, padding=1, stream=s)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=180,
                            cwd=Path(__file__).resolve().parents[1])
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_report_gives_the_workspace_of_the_api_path_in_use(capsys):
    import json

    from wsarena.cli import main

    reports = {}
    for api in ("legacy", "graph"):
        assert main(["report", "resnet50", "--backend", "cudnn", "--cudnn-api", api, "--format", "json"]) == 0
        reports[api] = json.loads(capsys.readouterr().out)
    graph_algos = {layer["fwd"]["algo"] for layer in reports["graph"]["layers"]}
    assert all(a.startswith("eng") for a in graph_algos)
    assert not any(layer["fwd"]["algo"].startswith("eng") for layer in reports["legacy"]["layers"])
    for report in reports.values():
        assert report["arena_bytes"] == max(layer[p]["workspace_bytes"] for layer in report["layers"]
                                            for p in ("fwd", "bwd_data", "bwd_filter"))


@pytest.mark.parametrize("api", ["legacy", "graph"])
def test_a_first_exhaustive_search_on_a_shifted_view_times_what_aligned_operands_run(cp, api, tmp_path):
    """The search times on aligned copies of a view 2 bytes off a boundary (timing_operands), so the candidates
    that refuse the view are timed, not saved as rejected for the geometry; the view still runs (on the first
    candidate that takes it) and matches the reference."""
    import json

    from wsarena import algos

    x = np.random.default_rng(5).standard_normal((2, 9, 9, 8))
    w = np.random.default_rng(6).standard_normal((16, 3, 3, 8))
    base = cp.empty(x.size + 1, "float16")
    xd = base[1:].reshape(x.shape)
    xd[...] = cp.asarray(x, "float16")
    wd = cp.asarray(w, "float16")
    backend = get_backend("cudnn", api)
    a, _, out = backend.timing_operands(xd, wd, cp.empty((2, 9, 9, 16), "float16"))
    assert a.data.ptr % 16 == 0 and out.data.ptr % 16 == 0 and bool((a == xd).all())
    assert all(t is wd for t in backend.timing_operands(wd, wd, wd))  # aligned already: the operands themselves
    algos.cache_clear()
    with config(cudnn_api=api, algo_search="exhaustive", cache_dir=tmp_path):
        y = conv_forward(xd, wd, padding=1, layout="NHWC")
    ref = ref_conv_forward(cp.asnumpy(xd).astype(np.float64), w.astype("float16").astype(np.float64), padding=1,
                           layout="NHWC")
    assert _rel(cp.asnumpy(y).astype(np.float64), ref) <= 2e-2
    (entry,) = (tmp_path / "search").glob("*.json")
    results = json.loads(entry.read_text())["results"]
    timed = [r for r in results if r["time_ms"] is not None]
    # a search on the view itself leaves out every candidate that refuses it: on an H100, the tensor-core ones
    assert len(timed) >= len(results) // 2, results
