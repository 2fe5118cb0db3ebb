"""bench/bench_search_cache.py on the CPU, with a one-layer model: a measuring process that runs past its time limit
or fails costs its own figures, not those the others measured."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_search_cache", ROOT / "bench" / "bench_search_cache.py")
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

LAYERS = {"layers": [{"name": "c", "input_shape": [1, 2, 6, 6], "weight_shape": [3, 2, 3, 3]}]}


def run_bench(tmp_path: Path, monkeypatch, capsys, *extra: str, model: bool = True) -> tuple[int, str, dict]:
    """bench_search_cache.py's main on LAYERS (a model file that is not there unless ``model``): its exit status,
    output and JSON."""
    path = tmp_path / "model.json"
    if model:
        path.write_text(json.dumps(LAYERS))
    out = tmp_path / "out.json"
    argv = ["bench_search_cache.py", "--model", str(path), "--batch", "2", "--json", str(out), *extra]
    monkeypatch.setattr(sys, "argv", argv)
    status = bench.main()
    return status, capsys.readouterr().out, json.loads(out.read_text())


def test_a_process_past_its_time_limit_leaves_the_others_figures(tmp_path, monkeypatch, capsys):
    """The processes without the cache get a limit too short to start in (each is really started and killed): the
    table and the JSON keep the others' times, leave that row empty, and say which processes gave none."""
    run = subprocess.run

    def short_for_cache_off(command, **kwargs):
        if kwargs["env"]["WSARENA_CACHE_DIR"] == "off":
            kwargs["timeout"] = 0.001
        return run(command, **kwargs)

    monkeypatch.setattr(bench.subprocess, "run", short_for_cache_off)
    status, text, result = run_bench(tmp_path, monkeypatch, capsys, "--repeat", "2")
    assert status == 0
    assert result["runs"]["off"] == [] and result["medians"]["off"] is None and result["saved_s"] is None
    assert [len(result["runs"][kind]) for kind in ("first", "second")] == [2, 2]
    for kind in ("first", "second"):
        times = [r["first_step_done_s"] for r in result["runs"][kind]]
        assert result["medians"][kind]["first_step_done_s"] == pytest.approx(sum(times) / 2)
    assert result["missing"] == [f"round {n}, cache off: timed out after 0.001 s" for n in (1, 2)]
    assert "round 2, cache on, second process: setup " in text  # as each process ends
    rows = {line[:28].strip(): line[28:].split() for line in text.splitlines()}
    assert rows["cache off"] == ["-", "-", "-", "0"]
    assert rows["cache on, second process"][-1] == "2" and "-" not in rows["cache on, second process"]
    assert "no times from round 2, cache off: timed out after 0.001 s" in text
    assert "start-up saved by the cache: not measured" in text


def test_no_process_giving_times_exits_1_and_says_why(tmp_path, monkeypatch, capsys):
    """Every process fails (its model file is not there): no exception, the reasons, exit status 1; the second
    process of a round whose first gave nothing is not run, as it would time a search."""
    status, text, result = run_bench(tmp_path, monkeypatch, capsys, "--repeat", "1", model=False)
    assert status == 1
    missing = result["missing"]
    assert [line.split(":")[0] for line in missing] == [
        "round 1, cache off", "round 1, cache on, first process", "round 1, cache on, second process"]
    assert "cannot read" in missing[0] and "exit status 1" in missing[0]
    assert missing[2].endswith("not run: the first process of its round gave no times")
    assert result["runs"] == {"off": [], "first": [], "second": []}
    assert "no times from round 1, cache on, first process: failed (exit status 1)" in text
