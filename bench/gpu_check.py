"""Run on a GPU machine: the GPU tests, then the rest of the test suite, then the GPU benchmarks and curves.

Writes ``bench/results/gpu-check-<date>.json`` (or into ``--out``) with ``commit``, ``device``, ``cudnn_version``,
the Python and package versions (``python``, ``versions``: pytest's and PyTorch's too), ``passed``, ``failed``,
``skipped`` (over both test runs), the failing test ids, each phase's own counts and
exit status, and each benchmark's exit status and output. First of all it captures the GPU's device properties
as cuDNN serialises them (``<gpu>-cudnn<version>.json``, e.g. ``h100-cudnn91900.json``: where the version is
the one the tests load, commit it as ``tests/data/h100.json`` for the tests that plan without a GPU; a later cuDNN
may refuse an earlier one's, docs/deviceless.md). The benchmarks include a
ResNet-50 training step at batch 32 in PyTorch against the same model converted by ``wsarena.torch`` (step, issue
and GPU time, the kernels with the most GPU time, the step's kernel count and calls into CUDA that synchronise, copy
or allocate, peak memory, PyTorch's peak convolution workspace against the arena's, and what the arena allocated
over the timed steps; ``torch-resnet50-b32-{float32,float16,float32-contiguous}-gpu.json`` beside the JSON:
channels-last but the last), ``wsarena tune`` of ResNet-50 and VGG-16 at batch 32 float32 and batch 64 float16 on
cuDNN (``tune-MODEL-DTYPE-bBATCH-gpu.json`` and ``.png`` beside the JSON, each searched afresh in a cache folder of its
own) and the search cache's start-up saving (``search-cache-startup-resnet50-gpu.json``); the host, arena and CUDA
graph benchmarks write their tables as JSON too (``bench_gpu_host-gpu.json``, ``bench_gpu_arena-gpu.json``,
``capture-resnet50-{b32-float32,b64-float16}-gpu.json``), and which stream questions CUDA answers during a capture
(``probe_capture_ids.py``, ``capture-ids-gpu.json``), and what one refused growth costs through CuPy's pool and
PyTorch's allocator (``probe_refusal_cost.py``, ``refusal-cost-gpu.json``) and what the arena's record of refusals
saves a ResNet-50 step on a nearly full device (``bench_gpu_pressure.py``, ``pressure-resnet50-b32-gpu.json``),
and a cached call's CUDA-touching calls, counted and timed (``bench_device_calls.py``, ``device-calls-gpu.json``).
The file is written after every phase, so a run cut short by the machine's time limit still leaves what it
finished. Exit status: 0 when every test run passed and every benchmark and curve exited 0, else 1.

    python bench/gpu_check.py [--out DIR] [--gpu-timeout S] [--test-timeout S] [--bench-timeout S]
                              [--per-test-timeout S] [--deadline S] [--no-bench | --no-tests] [--quick]
                              [-- extra pytest args]

A lent machine's time may not hold all of it in one command: run the tests (``--no-bench``), then the benchmarks
(``--no-tests --quick``, into ``gpu-check-<date>-benchmarks.json``). ``--deadline S`` ends the run within S seconds
(give a command's limit, less a minute for gpu_check.sh's installs): a phase still running then is cut short, the
output it printed so far in the JSON, which a limit on the whole command would lose; a phase left too little time is
recorded as not run. Each phase runs in a process group of its own, killed whole when its time is up and when
gpu_check itself is stopped (Ctrl-C, SIGTERM), so that nothing it started (xdist workers, a benchmark's child
process) runs on into the next phase.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What a phase --deadline leaves too little time to start is recorded as (under 30 s: a benchmark's process takes
# some 10 s to import CuPy, PyTorch and cuDNN); each phase ends 10 s before the deadline, to write the JSON.
NOT_RUN = {"exit_status": None, "not_run": "too little time left before --deadline"}
_LEAST_S, _MARGIN_S = 30, 10
# Seconds to wait for the pipes of a killed phase to close, and what it printed to come in
_DRAIN_S = 10
# Run after the tests, each with --bench-timeout (times the factor given): the script and its arguments, "{out}"
# standing for the results folder.
BENCHMARKS = (
    (("probe_capture_ids.py", "--json", "{out}/capture-ids-gpu.json"), 1),
    (("bench_gpu_torch.py", "--json", "{out}/torch-resnet50-b32-float32-gpu.json"), 3),
    (("bench_gpu_torch.py", "--memory-format", "contiguous", "--json",
      "{out}/torch-resnet50-b32-float32-contiguous-gpu.json"), 3),
    (("bench_gpu_torch.py", "--autocast", "float16", "--json", "{out}/torch-resnet50-b32-float16-gpu.json"), 3),
    (("bench_gpu_arena.py", "--json", "{out}/bench_gpu_arena-gpu.json"), 1),
    (("bench_gpu_host.py", "--json", "{out}/bench_gpu_host-gpu.json"), 1),
    (("bench_device_calls.py", "--gpu", "--json", "{out}/device-calls-gpu.json"), 1),
    (("bench_gpu_capture.py", "--json", "{out}/capture-resnet50-b32-float32-gpu.json"), 1),
    (("bench_gpu_capture.py", "--batch", "64", "--dtype", "float16", "--json",
      "{out}/capture-resnet50-b64-float16-gpu.json"), 1),
    (("probe_refusal_cost.py", "--json", "{out}/refusal-cost-gpu.json"), 1),
    (("bench_gpu_pressure.py", "--json", "{out}/pressure-resnet50-b32-gpu.json"), 1),
)
TUNES = (("resnet50", 32, "float32"), ("vgg16", 32, "float32"), ("resnet50", 64, "float16"), ("vgg16", 64, "float16"))
# --quick: fewer repeats of each benchmark, and the first curve alone, so that the benchmarks fit in one command of
# a lent machine (some six minutes on an H100, by the repeats' share of the full run's times)
QUICK = {
    "bench_gpu_arena.py": ("--repeat", "3"),
    "bench_gpu_capture.py": ("--repeat", "3"),
    "bench_gpu_host.py": ("--rounds", "3"),
    "bench_gpu_torch.py": ("--steps", "5", "--warmup", "2"),
    "bench_gpu_pressure.py": ("--steps", "3"),
}


def junit_counts(path: Path, slowest: int = 15) -> dict:
    """Passed, failed and skipped tests in pytest's JUnit XML report, the failures by name, and the ``slowest``
    tests with their seconds: where a phase's time went on a lent machine."""
    suites = ET.parse(path).getroot()
    counts: dict = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    times = []
    for case in suites.iter("testcase"):
        outcome = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        name = f"{case.get('classname')}::{case.get('name')}"
        times.append((float(case.get("time") or 0), name))
        if "failure" in outcome or "error" in outcome:
            counts["failed"] += 1
            counts["failures"].append(name)
        elif "skipped" in outcome:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    counts["slowest"] = [{"test": name, "seconds": round(t, 1)} for t, name in sorted(times, reverse=True)[:slowest]]
    return counts


