"""What the arena tests share: the kinds of arena under test, and the providers and plans they are given.

The ``arena_kind``, ``key``, ``provider`` and ``arena`` fixtures (in ``conftest.py``) run a test on both kinds
of arena; ``host_provider`` / ``host_arena`` and ``device_provider`` / ``device_arena`` on one kind.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Hashable
from typing import Any

from wsarena.arena import Arena
from wsarena.arena.testing import RecordingProvider

KINDS = ("host", "device")


class ArenaKind:
    """One kind of arena under test.

    ``"host"``: a host arena, whose sub-arenas are CPU lanes (any hashable key). ``"device"``: an arena over
    ``RecordingProvider(device_id=0)``, whose sub-arenas are keyed by CUDA stream handles (handle 2 per thread)
    while it hands out host memory, so that the device rules run without a GPU.
    """

    def __init__(self, name: str) -> None:
        if name not in KINDS:
            raise ValueError(f"arena kind must be one of {KINDS}, not {name!r}")
        self.name = name
        self.device_id = None if name == "host" else 0
        self._handles: dict[Hashable, int] = {}

    @property
    def host(self) -> bool:
        """Whether sub-arenas are CPU lanes."""
        return self.device_id is None

    def key(self, name: Hashable) -> Hashable:
        """The stream a test calls ``name``: on the host ``name`` itself (a lane key), on the device a handle of
        its own for this kind, the same each time it is asked for (3, 4, ...: not 0, 1 or 2, which name the
        legacy and per-thread default streams)."""
        if self.host:
            return name
        return self._handles.setdefault(name, 3 + len(self._handles))

    def nested_error(self, key: Hashable) -> str:
        """A pattern for the error of a nested lease on ``key`` (the resolved key)."""
        where = "CPU lane" if self.host else "stream"
        return re.escape(f"already holds a lease on {where} {key!r}")

    def __repr__(self) -> str:
        return f"ArenaKind({self.name!r})"


def snapshot(arena: Arena) -> dict[str, Any]:
    """The arena's statistics as a plain dict, to compare before and after."""
    return arena.stats().to_dict()


class GatedProvider(RecordingProvider):
    """Allocations wait at a gate, so that a test can act (close the arena, lease) while one is under way."""

    def __init__(self, device_id: int | None = None) -> None:
        super().__init__(device_id=device_id)
        self.allocating = threading.Event()
        self.gate = threading.Event()

    def allocate(self, size: int, *, stream: Any) -> Any:
        self.allocating.set()
        assert self.gate.wait(10)
        return super().allocate(size, stream=stream)


class Plan:
    """A plan as ``Arena.reserve_for`` reads one: the capacity each planned stream needs."""

    def __init__(self, *stream_bytes: int) -> None:
        self.stream_bytes = stream_bytes

    def __repr__(self) -> str:
        return f"Plan{self.stream_bytes}"


def wait_for_a_waiter(arena: Arena, key: Hashable, timeout: float = 10) -> None:
    """Return once a thread waits on the sub-arena of ``key`` (for its lease or its growth), or after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while arena._subs[key].waiters == 0 and time.monotonic() < deadline:
        time.sleep(0.001)


class RefusalClock:
    """What the arena times the provider's refusals by (``wsarena.arena._refusals.clock``), moved on by the test
    alone: ``now`` in seconds."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def refusing(provider: RecordingProvider, clock: RefusalClock, seconds: float, limit: int = 4096) -> list[int]:
    """Make ``provider`` refuse more than ``limit`` bytes, each refusal taking ``seconds`` of ``clock``; returns the
    list of sizes it is asked for, as it is asked."""
    asked: list[int] = []

    def fail(nbytes: int) -> bool:
        asked.append(nbytes)
        if nbytes > limit:
            clock.now += seconds
            return True
        return False

    provider.fail = fail
    return asked
