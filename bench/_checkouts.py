"""Checkouts of the package side by side, for the CPU benchmarks that compare them: the benchmark runs its own
script again in a subprocess per checkout root, with that root as PYTHONPATH, and the script's hidden ``--json``
prints one measurement. The scripts import this module from their folder, which is on sys.path when one runs."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's root


def add_options(parser: argparse.ArgumentParser, json_metavar: str | None = None) -> None:
    """``--rounds``, ``--checkout`` (one root each time) and the hidden ``--json`` a parent passes: the case to
    measure, named by ``json_metavar``, or, without it, a flag."""
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per checkout")
    parser.add_argument("--checkout", action="append", default=[], help="a checkout root to compare")
    if json_metavar is None:
        parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one measurement, for a parent
    else:
        parser.add_argument("--json", metavar=json_metavar, help=argparse.SUPPRESS)


def measure_in(root: str, script: str, args: Sequence[str], env: Mapping[str, str] | None = None) -> Any:
    """What ``script`` prints as JSON, run with ``args`` in a subprocess on the package of checkout ``root``;
    ``env`` adds to the environment."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(root), **(env or {})}
    done = subprocess.run([sys.executable, os.path.abspath(script), *args], env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout)


def best_of_rounds(script: str, roots: Sequence[str], cases: Sequence[str], rounds: int, args: Sequence[str],
                   env: Mapping[str, str] | None = None) -> dict[tuple[str, str], dict[str, Any]]:
    """Each case measured in each checkout once a round (``script --json CASE *args``), the checkouts in turn: by
    (root, case), the measurement of the round with the fewest ``"ms"``."""
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for _ in range(rounds):
        for case in cases:
            for root in roots:
                found = measure_in(root, script, ["--json", case, *args], env)
                kept = best.get((root, case))
                if kept is None or found["ms"] < kept["ms"]:
                    best[root, case] = found
    return best


def rows(best: Mapping[tuple[str, str], dict[str, Any]], roots: Sequence[str],
         cases: Sequence[str]) -> Iterator[tuple[str, str, dict[str, Any], float]]:
    """A table's rows from :func:`best_of_rounds`, case by case, a checkout each: the case, the checkout's folder
    name, its measurement and its ``"ms"`` over the first checkout's."""
    for case in cases:
        first = best[roots[0], case]["ms"]
        for root in roots:
            got = best[root, case]
            yield case, os.path.basename(os.path.abspath(root)), got, got["ms"] / first
