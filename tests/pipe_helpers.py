"""A pipe written to by a thread, named as a shell's ``<(command)`` names one, for the tests of what reads a file
or a pipe (model files, device properties)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

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
