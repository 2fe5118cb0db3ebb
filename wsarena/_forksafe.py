"""Locks that a forked child can take.

A lock held by another thread at ``os.fork()`` stays held in the child, where that thread does not exist: the
child would wait for it for ever. Each lock made here is made free again in the child (``os.register_at_fork``),
which is right for locks that guard a few stores at a time (the data they guard is whole between two bytecodes,
and the fork happens between two bytecodes). Arenas, whose lock guards more than that, start again in the child
instead (:mod:`wsarena.arena._lifecycle`).

The locks are held weakly, and freed by one at-fork hook, registered as this module is imported (before any other
of wsarena's): a lock of an object (a cache) goes with it, where a hook of its own would keep it, and run at every
fork, for ever (at-fork hooks cannot be unregistered).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

__all__ = ["lock", "rlock"]

_made: weakref.WeakSet[Any] = weakref.WeakSet()


def _reinit_all_in_child() -> None:
    for made in list(_made):
        made._at_fork_reinit()  # what the standard library does for its own locks


os.register_at_fork(after_in_child=_reinit_all_in_child)


def lock() -> threading.Lock:
    """A ``threading.Lock`` that a forked child finds free."""
    made = threading.Lock()
    _made.add(made)
    return made


def rlock() -> threading.RLock:
    """A ``threading.RLock`` that a forked child finds free."""
    made = threading.RLock()
    _made.add(made)
    return made
