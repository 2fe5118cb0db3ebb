"""The graph-API cudnn backend without a GPU: its plan cache with fakes, its routing and fallback with fakes, and
the whole planning path for real against device properties (cuDNN builds plans for an H100 on this machine).

GPU runs of the same backend are in test_cudnn_backend.py and test_planner.py, parametrized over ``cudnn_api``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import wsarena
from wsarena import algos, config, configure
from wsarena._geometry import conv_geometry
from wsarena._search_env import api_path
from wsarena.backends import Candidate, device_properties_backend
from wsarena.backends._cudnn_backend import CudnnBackend
from wsarena.backends._graph_plans import ALIGNED, PlanCache, alignment, is_engine_name
from wsarena.cli import main
from wsarena.errors import BackendUnavailableError, CudnnApiFallbackWarning

from .cudnn_probe import driver

H100 = Path(__file__).parent / "data" / "h100-handwritten.json"
GEOM = conv_geometry((2, 4, 9, 9), (6, 4, 3, 3), padding=1)


class FakePlan:
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
    assert algos._key(graph_backend, "fwd", GEOM, "heuristic", None) != algos._key(legacy, "fwd", GEOM, "heuristic",
                                                                                  None)


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


def test_a_plan_for_an_h100_from_its_properties(finalizing):
    layers = wsarena.load_model("resnet50")[:6]
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


def test_report_device_properties(finalizing, capsys):
    with config(cudnn_api="legacy"):  # the flag needs no setting: it always takes the graph API
        assert main(["report", "resnet50", "--batch", "4", "--device-properties", str(H100), "--format", "json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert err == "" and report["backend"] == "cudnn" and report["device"].startswith("NVIDIA H100")
    assert report["layers"][0]["fwd"]["algo"].startswith("eng") and report["arena_bytes"] > 0
    assert main(["report", "resnet50", "--device-properties", "/nonexistent.json"]) == 2
    assert "nonexistent" in capsys.readouterr().err


def test_report_device_properties_without_the_driver_library_says_why():
    """A machine with no libcuda.so.1 at all (this one, outside the tests' stand-in): exit 3, one clear line."""
    if driver.real_driver_library():
        pytest.skip("this machine has the NVIDIA driver library")
    result = subprocess.run(
        [sys.executable, "-m", "wsarena", "report", "resnet50", "--device-properties", str(H100)],
        capture_output=True, text=True, timeout=120, check=False, cwd=Path(__file__).parents[1],
    )
    assert result.returncode == 3 and result.stdout == ""
    assert "wsarena: error: planning against device properties needs" in result.stderr
    assert "libcuda.so.1" in result.stderr.splitlines()[-1]


def test_the_cudnn_api_flag(capsys):
    assert main(["report", "resnet50", "--backend", "cpu", "--cudnn-api", "graph", "--passes", "fwd"]) == 0
    capsys.readouterr()
    assert main(["report", "resnet50", "--cudnn-api", "v8"]) == 2
    assert "--cudnn-api" in capsys.readouterr().err
