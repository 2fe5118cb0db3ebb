"""Workspace arenas: one per device, one buffer per stream, leased out to convolution calls.

::

    arena = get_arena("cpu")                  # or a CUDA ordinal; None = the current device
    with arena.lease(nbytes, stream=None) as ws:
        ws.ptr, ws.nbytes, ws.array           # address, size, 1-D uint8 array (NumPy / CuPy)
    arena.reserve(nbytes); arena.trim(); arena.held_bytes(); arena.stats()

Memory comes from a provider (:class:`HostProvider`, :class:`CupyProvider`, :class:`AsyncProvider`, or any
:class:`MemoryProvider`); ``stream=`` is normalised by :func:`resolve_stream`, and :func:`stream_handle`
gives the raw ``cudaStream_t`` for a ``stream=`` argument. Handle 2, the per-thread default stream, is keyed per
thread (:class:`PerThreadStream`). See :mod:`wsarena.arena._arena` for the rules.
"""

from __future__ import annotations

from ._arena import POISON_BYTE, Arena, Workspace, aligned_size
from ._registry import get_arena, reset_arenas, set_arena
from ._stats import ArenaStats, StreamStats
from .providers import AsyncProvider, Buffer, CupyProvider, HostProvider, MemoryProvider
from .streams import PerThreadStream, ThreadLane, resolve_stream, stream_handle, thread_lane

__all__ = sorted(
    [
        "POISON_BYTE",
        "Arena",
        "ArenaStats",
        "AsyncProvider",
        "Buffer",
        "CupyProvider",
        "HostProvider",
        "MemoryProvider",
        "PerThreadStream",
        "StreamStats",
        "ThreadLane",
        "Workspace",
        "aligned_size",
        "get_arena",
        "reset_arenas",
        "resolve_stream",
        "set_arena",
        "stream_handle",
        "thread_lane",
    ]
)
