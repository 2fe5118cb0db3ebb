"""Buffers that no sub-arena uses any more but that a CUDA graph may still hold: kept aside (the table's ``kept``)
until no graph holds them, then freed in stream order; at exit, every buffer let go at once (one a graph holds is
abandoned); when the arena is collected, every buffer let go with no stream (one a graph holds is kept for it). These
functions are the routing table's methods (``_Table.release_kept`` and the like), written here to keep each module to
one job. Like every method of the table, they run with the arena's lock held.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from ._sub import _SubArena, abandoned

if TYPE_CHECKING:
    from ._table import _Table

__all__: list[str] = []  # the table's own methods: _Table.release_kept, .unstream_kept, .pinned_bytes, ...


def release_kept(self: _Table) -> int:
    """Free, in stream order, the kept buffers that no graph holds any more; return the bytes let go. The buffer of
    a per-thread default stream is queued with its key, as :meth:`_SubArena.free_stream` queues it: whichever thread
    drains the queue frees it on that stream only if it is its own (:func:`wsarena.arena._lifecycle.give_back`).

    Each is queued before it leaves the list: an interrupt in between leaves it listed, and marked freed, so that the
    next call only takes it off. (Taken off first, it was lost to an interrupt as that call returned.)"""
    released = 0
    for entry in list(self.kept):
        _, block, stream = entry
        if block.pinned():
            continue
        if not block.freed:
            block.freed = True
            self.totals.frees += 1
            self.to_free.append((block.buffer, stream))
            released += block.size
        self.kept.remove(entry)
    return released


def unstream_kept(self: _Table, key: Hashable, moved: Hashable = None) -> None:
    """The stream of ``key`` may be gone, or its death would go unseen from now on: its kept buffers, which recorded
    that stream when they were kept, are freed with no stream (the provider waits for the device), as its other
    buffers are; ``moved``: the key they are listed under from now on (a dead stream's, whose handle another stream
    has)."""
    kept = self.kept  # changed in place: every sub-arena shares this list
    for i, (k, block, stream) in enumerate(kept):
        if k == key and (stream is not None or moved is not None):
            kept[i] = (k if moved is None else moved, block, None)


def pinned_bytes(self: _Table, sub: _SubArena | None, key: Hashable) -> int:
    """Bytes of ``key``'s buffers that a graph holds: the current one, the outgrown one, and those kept."""
    held = 0
    if sub is not None:
        for block in (sub.block, sub.retired):
            if block is not None and block.pinned():
                held += block.size
    return held + sum(block.size for k, block, _ in self.kept if k == key and block.pinned())


def let_go_everything(self: _Table) -> None:
    """At exit: queue every buffer, even under live leases, and forget all.
    A buffer a graph still holds is abandoned instead (never freed: the graph may be replayed)."""
    if self.unplaced:
        self.let_go_unplaced()  # while what the arena holds is known
    blocks = [(sub.block, sub.retired) for sub in self.subs.values()]
    blocks += [(block, None) for _, block, _ in self.kept]
    for sub in list(self.subs.values()):
        sub.anchor = None
        sub.block = sub.retired = sub.holder_block = None
    self.kept.clear()
    for pair in blocks:
        for block in pair:
            if block is None or block.freed:
                continue
            block.freed = True
            if block.pinned():
                abandoned.append(block.buffer)
                continue
            self.totals.frees += 1
            self.to_free.append((block.buffer, None))  # its streams may be gone too
    self.subs.clear()


def let_go_collected(self: _Table) -> None:
    """The arena was collected (no lease can be live: leases hold the arena), and its streams may be gone with it (a
    raw handle's owner may have let go of both): forget every sub-arena, queue its buffers to be freed with no stream,
    and keep those a graph holds for it, to be freed with no stream too once it is gone. Unlike :meth:`_Table.forget`,
    this leaves the records of captures that may be under way: the frees with no stream wait for them. A buffer queued
    already on a stream (held back for a capture) is freed with no stream too, by the drain (``_pinning.give_back``).
    Idempotent: the heir's :meth:`Arena.close` runs it, again if an earlier run failed
    (``wsarena.arena._arena._collected``)."""
    if self.unplaced:
        self.let_go_unplaced()  # while what the arena holds is known: one it holds, handed out again, stays held
    for sub in list(self.subs.values()):
        sub.anchor = None
        for block, retired in ((sub.retired, True), (sub.block, False)):
            if block is not None:
                sub._let_go(block, None, block.pinned(), retired)
        if self.subs.get(sub.key) is sub:
            del self.subs[sub.key]
    kept = self.kept
    for i, (key, block, stream) in enumerate(kept):
        if stream is not None:
            kept[i] = (key, block, None)
