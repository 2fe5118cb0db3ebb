"""The three convolution passes and which tensor each operand of a pass is.

A convolution ``y = conv(x, w)`` has three passes. Each reads two tensors and writes a third; every function of
wsarena that runs a pass takes them in the order ``(a, b, out)``:

==============  ==============  =================  ========================  =======================
pass            ``a``           ``b``              ``out``                   cuDNN's argument order
==============  ==============  =================  ========================  =======================
``fwd``         x               w                  y                         x, w, y
``bwd_data``    dy (as y)       w                  dx (as x)                 w, dy, dx
``bwd_filter``  x               dy (as y)          dw (as w)                 x, dy, dw
==============  ==============  =================  ========================  =======================

A *role* names a tensor by the forward convolution it belongs to: ``"x"``, ``"w"`` or ``"y"``, so that dy
has y's shape and descriptor, dx has x's, dw has w's.
"""

from __future__ import annotations

import enum
from typing import Any

from ._sizes import short_repr

__all__ = ["PASSES", "Pass"]


class Pass(enum.StrEnum):
    """A convolution pass. Members equal their names as strings: ``Pass.FWD == "fwd"``.

    ``Pass(name)`` raises ``ValueError`` naming the three passes for anything else.
    """

    FWD = "fwd"
    BWD_DATA = "bwd_data"
    BWD_FILTER = "bwd_filter"

    @property
    def roles(self) -> tuple[str, str, str]:
        """The roles of ``(a, b, out)``: ``("x", "w", "y")`` for ``fwd``, ``("y", "w", "x")`` for ``bwd_data``,
        ``("x", "y", "w")`` for ``bwd_filter``."""
        return _ROLES[self]

    @property
    def names(self) -> tuple[str, str, str]:
        """What the public ops call ``(a, b, out)``: ``("x", "w", "y")``, ``("dy", "w", "dx")``,
        ``("x", "dy", "dw")``."""
        return _NAMES[self]

    @property
    def cudnn_order(self) -> tuple[str, str, str]:
        """The roles in the order cuDNN's functions take them: the two inputs, then the tensor written."""
        return _CUDNN_ORDER[self]

    @staticmethod
    def xwy(pass_: str, a: Any, b: Any, out: Any) -> tuple[Any, Any, Any]:
        """``(x, w, y)`` of ``pass_``'s ``(a, b, out)``: ``(dx, w, dy)`` for ``bwd_data``. ``pass_`` is a member or
        its name; ``KeyError`` for another string (the callers run a pass already checked)."""
        i, j, k = _XWY[pass_]
        operands = (a, b, out)
        return operands[i], operands[j], operands[k]

    @classmethod
    def _missing_(cls, value: object) -> Pass:
        raise ValueError(f"pass must be one of {', '.join(map(repr, PASSES))}, not {short_repr(value)}")


_ROLES = {Pass.FWD: ("x", "w", "y"), Pass.BWD_DATA: ("y", "w", "x"), Pass.BWD_FILTER: ("x", "y", "w")}
# Where x, w and y stand in (a, b, out): a dict lookup, for the calls that run a pass (Pass(name) alone costs more)
_XWY: dict[str, tuple[int, ...]] = {p: tuple(roles.index(r) for r in ("x", "w", "y")) for p, roles in _ROLES.items()}
_NAMES = {Pass.FWD: ("x", "w", "y"), Pass.BWD_DATA: ("dy", "w", "dx"), Pass.BWD_FILTER: ("x", "dy", "dw")}
_CUDNN_ORDER = {Pass.FWD: ("x", "w", "y"), Pass.BWD_DATA: ("w", "y", "x"), Pass.BWD_FILTER: ("x", "y", "w")}

PASSES: tuple[str, ...] = tuple(p.value for p in Pass)  # the names, in this order, for messages and defaults
