"""The workspace of a stream that ``torch.cuda.graph`` or ``torch.cuda.make_graphed_callables`` will capture on.

A capture cannot grow its stream's workspace buffer (:mod:`wsarena.cudagraph`), so the stream must hold, before the
capture, what the captured calls need. :func:`wsarena.capture` gives its own stream that; PyTorch's captures begin
outside wsarena, on a stream the eager step may never have run on: ``torch.cuda.make_graphed_callables`` warms up on
a stream of its own and captures on ``torch.cuda.graph``'s default capture stream.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _interop
from .._gpu import gpu_unusable_reason
from ..arena import get_arena
from ..arena.streams import stream_handle
from ..cudagraph import largest_workspace
from ..errors import BackendUnavailableError

__all__ = ["prepare_capture"]


def prepare_capture(stream: Any = None) -> int:
    """Give ``stream`` the workspace a CUDA graph captured on it needs: the largest buffer any stream of its device's
    arena holds (at most the cap), as :func:`wsarena.capture` gives its own stream. Run the eager step first, which
    sizes the arena.

    Parameters
    ----------
    stream : torch.cuda.Stream, optional
        The stream the capture will run on. By default ``torch.cuda.graph``'s default capture stream, on which
        ``torch.cuda.graph(g)`` without ``stream=`` and ``torch.cuda.make_graphed_callables`` capture (made here,
        on the current device, where PyTorch has not made it yet, as ``torch.cuda.graph`` makes it).

    Returns
    -------
    int
        The bytes ``stream``'s workspace buffer holds now.

    Raises
    ------
    BackendUnavailableError
        No GPU is usable.
    TypeError
        ``stream`` is not a ``torch.cuda.Stream``.

    Without it, each convolution of such a capture runs an algorithm that needs no more workspace than the stream
    held (often a slower one than the eager step's), with a :class:`~wsarena.CaptureFallbackWarning`.
    """
    reason = gpu_unusable_reason()
    if reason is not None:
        raise BackendUnavailableError(f"wsarena.torch.prepare_capture needs a GPU: {reason}")
    if stream is None:
        graph = torch.cuda.graph
        if graph.default_capture_stream is None:
            graph.default_capture_stream = torch.cuda.Stream()
        stream = graph.default_capture_stream
    if not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"stream must be a torch.cuda.Stream, not {type(stream).__name__}")
    device = stream.device.index
    _interop._prefer_torch_memory(device)  # an arena made here takes PyTorch's memory, as a call's would
    arena = get_arena(device)
    # By its handle, as wsarena.torch's calls key PyTorch's streams: PyTorch gives a new object for the same stream
    # each time it is asked, and a buffer tied to one that dies is an orphan a capture cannot take (CaptureError).
    handle = stream_handle(stream)
    largest = largest_workspace(arena)
    if largest:
        arena.reserve(largest, stream=handle)
    held: int = arena.held_bytes(stream=handle)
    return held
