"""Growing a sub-arena: its buffer replaced by a larger one, for a lease or a reserve.

One thread at a time grows a sub-arena: the one whose token is in ``growing`` (a weak reference to the lease's
anchor, or to a reserve call's owner object, so that a growth cut short by an interrupt is known to be over once its
owner is gone). Others wait on a lock of their own, with the arena's lock let go. The provider is called with the
lock let go; the outgrown buffer is retired while a lease uses it (:meth:`_SubArena.install`). These functions are
the arena's methods (``Arena._grow`` and the like), written here to keep each module to one job.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Hashable
from functools import partial
from typing import TYPE_CHECKING, Any

from .._sizes import format_size, short_repr
from ..errors import ArenaOutOfMemoryError, ProviderError
from . import _refusals
from ._interrupts import finish
from ._keys import callers_key
from ._lifecycle import release_closed
from ._stats import aligned_size
from ._sub import _Block, _Owner, _SubArena, park, this_thread, wait

if TYPE_CHECKING:
    from ._arena import Arena
    from ._workspace import Workspace

__all__: list[str] = []  # the arena's own methods: Arena._grow_for, ._reserve, ._grow, ._end_growth


def _grow_for(self: Arena, ws: Workspace, sub: _SubArena) -> None:
    """Give ``ws``, which holds ``sub``, its bytes: once no other growth is under way, from the buffer if it
    is large enough, else from a new one."""
    n = ws.nbytes
    waiter = None
    while True:
        with self._lock:
            if self._table.closed:
                raise self._table.closed_error()
            over = self._table.growth_over(sub)
            if over:
                block = sub.block
                if block is not None and block.size >= n:
                    self._grant(sub, ws, block)
                    return
                if self._table.kept:  # a growth frees what released graphs held, as trim and stats do
                    self._table.release_kept()
                sub.grower = this_thread.token
                token = sub.growing = sub.holder  # the lease's own weak reference: it keeps nothing alive
            else:
                if sub.grower is this_thread.token:
                    raise _growing_already(self, sub)
                waiter = park(sub.growth_waiters, waiter)
        if not over:
            wait(waiter)
            continue
        self._grow(sub, token, n, ws._cap, ws)
        if ws._state == 1:  # granted the buffer it grew, as that was installed
            return
        # Not granted: the buffer was let go before the grant (a trim while an interrupt cut the installation
        # short). Grow again.


def _reserve(self: Arena, n: int, key: Hashable, anchor: Any, cap: int | None) -> None:
    """Grow the sub-arena of ``key`` to hold ``n`` bytes, unless it does already (``Arena.reserve``)."""
    if n == 0:
        if self._table.closed:  # reserves nothing, yet a closed arena refuses it, as it does a lease of 0 bytes
            raise self._table.closed_error()
        return
    refusal = self._growth_refusal(key, n)  # a stream being captured cannot grow
    owner = _Owner()  # the growth lasts while this frame does: an interrupt that ends it ends the growth
    token = weakref.ref(owner)
    waiter = None
    try:
        while True:
            with self._lock:
                if self._table.closed:
                    raise self._table.closed_error()
                sub = self._table.sub_for(key, anchor, capturing=refusal is not None)
                if self._table.growth_over(sub):
                    block = sub.block
                    if block is not None and block.size >= n:
                        return  # already large enough (maybe by another thread's growth)
                    if refusal is not None:
                        self._table.drop_if_idle(sub)  # made just now, maybe: it holds nothing
                        raise refusal
                    sub.grower = this_thread.token
                    sub.growing = token
                    break
                if sub.grower is this_thread.token:
                    raise _growing_already(self, sub)
                waiter = park(sub.growth_waiters, waiter)
            wait(waiter)
        try:
            self._grow(sub, token, n, cap)
        finally:
            if sub.growing is token:  # cut short before it could end its growth
                finish(self._end_growth, sub, token, None)
    finally:
        if self._to_free:
            self._give_back(key)


def _growing_already(self: Arena, sub: _SubArena) -> ProviderError:
    """The error of a thread that would wait for its own growth of ``sub``: one that the provider's ``allocate`` (or
    something it ran) asks for on that stream, which would never end."""
    return ProviderError(
        f"this thread is growing the workspace of stream {short_repr(sub.key)} already: {short_repr(self.provider)}"
        ".allocate, or something it ran, asked the arena for that stream's workspace again, which would wait for it "
        "forever"
    )


def _grow(self: Arena, sub: _SubArena, token: Any, n: int, cap: int | None, ws: Workspace | None = None) -> None:
    """Give ``sub`` a buffer of ``aligned_size(n)`` bytes (``sub.growing`` is ``token``; lock not held), and grant it
    to ``ws``, the lease growing it, if any. Raises the closed error if the arena closed meanwhile."""
    size = aligned_size(n)
    got: list[Any] = []
    freed_on = None  # where a buffer never installed is queued to be freed
    started = _refusals.clock()  # a refusal is timed: how long callers with a fallback then wait (_refusals.py)
    try:
        release_closed()  # what closed arenas kept for graphs gone since: freed before the provider is asked for more
        freed_on = sub.free_stream()  # read before a buffer exists: an interrupt in it loses none
        # allocate() hands its buffer to `got` within one C call (list.extend over a map): an interrupt lands as a
        # call returns to Python code, and one just after `buffer = allocate(...)` returned would lose the buffer.
        got.extend(map(partial(self.provider.allocate, stream=sub.stream), (size,)))
        if not got:  # allocate() raised StopIteration (a pool drawn by next()), which ended the map instead
            raise ProviderError(
                f"{short_repr(self.provider)}.allocate raised StopIteration for a request of {size} bytes"
            )
        buffer = got[0]
        block = _Block(buffer, *_address_and_size(self.provider, buffer, size))
    except BaseException as exc:
        if got and got[0] is not None:  # never installed: no one else would free it
            # Handed to the arena in one C call, before anything that a second Ctrl-C could land in; ending the growth
            # frees it, unless it is a buffer the arena holds, handed out again (Table.let_go_unplaced)
            self._table.unplaced.append((got[0], freed_on))
        finish(self._end_growth, sub, token, None)
        if isinstance(exc, MemoryError):
            now = _refusals.clock()
            with self._lock:
                self._table.refusals.refused(size, now - started, now)
            raise ArenaOutOfMemoryError(
                f"could not grow the workspace of stream {short_repr(sub.key)} to {format_size(size)}",
                requested=n, held=sub.capacity(), cap=cap,
            ) from exc
        raise
    clash = None
    try:
        clash = finish(self._end_growth, sub, token, block, ws)
    finally:
        # Refused (the arena closed, or the buffer overlaps one it holds), or cut short before it ran
        if not block.installed and not block.freed:
            self._to_free.append((buffer, freed_on))
    if self._table.closed:
        raise self._table.closed_error()
    if clash is not None:
        key, held = clash
        where = "that stream" if key is sub.key else f"stream {short_repr(callers_key(key))}"
        raise ProviderError(
            f"{short_repr(self.provider)}.allocate returned {short_repr(buffer)} for stream "
            f"{short_repr(callers_key(sub.key))}, whose bytes overlap {short_repr(held.buffer)}, which the arena holds "
            f"for {where}: the provider handed out memory that is in use"
        )


def _address_and_size(provider: Any, buffer: Any, size: int) -> tuple[int, int]:
    """``buffer.ptr`` and ``buffer.size`` as ints, of the buffer ``provider.allocate`` returned for ``size`` bytes:
    a ``TypeError`` if it is no :class:`~wsarena.arena.Buffer`, a :class:`~wsarena.errors.ProviderError` if it holds
    less."""
    if buffer is None:
        raise TypeError(f"{short_repr(provider)}.allocate returned None for a request of {size} bytes")
    try:
        ptr, nbytes = operator.index(buffer.ptr), operator.index(buffer.size)
    except (AttributeError, TypeError):
        raise TypeError(
            f"{short_repr(provider)}.allocate returned {short_repr(buffer)} for a request of {size} bytes, where a "
            "Buffer with an int ptr and size is expected"
        ) from None
    if nbytes < size:
        raise ProviderError(f"{short_repr(provider)} returned {short_repr(buffer)} for a request of {size} bytes")
    return ptr, nbytes


def _end_growth(
    self: Arena, sub: _SubArena, token: Any, block: _Block | None, ws: Workspace | None = None
) -> tuple[Hashable, _Block] | None:
    """End ``token``'s growth of ``sub``, installing ``block`` (if any) unless the arena closed meanwhile or ``block``
    overlaps a buffer the arena holds (returned then: :meth:`_Table.holding`; the caller frees ``block``), and
    granting it to ``ws`` if given. Idempotent (lock not held).

    The grant is made in the same locked step as the installation: until the lease holds the block, a trim or
    another thread's growth may let it go, and the lease would then be granted whatever the stream holds by the time
    it looked again (a smaller buffer, or none)."""
    with self._lock:
        clash = self._table.end_growth(sub, token, block)
        if (
            ws is not None and block is not None and sub.block is block and sub.holder is ws._ref
            and sub.holder_block is None
        ):
            self._grant(sub, ws, block)
    return clash
