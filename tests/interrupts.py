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
