"""What the README tells a user to type: its first two commands, the cap's three forms (``configure()``,
``WSARENA_CAP_WORKSPACE``, ``--cap-workspace``), which must give one and the same cap, and its Python blocks, each
run as written (those that need CUDA, marked ``gpu``, on a GPU)."""

from __future__ import annotations

import copy
import json
import os
import shlex
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import wsarena

from .cli_helpers import run_cli

ROOT = Path(__file__).resolve().parent.parent
PASSES = ("fwd", "bwd_data", "bwd_filter")


def _first_commands() -> list[list[str]]:
    """The README's first code block, each command line split at ``&&`` into its steps (comments left out)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index("```bash\n") + len("```bash\n")
    block = readme[start:readme.index("```", start)]
    return [[step.strip() for step in line.split("&&")] for line in block.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_readme_first_commands_name_what_the_package_has_and_the_report_runs():
    """Each line makes a venv, activates it and installs the package (with an extra the package defines), then runs
    the main job or the tests; the main job, run as written, prints the totals the README's first paragraph
    promises (shared against unshared)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)
    lines = _first_commands()
    assert len(lines) == 2
    ran = []
    for steps in lines:
        assert steps[:2] == ["python3 -m venv .venv", ". .venv/bin/activate"], steps
        install = shlex.split(steps[2])
        assert install[:2] == ["pip", "install"], steps
        target = install[-1]
        if "[" in target:  # ".[test]": an extra of this package
            extras = target[target.index("[") + 1:target.index("]")].split(",")
            assert set(extras) <= set(project["project"]["optional-dependencies"]), target
        command = shlex.split(steps[3])
        if command[0] == "wsarena":
            assert project["project"]["scripts"]["wsarena"] == "wsarena.cli:main"
            r = run_cli(*command[1:])  # python -m wsarena: the same main()
            assert (r.returncode, r.stderr) == (0, ""), r.stderr
            totals = r.stdout.strip().splitlines()[-3:]
            assert totals[0].startswith("unshared: one workspace per layer and pass"), totals
            assert totals[1].startswith("wsarena arena: the largest workspace per stream"), totals
            assert totals[2].startswith("saved:"), totals
            ran.append("report")
        else:
            assert command == ["python", "-m", "pytest"], steps
            assert "pytest" in " ".join(project["project"]["optional-dependencies"][extras[0]])
            assert project["tool"]["pytest"]["ini_options"]["testpaths"] == ["tests"]
            ran.append("tests")
    assert ran == ["report", "tests"]