def _run(command: list[str], timeout: float, env: dict, capture: bool = False) -> subprocess.CompletedProcess:
    """Run ``command`` in the checkout; past ``timeout`` seconds it is killed and its status is -9.

    It runs in a process group of its own, and the whole group is killed: past the time limit, and however else
    this call ends (Ctrl-C, or SIGTERM once :func:`_exit_on_sigterm` made it an exception). Killing the command
    alone would leave what it started (pytest's xdist workers, bench_gpu_host.py's torch v7 process) holding the
    GPU while the next phases run. What it printed before it was killed is kept."""
    pipe = subprocess.PIPE if capture else None
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=pipe, stderr=pipe, text=True, start_new_session=True
    )
    try:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
            return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
        except subprocess.TimeoutExpired as exc:
            cut = exc
        _kill_group(process)
        try:  # the pipes close once the group is gone: the rest of what it printed
            stdout, stderr = process.communicate(timeout=_DRAIN_S)
        except subprocess.TimeoutExpired as exc:  # a process that left the group holds them: what came so far
            stdout, stderr = _text(exc.stdout or cut.stdout), _text(exc.stderr or cut.stderr)
        return subprocess.CompletedProcess(
            command, -9, _text(stdout), _text(stderr) + f"\ntimed out after {timeout:.0f} s"
        )
    finally:
        # Also after the command ended by itself: anything it left running in its group goes with it. (The group's
        # number cannot name another group while any of its members lives.)
        _kill_group(process)
        if process.poll() is None:  # interrupted before the command was waited for
            process.wait()


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL to every process in ``process``'s group (the command is its leader: see :func:`_run`)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # none left (macOS answers EPERM for a group of zombies)
        pass


