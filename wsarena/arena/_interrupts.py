"""How the arena stays consistent when Ctrl-C lands in the middle of its bookkeeping.

CPython runs a signal handler (``KeyboardInterrupt`` for Ctrl-C) between instructions of the main thread: as a
function starts, after a call returns, at a loop's jump back, and while a blocking lock acquisition waits. It
never runs one inside a C function, so ``with lock:`` (acquired and released in C, the body protected from the
first instruction on) can neither leave the lock held nor release it twice. What an interrupt *can* do is stop
the arena's bookkeeping half way, stop the release of a lease before it starts, or stop a wait between letting go
of a lock and taking it back (``threading.Condition.wait`` has such a place: an interrupt there lets the caller's
``with`` release a lock it no longer holds, "cannot release un-acquired lock"). The rules, in one place:

1. The arena takes its lock only with ``with self._lock:``; it never releases and retakes it by hand, and never
   waits while holding it: a waiting thread queues a lock of its own, leaves the ``with`` block and waits on that
   lock (a C call), then takes the arena's lock again with ``with`` (:func:`~wsarena.arena._sub.wait`).
2. Each step that must not be left undone (ending a lease, ending a growth) is an idempotent method, and runs
   under :func:`finish`, which repeats it until one run completes and raises the interruption afterwards.
3. Within such a step, what other threads wait for changes by plain stores with no call in between, so a
   repeat finds either all of it done or none of it; and every wait re-checks its condition every
   ``RECHECK_SECONDS``, so a wake-up lost to an interrupt delays a waiting thread but never strands it.
4. What no step can cover (an interrupt on the first instruction of ``__exit__`` or of :func:`finish`, or at its
   jump back) is covered by ownership: a lease is held through a weak reference to what will end it, the bound
   ``__exit__`` its ``with`` statement keeps until the statement is over (or, for a lease entered by hand, its
   Workspace); a growth, through one to its lease or its ``reserve`` call. Once that is gone, nothing can end the
   lease or the growth any more, and the arena ends it when it next looks at the stream, or at every stream (a trim,
   stats, close: :mod:`wsarena.arena._table`). So a ``with arena.lease(...) as ws:`` that was interrupted anywhere
   leaves the stream usable by the next statement, whether or not ``ws`` still refers to the Workspace.
5. Weakref callbacks, which the collector may run anywhere, are C calls (``deque.append``) or absent: an
   interrupt that landed in Python code there would be lost. The one exception is the finalizer that frees a
   collected arena's buffers (an interrupt there leaves the closed arena it hands them to kept, for the next trim,
   stats or growth of any arena to close again, or, before that arena could free anything, them to their owner
   objects' own collection). The graph API's plan cache's (``backends._graph_plans._hand_over``) holds what it
   hands over or defers (its records, its plans) first, in one C call, and lets go of it last: an interrupt there
   leaves it held for good. The finalizers of what the arena does not own (cuDNN handles, descriptors and plans,
   the CPU backend's lowered calls) are Python too: an interrupt there is lost, and what it was to destroy or let
   go of stays, never destroyed twice.
6. A buffer changes hands within one C call: from the provider's ``allocate`` into a list (``list.extend`` over a
   ``map``), from there, where the growth fails or is interrupted before the buffer is installed, to the arena's
   queue of buffers no sub-arena was given (the error path's first call, so that a second Ctrl-C on the heels of the
   first finds it there), from the queue of buffers let go to ``deallocate``, or to the list of those that wait for a
   capture to end (a ``for`` loop over ``iter(queue.popleft, None)``, whose body calls no Python function first),
   never through a local that an interrupt as the call returns would leave holding it. What the provider does in its
   own frames is its own (a Ctrl-C inside ``allocate`` or ``deallocate`` may lose that buffer). Likewise a sub-arena
   that is forgotten queues its buffers before it leaves the table.
7. An array kept for a CUDA graph (:meth:`~wsarena.arena._pins.GraphPin.keep`) goes to its pin within one C call
   (``dict.update`` over a ``zip``), in a step that runs under :func:`finish` from the first instruction of the
   keep on (the ops' ``_keep_with_capture``, ``Arena.keep_with_capture``, the pin's own): an interrupt before that
   call runs the step again, one after it finds the array kept. The count of what pins keep
   (:class:`~wsarena.arena._pins.KeptBytes`) changes owner by owner, with no call between the stores of one, and
   the pin records each owner it counted, so that a step run again counts none twice; letting go of a pin's
   objects is such steps too, the pin taken off the list of those that keep last. A captured call's copy of an
   operand goes to the list the call keeps from within the C call that makes it (``ops._made_contiguous``: a slice
   assignment over a ``map``), so that no Ctrl-C lands between the copy and its store.
8. No loop has its jump back outside the ``with`` around it (above all one that holds a lock, wsarena's or the
   backends'), nor outside a ``try`` whose ``finally``, or an ``except`` that catches a Ctrl-C, cleans up (closes a
   descriptor, releases a lock, restores a state). CPython 3.13 takes a Ctrl-C at a loop's jump back, and its
   compiler may leave that jump outside the ``with`` or ``try``, whose ``__exit__`` or ``finally`` then does not run
   (python/cpython#130279): a lock stayed held, and every later call waited for it; a descriptor stayed open. Such a
   loop runs in a function of its own, or in a generator expression that a call consumes (``list(k for k in keys
   if ...)``, where a list comprehension, inlined since CPython 3.12, would not do): raised in a function the locking
   one calls, the Ctrl-C reaches it at the call, inside its ``with`` or ``try``. The tests scan the bytecode around
   every ``with`` and every such ``try`` of the package on 3.13 for such a jump.
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