def _run_model(model: str) -> dict[str, Any]:
    """The plan of ``model`` under the settings in force, and the largest lease its three passes take when run
    through the ops on NumPy arrays of its shapes (batch 1, as planned)."""
    layers = wsarena.load_model(model)
    rng = np.random.default_rng(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", wsarena.WorkspaceCapWarning)
        plan = wsarena.plan(layers, backend="cpu")
        for layer in layers:
            g = layer.geometry()
            x = rng.random(g.input_shape, dtype=np.float32)
            w = rng.random(g.weight_shape, dtype=np.float32)
            args = {"stride": g.stride, "padding": g.padding, "dilation": g.dilation, "groups": g.groups}
            y = wsarena.conv_forward(x, w, **args)
            wsarena.conv_backward_data(y, w, input_shape=x.shape, **args)
            wsarena.conv_backward_filter(x, y, weight_shape=w.shape, **args)
    return {"plan": plan.to_dict(), "high_water": wsarena.get_arena("cpu").stats().high_water_bytes}


def _run_model_in_child(model: str, env: dict[str, str]) -> dict[str, Any]:
    """:func:`_run_model` in a new process, as a user's script runs, with ``env`` and no other WSARENA_* variable."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("WSARENA_")}
    full_env.update(env)
    code = "import json, sys; from tests.test_readme import _run_model; print(json.dumps(_run_model(sys.argv[1])))"
    r = subprocess.run([sys.executable, "-c", code, model], capture_output=True, text=True, env=full_env, cwd=ROOT,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _choices(report: dict[str, Any]) -> list[tuple[str, str, int]]:
    """Each layer's algorithm and workspace per pass, from a report's JSON (``Plan.to_dict()``)."""
    return [(layer["name"], layer[p]["algo"], layer[p]["workspace_bytes"])
            for layer in report["layers"] for p in PASSES]


def test_the_cap_set_in_python_in_the_environment_or_on_the_command_line_is_one_cap(tmp_path):
    """``wsarena.configure(cap_workspace="4KiB")``, ``WSARENA_CAP_WORKSPACE=4KiB`` and ``--cap-workspace 4KiB`` (the
    README's three ways) each bound every call's workspace, the ops' as well as the plan's, and choose alike."""
    model = tmp_path / "model.json"
    model.write_text(json.dumps([
        {"name": "c3x3", "input_shape": [1, 8, 16, 16], "weight_shape": [8, 8, 3, 3], "padding": 1},
        {"name": "c1d", "input_shape": [1, 4, 64], "weight_shape": [6, 4, 5], "stride": 2},
    ]))
    cap = 4 << 10  # c3x3's passes need more, c1d's fit: both kinds of choice
    uncapped = _run_model_in_child(str(model), {})
    assert uncapped["plan"]["cap_workspace_bytes"] is None
    assert uncapped["high_water"] > cap and max(ws for *_, ws in _choices(uncapped["plan"])) > cap  # a cap to obey

    environment = _run_model_in_child(str(model), {"WSARENA_CAP_WORKSPACE": "4KiB"})
    wsarena.configure(cap_workspace="4KiB")
    python = _run_model(str(model))
    r = run_cli("report", str(model), "--backend", "cpu", "--format", "json", "--cap-workspace", "4KiB")
    assert r.returncode == 0, r.stderr
    command_line = json.loads(r.stdout)

    for run in (environment, python):
        assert run["plan"]["cap_workspace_bytes"] == cap
        assert run["high_water"] == max(ws for *_, ws in _choices(run["plan"])) > 0  # the ops leased as planned
    assert command_line["cap_workspace_bytes"] == cap
    choices = _choices(command_line)
    assert all(ws <= cap for *_, ws in choices)
    assert _choices(environment["plan"]) == _choices(python["plan"]) == choices


def test_tunes_apply_line_exported_runs_the_tuned_choices(tmp_path):
    """``export $(wsarena tune MODEL --apply)``: the line is NAME=VALUE words a shell exports, and the next command
    runs under the recommended cap with the algorithms the curve timed there (those of ``report --max-slowdown``,
    the plan at that cap), read from the search cache tuning filled. Under the cap alone the default heuristic
    search chose other algorithms for most of these calls, and the step was not the one the curve promised."""
    model = tmp_path / "model.json"
    model.write_text(json.dumps([
        {"name": "a", "input_shape": [2, 8, 16, 16], "weight_shape": [16, 8, 3, 3]},
        {"name": "b", "input_shape": [2, 16, 16, 16], "weight_shape": [16, 16, 1, 1]},
        {"name": "c", "input_shape": [2, 16, 8, 8], "weight_shape": [32, 16, 3, 3], "stride": 2, "padding": 1},
    ]))
    cache = {"WSARENA_CACHE_DIR": str(tmp_path / "cache")}
    r = run_cli("tune", str(model), "--backend", "cpu", "--apply", env=cache)
    assert r.returncode == 0, r.stderr
    (line,) = r.stdout.splitlines()
    settings = dict(word.split("=", 1) for word in shlex.split(line))
    assert settings.keys() == {"WSARENA_CAP_WORKSPACE", "WSARENA_ALGO_SEARCH"}, line

    def algorithms(*argv: str, env: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
        r = run_cli("report", str(model), "--backend", "cpu", "--format", "json", *argv, env={**cache, **env})
        assert r.returncode == 0, r.stderr
        report = json.loads(r.stdout)
        return report, [layer[p]["algo"] for layer in report["layers"] for p in PASSES]

    tuned, expected = algorithms("--max-slowdown", "2%", env={})
    applied, chosen = algorithms(env=settings)
    assert applied["cap_workspace_bytes"] == tuned["cap_workspace_bytes"] == int(settings["WSARENA_CAP_WORKSPACE"])
    assert chosen == expected and applied["arena_bytes"] == tuned["arena_bytes"]


def _readme_sentence(start: str, end: str) -> str:
    """The README's text from ``start`` up to ``end``, its lines joined."""
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split("\n"))
    begin = readme.index(start)
    return readme[begin:readme.index(end, begin)]


def test_the_reports_json_keys_are_those_the_readme_lists(capsys, tmp_path):
    """"`--format json` prints one JSON object: ..." names every top-level key of a report, the per-pass keys of a
    layer, and `max_slowdown` only with `--max-slowdown`: nothing more, nothing less."""
    import re

    from .cli_helpers import run_main

    text = _readme_sentence("`--format json` prints one JSON object: the header", "It reads back")
    spans = re.findall(r"`([^`]+)`", text)
    named = {span for span in spans if re.fullmatch(r"[a-z_]+", span)}
    named |= {key for span in spans if span.startswith("{") for key in re.findall(r'"(\w+)"', span)}
    model = tmp_path / "model.json"
    model.write_text(json.dumps([{"name": "c", "input_shape": [1, 2, 8, 8], "weight_shape": [2, 2, 3, 3]}]))
    for extra in ([], ["--max-slowdown", "5%"]):
        code, out, err = run_main(capsys, "report", str(model), "--backend", "cpu", "--format", "json", *extra)
        assert code == 0, err
        report = json.loads(out)
        keys = set(report) | set(report["layers"][0]["fwd"])
        layer_keys = {"name", "input_shape", "weight_shape", "stride", "padding", "dilation", "groups"}
        assert set(report["layers"][0]) == layer_keys | set(PASSES)  # "the keys of a JSON layer", and the passes
        assert named - {"max_slowdown"} == keys - {"max_slowdown"}, named ^ keys
        assert ("max_slowdown" in report) == bool(extra) and "max_slowdown" in named


def test_the_tune_json_keys_are_those_the_readme_lists(capsys, tmp_path):
    """"`--format json` prints one object: the header keys of `report` but ..." names every top-level key of
    ``wsarena tune``'s JSON and every key of a curve point: nothing more, nothing less. `report` (the command) and
    `cap_workspace_bytes` (named as left out of the header; a curve point's key) are not top-level keys."""
    import re

    from .cli_helpers import run_main

    text = _readme_sentence("`--format json` prints one object: the header keys of `report`", "The table's header")
    spans = re.findall(r"`([^`]+)`", text)
    named = {span for span in spans if re.fullmatch(r"[a-z_]+", span)} - {"report", "cap_workspace_bytes"}
    point_spans = [span for span in spans if span.startswith("{")]
    assert len(point_spans) == 1, point_spans
    point_keys = set(re.findall(r'"(\w+)"', point_spans[0]))
    model = tmp_path / "model.json"
    model.write_text(json.dumps([{"name": "c", "input_shape": [1, 2, 8, 8], "weight_shape": [2, 2, 3, 3]}]))
    code, out, err = run_main(capsys, "tune", str(model), "--backend", "cpu", "--format", "json")
    assert code == 0, err
    tuned = json.loads(out)
    assert named == set(tuned), named ^ set(tuned)
    assert all(set(point) == point_keys for point in tuned["curve"]), tuned["curve"]


def _python_blocks() -> list[str]:
    """The README's ``python`` code blocks, in order."""
    import re

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.findall(r"^```python\n(.*?)^```$", readme, flags=re.DOTALL | re.MULTILINE)


# Each README block by the start of its first line: those the tests below run here, and those they run on a GPU
# (CUDA streams and graphs, RMM), skipped without one.
_RUN_HERE = {
    "ops": "import numpy as np",
    "convert": "import wsarena, wsarena.torch",
    "layers": "import json, torch, wsarena, wsarena.torch",
    "settings": "wsarena.configure(",
    "arena": "arena = wsarena.get_arena(",
}
_RUN_ON_GPU = {
    "torch graph": "side = torch.cuda.Stream()",
    "rmm": "import cupy, rmm, wsarena",
    "capture": "step()",
}


def _block(name: str) -> str:
    """The README block ``name``, as written: the one block that starts as ``_RUN_HERE`` or ``_RUN_ON_GPU`` says."""
    start = {**_RUN_HERE, **_RUN_ON_GPU}[name]
    (block,) = [b for b in _python_blocks() if b.startswith(start)]
    return block


def _run_block(name: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """Run the README block ``name`` as written, in ``namespace`` (the names it leaves undefined), and return it."""
    exec(compile(_block(name), "README.md", "exec"), namespace)  # noqa: S102 - the README's own code, as a user runs it
    return namespace


def test_every_python_block_of_the_readme_compiles_and_is_one_these_tests_run():
    """Each start names one block, and together they name every block: those needing a GPU are the
    ``torch.cuda.graph`` capture, RMM under CuPy and ``wsarena.capture()``, which the ``gpu`` tests below run."""
    blocks = _python_blocks()
    assert len(blocks) == len(_RUN_HERE) + len(_RUN_ON_GPU)
    for block in blocks:
        compile(block, "README.md", "exec")
    named = [_block(name) for name in (*_RUN_HERE, *_RUN_ON_GPU)]
    assert sorted(named) == sorted(blocks)
    assert "with torch.cuda.graph(graph, stream=side):" in _block("torch graph")
    assert "rmm.reinitialize(pool_allocator=True" in _block("rmm")
    assert "with wsarena.capture() as graph:" in _block("capture")


def _positive_sums_error(got: Any, ref: Any) -> float:
    from .reference import error_for_sums

    return error_for_sums(got, ref, ref)  # operands of np.random.rand: no term is negative, the sums are the scale


def test_the_ops_block_runs_as_written_and_convolves_as_the_float64_reference():
    """The README's first Python block, as written: its three passes agree with tests/reference.py within 1e-5 of
    the sums (float32 sums of 576 terms)."""
    from .reference import ref_conv_backward_data, ref_conv_backward_filter, ref_conv_forward

    ns = _run_block("ops", {})
    x, w, y = ns["x"], ns["w"], ns["y"]
    assert _positive_sums_error(y, ref_conv_forward(x, w, padding=1)) <= 1e-5
    assert _positive_sums_error(ns["dx"], ref_conv_backward_data(y, w, x.shape, padding=1)) <= 1e-5
    assert _positive_sums_error(ns["dw"], ref_conv_backward_filter(x, y, w.shape, padding=1)) <= 1e-5


def test_the_settings_and_arena_blocks_run_as_written():
    """The settings block leaves its cap configured; the arena block's lease is of the size asked, and its arena
    holds nothing once trimmed."""
    ns = _run_block("settings", {"wsarena": wsarena})
    config = wsarena.get_config()
    assert (config.cap_workspace, config.algo_search, config.backend) == (256 << 20, "heuristic", "auto")
    _run_block("arena", ns)
    assert ns["ws"].nbytes == 1 << 20
    stats = ns["arena"].stats()
    assert (stats.capacity_bytes, stats.leases, stats.high_water_bytes) == (0, 0, 1 << 20)  # reserved, trimmed


def _small_model(torch: Any) -> Any:
    """The model the PyTorch blocks run on, its weights seeded: convolutions with and without bias, batch norm, a
    transposed convolution."""
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.ConvTranspose2d(8, 4, 2, stride=2),
    )


def test_the_pytorch_blocks_run_as_written_train_as_pytorch_and_plan_the_model(monkeypatch, tmp_path, capsys):
    """``convert`` and its training loop, on a float64 model (convolutions with and without bias, batch norm, a
    transposed convolution), train it as PyTorch's own convolutions do (1e-10); the block that plans a model prints
    the plan's arena and writes a ``model.json`` that reads back as the same layers, leaving no file open."""
    torch = pytest.importorskip("torch")
    from torch import nn

    import wsarena.torch as wt

    model = _small_model(torch).double()
    reference = copy.deepcopy(model)
    loader = [(torch.randn(2, 3, 16, 16, dtype=torch.float64), torch.randn(2, 4, 16, 16, dtype=torch.float64))
              for _ in range(3)]
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _run_block("convert", {"model": model, "loader": loader, "loss_fn": loss_fn, "optimizer": optimizer})
    assert [type(m) for m in model if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d))] == [
        wt.Conv2d, wt.Conv2d, wt.ConvTranspose2d]
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, target in loader:
        optimizer.zero_grad()
        loss_fn(reference(x), target).backward()
        optimizer.step()
    for trained, expected in zip(model.state_dict().values(), reference.state_dict().values(), strict=True):
        assert torch.allclose(trained, expected, rtol=0, atol=1e-10)

    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ns = _run_block("layers", {"model": model.float()})  # converted, in the dtype of the block's input
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
    layers = wsarena.load_model("model.json")
    assert layers == ns["layers"] and [layer.name for layer in layers] == ["0", "3", "5"]
    assert capsys.readouterr().out == f"{wsarena.plan(layers, batch=32).arena_bytes}\n"


