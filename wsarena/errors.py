"""Exceptions raised by wsarena.

Bad arguments raise the built-in ``ValueError`` or ``TypeError`` naming the argument. What a correct program can
meet as it runs, and may want to handle, is a :class:`WsarenaError`: what the environment cannot do, an arena closed
under it (by another thread, at exit), the memory provider or a CUDA call failing, a graph with nothing to launch;
those that are runtime errors keep ``RuntimeError`` as a base, so ``except RuntimeError`` catches them too. A misuse
of an object in the caller's own code stays a plain ``RuntimeError``, as Python's own objects raise it: a lease
entered twice, or its array used outside it; a nested lease on a lane or stream the thread holds; a ``config()``
block entered inside itself, or ended where it did not begin. Everything else::

    WsarenaError
    ├── ArenaClosedError (RuntimeError)            a lease or reserve of a closed arena (close(), reset_arenas());
    │   │                                          get_arena() then makes a new one
    │   └── ReleasedAtExitError                    a lease or reserve of a device arena that wsarena's exit
    │                                              handler released (a later exit handler, a thread still running)
    ├── BackendUnavailableError (RuntimeError)     the environment cannot do it: no GPU, no libcudnn, CUDA in a
    │                                              child forked after it was initialised, an arena whose provider
    │                                              lacks a method the call needs (as_array, fill)
    │   └── wsarena.cudnn.CudnnNotFoundError
    ├── CaptureError (RuntimeError)                a call in a CUDA graph capture would search, finalize a plan,
    │                                              create a handle or grow the arena (nothing was enqueued); a
    │                                              capture block that ended with no graph, and its launch()
    ├── CudaError (RuntimeError)                   a CUDA runtime call of wsarena's own failed (those CuPy makes
    │                                              raise CuPy's errors)
    ├── wsarena.cudnn.CudnnError (RuntimeError)    a cuDNN status; one subclass per status (those of memory cuDNN
    │   │                                          could not allocate, host or device, are MemoryErrors too)
    │   └── wsarena.cudnn.graph.DevicePropertiesError
    │                                              device properties that describe no GPU (BAD_PARAM; a ValueError)
    ├── ProviderError (RuntimeError)               the memory provider broke its contract: a buffer smaller than
    │                                              asked or overlapping one the arena holds, a StopIteration, a
    │                                              request for the stream it allocates for
    ├── UnsupportedConvolutionError (ValueError)   the backend has no algorithm at all for this convolution
    └── WorkspaceMemoryError (MemoryError)         carries requested, held and cap, in bytes
        ├── WorkspaceCapError                      the request is above the workspace cap
        ├── ArenaOutOfMemoryError                  the memory provider could not grow the arena
        ├── AlignmentWorkspaceError                cuDNN's plan for the operands' alignment needs more than
        │                                          was leased (the graph API)
        └── NoAlgorithmFitsError                   no algorithm can run within the cap and memory

    WorkspaceCapWarning (UserWarning)              the cap excluded the fastest algorithm (once per shape)
    CaptureFallbackWarning (UserWarning)           a captured call runs an algorithm that needs less workspace than
                                                   the first choice: its stream's buffer holds too little (once per
                                                   stream)
    MemoryFallbackWarning (UserWarning)            memory, not the cap, made a call run a slower algorithm, or cut
                                                   an exhaustive search short (once per arena)
    └── SearchFallbackWarning                      an exhaustive search could time nothing (memory, or the backend
                                                   refused): the call runs the heuristic order (once per call)
    SearchCacheWarning (UserWarning)               the search cache could not be read or written; going on
    CudnnApiFallbackWarning (UserWarning)          cuDNN's graph API runs no engine for a convolution: the legacy
                                                   API runs it (once per pass and geometry)
"""

from __future__ import annotations

import functools
from collections.abc import Hashable

from ._sizes import cap_for, exact_cap, format_size

