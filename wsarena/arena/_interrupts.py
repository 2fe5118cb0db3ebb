"""How the arena stays consistent when Ctrl-C lands in the middle of its bookkeeping.

CPython runs a signal handler (``KeyboardInterrupt`` for Ctrl-C) between instructions of the main thread: as a
function starts, after a call returns, at a loop's jump back, and while a blocking lock acquisition waits. It
never runs one inside a C function, so ``with lock:`` (acquired and released in C, the body protected from the
first instruction on) can neither leave the lock held nor release it twice. What an interrupt *can* do is stop
the arena's bookkeeping half way, or stop the release of a lease before it starts. The rules, in one place:

1. The arena takes its lock only with ``with self._lock:``; it never releases and retakes it by hand.
2. Each step that must not be left undone (ending a lease, ending a growth) is an idempotent method, and runs
   under :func:`finish`, which repeats it until one run completes and raises the interruption afterwards.
3. Within such a step, what other threads wait for changes by plain stores with no call in between, so a
   repeat finds either all of it done or none of it; and every wait re-checks its condition every
   ``RECHECK_SECONDS``, so a wake-up lost to an interrupt delays a waiting thread but never strands it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["RECHECK_SECONDS", "finish"]

T = TypeVar("T")

RECHECK_SECONDS = 0.05


def finish(step: Callable[..., T], *args: object) -> T:
    """Run ``step(*args)`` to completion despite ``KeyboardInterrupt``, then raise the first one (if any).

    ``step`` must be idempotent: an interrupted run is followed by another. Other exceptions pass through at
    once. An interrupt that lands as this function itself starts still escapes it; a lease cut short that way
    stays held until its :class:`~wsarena.arena.Workspace` is released again.
    """
    interrupted: KeyboardInterrupt | None = None
    while True:
        try:
            result = step(*args)
            break
        except KeyboardInterrupt as exc:
            interrupted = interrupted or exc
    if interrupted is not None:
        try:
            raise interrupted
        finally:
            interrupted = None  # no cycle between this frame and the traceback that holds it
    return result