def _torch_on_a_gpu() -> Any:
    """PyTorch, where it sees a CUDA device (else the test is skipped, saying which is missing)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    return torch


@pytest.mark.gpu
def test_the_torch_cuda_graph_block_runs_as_written_and_replays_pytorchs_own_step():
    """The block that captures a step with ``torch.cuda.graph`` on a stream of its own, on a converted float32 model
    (convolutions with and without bias, batch norm, a transposed convolution): its replay on ``next_x`` gives the
    loss and gradients PyTorch's own convolutions give there (TF32 off; within 1e-4 of the largest, as
    test_torch_gpu.py), no captured call fell back for want of workspace, and the graph pinned the workspace of
    ``side`` where the calls took any."""
    torch = _torch_on_a_gpu()
    from torch import nn

    import wsarena.torch as wt

    reference = _small_model(torch).cuda()
    model = wt.convert(copy.deepcopy(reference))
    static_x, next_x, static_target = (torch.randn(2, c, 16, 16, device="cuda") for c in (3, 3, 4))
    loss_fn = nn.MSELoss()
    allow_tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        loss = loss_fn(reference(next_x), static_target)
        loss.backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", wsarena.CaptureFallbackWarning)
            ns = _run_block("torch graph", {"torch": torch, "model": model, "loss_fn": loss_fn, "static_x": static_x,
                                            "static_target": static_target, "next_x": next_x})
        ns["side"].synchronize()
    finally:
        torch.backends.cudnn.allow_tf32 = allow_tf32
    assert [str(w.message) for w in caught if issubclass(w.category, wsarena.CaptureFallbackWarning)] == []
    assert type(model[0]) is wt.Conv2d and type(model[5]) is wt.ConvTranspose2d
    # item(), not float(): PyTorch warns when float() takes a tensor that requires grad, as both losses do
    assert abs(ns["static_loss"].item() - loss.item()) <= 1e-4 * abs(loss.item())
    grads = {name: p.grad for name, p in model.named_parameters()}
    expected = {name: p.grad for name, p in reference.named_parameters()}
    assert grads.keys() == expected.keys()
    scale = max(float(g.abs().max()) for g in expected.values())
    assert [name for name, g in expected.items() if float((grads[name] - g).abs().max()) > 1e-4 * scale] == []
    stats = wsarena.get_arena(static_x.device.index).stats()
    side = stats.streams.get(ns["side"].cuda_stream)
    assert (side is not None and side.pinned_bytes > 0) == (stats.high_water_bytes > 0)  # tiny calls may take none


@pytest.mark.gpu
def test_the_rmm_block_runs_as_written_and_the_arena_takes_its_memory_from_rmms_pool():
    """The block that makes RMM CuPy's allocator: the device's arena made after it is a ``CupyProvider``'s whose
    buffers come from the RMM pool the block made (counted by a statistics adaptor over the pool), and a convolution
    through it agrees with the float64 reference. CuPy's allocator and RMM's resource are put back after."""
    pytest.importorskip("cupy", reason="CuPy is not installed")
    try:  # missing, or installed but not importable (built for another CUDA); importorskip's exc_type needs pytest 8.2
        import rmm.allocators.cupy
    except ImportError as exc:
        pytest.skip(f"RAPIDS RMM cannot be imported: {exc}")
    import cupy
    import rmm
    from rmm.allocators.cupy import rmm_cupy_allocator

    from wsarena.arena import CupyProvider, reset_arenas

    from .reference import ref_conv_forward

    resource, allocator = rmm.mr.get_current_device_resource(), cupy.cuda.get_allocator()
    try:
        _run_block("rmm", {})
        pool = rmm.mr.get_current_device_resource()
        assert isinstance(pool, rmm.mr.PoolMemoryResource) and cupy.cuda.get_allocator() is rmm_cupy_allocator
        assert wsarena.get_config().allocator == "cupy"
        counted = rmm.mr.StatisticsResourceAdaptor(pool)
        rmm.mr.set_current_device_resource(counted)

        def current_bytes() -> int:
            counts = counted.allocation_counts  # a Statistics object; a dict before RMM 24.10
            return int(counts["current_bytes"] if isinstance(counts, dict) else counts.current_bytes)

        arena = wsarena.get_arena(cupy.cuda.Device().id)
        assert type(arena.provider) is CupyProvider
        before = current_bytes()
        arena.reserve(8 << 20, stream=cupy.cuda.get_current_stream())
        assert current_bytes() - before >= 8 << 20
        rng = np.random.default_rng(0)
        x, w = rng.random((2, 4, 9, 9), dtype=np.float32), rng.random((6, 4, 3, 3), dtype=np.float32)
        y = cupy.asnumpy(wsarena.conv_forward(cupy.asarray(x), cupy.asarray(w), padding=1))
        assert _positive_sums_error(y, ref_conv_forward(x, w, padding=1)) <= 1e-5
    finally:
        try:
            reset_arenas()  # its buffers go back to RMM before RMM's resource and CuPy's allocator are put back
            cupy.cuda.Device().synchronize()
        finally:  # put back even where that raised, so that the tests after run on CuPy's own allocator
            cupy.cuda.set_allocator(allocator)
            rmm.mr.set_current_device_resource(resource)


@pytest.mark.gpu
def test_the_capture_block_runs_as_written_and_its_launches_run_the_step():
    """The block that captures ``step()`` with ``wsarena.capture()`` and launches the graph 1,000 times, on a step of
    the three passes (float32) whose input is its own call count times a fixed array: the count is 1,001 (the eager
    call and the launches; the capture recorded the step without running it), the last launch's results agree with
    the float64 reference for that input, the capture's stream held a buffer as large as the eager stream's, and
    the graph, closed, pins nothing (once CUDA has let go of it)."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    import gc
    import time

    from .reference import ref_conv_backward_data, ref_conv_backward_filter, ref_conv_forward

    rng = np.random.default_rng(0)
    base, w = rng.random((2, 4, 9, 9), dtype=np.float32), rng.random((6, 4, 3, 3), dtype=np.float32)
    count = cupy.zeros((), cupy.float32)
    base_d, w_d = cupy.asarray(base), cupy.asarray(w)
    x, y = cupy.empty(base.shape, cupy.float32), cupy.empty((2, 6, 9, 9), cupy.float32)
    dx, dw = cupy.empty_like(x), cupy.empty_like(w_d)

    def step() -> None:
        cupy.add(count, 1, out=count)
        cupy.multiply(base_d, count, out=x)
        wsarena.conv_forward(x, w_d, padding=1, out=y)
        wsarena.conv_backward_data(y, w_d, x.shape, padding=1, out=dx)
        wsarena.conv_backward_filter(x, y, w_d.shape, padding=1, out=dw)
        stream = cupy.cuda.get_current_stream()
        if not stream.is_capturing():
            stream.synchronize()  # the eager step is over before the launches, on a stream that does not wait for it

    arena = wsarena.get_arena(cupy.cuda.Device().id)
    eager_stream = cupy.cuda.get_current_stream()
    arena.reserve(1 << 20, stream=eager_stream)  # a workspace the eager stream holds, whatever its calls need
    cupy.cuda.Device().synchronize()  # the operands, written on the legacy default stream
    ns = _run_block("capture", {"wsarena": wsarena, "step": step})
    graph = ns["graph"]
    graph.stream.synchronize()
    assert isinstance(graph, wsarena.CapturedGraph) and graph.closed and float(count) == 1001
    x64 = base.astype(np.float64) * 1001
    y64 = ref_conv_forward(x64, w, padding=1)
    assert _positive_sums_error(cupy.asnumpy(y), y64) <= 1e-5
    assert _positive_sums_error(cupy.asnumpy(dx), ref_conv_backward_data(y64, w, x64.shape, padding=1)) <= 1e-5
    assert _positive_sums_error(cupy.asnumpy(dw), ref_conv_backward_filter(x64, y64, w.shape, padding=1)) <= 1e-5
    streams = arena.stats().streams
    eager = max(held.capacity_bytes for key, held in streams.items() if key != graph.stream.ptr)
    assert streams[graph.stream.ptr].capacity_bytes >= eager >= 1 << 20  # the eager stream's, rounded as a growth
    deadline = time.monotonic() + 5.0  # CUDA runs a dropped graph's destructors on a thread of its own
    while arena.stats().pinned_bytes and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert arena.stats().pinned_bytes == 0


