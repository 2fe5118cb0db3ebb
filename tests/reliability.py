"""What the reliability tests share: running a script of ``tests/scripts`` in a child process, with a time bound."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def script_command(name: str, *args: object) -> list[str]:
    return [sys.executable, str(SCRIPTS / name), *map(str, args)]


def child_env(**env: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **env}


def run_script(name: str, *args: object, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``tests/scripts/<name>`` with ``args``; a child still running after ``timeout`` seconds is killed (and
    ``subprocess.TimeoutExpired`` fails the test: a hang)."""
    return subprocess.run(
        script_command(name, *args), check=False, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        env=child_env(**env),
    )


def figures(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The JSON object a script prints as its last line of output, after checking that it exited cleanly."""
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    found: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return found