def _text(data: bytes | str | None) -> str:
    """Output as text: a time limit's exception carries the bytes read so far."""
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def _exit_on_sigterm() -> None:
    """Make SIGTERM end this process as Ctrl-C does, through ``finally`` blocks, so that :func:`_run` kills the
    phase running then; by default Python dies at once, and the phase's process group would run on."""
    def leave(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)


def checkout_commit() -> str | None:
    """The commit of this checkout as the results name it: WSARENA_COMMIT where given (gpu_check.sh's header says
    when), else git's."""
    return os.environ.get("WSARENA_COMMIT") or _git_commit()


def _git_commit() -> str | None:
    """The checkout's commit, where git and the .git folder are there (a copy sent to a GPU machine may lack
    them: gpu_check.sh passes WSARENA_COMMIT then)."""
    try:
        top, head = (
            subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False
            ).stdout.strip()
            for args in (["rev-parse", "--show-toplevel"], ["rev-parse", "HEAD"])
        )
    except (OSError, subprocess.SubprocessError):
        return None
    # A copy without .git inside another checkout would report that checkout's commit
    return head if top and Path(top).resolve() == ROOT else None


def _workers(marker: str) -> list[str]:
    """pytest-xdist's arguments for the tests that need no GPU, where it is installed: they take some three minutes
    in one process, a good part of a lent machine's time. The GPU tests run in one process, as users run them."""
    if marker == "gpu" or importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(min(8, os.cpu_count() or 1))]


def _pytest(marker: str, timeout: float, per_test: float, extra: list[str], env: dict) -> dict:
    """One pytest run over the tests selected by ``-m marker``; its counts and exit status.

    Each test's outcome is printed as it comes (``-v``), so that a run cut short by the phase's time limit, which
    leaves no report, still names the tests that failed in the log. A test past ``per_test`` seconds in a
    pytest-xdist worker is ended by pytest-timeout's thread method, which ends one hung in a C call (a CUDA call, a
    lock taken in a finalizer) too, and xdist starts another worker; the signal method acts only once the interpreter
    gets control back. In one process the thread method would end the whole run, report and all."""
    workers = _workers(marker)
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [
            sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", marker, *workers,
            f"--timeout={per_test:g}", f"--timeout-method={'thread' if workers else 'signal'}",
            f"--junitxml={junit}", *extra,
        ]
        run = _run(command, timeout, env)
        if junit.exists():
            counts = junit_counts(junit)
        else:  # a crash (say a segfault in a C call) or the time limit: pytest wrote no report
            reason = f"pytest -m {marker!r} ended without a report (exit status {run.returncode})"
            counts = {"passed": 0, "failed": 1, "skipped": 0, "failures": [reason]}
    return {**counts, "exit_status": run.returncode}