def test_the_settings_table_has_every_setting_with_its_variable_and_default():
    """The README's settings table has one row per field of ``wsarena.Config``, each with the environment variable
    the settings read for it and its default; every ``WSARENA_*`` name the package's code holds is in the README."""
    import dataclasses
    import re

    from wsarena._config import _ENV

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## The cap and other settings"):readme.index("How the settings are read")]
    rows = {m[1]: (m[2], m[3]) for m in re.finditer(r"^\| `(\w+)` \| `(\w+)` \| (.*) \|$", section, re.MULTILINE)}
    fields = {f.name for f in dataclasses.fields(wsarena.Config)}
    assert set(rows) == fields, set(rows) ^ fields
    assert {key: var for key, (var, _) in rows.items()} == _ENV
    defaults = wsarena.Config(cache_dir="off")  # the rest as built in
    for key, (_, values) in rows.items():
        if key == "cache_dir":
            continue  # the user's cache folder, which differs by machine: the row says it in words
        default = getattr(defaults, key)
        if default is None or isinstance(default, bool):
            words = ["none"] if default is None else ["on" if default else "off"]
        elif isinstance(default, int):
            words = [str(default), wsarena.format_size(default).replace(" ", "")]
        else:
            words = [default]
        said = "|".join(map(re.escape, words))
        # "`x` (default", "x, the default", "default 1024", "default `64MiB`"
        assert re.search(rf"`?({said})`?,? \(?(the )?default|default `?({said})`?[ ),;]", values), (key, values)
    names = {name for path in (ROOT / "wsarena").rglob("*.py")
             for name in re.findall(r"WSARENA_[A-Z_]+", path.read_text(encoding="utf-8"))}
    assert names and [name for name in sorted(names) if name not in readme] == []


