"""Processes that end in odd states end cleanly: the expected status, nothing on stderr but the traceback of an
exception the program did not catch, and (checked just before the end) every lane still serving other threads.
Each case runs ``tests/scripts/exit.py`` in a child process, on a host arena and on a device-keyed one.

A device arena is released at exit, before CUDA is torn down: an exit handler that runs after wsarena's (as CuPy's
do) finds every device buffer given back and the arena closed to new leases. A thread that holds the arena's lock
at exit (``lock_held``) must not keep the process from ending: the release waits for the lock a bounded time."""

import signal

import pytest

from .reliability import run_script

CASES = [  # case, exit status, the last line of stderr ("" for none)
    ("live_lease", 0, ""),
    ("threads_mid_call", 0, ""),
    ("after_close", 0, ""),
    ("exception", 1, "ValueError: boom"),
    ("interrupt", -signal.SIGINT, "KeyboardInterrupt"),
    ("exit_in_lease", 3, ""),
    ("lock_held", 0, ""),
]


@pytest.mark.parametrize("kind", ["host", "device"])
@pytest.mark.parametrize(("case", "status", "last_line"), CASES)
def test_a_process_ends_cleanly_in_every_state(kind, case, status, last_line):
    result = run_script("exit.py", case, kind, timeout=30)  # a hang at exit is a TimeoutExpired
    assert result.returncode == status, result.stderr
    lanes = 2 if case == "live_lease" else 3  # a lane held at exit is not offered to others
    refused = "lease refused: this arena was released at interpreter exit"
    after = {"host": "", "device": f"after exit: 0 held, {refused}\n"}[kind]
    if case == "lock_held" and kind == "device":
        after = "after exit\n"
    if case == "threads_mid_call" and kind == "device":  # each ended by SystemExit at its next lease
        after = "daemon threads running: 0\n" + after
    assert result.stdout == f"usable {lanes}/{lanes}\n{after}"
    if not last_line:
        assert result.stderr == ""
    else:  # only the uncaught exception's own traceback: no warning, no 'Exception ignored'
        lines = result.stderr.strip().splitlines()
        assert lines[0] == "Traceback (most recent call last):" and lines[-1] == last_line, result.stderr
        assert len(lines) == 4, result.stderr