__all__ = [
    "AlignmentWorkspaceError",
    "ArenaClosedError",
    "ArenaOutOfMemoryError",
    "BackendUnavailableError",
    "CaptureError",
    "CaptureFallbackWarning",
    "CudaError",
    "CudnnApiFallbackWarning",
    "MemoryFallbackWarning",
    "NoAlgorithmFitsError",
    "ProviderError",
    "ReleasedAtExitError",
    "SearchCacheWarning",
    "SearchFallbackWarning",
    "UnsupportedConvolutionError",
    "WorkspaceCapError",
    "WorkspaceCapWarning",
    "WorkspaceMemoryError",
    "WsarenaError",
]


class WsarenaError(Exception):
    """Base class of wsarena's own exceptions."""


class ArenaClosedError(WsarenaError, RuntimeError):
    """A lease or reserve of an arena that is closed (``arena.close()``, ``wsarena.arena.reset_arenas()``), another
    thread's doing perhaps: ``get_arena()`` makes a new arena for its device. A device arena that wsarena's exit
    handler released raises :class:`ReleasedAtExitError`."""


class ReleasedAtExitError(ArenaClosedError):
    """A lease or reserve of a device arena that wsarena's exit handler released, as the interpreter exits, before
    CUDA is torn down: only a later exit handler (one registered before the first device arena) or a thread still
    running can still ask. A daemon thread gets ``SystemExit`` instead, which ends it quietly; a thread made outside
    ``threading`` (PyTorch's autograd thread) gets this error."""


class BackendUnavailableError(WsarenaError, RuntimeError):
    """The requested backend cannot run here (no usable GPU, no libcudnn, CUDA in a child forked after it was
    initialised, an arena whose provider lacks the method the call needs, ...)."""


class CaptureError(WsarenaError, RuntimeError):
    """CUDA graph capture went, or would go, wrong; the message says what to do.

    - A call made while its stream is being captured would have had to do what a capture cannot hold (search for an
      algorithm, finalize an execution plan, create a cuDNN handle, grow the arena; an ``arena.reserve()`` too), or
      its stream cannot be used now (its capture was invalidated by an earlier error; the legacy default stream
      while another stream of the device is captured). Nothing was enqueued.
    - A :func:`wsarena.capture` block ended without a graph: its capture had been invalidated, or ended inside it (a
      capture begun on its stream since, which CUDA gives another id, is left to its owner).
    - :meth:`wsarena.CapturedGraph.launch` of a graph that has none: its block has not ended, raised or ended
      without one, or the graph is closed. Nothing was launched.

    Attributes
    ----------
    stream : hashable or None
        Where a lease or a reserve would have had to grow the arena: the key of the stream being captured, as
        :meth:`Arena.stats` names it (its raw handle; the per-thread default stream's key object; on the host, the
        lane's key). ``None`` in the other cases.
    """

    stream: Hashable | None = None


class CudaError(WsarenaError, RuntimeError):
    """A CUDA runtime call that wsarena makes itself failed (the user object by which a graph captured on a stream
    holds the workspace it used, a capture's state): the message names the call and CUDA's error. CUDA errors of the
    calls CuPy makes are CuPy's (``cupy.cuda.runtime.CUDARuntimeError``, a ``RuntimeError`` too)."""


class ProviderError(WsarenaError, RuntimeError):
    """The arena's memory provider broke its contract: its ``allocate`` returned a buffer smaller than asked, or one
    whose bytes overlap a buffer the arena holds, raised ``StopIteration`` (a pool drawn by ``next()``), or asked the
    arena for the stream it allocates for, which would wait for itself (a lease there while a lease grows it is a
    nested lease on a stream the thread holds: a plain ``RuntimeError``). The arena is unchanged and usable; what
    the provider returned went back to its ``deallocate``, unless it is a buffer the arena holds. A buffer of another
    type is a ``TypeError``, and any other exception of the provider's passes through unchanged."""


class UnsupportedConvolutionError(WsarenaError, ValueError):
    """The backend offers no algorithm for this convolution (whatever the cap or the memory)."""