def _tune_curves(out: Path, limit, env: dict, quick: bool, runs: dict, write) -> None:
    """``wsarena tune`` on cuDNN for each of TUNES (the first alone if ``quick``), then the search cache's start-up
    saving: their exit statuses, wall times and output into ``runs``, written (``write()``) as each ends, their files
    into ``out``. ``limit(factor)``: the seconds one of them may take, ``factor`` times --bench-timeout or what
    --deadline leaves; None when too little is left to start it."""
    for model, batch, dtype in TUNES[:1] if quick else TUNES:
        name = f"tune-{model}-{dtype}-b{batch}-gpu"
        if (timeout := limit(1)) is None:
            runs[name] = NOT_RUN
            continue
        with tempfile.TemporaryDirectory() as cache:  # searched afresh, whatever the machine's cache holds
            command = [sys.executable, "-m", "wsarena", "tune", model, "--batch", str(batch), "--dtype", dtype,
                       "--backend", "cudnn", "--format", "json", "--plot", str(out / f"{name}.png")]
            start = time.perf_counter()
            run = _run(command, timeout, {**env, "WSARENA_CACHE_DIR": cache}, capture=True)
            seconds = time.perf_counter() - start
        if run.returncode == 0:
            (out / f"{name}.json").write_text(run.stdout)
        runs[name] = {"exit_status": run.returncode, "wall_s": round(seconds, 2), "stderr": run.stderr[-2000:]}
        write()
        print(f"{name}: exit status {run.returncode}, {seconds:.1f} s", flush=True)
    if (timeout := limit(3)) is None:
        runs["search_cache_startup"] = NOT_RUN
        return
    startup = out / "search-cache-startup-resnet50-gpu.json"
    command = [sys.executable, str(ROOT / "bench" / "bench_search_cache.py"), "--backend", "cudnn", "--model",
               "resnet50", "--batch", "32", "--repeat", "1" if quick else "3", "--json", str(startup)]
    start = time.perf_counter()
    run = _run(command, timeout, env, capture=True)
    print(run.stdout, run.stderr, sep="\n")
    runs["search_cache_startup"] = {"exit_status": run.returncode, "wall_s": round(time.perf_counter() - start, 2),
                                    "output": run.stdout.splitlines() + run.stderr.splitlines()[-20:]}
    write()


_CAPTURE = """
import json, sys
from wsarena.cudnn import get_handle, graph, library_info
import cupy
cupy.cuda.Device(0).use()
text = graph.device_properties_json(graph.device_properties(handle=get_handle(0)))
name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
print(json.dumps({"name": name.decode() if isinstance(name, bytes) else name,
                  "cudnn": library_info()["version"], "properties": json.loads(text)}))
"""


def capture_device_properties(out: Path, env: dict, timeout: float = 120) -> dict:
    """Device 0's properties as cuDNN 9.8+ serialises them, into ``out/<gpu>-cudnn<version>.json``."""
    run = _run([sys.executable, "-c", _CAPTURE], timeout, env, capture=True)
    try:
        found = json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 else None
    except (ValueError, IndexError):  # no JSON last: recorded, and the tests and benchmarks still run
        found = None
    if not isinstance(found, dict) or not {"name", "cudnn", "properties"} <= found.keys():
        return {"exit_status": run.returncode, "stdout": run.stdout[-2000:], "stderr": run.stderr[-2000:]}
    words = [w for w in found["name"].replace("NVIDIA", "").split() if any(c.isdigit() for c in w)]
    stem = (words[0] if words else "gpu").lower()
    target = out / f"{stem}-cudnn{found['cudnn']}.json"
    target.write_text(json.dumps(found["properties"], indent=1) + "\n")
    print(f"device properties of {found['name']} (cuDNN {found['cudnn']}) -> {target}", flush=True)
    return {"exit_status": 0, "file": target.name, "device": found["name"], "cudnn": found["cudnn"]}


def header(info: dict) -> dict:
    """The result's first fields, from :func:`wsarena.info.collect_info`'s ``info``: the checkout, the machine, and
    the versions the tests ran under (Python, pytest, the packages ``wsarena info`` lists, PyTorch), so that a result
    can be told apart from another machine's; the counts start at 0."""
    devices = [d.get("name") for d in info["gpu"]["devices"] if "name" in d]
    return {
        "date": datetime.date.today().isoformat(),
        "commit": checkout_commit(),
        "device": devices[0] if devices else None,
        "devices": devices,
        "cudnn_version": info["cudnn"].get("version_string") or info["cudnn"].get("version"),
        "cuda_driver": info["cuda"].get("driver"),
        "gpu_usable": info["gpu"]["usable"],
        "gpu_unusable_reason": info["gpu"]["reason"],
        "python": info["python"],
        "versions": {
            **info["packages"],
            "pytest": _version("pytest"),
            "pytest-xdist": _version("pytest-xdist"),
            "torch": info["torch"]["version"] if info["torch"]["installed"] else None,
        },
        "passed": 0, "failed": 0, "skipped": 0, "failures": [],
        "phases": {},
    }


