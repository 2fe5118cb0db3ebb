"""Running a test's check in a forked child of the pytest process (what a data loader's fork does to wsarena)."""

from __future__ import annotations

import os
import select
import signal
import time
import warnings
from collections.abc import Callable
from typing import Any

HANG_SECONDS = 30  # a child that has not answered by then is taken to hang (a lock held for ever)


def fork(child: Callable[[], Any]) -> Callable[[], Any]:
    """Fork now and run ``child()`` in the child, which never returns into pytest; return ``wait``.

    ``wait()`` returns what ``child()`` returned (its ``repr``, evaluated), or fails the test with the child's
    error. A child that hangs (in the fork's own hooks too, where nothing of the child's can bound it) is killed
    after :data:`HANG_SECONDS` and fails the test rather than outliving it.
    """
    read, write = os.pipe()
    with warnings.catch_warnings():
        # CPython 3.12 on warns of a fork while other threads run, which is what the tests that hold a lock in
        # another thread at the fork are about
        warnings.filterwarnings("ignore", r"This process \(pid=\d+\) is multi-threaded", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        code, answer = 1, b""
        try:
            os.close(read)
            answer = repr(child()).encode()
            code = 0
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, whatever it was
            answer = f"{type(exc).__name__}: {exc}".encode()
        finally:
            try:
                os.write(write, answer)
            finally:
                os._exit(code)
    os.close(write)

    def wait() -> Any:
        chunks = []
        deadline = time.monotonic() + HANG_SECONDS
        with os.fdopen(read, "rb") as pipe:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([pipe], [], [], left)[0]:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    raise AssertionError(f"the forked child hung for {HANG_SECONDS} s")
                chunk = os.read(pipe.fileno(), 65536)
                if not chunk:
                    break
                chunks.append(chunk)
        _, status = os.waitpid(pid, 0)
        answer = b"".join(chunks).decode()
        assert os.waitstatus_to_exitcode(status) == 0, f"the forked child failed: {answer}"
        return eval(answer)

    return wait
