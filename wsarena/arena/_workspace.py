"""The object a lease yields: an address, a size, and an array over them for the length of the lease."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from types import MethodType
from typing import TYPE_CHECKING, Any, Self, cast

from .._sizes import format_size, short_repr
from ._interrupts import finish
from .providers import missing_method
from .streams import raw_handle

if TYPE_CHECKING:
    import weakref

    from ._arena import Arena
    from ._sub import _Block, _SubArena

__all__ = ["Workspace"]


class _WithExit:
    """Makes ``Workspace.__exit__`` the holder of a lease that a ``with`` statement enters.

    A ``with`` statement looks its ``__exit__`` up before it enters the lease and keeps the bound method until the
    statement ends; that method is what holds the lease. Once it is gone, the lease is over, even when a Ctrl-C
    stopped ``__exit__`` before it could release anything and the Workspace itself lives on (in ``ws`` of
    ``with arena.lease(n) as ws:``): the arena ends it when it next looks at the lane (:mod:`wsarena.arena._table`).

    Not every lookup is the ``with`` statement's that enters the lease. One that nothing keeps (``hasattr(ws,
    "__exit__")`` before a manual ``__enter__``) is gone by the time the lease is taken: ``ws`` holds the lease then
    (:meth:`Arena._acquire`). One by another thread's ``with`` statement on the same Workspace, just before this one
    entered it, goes when that statement fails to enter it: its ``__enter__`` makes ``ws`` the holder first.
    """

    __slots__ = ("function",)

    def __init__(self, function: Callable[..., None]) -> None:
        self.function = function

    def __get__(self, ws: Workspace | None, owner: type | None = None) -> Any:
        if ws is None:
            return self.function  # Workspace.__exit__(ws, ...), as contextlib.ExitStack calls it
        method = MethodType(self.function, ws)
        if not ws._state:  # looked up before the lease starts, as a with statement does
            ws._with = method
        return method


class Workspace:
    """A leased workspace: ``nbytes`` bytes at ``ptr`` on ``stream``, usable inside its ``with`` block.

    Returned by :meth:`Arena.lease`; the lease is taken on entering the ``with`` block and released on leaving
    it. A zero-byte workspace has ``ptr == 0`` and takes nothing from the arena.

    Attributes
    ----------
    ptr : int
        Address of the first byte (0 before entering and for zero bytes).
    nbytes : int
        Bytes leased.
    stream : hashable
        The sub-arena key: the raw ``cudaStream_t`` handle on a device (for handle 2, the per-thread default
        stream, the thread's own key, whose ``handle`` is 2), the lane key on the host.
    cuda_stream : int or None
        On a device, the raw ``cudaStream_t`` the workspace belongs to (2 for the per-thread default stream), also
        for zero bytes (once entered); ``None`` on the host.
    pin : GraphPin or None
        Taken while its stream was captured into a CUDA graph: that graph's pin (:mod:`wsarena.arena._pins`),
        live as long as the graph exists, to which the buffer is pinned; a call ties to it what else its captured
        kernels use (the graph API's execution plans). ``None`` otherwise.
    """

    __slots__ = (
        "__weakref__", "_anchor", "_arena", "_array", "_block", "_cap", "_debug", "_ref", "_state", "_sub", "_with",
        "cuda_stream", "nbytes", "pin", "ptr", "stream",
    )

    def __init__(
        self, arena: Arena, nbytes: int, stream: Hashable, anchor: Any, debug: bool, cap: int | None = None
    ) -> None:
        self.ptr = 0
        self.nbytes = nbytes
        self.stream = stream
        self.cuda_stream: int | None = None
        self.pin: Any = None
        self._arena = arena
        self._anchor = anchor  # keeps a caller's temporary stream object alive for the lease
        self._block: _Block | None = None
        self._sub: _SubArena | None = None  # the sub-arena it holds (set when the lane is taken)
        self._ref: weakref.ref[Any] | None = None  # the sub-arena's holder while this lease holds it
        self._with: Any = None  # the bound __exit__ of the with statement about to enter it
        self._array: Any = None
        self._state = 0  # 0 not entered, 1 live, 2 released
        self._debug = debug
        self._cap = cap  # the cap it was checked under, for an out-of-memory error's numbers

    @property
    def array(self) -> Any:
        """A 1-D ``uint8`` array of exactly ``nbytes`` over the workspace (NumPy on the host, CuPy on a device).

        Valid only inside the lease; do not keep it (or views of it) beyond the ``with`` block.
        """
        if self._state != 1:
            raise RuntimeError("a workspace's array is usable only inside its lease (the with block)")
        array = self._array
        if array is None:
            buffer = self._block.buffer if self._block is not None else None
            provider = self._arena.provider
            try:
                as_array = provider.as_array
            except AttributeError:  # a provider of leases alone
                raise missing_method(provider, "as_array") from None
            array = self._array = as_array(buffer, self.nbytes)
        return array

    def __enter__(self) -> Self:
        if self._state:
            if self._state == 1 and self.nbytes:  # live: this with statement's __exit__ may hold it (_WithExit)
                self._arena._hold_by_workspace(self)
            raise RuntimeError("a lease can be entered only once; call arena.lease() again")
        if not self.nbytes:
            self._with = None  # holds nothing: nothing to hold it by (and it would keep self in a cycle)
            if self._arena.closed:  # takes nothing, yet a closed arena refuses every lease alike
                raise self._arena._table.closed_error()
            capture = self._arena._capture
            if capture is not None:
                # The call's kernels still go on this stream: one that CUDA refuses now (a capture an earlier error
                # invalidated, the legacy default stream while another is captured) is the CaptureError a lease that
                # takes bytes gets there, before anything is enqueued. No buffer is pinned, but the graph gets its
                # pin all the same: the call ties its plan to it.
                graph = capture(raw_handle(self.stream))
                if graph is not None:
                    self.pin = self._arena._pin_for(graph)
            if not self._arena._lanes:  # the stream it resolved, which the call binds its cuDNN handle to
                self.cuda_stream = cast(int, raw_handle(self.stream))
            self._state = 1
            return self
        try:
            self._arena._acquire(self)
        except BaseException:
            # Whatever the acquisition had taken when it failed or was interrupted goes back: after a
            # KeyboardInterrupt the with block never starts, so nothing else would ever release it.
            finish(self._arena._end, self)
            raise
        return self

    @_WithExit
    def __exit__(self, *exc_info: object) -> None:
        if self._state == 1:
            if self.nbytes:
                try:
                    self._arena._end(self)
                except KeyboardInterrupt:  # the with block is over: a release cut short is repeated, then raised
                    finish(self._arena._end, self)
                    raise
            else:
                self._state = 2
        self._array = None
        self._anchor = None

    def __copy__(self) -> Self:
        return self  # a copy of a live lease would end it for its owner, who would go on using bytes no longer held

    def __deepcopy__(self, memo: Any) -> Self:
        return self

    def __reduce__(self) -> Any:
        raise TypeError("a Workspace is a lease of this process's memory and cannot be pickled")

    def __repr__(self) -> str:
        state = ("not entered", "live", "released")[self._state]
        return f"<Workspace {format_size(self.nbytes)} at {self.ptr:#x} on stream {short_repr(self.stream)}, {state}>"
