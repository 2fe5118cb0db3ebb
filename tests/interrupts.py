"""Delivering Ctrl-C where CPython may deliver it: as a function starts."""

from __future__ import annotations

import contextlib
import dis
import gc
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
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


def collecting(phase: str, info: dict[str, int]) -> None:
    """A ``gc.callbacks`` entry: whether a collection of cyclic garbage is under way (``collecting.now``). The
    finalizer of an arena from an earlier test collected meanwhile runs wsarena's frames, which must not take the
    interrupt meant for the run (Python ignores an exception there, with a warning)."""
    collecting.now = phase == "start"  # type: ignore[attr-defined]


collecting.now = False  # type: ignore[attr-defined]


def _run_traced(trace: Callable[..., Any], fired: Callable[[], bool], function: Callable[..., Any], args: Any) -> bool:
    """Call ``function(*args)`` with ``trace`` as this thread's trace function (and ``collecting`` watching the
    garbage collector), swallowing the ``KeyboardInterrupt`` that ``trace`` raised (``fired()`` says it did), not
    another. Returns ``fired()``."""
    sys.settrace(trace)
    gc.callbacks.append(collecting)
    try:
        function(*args)
    except KeyboardInterrupt:
        if not fired():
            raise
    finally:
        sys.settrace(None)
        gc.callbacks.remove(collecting)
        collecting.now = False
    return fired()


def interrupt_at_call(
    n: int, function: Callable[..., Any], *args: Any, skip: Callable[[Any], bool] = lambda code: False
) -> bool:
    """Call ``function(*args)``, raising ``KeyboardInterrupt`` once as the ``n``-th Python function call of that
    run starts (the call of ``function`` itself is the first; calls whose code object ``skip`` accepts are not
    counted, nor calls of a garbage collection under way). Returns whether it was raised (the exception is swallowed
    here, as a caller's ``except KeyboardInterrupt`` would). Stepping ``n`` from 1 until this returns ``False``
    delivers an interrupt at every function entry of the run, one run each.
    """
    calls = 0
    fired = False

    def trace(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls, fired
        if event == "call" and not collecting.now and not skip(frame.f_code):
            calls += 1
            if calls == n:
                sys.settrace(None)
                fired = True
                raise KeyboardInterrupt(f"at call {n}: {frame.f_code.co_qualname}")

    return _run_traced(trace, lambda: fired, function, args)


def _opcode_events() -> int:
    """How many "opcode" events a trace function gets from a short function's run, asking for them as
    interrupt_at_check does (``f_trace_opcodes`` set on the frame's "call" event). The thread's trace function, if
    any (a coverage tool's, a debugger's), is this one's meanwhile, and again once it returns: run as the module is
    imported, as a test module is collected, it must not end a coverage measure of the whole run."""

    def probe() -> None:
        for _ in range(2):
            pass

    events = 0

    def trace(frame: Any, event: str, arg: Any) -> Any:
        nonlocal events
        if frame.f_code is not probe.__code__:
            return None
        frame.f_trace_opcodes = True
        events += event == "opcode"
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        probe()
    finally:
        sys.settrace(previous)
    return events


# CPython 3.12.0 and 3.12.1 send no opcode event in a process until a trace function has asked for them in an earlier
# sys.settrace() (CPython's issue gh-114480): the first traced run of interrupt_at_check would see none of its checks
# after a call or at a loop's jump back. The first probe asks for them; the second finds them sent.
_opcode_events()
assert _opcode_events() > 0, "no opcode events: interrupt_at_check would place nothing but at a function's start"

_WATCHED = tuple(f"{os.sep}{name}" for name in ("threading.py", "test_reliability_interrupts.py")) + tuple(
    str(path) for path in (Path(__file__).resolve().parent.parent / "wsarena").rglob("*.py")
)
_CHECKED_AFTER = {dis.opmap[name] for name in ("CALL", "JUMP_BACKWARD") if name in dis.opmap}


def interrupt_at_check(
    n: int, function: Callable[..., Any], *args: Any, skip: Callable[[Any], bool] = lambda code: False,
    after: Callable[[], bool] = lambda: True, instead: Callable[[], Any] | None = None,
) -> bool:
    """Call ``function(*args)``, raising ``KeyboardInterrupt`` once at the ``n``-th place of that run where CPython
    runs signal handlers: as a Python function starts, just after a call returns, and at a loop's jump back (the
    instruction after a ``CALL`` or ``JUMP_BACKWARD`` of the same frame), in this thread's frames of wsarena, of
    the tests and of ``threading`` (not in a garbage-collector callback of some other library's that happens to run
    meanwhile), leaving out frames whose code object ``skip`` accepts. Returns whether it was raised (the exception
    is swallowed here). Stepping ``n`` from 1 until this returns ``False`` delivers a Ctrl-C at every such place of
    the run, one run each. ``after``: places are counted only once it returns true (once the run raised a first
    Ctrl-C of the caller's own, say, for a second on its heels). ``instead``: called there rather than raising (what
    another thread does, which CPython may switch to at those places too).
    """
    checks = 0
    fired = False
    last: dict[int, int] = {}  # frame id -> the opcode it executed last

    def trace(frame: Any, event: str, arg: Any) -> Any:
        nonlocal checks, fired
        if fired or collecting.now or not frame.f_code.co_filename.endswith(_WATCHED) or skip(frame.f_code):
            return None
        frame.f_trace_opcodes = True
        here = id(frame)
        if event == "call":
            last[here] = -1
            checked = True
        elif event == "opcode":
            checked = last.get(here) in _CHECKED_AFTER
            last[here] = frame.f_code.co_code[frame.f_lasti]
        else:
            if event == "exception":  # a call that raised: its frame goes on at a handler, where nothing is checked
                last[here] = -1
            return trace
        if checked and after():
            checks += 1
            if checks == n:
                fired = True
                if instead is not None:
                    instead()
                    return None
                raise KeyboardInterrupt(f"at check {n}: {frame.f_code.co_qualname}:{frame.f_lineno}")
        return trace

    return _run_traced(trace, lambda: fired, function, args)


def from_a_frame_of(function: Callable[..., Any]) -> Callable[[], bool]:
    """An ``after`` for :func:`interrupt_at_check`: true from the first check made while a frame of ``function`` is
    on this thread's stack on (where a step begins that must lose nothing from its first instruction on)."""
    code = function.__code__
    began = False

    def after() -> bool:
        nonlocal began
        frame = None if began else sys._getframe()
        while frame is not None and frame.f_code is not code:
            frame = frame.f_back
        began = began or frame is not None
        return began

    return after


def within_a_frame_of(function: Callable[..., Any]) -> Callable[[], bool]:
    """An ``after`` for :func:`interrupt_at_check`: true while a frame of ``function`` is on this thread's stack (the
    checks of a step alone, its own frame's and those of what it calls)."""
    code = function.__code__

    def within() -> bool:
        frame = sys._getframe()
        while frame is not None and frame.f_code is not code:
            frame = frame.f_back
        return frame is not None

    return within