class WorkspaceMemoryError(WsarenaError, MemoryError):
    """Workspace memory could not be provided.

    Attributes
    ----------
    requested : int
        Bytes asked for. The message writes them as a cap that admits them (rounded up: ``cap_for``).
    held : int
        Bytes the sub-arena held when the request failed.
    cap : int or None
        The workspace cap in force, or ``None``.
    """

    def __init__(self, message: str, *, requested: int, held: int, cap: int | None) -> None:
        self.requested = requested
        self.held = held
        self.cap = cap
        self._message = message
        super().__init__(  # the cap as cap_workspace takes it back, and the request as a cap that admits it
            f"{message} (requested {cap_for(requested)}, held {format_size(held)}, cap {exact_cap(cap)})"
        )

    def __reduce__(self) -> tuple:
        # The default would call cls(formatted message) and fail: a worker process's error would then reach
        # its parent as a BrokenProcessPool instead.
        rebuild = functools.partial(
            type(self), self._message, requested=self.requested, held=self.held, cap=self.cap
        )
        return (rebuild, (), self.__dict__)


class WorkspaceCapError(WorkspaceMemoryError):
    """A workspace above the configured cap was requested."""


class ArenaOutOfMemoryError(WorkspaceMemoryError):
    """The memory provider failed while growing a sub-arena; the arena is unchanged and usable."""


class AlignmentWorkspaceError(WorkspaceMemoryError):
    """cuDNN's execution plan for the operands' alignment needs more workspace than its candidate was leased, which
    is the size of its plan for 16-byte-aligned operands (the graph API; a view at an odd offset runs a plan of
    its own). A chosen candidate is passed over for the next; one forced with ``algo=`` cannot run these operands
    (copy them to 16-byte-aligned addresses, or leave ``algo=`` out). ``requested`` is that plan's workspace and
    ``held`` the bytes leased for the candidate (the sub-arena's buffer may be larger)."""


class NoAlgorithmFitsError(WorkspaceMemoryError):
    """No algorithm of the requested pass can run within the cap and the memory available."""


class WorkspaceCapWarning(UserWarning):
    """The workspace cap excluded a faster algorithm; issued once per convolution shape and cap."""


class SearchCacheWarning(UserWarning):
    """A search cache file was unreadable or foreign (it is ignored and replaced), or the cache directory could
    not be read, written or trimmed (the process goes on without saving), or holds a folder named as an entry, or
    its limit is smaller than one entry. Issued once per directory for each of these, not once per file."""


class CaptureFallbackWarning(UserWarning):
    """A call captured into a CUDA graph runs an algorithm that needs less workspace than the first choice, which
    its stream's buffer is too small for: a capture cannot grow it. Issued once per stream."""


class MemoryFallbackWarning(UserWarning):
    """Memory, not the cap, chose an algorithm: a call ran a candidate ranked after one that memory denied (the
    arena could not grow for its workspace, or it ran out of memory of its own), or an exhaustive search could not
    time the candidates that need more workspace than memory gave it. Issued once per arena: while memory stays
    short, other calls fall back too (``arena.stats().refused_bytes`` shows the growth refused lately). A search
    that could time none says so with :class:`SearchFallbackWarning`, once per call."""


class SearchFallbackWarning(MemoryFallbackWarning):
    """An exhaustive search could time no algorithm of a call, for want of memory (no workspace, no operands) or because
    the backend refused to time the call (cuDNN's FindEx may refuse it as a whole), which the message says: the call
    runs the candidates in the heuristic order, as the heuristic search does, and the next call searches again, or,
    where memory alone stopped every candidate of a whole ranking, once the least workspace it lacked can be had, which
    the message says with its size. Issued once per call (pass, geometry, cap, device), whatever other memory warnings
    said; a :class:`MemoryFallbackWarning`, memory being its usual cause, so that a filter of those takes it too."""


class CudnnApiFallbackWarning(UserWarning):
    """With ``cudnn_api="graph"``, no engine of cuDNN's graph API could run a convolution, which then runs through
    the legacy API; issued once per pass and geometry."""