def test_a_switchs_row_names_what_python_takes_beside_the_variables_words():
    """A switch (``debug``) is ``1``/``on``/... in its environment variable but ``True`` or ``False`` in Python, where
    ``config()`` refuses the variable's words: its row of the settings table names both Python values."""
    import dataclasses
    import re

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## The cap and other settings"):readme.index("How the settings are read")]
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `(\w+)` \| `\w+` \| (.*) \|$", section, re.MULTILINE)}
    defaults = wsarena.Config(cache_dir="off")
    switches = [f.name for f in dataclasses.fields(wsarena.Config) if isinstance(getattr(defaults, f.name), bool)]
    assert "debug" in switches
    for key in switches:
        assert "`True`" in rows[key] and "`False`" in rows[key], rows[key]
        for word in ("1", "on", 1):
            with pytest.raises(TypeError, match=f"{key} must be True or False"), wsarena.config(**{key: word}):
                pass
        with wsarena.config(**{key: True}):
            assert getattr(wsarena.get_config(), key) is True


def test_the_errors_the_readme_calls_wsarena_errors_are():
    """"Those classes, `ModelError` and cuDNN's errors (`wsarena.cudnn`) are all `wsarena.WsarenaError`s": every
    exception (not a warning) that ``wsarena.errors``, ``wsarena.models`` and ``wsarena.cudnn`` export."""
    import wsarena.cudnn
    import wsarena.errors
    import wsarena.models

    assert "`wsarena.WsarenaError`s" in _readme_sentence("**Bad input.**", "On the command line")
    found = [getattr(module, name) for module in (wsarena.errors, wsarena.models, wsarena.cudnn)
             for name in module.__all__]
    errors = [c for c in found if isinstance(c, type) and issubclass(c, Exception) and not issubclass(c, Warning)]
    assert wsarena.models.ModelError in errors and wsarena.cudnn.CudnnError in errors and len(errors) > 20
    assert [c.__name__ for c in errors if not issubclass(c, wsarena.WsarenaError)] == []


