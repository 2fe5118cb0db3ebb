"""The object a lease yields: an address, a size, and an array over them for the length of the lease."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from .._sizes import format_size

if TYPE_CHECKING:
    from ._arena import Arena
    from ._sub import _Block, _Sub

__all__ = ["Workspace"]


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
        stream, the thread's :class:`~wsarena.arena.PerThreadStream`: ``int(ws.stream) == 2``), the lane key on
        the host.
    """

    __slots__ = (
        "ptr", "nbytes", "stream", "_arena", "_anchor", "_block", "_sub", "_array", "_state", "_debug", "_cap",
    )

    def __init__(
        self, arena: Arena, nbytes: int, stream: Hashable, anchor: Any, debug: bool, cap: int | None = None
    ) -> None:
        self.ptr = 0
        self.nbytes = nbytes
        self.stream = stream
        self._arena = arena
        self._anchor = anchor  # keeps a caller's temporary stream object alive for the lease
        self._block: _Block | None = None
        self._sub: _Sub | None = None
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
            array = self._array = self._arena.provider.as_array(buffer, self.nbytes)
        return array

    def __enter__(self) -> Workspace:
        if self._state:
            raise RuntimeError("a lease can be entered only once; call arena.lease() again")
        if not self.nbytes:
            if self._arena.closed:  # takes nothing, yet a closed arena refuses every lease alike
                raise RuntimeError("this arena is closed")
            self._state = 1
            return self
        try:
            self._arena._acquire(self)  # sets _state = 1 together with the arena's bookkeeping
            return self
        except KeyboardInterrupt:
            # Ctrl-C after the lease was taken but before the with block began: nothing would ever release it.
            if self._state == 1:
                self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc_info: Any) -> None:
        interrupted = None
        while self._state == 1:
            try:
                if self.nbytes:
                    self._arena._release(self)  # sets _state = 2 together with the arena's bookkeeping
                else:
                    self._state = 2
            except KeyboardInterrupt as exc:  # the with block is over: a release cut short must be retried
                interrupted = interrupted or exc
        self._array = None
        self._anchor = None
        if interrupted is not None:
            raise interrupted

    def __repr__(self) -> str:
        state = ("not entered", "live", "released")[self._state]
        return f"<Workspace {format_size(self.nbytes)} at {self.ptr:#x} on stream {self.stream!r}, {state}>"
