"""Leases taken while their stream is captured into a CUDA graph: no growth, and the buffer pinned to the graph.

A captured kernel keeps the workspace address it was given, so the lease's buffer is pinned to the graph being
captured (:mod:`wsarena.arena._pins`) and is never freed while that graph exists. Growing the sub-arena cannot be
captured (an allocation is not a graph node the arena could keep), so a capture finds the buffer large enough, from
an eager step or a reserve, or gets :class:`~wsarena.errors.CaptureError`. These functions are the arena's methods
(``Arena._acquire_captured``, ``Arena._pin_for``), written here to keep each module to one job.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._sizes import format_size
from ..errors import CaptureError
from ._pins import GraphPin

if TYPE_CHECKING:
    from ._arena import Arena
    from ._workspace import Workspace

__all__: list[str] = []

_PRUNE_AT = 64  # captures remembered before those whose graphs are gone are forgotten


def _acquire_captured(self: Arena, ws: Workspace, anchor: Any, capture: Any) -> None:
    """Take the lease ``ws`` while its stream is being captured: from the buffer the stream holds, pinned to the
    graph (lock not held; on any exception the Workspace gives back what was taken)."""
    pin = self._pin_for(capture)
    sub = self._take_lane(ws, anchor)
    with self._lock:
        if self._table.closed:
            raise self._table.closed_error()
        block = sub.block
        if sub.growing is not None or block is None or block.size < ws.nbytes:
            held = 0 if block is None or sub.growing is not None else block.size
            raise CaptureError(
                f"a lease of {format_size(ws.nbytes)} on stream {sub.key!r} during CUDA graph capture needs the "
                f"arena to grow (it holds {format_size(held)} there), which cannot be captured: run the step once "
                "before capturing, or reserve first (arena.reserve_for(plan) or arena.reserve(nbytes, stream=...))"
            )
        if pin not in block.pins:
            block.pins.append(pin)
        self._grant(sub, ws, block)


def _pin_for(self: Arena, capture: Any) -> Any:
    """The pin of the graph that ``capture`` records into, made and handed to the graph on the capture's first
    lease (lock not held: ``capture.retain`` calls CUDA)."""
    captures = self._table.captures
    with self._lock:
        pin = captures.get(capture.id)
    if pin is not None:
        return pin
    pin = GraphPin()
    capture.retain(pin)
    with self._lock:
        if len(captures) >= _PRUNE_AT and len(captures) & (len(captures) - 1) == 0:  # at each power of two
            for key in [key for key, old in captures.items() if not old.live()]:
                del captures[key]
        return captures.setdefault(capture.id, pin)
