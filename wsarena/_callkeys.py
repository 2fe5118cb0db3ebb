"""Keys of call signatures. A training step repeats its calls, so what a call's arguments determine is remembered
per signature: by the ops, one record each (:mod:`wsarena.ops`), and by :mod:`wsarena.torch`, one checked geometry
and what goes with it each (:mod:`wsarena.torch._shapes`). Both key them and bound them alike, here."""

from __future__ import annotations

from typing import Any, TypeVar

__all__ = ["RECORDS_MAX", "Uncacheable", "freeze", "freeze_params", "remember"]

RECORDS_MAX = 4096  # signatures a table keeps; past it the table is emptied and rebuilt as calls come

K = TypeVar("K")
V = TypeVar("V")


class Uncacheable(Exception):
    """An argument that cannot key a signature: a call with it is checked afresh every time."""


def freeze(value: Any) -> Any:
    """``value`` with lists turned into tuples, so that the arguments of a call can key a record."""
    kind = type(value)
    if kind is int or kind is str or value is None:
        return value
    if kind is tuple or kind is list:
        for v in value:
            if type(v) is not int:
                return tuple(map(freeze, value))
        # ints alone, a stride or a shape: a loop and no generator, half the time (it runs several times a call)
        return value if kind is tuple else tuple(value)
    # Anything else is checked every time: a float or a bool equals an int as a key (True == 1) yet is invalid.
    raise Uncacheable


def freeze_params(params: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """``params`` with lists frozen into tuples, or ``None`` when one of them cannot key a record (a float, a bool,
    a NumPy integer: each call checks those afresh, since ``True == 1`` would find the record of ``1``)."""
    # Ints and tuples of ints (a module's parameters, wsarena.torch's) are a key as they are: told in one loop,
    # without a call of freeze for each, half the time
    for value in params:
        kind = type(value)
        if kind is tuple:
            for v in value:
                if type(v) is not int:
                    break
            else:
                continue
        elif kind is int:
            continue
        break
    else:
        return params
    try:
        return tuple(map(freeze, params))
    except Uncacheable:
        return None


def remember(table: dict[K, V], key: K, value: V) -> None:
    """``table[key] = value``, emptying ``table`` first when it holds :data:`RECORDS_MAX` signatures."""
    if len(table) >= RECORDS_MAX:
        table.clear()
    table[key] = value