def test_the_reliability_tests_that_need_a_gpu_are_those_the_readme_names():
    """"all of them but `tests/test_capture_gpu.py`, which needs a GPU, run in CI, on the CPU": of the test files the
    Reliability table names, those marked ``gpu`` as a whole (skipped without a GPU) are the ones said to need one."""
    import ast
    import re

    def marked_gpu(path: str) -> bool:
        """Whether the module's ``pytestmark``, one mark or a list of them, has ``pytest.mark.gpu``."""
        for node in ast.parse((ROOT / path).read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
                return re.search(r"\bpytest\.mark\.gpu\b", ast.unparse(node.value)) is not None
        return False

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("## Reliability"):readme.index("**Bad input.**")]
    intro, rows = table.split("| promise |", 1)
    named = set(re.findall(r"`(tests/test_\w+\.py)`", rows))
    assert len(named) > 10 and all((ROOT / path).is_file() for path in named), named
    gpu_only = {path for path in named if marked_gpu(path)}
    assert gpu_only == set(re.findall(r"`(tests/test_\w+\.py)`, which needs a GPU", " ".join(intro.split())))


def test_every_public_name_is_named_in_the_readme_or_docs():
    """Each name of ``wsarena.__all__``, ``wsarena.arena.__all__`` and ``wsarena.torch.__all__`` is written in the
    README or docs/*.md, whole (``Conv1d/2d/3d`` names the three), where a user looks for it."""
    import re

    import wsarena.arena

    modules = [wsarena, wsarena.arena]
    try:
        import wsarena.torch
    except ImportError:  # an install without PyTorch: its names are checked where it is
        pass
    else:
        modules.append(wsarena.torch)
    text = "\n".join(path.read_text(encoding="utf-8") for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    text = re.sub(r"\b(\w+)1d/2d/3d\b", r"\g<1>1d \g<1>2d \g<1>3d", text)
    missing = [f"{module.__name__}.{name}" for module in modules for name in module.__all__
               if not re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text)]
    assert missing == []
