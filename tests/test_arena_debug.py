"""Debug mode, on either kind of arena: released bytes are poisoned, and overlapping live leases are caught."""

import numpy as np
import pytest

import wsarena
from wsarena.arena import Arena, Buffer, HostProvider
from wsarena.arena._arena import POISON_BYTE


def test_debug_poisons_released_bytes(arena, provider):
    with wsarena.config(debug=True), arena.lease(1000) as ws:
        view = ws.array
        view[:] = 1
    assert (view == POISON_BYTE).all()
    assert provider.fills and provider.fills[0][1:3] == (POISON_BYTE, 1000)


def test_debug_off_does_not_poison(arena, provider):
    with arena.lease(100) as ws:
        view = ws.array
        view[:] = 1
    assert (view == 1).all() and provider.fills == []


def test_debug_mode_from_environment(arena, monkeypatch):
    monkeypatch.setenv("WSARENA_DEBUG", "1")
    wsarena._config._reset()
    with arena.lease(64) as ws:
        view = ws.array
    assert (view == POISON_BYTE).all()


class _SameMemoryProvider(HostProvider):
    """A broken provider that hands every stream the same memory."""

    def __init__(self, device_id):
        self.device_id = device_id
        self.memory = np.empty(1 << 20, np.uint8)

    def allocate(self, nbytes, *, stream=None):
        return Buffer(self.memory.__array_interface__["data"][0], nbytes, self.memory[:nbytes])


def test_debug_catches_overlapping_leases_on_different_streams(arena_kind, key):
    arena = Arena(_SameMemoryProvider(arena_kind.device_id))
    with wsarena.config(debug=True):
        with arena.lease(100, stream=key("a")):
            with pytest.raises(AssertionError, match="overlaps"), arena.lease(100, stream=key("b")):
                pass
            assert arena.stats().leases == 1
        with arena.lease(100, stream=key("b")):  # no overlap once "a" is released
            pass
