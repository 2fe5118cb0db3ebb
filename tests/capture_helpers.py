"""What the capture tests share: raw stream handles of a device-like arena, what its provider freed, and a capture of
one lease."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from wsarena.arena import Arena
from wsarena.arena.testing import FakeGraph, RecordingProvider

S1, S2 = 0x51, 0x52  # raw stream handles of a device-like arena


def freed(provider: RecordingProvider) -> list[int]:
    """The addresses of the buffers ``provider`` freed, in order."""
    return [buffer.ptr for buffer, _ in provider.frees]


def freed_on(provider: RecordingProvider) -> list[tuple[int, Any]]:
    """(address, stream) of each buffer ``provider`` freed, in order."""
    return [(buffer.ptr, stream) for buffer, stream in provider.frees]


def capture_a_lease(
    provider: RecordingProvider, arena: Arena, nbytes: int = 1000, stream: Hashable = S1
) -> tuple[FakeGraph, int]:
    """Capture ``stream`` (a raw handle, or a stream object with its ``handle``) into a new graph while a lease of
    ``nbytes`` is taken there, then end the capture. Returns the graph and the address the lease got: the buffer
    the graph pins."""
    graph = provider.begin_capture(getattr(stream, "handle", stream))
    with arena.lease(nbytes, stream=stream) as ws:
        pinned = ws.ptr
    provider.end_capture(graph)
    return graph, pinned