def _version(distribution: str) -> str | None:
    """The installed ``distribution``'s version, or None where it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--gpu-timeout", type=float, default=240, help="seconds for the GPU tests")
    parser.add_argument("--test-timeout", type=float, default=150, help="seconds for the other tests")
    parser.add_argument("--bench-timeout", type=float, default=240, help="seconds for each benchmark")
    parser.add_argument("--no-bench", action="store_true", help="run the tests only")
    parser.add_argument("--no-tests", action="store_true",
                        help="run the benchmarks and curves only, into gpu-check-<date>-benchmarks.json")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, one tune curve (see QUICK)")
    parser.add_argument("--per-test-timeout", type=float, default=120, help="seconds for any one test")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds within which the whole run ends (a lent machine's limit on one command): each "
                             "phase's time limit is cut to what is left, and a phase left too little is not run")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    if args.no_bench and args.no_tests:
        parser.error("--no-bench and --no-tests leave nothing to run")
    _exit_on_sigterm()
    args.out = args.out.resolve()  # the benchmarks run in the checkout, and write where the JSON says they did
    end = None if args.deadline is None else time.monotonic() + args.deadline

    def limit(seconds: float) -> float | None:
        """``seconds``, or what --deadline leaves of them; None when that is too little to start a phase."""
        if end is None:
            return seconds
        left = min(seconds, end - time.monotonic() - _MARGIN_S)
        return left if left >= min(seconds, _LEAST_S) else None

    sys.path.insert(0, str(ROOT))
    from wsarena.info import collect_info

    info = collect_info()
    # This checkout, installed or not, ahead of whatever the caller put on the path (wheels carried to the machine).
    # Unbuffered: a phase killed at its time limit leaves in the JSON what it printed, not what its buffer flushed.
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = header(info)
    args.out.mkdir(parents=True, exist_ok=True)
    # a second command on the same day, for the benchmarks alone, keeps the first one's test counts
    target = args.out / f"gpu-check-{result['date']}{'-benchmarks' if args.no_tests else ''}.json"

    def write() -> None:
        target.write_text(json.dumps(result, indent=2) + "\n")

    write()
    result["device_properties"] = capture_device_properties(args.out, env, limit(120) or 1)
    write()
    ok = True
    phases = (("gpu_tests", "gpu", args.gpu_timeout), ("other_tests", "not gpu", args.test_timeout))
    for phase, marker, timeout in () if args.no_tests else phases:
        if (left := limit(timeout)) is None:
            result["phases"][phase] = NOT_RUN
            ok = False
            continue
        counts = _pytest(marker, left, args.per_test_timeout, args.pytest_args, env)
        result["phases"][phase] = counts
        for key in ("passed", "failed", "skipped"):
            result[key] += counts[key]
        result["failures"] += counts["failures"]
        ok = ok and counts["exit_status"] == 0  # 5, no test selected, fails too: the GPU tests went missing
        write()
        print(f"{phase}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
              f"(exit status {counts['exit_status']})", flush=True)
        if counts.get("slowest"):
            print("  slowest: " + ", ".join(f"{t['test']} {t['seconds']} s" for t in counts["slowest"][:5]), flush=True)
    result["benchmarks"] = {}
    for (script, *script_args), factor in () if args.no_bench else BENCHMARKS:
        script_args = [a.replace("{out}", str(args.out)) for a in script_args]
        script_args += QUICK.get(script, ()) if args.quick else ()
        command = [sys.executable, str(ROOT / "bench" / script), *script_args]
        key = " ".join([script, *script_args])
        if (timeout := limit(factor * args.bench_timeout)) is None:
            result["benchmarks"][key] = NOT_RUN
            ok = False
            continue
        start = time.perf_counter()
        bench = _run(command, timeout, env, capture=True)
        print(bench.stdout, bench.stderr, sep="\n")
        ok = ok and bench.returncode == 0
        result["benchmarks"][key] = {
            "exit_status": bench.returncode, "wall_s": round(time.perf_counter() - start, 2),
            "output": bench.stdout.splitlines() + bench.stderr.splitlines()[-20:],
        }
        write()
    if not args.no_bench:
        result["tune"] = {}
        _tune_curves(args.out, lambda factor: limit(factor * args.bench_timeout), env, args.quick, result["tune"],
                     write)
        ok = ok and all(run["exit_status"] == 0 for run in result["tune"].values())
        write()
    print(f"wrote {target}: {result['passed']} passed, {result['failed']} failed, {result['skipped']} skipped")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
