"""Module locks that a forked child can take.

A lock held by another thread at ``os.fork()`` stays held in the child, where that thread does not exist: the
child would wait for it for ever. Each lock made here is made free again in the child (``os.register_at_fork``),
which is right for locks that guard a few stores at a time (the data they guard is whole between two bytecodes,
and the fork happens between two bytecodes). Arenas, whose lock guards more than that, start again in the child
instead (:mod:`wsarena.arena._lifecycle`).
"""

from __future__ import annotations

import os
import threading
from typing import Any

__all__ = ["lock", "rlock"]


def _reinit_in_child(made: Any) -> Any:
    os.register_at_fork(after_in_child=made._at_fork_reinit)  # what the standard library does for its own locks
    return made


def lock() -> threading.Lock:
    """A ``threading.Lock`` that a forked child finds free."""
    made: threading.Lock = _reinit_in_child(threading.Lock())
    return made


def rlock() -> threading.RLock:
    """A ``threading.RLock`` that a forked child finds free."""
    made: threading.RLock = _reinit_in_child(threading.RLock())
    return made
