"""Snapshots of an arena's bookkeeping, returned by :meth:`Arena.stats`."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ._keys import callers_key

if TYPE_CHECKING:
    from ._table import _Table

__all__ = ["ArenaStats", "StreamStats", "aligned_size"]

_SMALL = 256  # every capacity is a multiple of this (CUDA's allocation alignment)
_LARGEST_STEP = 2 << 20  # the driver's large-page size


def aligned_size(nbytes: int) -> int:
    """The capacity a sub-arena grows to for a request of ``nbytes``.

    The request rounded up to a step that grows with it: 256 B below 8 KiB, then the largest power of two
    not above ``nbytes / 16``, at most 2 MiB. So growth overshoots a request by less than 256 B or 1/16 of it
    (whichever is larger, and never by 2 MiB or more), while a run of slightly larger requests grows the
    buffer a bounded number of times instead of once per request: at most 16 times per doubling up to 32 MiB,
    and once per 2 MiB above (the same absolute waste as a 2 MiB page). Doubling is avoided on purpose: it
    would hold up to twice the largest workspace, which is exactly the memory the arena exists to save.
    """
    if nbytes <= 0:
        return 0
    step = max(_SMALL, min(_LARGEST_STEP, 1 << max(0, nbytes.bit_length() - 5)))
    return -(-nbytes // step) * step


class _Fields:
    """Item access beside attribute access: ``stats["capacity_bytes"] == stats.capacity_bytes``."""

    def __getitem__(self, name: str) -> Any:
        if name not in self.keys():
            raise KeyError(name)
        return getattr(self, name)

    def keys(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self))  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def to_dict(self) -> dict[str, Any]:
        """A plain ``dict`` (nested for ``streams``, keyed by ``repr`` of the stream key)."""
        out: dict[str, Any] = {}
        for name in self.keys():
            value = getattr(self, name)
            if name == "streams":
                value = {repr(k): v.to_dict() for k, v in value.items()}
            out[name] = value
        return out


@dataclasses.dataclass(frozen=True)
class StreamStats(_Fields):
    """One sub-arena (one stream or CPU lane).

    Attributes
    ----------
    capacity_bytes : int
        Size of the sub-arena's current buffer (0 before the first lease and after a trim).
    high_water_bytes : int
        Largest lease on this sub-arena since it was created.
    allocations : int
        Buffers allocated for it (the first one and every growth).
    growths : int
        Allocations that replaced a smaller buffer.
    leases : int
        Live leases (zero-byte leases hold nothing and are not counted).
    retired_bytes : int
        Outgrown buffers still used by a live lease; each is freed, in stream order, when its last lease ends.
    pinned_bytes : int
        This stream's buffers that a CUDA graph captured and still holds (current, outgrown or trimmed); each is
        freed, in stream order, once no graph holds it.
    """

    capacity_bytes: int
    high_water_bytes: int
    allocations: int
    growths: int
    leases: int
    retired_bytes: int
    pinned_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class ArenaStats(_Fields):
    """The whole arena: totals, and one :class:`StreamStats` per live sub-arena in ``streams``.

    Attributes
    ----------
    capacity_bytes : int
        Sum of the sub-arenas' capacities: what the arena holds, outgrown buffers aside.
    high_water_bytes : int
        Largest lease since the arena was created (it survives trims and swept sub-arenas).
    allocations, growths : int
        Totals since the arena was created.
    frees : int
        Buffers given back to the provider since the arena was created (``allocations - frees`` buffers are held).
    leases : int
        Live leases.
    retired_bytes : int
        Sum of the sub-arenas' ``retired_bytes``.
    streams : Mapping
        Stream key (raw handle on a device, lane key on the host, as the caller passed it) to :class:`StreamStats`.
        A snapshot keeps the lane key objects it names alive, and so their lanes: drop it once read.
    pinned_bytes : int
        Buffers that CUDA graphs captured and still hold, over every stream (those of streams forgotten since
        included): workspace alone (what else the graphs keep: ``kept_bytes``).
    refused_bytes : int
        The smallest growth the provider refused since it last granted one as large (or since :meth:`Arena.trim`):
        a call that can fall back to a buffer its stream holds does not ask for as much again for a while
        (:meth:`Arena.defers_growth`; a lease itself always asks). 0: none.
    kept_bytes : int
        Arrays kept for CUDA graphs, by this arena's pins (:meth:`Arena.keep_with_capture`): what the calls captured
        on its streams allocated (copies of operands, results made without ``out=``), and a program's own arrays it
        was given. Each counted by the ``nbytes`` of the array that owns its memory (the ``base`` of a NumPy or CuPy
        view), once however many views of it, or graphs, keep it; read as it is kept, never again. An object whose
        ``base`` cannot be read (a property that raises) counts as its own owner, and one whose ``nbytes`` cannot
        be read (none, a property that raises, no integer) counts 0. 0 once those graphs are destroyed and what
        they kept is let go (what may free device memory as it goes waits while a capture is under way). Not per
        stream: a graph may capture several.
    """

    capacity_bytes: int
    high_water_bytes: int
    allocations: int
    growths: int
    frees: int
    leases: int
    retired_bytes: int
    streams: Mapping[Hashable, StreamStats]
    pinned_bytes: int = 0
    refused_bytes: int = 0
    kept_bytes: int = 0

    def __reduce__(self) -> tuple[Any, ...]:
        # pickle and deepcopy cannot take the read-only view of ``streams``: they get a dict, and wrap it again
        fields = {name: getattr(self, name) for name in self.keys()}
        fields["streams"] = dict(self.streams)
        return (_arena_stats, (fields,))


def _arena_stats(fields: dict[str, Any]) -> ArenaStats:
    """An :class:`ArenaStats` from its fields, ``streams`` a plain dict (unpickling)."""
    return ArenaStats(**{**fields, "streams": MappingProxyType(dict(fields["streams"]))})


def snapshot(table: _Table) -> ArenaStats:
    """The stats of the sub-arenas in ``table`` now (the arena's lock held); ``kept_bytes``, its pins' count
    (:class:`~wsarena.arena._pins.KeptBytes`), made as they keep."""
    streams = {
        callers_key(key): StreamStats(
            capacity_bytes=sub.capacity(),
            high_water_bytes=sub.high_water,
            allocations=sub.allocations,
            growths=sub.growths,
            leases=int(sub.holder_block is not None),
            retired_bytes=sub.retired_bytes(),
            pinned_bytes=table.pinned_bytes(sub, key),
        )
        for key, sub in table.subs.items()
    }
    totals = table.totals
    return ArenaStats(
        capacity_bytes=sum(s.capacity_bytes for s in streams.values()),
        high_water_bytes=totals.high_water,
        allocations=totals.allocations,
        growths=totals.growths,
        frees=totals.frees,
        leases=sum(s.leases for s in streams.values()),
        retired_bytes=sum(s.retired_bytes for s in streams.values()),
        streams=MappingProxyType(streams),
        pinned_bytes=sum(s.pinned_bytes for s in streams.values()) + sum(
            block.size for key, block, _ in table.kept if key not in table.subs and block.pinned()
        ),
        refused_bytes=table.refusals.nbytes,
        kept_bytes=table.kept_arrays.nbytes,
    )
