"""Delivering Ctrl-C where CPython may deliver it: as a function starts."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def interrupt_at_entry_of(function: Callable[..., Any]) -> Iterator[None]:
    """Within the block, raise ``KeyboardInterrupt("at <qualified name>")`` once, as ``function`` starts."""
    code = function.__code__

    def trace(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is code:
            sys.settrace(None)
            raise KeyboardInterrupt(f"at {code.co_qualname}")

    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(None)


def interrupt_at_call(
    n: int, function: Callable[..., Any], *args: Any, skip: Callable[[Any], bool] = lambda code: False
) -> bool:
    """Call ``function(*args)``, raising ``KeyboardInterrupt`` once as the ``n``-th Python function call of that
    run starts (the call of ``function`` itself is the first; calls whose code object ``skip`` accepts are not
    counted). Returns whether it was raised (the exception is swallowed here, as a caller's ``except
    KeyboardInterrupt`` would). Stepping ``n`` from 1 until this returns ``False`` delivers an interrupt at every
    function entry of the run, one run each.
    """
    calls = 0
    fired = False

    def trace(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls, fired
        if event == "call" and not skip(frame.f_code):
            calls += 1
            if calls == n:
                sys.settrace(None)
                fired = True
                raise KeyboardInterrupt(f"at call {n}: {frame.f_code.co_qualname}")

    sys.settrace(trace)
    try:
        function(*args)
    except KeyboardInterrupt:
        if not fired:
            raise
    finally:
        sys.settrace(None)
    return fired
