"""A pipe written to by a thread, named as a shell's ``<(command)`` names one, for the tests of what reads a file
or a pipe (model files, device properties); a call run where a FIFO could hold it, let go if it does."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest


@contextlib.contextmanager
def written_pipe(data: bytes) -> Iterator[str]:
    """The path of a pipe (/dev/fd/N, as bash's ``<(command)`` gives one) that a thread writes ``data`` to, then
    closes: a pipe gives at most what its buffer holds (64 KiB on Linux) a read, so larger data is read in parts.
    The read end is closed on leaving, which ends a writer that nothing reads any more (a read to a limit)."""
    if not os.path.isdir("/dev/fd"):
        pytest.skip("no /dev/fd, which names a process's descriptors")
    r, w = os.pipe()

    def write() -> None:
        with contextlib.suppress(BrokenPipeError), open(w, "wb") as f:
            f.write(data)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        yield f"/dev/fd/{r}"
    finally:
        os.close(r)
        writer.join()


def unblocked(call: Callable[[], Any], fifo: str | os.PathLike[str], timeout: float = 20.0) -> Any:
    """``call()`` run in a thread; one still blocked after ``timeout`` seconds (opening the FIFO ``fifo``, which
    waits for a writer) is let go by opening the FIFO for writing, and the test fails."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a writer that writes nothing: the reader sees the end
        thread.join(timeout)
        pytest.fail(f"blocked opening {fifo}")
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]
