"""The reliability campaign at a larger scale than CI runs it; prints one table of figures.

    python bench/reliability_campaign.py [--storm-processes 25] [--storm-seconds 1] [--forks 100]
                                         [--exit-repeats 10] [--load-threads 8] [--load-rounds 40]
                                         [--fuzz-examples 3000] [--only storms,forks,faults,load,exits,fuzzing]

Interrupt storms (``tests/scripts/storm.py``, every mode and signal source, in child processes): interrupts
delivered, errors other than KeyboardInterrupt, leases left live, lanes not usable afterwards. Fork while busy
(``tests/scripts/fork.py``, also while threads make a process's first convolution): forks, hangs (a child still
running after 10 s), failed children. Injected faults (``tests/test_reliability_faults.py``): a provider failing its
n-th allocation for every n of a ResNet-50-like forward and backward run, and a MemoryError in the k-th algorithm
run for every k. Load (``tests/test_reliability_load.py``, debug mode): calls, overlaps found, results unequal to
the serial run, resident memory growth after the first round. Process exits (``tests/scripts/exit.py``): processes,
unclean ones. Fuzzing (``tests/test_fuzz_ops.py`` and ``tests/test_fuzz_inputs.py`` with ``WSARENA_FUZZ_EXAMPLES``
inputs per test, counted by ``tests/fuzz_tally.py``): inputs tried, refused, refused as documented, and failed tests
(an escape fails its test).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("WSARENA_CACHE_DIR", "off")  # exhaustive searches here are not worth keeping

from tests.reliability import child_env, script_command
from tests.test_reliability_exit import CASES

STORMS = [(mode, source) for mode in ("lease", "ops", "contend", "ops_contend") for source in ("thread", "itimer")]


def storms(processes: int, seconds: float) -> dict[str, int]:
    totals = {"processes": 0, "delivered": 0, "errors": 0, "leases_live": 0, "lanes_unusable": 0, "hung": 0,
              "crashed": 0}
    for mode, source in STORMS:
        for _ in range(processes):
            totals["processes"] += 1
            try:
                done = subprocess.run(script_command("storm.py", mode, source, seconds, 1), capture_output=True,
                                      text=True, timeout=60 + seconds, cwd=ROOT, env=child_env(), check=False)
            except subprocess.TimeoutExpired:
                totals["hung"] += 1
                continue
            if done.returncode != 0 or not done.stdout.strip():
                totals["crashed"] += 1
                print(done.stderr[-2000:], file=sys.stderr)
                continue
            found = json.loads(done.stdout.strip().splitlines()[-1])
            totals["delivered"] += found["delivered"]
            totals["errors"] += sum(found["errors"].values()) + bool(done.stderr)
            totals["leases_live"] += found["leases_live"]
            totals["lanes_unusable"] += 2 * found["lanes"] - found["usable_here"] - found["usable_elsewhere"]
    return totals


def forks(count: int) -> dict[str, int]:
    totals = {"forks": 0, "hangs": 0, "failed": 0}
    for scenario in ("busy", "held", "device", "first"):
        done = subprocess.run(script_command("fork.py", scenario, count), capture_output=True, text=True,
                              timeout=30 * count, cwd=ROOT, env=child_env(), check=False)
        found = json.loads(done.stdout.strip().splitlines()[-1])
        for key in totals:
            totals[key] += found[key]
        totals["failed"] += bool(done.stderr)
    return totals


def faults() -> dict[str, int]:
    import warnings

    from wsarena import MemoryFallbackWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemoryFallbackWarning)  # every fault injected is a fallback for want of memory
        return _faults()


def _faults() -> dict[str, int]:
    from tests import test_reliability_faults as t
    from wsarena import algos, ops
    from wsarena.arena import Arena
    from wsarena.arena.testing import RecordingProvider
    from wsarena.backends import _cpu_backend, cpu

    totals = {"allocation_faults": 0, "survived": 0, "typed_errors": 0, "algorithm_faults": 0, "wrong": 0}
    for search in ("heuristic", "exhaustive"):
        n = 1
        while True:
            provider = t.FailingNth(n)
            arena = Arena(provider)
            algos.cache_clear()
            ops.records_clear()
            with (mock.patch.object(_cpu_backend.CpuBackend, "arena", lambda self, arena=arena: arena),
                  __import__("wsarena").config(algo_search=search)):
                outcomes = t._step()
            if provider.calls < n:
                break
            totals["allocation_faults"] += 1
            totals["typed_errors"] += outcomes.count("typed error")
            totals["survived"] += outcomes.count("correct")
            totals["wrong"] += len(outcomes) - outcomes.count("correct") - outcomes.count("typed error")
            n += 1
    real = cpu.run_unchecked
    arena = Arena(RecordingProvider())
    k = 1
    while True:
        runs = 0

        def run(*args: Any, k: int = k) -> None:
            nonlocal runs
            runs += 1
            if runs == k:
                raise MemoryError("injected")
            real(*args)

        with (mock.patch.object(_cpu_backend.CpuBackend, "arena", lambda self: arena),
              mock.patch.object(cpu, "run_unchecked", run)):
            outcomes = t._step()
        if runs < k:
            break
        totals["algorithm_faults"] += 1
        totals["wrong"] += len(outcomes) - outcomes.count("correct")
        k += 1
    return totals


def load(threads: int, rounds: int) -> dict[str, int]:
    import wsarena
    from tests.test_reliability_load import load as run_load

    wsarena.configure(debug=True)
    calls, overlaps, mismatches, resident = run_load(threads, rounds)
    wsarena.configure(debug=False)
    return {"calls": calls, "overlaps": overlaps, "mismatches": mismatches,
            "rss_growth_mib": (max(resident[1:]) - resident[0]) >> 20}


def exits(repeats: int) -> dict[str, int]:
    totals = {"processes": 0, "unclean": 0}
    for kind in ("host", "device"):
        for case, status, last_line in CASES:
            for _ in range(repeats):
                done = subprocess.run(script_command("exit.py", case, kind), capture_output=True, text=True,
                                      timeout=60, cwd=ROOT, env=child_env(), check=False)
                totals["processes"] += 1
                lines = done.stderr.strip().splitlines()
                clean = done.returncode == status and (lines[-1:] == [last_line] if last_line else not lines)
                totals["unclean"] += not clean or not done.stdout.startswith("usable")
    return totals


def fuzzing(examples: int) -> dict[str, int]:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        tally = Path(folder) / "tally.jsonl"
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_fuzz_ops.py",
             "tests/test_fuzz_inputs.py"],
            capture_output=True, text=True, cwd=ROOT, check=False,
            env=child_env(WSARENA_FUZZ_EXAMPLES=str(examples), WSARENA_FUZZ_TALLY=str(tally)),
        )
        areas = [json.loads(line) for line in tally.read_text().splitlines()]
    if done.returncode != 0:
        print(done.stdout[-4000:], file=sys.stderr)
    tried, refused = sum(a["tried"] for a in areas), sum(a["refused"] for a in areas)
    documented = sum(a["refused as documented"] for a in areas)
    return {"areas": len(areas), "tried": tried, "refused": refused, "refused_as_documented": documented,
            "failed_tests": done.stdout.count("FAILED ")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--storm-processes", type=int, default=25)
    parser.add_argument("--storm-seconds", type=float, default=1.0)
    parser.add_argument("--forks", type=int, default=100)
    parser.add_argument("--exit-repeats", type=int, default=10)
    parser.add_argument("--load-threads", type=int, default=8)
    parser.add_argument("--load-rounds", type=int, default=40)
    parser.add_argument("--fuzz-examples", type=int, default=3000)
    parser.add_argument("--only", default="storms,forks,faults,load,exits,fuzzing",
                        help="the campaigns to run, comma-separated (default: all)")
    args = parser.parse_args()
    campaigns = {
        "storms": ("interrupt storms", lambda: storms(args.storm_processes, args.storm_seconds)),
        "forks": ("fork while busy", lambda: forks(args.forks)),
        "faults": ("injected faults", faults),
        "load": ("load (debug mode)", lambda: load(args.load_threads, args.load_rounds)),
        "exits": ("process exits", lambda: exits(args.exit_repeats)),
        "fuzzing": ("fuzzing", lambda: fuzzing(args.fuzz_examples)),
    }
    chosen = args.only.split(",")
    unknown = set(chosen) - set(campaigns)
    if unknown:
        parser.error(f"unknown campaign(s) {', '.join(sorted(unknown))}; known: {', '.join(campaigns)}")
    for key in chosen:
        name, run = campaigns[key]
        figures = run()
        print(f"{name:<20} " + "  ".join(f"{key}={value}" for key, value in figures.items()), flush=True)


if __name__ == "__main__":
    main()
