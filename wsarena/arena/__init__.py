"""Workspace arenas: one per device, one buffer per stream, leased out to convolution calls.

::

    arena = get_arena("cpu")                  # or a CUDA ordinal; None = the current device
    with arena.lease(nbytes, stream=None) as ws:
        ws.ptr, ws.nbytes, ws.array           # address, size, 1-D uint8 array (NumPy / CuPy)
    arena.reserve(nbytes); arena.trim(); arena.held_bytes(); arena.stats()

Memory comes from a provider (:class:`HostProvider`, :class:`CupyProvider`, :class:`AsyncProvider`,
:class:`TorchProvider`, or any :class:`MemoryProvider`). What ``stream=`` accepts is written in
:mod:`wsarena.arena.streams`; the rules that make sharing safe, in :mod:`wsarena.arena._arena`.
"""

from __future__ import annotations

from ._arena import Arena
from ._registry import get_arena, reset_arenas, set_arena
from ._stats import ArenaStats, StreamStats
from ._workspace import Workspace
from .providers import AsyncProvider, Buffer, CupyProvider, HostProvider, MemoryProvider, TorchProvider

__all__ = [
    "Arena",
    "ArenaStats",
    "AsyncProvider",
    "Buffer",
    "CupyProvider",
    "HostProvider",
    "MemoryProvider",
    "StreamStats",
    "TorchProvider",
    "Workspace",
    "get_arena",
    "reset_arenas",
    "set_arena",
]
