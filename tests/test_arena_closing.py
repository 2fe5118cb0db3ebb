"""Closing an arena, on either kind: idle buffers go at once, leased ones when their lease ends, and a growth
or a wait under way when it closes is refused without losing a buffer."""

import threading

import pytest

from wsarena.arena import Arena
from wsarena.errors import ArenaClosedError, ArenaOutOfMemoryError, WsarenaError

from .arena_helpers import GatedProvider, Plan, wait_for_a_waiter


def test_close_frees_idle_buffers_now_and_busy_ones_at_release(arena, provider, key):
    arena.reserve(100, stream=key("idle"))
    with arena.lease(100, stream=key("busy")):
        arena.close()
        arena.close()  # idempotent
        assert len(provider.frees) == 1
    assert provider.held == []


def test_repr_says_what_the_arena_holds_and_whether_it_is_closed(arena, provider, key):
    name = repr(provider)
    assert repr(arena) == f"<Arena {name}: 0 stream(s), 0 B>"
    arena.reserve(1000, stream=key("idle"))
    with arena.lease(4096, stream=key("busy")):
        assert repr(arena) == f"<Arena {name}: 2 stream(s), 5 KiB>"
        arena.close()
        assert repr(arena) == f"<Arena {name}: 1 stream(s), 4 KiB, closed>"  # the live lease's buffer
    assert repr(arena) == f"<Arena {name}: 0 stream(s), 0 B, closed>"


@pytest.mark.parametrize("nbytes", [0, 100])
def test_a_closed_arena_refuses_a_reserve_as_it_does_a_lease_whatever_it_takes(arena, key, nbytes):
    """With ``wsarena.ArenaClosedError``: caught by ``WsarenaError``, as the README says what a program meets as it
    runs is (another thread may close the arena), and still a ``RuntimeError``, as it was. Once, a plain
    ``RuntimeError``."""
    arena.reserve(1000, stream=key("s"))
    arena.close()
    for call in (
        lambda: arena.lease(nbytes, stream=key("s")).__enter__(),
        lambda: arena.reserve(nbytes, stream=key("s")),
        lambda: arena.reserve_for(Plan(nbytes), streams=[key("s")]),
    ):
        with pytest.raises(WsarenaError, match="^this arena is closed$") as caught:
            call()
        assert type(caught.value) is ArenaClosedError and isinstance(caught.value, RuntimeError)
    assert arena.stats().streams == {}


@pytest.mark.parametrize("call", ["reserve", "lease"])
def test_close_during_a_growth_refuses_it_and_frees_what_it_allocated(arena_kind, key, call):
    provider = GatedProvider(arena_kind.device_id)
    arena = Arena(provider)
    errors = []

    def grow():
        try:
            if call == "reserve":
                arena.reserve(1 << 20, stream=key("L"))
            else:
                with arena.lease(1 << 20, stream=key("L")):
                    errors.append("granted")
        except RuntimeError as exc:
            errors.append((type(exc), str(exc)))

    thread = threading.Thread(target=grow)
    thread.start()
    assert provider.allocating.wait(10)
    arena.close()
    provider.gate.set()
    thread.join(10)
    assert errors == [(ArenaClosedError, "this arena is closed")]
    assert provider.held == [] and arena.stats().capacity_bytes == 0


def test_a_thread_waiting_for_a_growth_when_the_arena_closes_does_not_grow_it_again(arena_kind, key):
    provider = GatedProvider(arena_kind.device_id)
    arena = Arena(provider)
    errors = []

    def run(call):
        try:
            call()
        except RuntimeError as exc:
            errors.append(str(exc))

    first = threading.Thread(target=run, args=(lambda: arena.reserve(4096, stream=key("L")),))
    first.start()
    assert provider.allocating.wait(10)
    second = threading.Thread(target=run, args=(lambda: arena.lease(1 << 20, stream=key("L")).__enter__(),))
    second.start()
    wait_for_a_waiter(arena, key("L"))
    arena.close()
    provider.gate.set()
    first.join(10)
    second.join(10)
    assert errors == ["this arena is closed"] * 2
    assert len(provider.allocations) == 1 and provider.held == []


def test_close_during_a_failing_growth_frees_the_old_buffer(arena, provider, key):
    arena.reserve(4096, stream=key("L"))

    def fail(nbytes):
        arena.close()  # as another thread could while the lock is released to allocate
        return True

    provider.fail = fail
    with pytest.raises(ArenaOutOfMemoryError), arena.lease(1 << 20, stream=key("L")):
        pass
    assert provider.held == []


def test_close_while_a_thread_waits_for_the_stream_frees_it_after_both(arena, provider, key):
    waiting, outcome = threading.Event(), []

    def waiter():
        waiting.set()
        try:
            with arena.lease(4096, stream=key("L")):
                outcome.append("granted")
        except RuntimeError as exc:
            outcome.append(str(exc))

    with arena.lease(4096, stream=key("L")):
        thread = threading.Thread(target=waiter)
        thread.start()
        assert waiting.wait(10)
        wait_for_a_waiter(arena, key("L"))
        arena.close()
    thread.join(10)
    assert outcome == ["this arena is closed"]
    assert provider.held == []
