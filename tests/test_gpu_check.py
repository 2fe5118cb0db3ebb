"""bench/gpu_check.py's runner of a phase, on the CPU: a phase cut short by its time limit, or by Ctrl-C or SIGTERM
of gpu_check itself, leaves nothing of its own running (on a GPU machine, an xdist worker or a benchmark's child
process would hold the GPU through the next phases)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
assert _spec is not None and _spec.loader is not None
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg"), reason="process groups are POSIX's")

# A phase that starts a process of its own (as pytest starts its xdist workers), writes both pids to argv[1] once
# that process runs, says so, and waits; argv[1] + ".done" says that it was not killed.
PHASE = """
import os, subprocess, sys, time
grandchild = subprocess.Popen(["sleep", "60"])
with open(sys.argv[1] + ".part", "w") as f:
    f.write(f"{os.getpid()} {grandchild.pid}")
os.replace(sys.argv[1] + ".part", sys.argv[1])
print("phase started", flush=True)
time.sleep(60)
open(sys.argv[1] + ".done", "w").close()
"""


def running(pid: int) -> bool:
    """Whether ``pid`` still runs: a zombie does not (a killed process whose parent died waits there for whichever
    process adopts it to reap it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:  # reaped since, or a system without /proc, where os.kill's answer stands
        return not Path("/proc/self").exists()


def gone_soon(pids: list[int], seconds: float = 3.0) -> bool:
    end = time.monotonic() + seconds
    while any(running(pid) for pid in pids):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def read_pids(path: Path, seconds: float = 30.0) -> list[int]:
    end = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < end, "the phase never started its process"
        time.sleep(0.05)
    return [int(p) for p in path.read_text().split()]


def kill_left(pids: list[int]) -> None:
    """What a failing test left running: the processes its phase started, by their pids."""
    for pid in pids:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("capture", [True, False])
def test_a_phase_past_its_time_limit_is_killed_with_what_it_started(tmp_path, capture):
    pids_file = tmp_path / "pids"
    run = gpu_check._run([sys.executable, "-c", PHASE, str(pids_file)], 5, dict(os.environ), capture=capture)
    pids = read_pids(pids_file, 0)
    try:
        assert gone_soon(pids), "the phase's own process outlived its time limit"
    finally:
        kill_left(pids)
    assert not Path(f"{pids_file}.done").exists(), "the phase was waited for, not killed"
    assert run.returncode == -9
    if capture:  # what it printed before the limit is kept
        assert "phase started" in run.stdout
        assert run.stderr.endswith("timed out after 5 s")


def test_a_phase_that_ends_in_time_gives_its_status_and_output():
    run = gpu_check._run([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], 60, dict(os.environ),
                         capture=True)
    assert (run.returncode, run.stdout, run.stderr) == (3, "out\n", "")


# gpu_check itself, running a phase, as main() prepares it to
DRIVER = """
import importlib.util, os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal, whatever this process inherited
spec = importlib.util.spec_from_file_location("gpu_check", sys.argv[1])
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)
gpu_check._exit_on_sigterm()
gpu_check._run([sys.executable, "-c", sys.argv[2], sys.argv[3]], 120, dict(os.environ), capture=sys.argv[4] == "1")
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
@pytest.mark.parametrize("capture", [True, False])
def test_gpu_check_stopped_mid_phase_leaves_nothing_of_the_phase_running(tmp_path, signum, capture):
    pids_file = tmp_path / "pids"
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(ROOT / "bench" / "gpu_check.py"), PHASE, str(pids_file), str(int(capture))],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    pids: list[int] = []
    try:
        pids = read_pids(pids_file)
        driver.send_signal(signum)
        status = driver.wait(30)
        assert gone_soon(pids), "the phase ran on after gpu_check was stopped"
        assert status != 0
        assert not Path(f"{pids_file}.done").exists(), "the phase was waited for, not killed"
    finally:
        kill_left(pids)
        if driver.poll() is None:
            driver.kill()
            driver.wait()


def test_a_phases_report_names_its_failures_and_its_slowest_tests(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_quick" time="0.25"/>'
        '<testcase classname="tests.test_a" name="test_slow" time="41.5"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_b" name="test_middle" time="3"><skipped message="y"/></testcase>'
        '<testcase classname="tests.test_b" name="test_broken" time="7"><error message="z"/></testcase>'
        "</testsuite></testsuites>"
    )
    counts = gpu_check.junit_counts(report, slowest=3)
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (1, 2, 1)
    assert counts["failures"] == ["tests.test_a::test_slow", "tests.test_b::test_broken"]
    assert counts["slowest"] == [
        {"test": "tests.test_a::test_slow", "seconds": 41.5}, {"test": "tests.test_b::test_broken", "seconds": 7.0},
        {"test": "tests.test_b::test_middle", "seconds": 3.0},
    ]


# Each (script, arguments) of argv[1] (JSON) run as `python bench/SCRIPT` runs it, up to its parser's parse_args,
# where what that parser makes of the arguments is taken instead: null where it takes them, else argparse's error
# (an unknown option, a value refused, an option missing its value), or NO_TORCH for a script that imports PyTorch
# where it is not installed (wsarena[torch] is optional); one JSON list, an entry each.
NO_TORCH = "PyTorch is not installed"
PARSE = f"""
import argparse, contextlib, io, json, os, runpy, sys

class Reached(Exception):
    pass

def reached(self, args=None, namespace=None):
    raise Reached(self)

real = argparse.ArgumentParser.parse_known_args
found = []
for script, given in json.loads(sys.argv[1]):
    sys.argv = [script]
    sys.path.insert(0, os.path.dirname(script))  # as `python SCRIPT` puts its folder first
    argparse.ArgumentParser.parse_known_args = reached  # parse_args calls it
    try:
        runpy.run_path(script, run_name="__main__")
    except Reached as exc:
        parser = exc.args[0]
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        found.append({NO_TORCH!r})
        continue
    else:
        found.append("the script never parsed its arguments")
        continue
    finally:
        argparse.ArgumentParser.parse_known_args = real
        sys.path.pop(0)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(given)
    except SystemExit:
        found.append(err.getvalue().strip().splitlines()[-1])
    else:
        found.append(None)
print(json.dumps(found))
"""


def parsed_by_scripts(cases: list[tuple[str, list[str]]]) -> list[str | None]:
    """What each bench script's own argparse parser makes of the arguments given it (:data:`PARSE`), in one child
    process: options that a script adds through a shared helper (``_checkouts.add_options``, hidden ones too)
    count as any other."""
    run = subprocess.run(
        [sys.executable, "-c", PARSE, json.dumps([[str(ROOT / "bench" / script), args] for script, args in cases])],
        capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def test_every_benchmark_gpu_check_runs_exists_and_takes_the_options_it_is_given(tmp_path):
    """What a lent machine's minutes would find broken only there: a script renamed, an option dropped or a value
    it no longer takes. Each script named exists, and its parser takes the arguments gpu_check passes it, with
    --quick's and without."""
    cases = []
    for (script, *args), factor in gpu_check.BENCHMARKS:
        assert (ROOT / "bench" / script).is_file(), script
        assert factor >= 1
        given = [a.replace("{out}", str(tmp_path)) for a in args]
        cases += [(script, given), (script, given + list(gpu_check.QUICK.get(script, ())))]
    found = parsed_by_scripts(cases)
    refused = [(script, args, why) for (script, args), why in zip(cases, found) if why not in (None, NO_TORCH)]
    assert refused == []
    named = {script for (script, *_), _ in gpu_check.BENCHMARKS}
    assert set(gpu_check.QUICK) <= named
    unchecked = sorted({script for (script, _), why in zip(cases, found) if why == NO_TORCH})
    if unchecked:  # the others are checked above
        pytest.skip(f"{NO_TORCH} (wsarena[torch]): the parsers of {', '.join(unchecked)} were not asked")


def test_the_scripts_parsers_are_asked_options_of_shared_helpers_included():
    """The check above asks the parser: the options a checkout-comparing benchmark takes through
    ``_checkouts.add_options`` (--rounds, --checkout, the hidden --json), which its own source does not spell, are
    taken, and what no parser declares, or a value of the wrong type, is refused."""
    found = parsed_by_scripts([
        ("bench_pressure.py", ["--rounds", "2", "--checkout", "a", "--checkout", "b", "--json", "heuristic"]),
        ("bench_pressure.py", ["--steps", "3", "--bogus"]),
        ("bench_pressure.py", ["--rounds", "two"]),
    ])
    assert found[0] is None
    assert found[1] is not None and found[1].endswith("error: unrecognized arguments: --bogus")
    assert found[2] is not None and "--rounds" in found[2] and "'two'" in found[2]


def test_the_result_names_the_versions_the_tests_ran_under():
    """The result says which Python, pytest and packages ran the tests, from what this process has, so that two
    GPU machines' results can be told apart (the counts start at 0 and the JSON takes it as it is)."""
    import platform

    from wsarena.info import collect_info

    result = json.loads(json.dumps(gpu_check.header(collect_info())))
    assert result["python"] == f"{platform.python_implementation()} {platform.python_version()}"
    assert result["versions"]["pytest"] == pytest.__version__
    assert result["versions"]["numpy"] == __import__("numpy").__version__
    try:
        import torch
    except ImportError:
        assert result["versions"]["torch"] is None
    else:
        assert result["versions"]["torch"] == torch.__version__
    assert (result["passed"], result["failed"], result["skipped"], result["failures"]) == (0, 0, 0, [])
    assert gpu_check._version("no-such-distribution-wsarena") is None
