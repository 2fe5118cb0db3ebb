"""Run on a GPU machine: the whole test suite with the GPU tests enabled, then the GPU benchmark.

Writes ``bench/results/gpu-check-<date>.json`` (or into ``--out``) with ``device``, ``cudnn_version``,
``passed``, ``failed``, ``skipped``, the failing test ids, and the benchmark's output. Exit status: pytest's.

    python bench/gpu_check.py [--out DIR] [--test-timeout S] [--bench-timeout S] [-- extra pytest args]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def junit_counts(path: Path) -> dict:
    suites = ET.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    for case in suites.iter("testcase"):
        outcome = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        name = f"{case.get('classname')}::{case.get('name')}"
        if "failure" in outcome or "error" in outcome:
            counts["failed"] += 1
            counts["failures"].append(name)
        elif "skipped" in outcome:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def _run(command: list[str], timeout: float, env: dict, capture: bool = False) -> subprocess.CompletedProcess:
    """Run ``command`` in the checkout; past ``timeout`` seconds it is killed and its status is -9."""
    try:
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=capture, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        def text(data: bytes | str | None) -> str:
            return data.decode(errors="replace") if isinstance(data, bytes) else data or ""

        stderr = text(exc.stderr) + f"\ntimed out after {timeout} s"
        return subprocess.CompletedProcess(command, -9, text(exc.stdout), stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--test-timeout", type=float, default=420, help="seconds for the whole test run")
    parser.add_argument("--bench-timeout", type=float, default=150, help="seconds for the benchmark")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from wsarena.info import collect_info

    info = collect_info()
    devices = [d.get("name") for d in info["gpu"]["devices"] if "name" in d]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout, installed or not
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
        tests = _run([*command, *args.pytest_args], args.test_timeout, env)
        if junit.exists():
            counts = junit_counts(junit)
        else:  # a crash (say a segfault in a C call) or the time limit: pytest wrote no report
            reason = f"pytest ended without a report (exit status {tests.returncode})"
            counts = {"passed": 0, "failed": 1, "skipped": 0, "failures": [reason]}
    bench = _run([sys.executable, str(ROOT / "bench" / "bench_gpu_arena.py")], args.bench_timeout, env, capture=True)
    print(bench.stdout, bench.stderr, sep="\n")
    result = {
        "date": datetime.date.today().isoformat(),
        "device": devices[0] if devices else None,
        "devices": devices,
        "cudnn_version": info["cudnn"].get("version_string") or info["cudnn"].get("version"),
        "cuda_driver": info["cuda"].get("driver"),
        "gpu_usable": info["gpu"]["usable"],
        "gpu_unusable_reason": info["gpu"]["reason"],
        **counts,
        "pytest_exit_status": tests.returncode,
        "benchmark_exit_status": bench.returncode,
        "benchmark_output": bench.stdout.splitlines() + bench.stderr.splitlines()[-20:],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / f"gpu-check-{result['date']}.json"
    target.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {target}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    return tests.returncode


if __name__ == "__main__":
    raise SystemExit(main())
