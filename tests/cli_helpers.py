"""Running the wsarena command in tests: in this process (``run_main``) or as a child process (``run_cli``)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from wsarena.cli import main


def run_main(capsys: Any, *argv: str) -> tuple[int, str, str]:
    """``main(argv)`` here: its exit code and what it wrote to stdout and stderr."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m wsarena ARGV`` without the caller's WSARENA_* variables (plus ``env``)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("WSARENA_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "wsarena", *argv], capture_output=True, text=True, env=full_env, timeout=300,
        check=False,
    )
