"""Byte sizes written for people: ``"256MiB"``, ``"1.5GiB"``, ``"2GB"``; and the other figures the commands print
for people (seconds, percentages) and the values their errors quote; and :func:`write_text`, which writes such text
to a stream whose encoding may not show all of it.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal units (kB, MB, GB, TB) are powers of 1000.
A size must come out as a whole, non-negative number of bytes.
"""

from __future__ import annotations

import itertools
import json
import operator
import os
import re
import reprlib
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, TypeGuard

__all__ = ["format_size", "parse_size"]

INT32_MAX = 2**31 - 1  # the largest dimension or parameter a cuDNN descriptor holds (the batch's bound too)

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


class _Short(reprlib.Repr):
    """reprlib's cuts, but a list or tuple of more than 6 items (a dict of more than 4, a set of more than 6) ends in
    how many more it holds, ``[1, 2, 3, 4, 5, 6, ... 94 more]``, not in ``...``: in a tuple that reads as Python's
    Ellipsis, and says nothing of the length."""

    def _items(self, x: Any, level: int, left: str, right: str, limit: int, trail: str = "",
               show: Callable[[Any], str] | None = None) -> str:
        """``x``'s first ``limit`` items, each as ``show`` gives it (by default its own short repr), between ``left``
        and ``right``, and how many more it holds."""
        if level <= 0 and x:
            return f"{left}...{right}"
        shown = [self.repr1(item, level - 1) if show is None else show(item) for item in itertools.islice(x, limit)]
        if len(x) > limit:
            shown.append(f"... {len(x) - limit} more")
        elif len(x) == 1:
            right = trail + right
        return left + ", ".join(shown) + right

    def repr_tuple(self, x: tuple[Any, ...], level: int) -> str:
        return self._items(x, level, "(", ")", self.maxtuple, ",")

    def repr_list(self, x: list[Any], level: int) -> str:
        return self._items(x, level, "[", "]", self.maxlist)

    def repr_set(self, x: set[Any], level: int) -> str:
        if not x:
            return "set()"
        return self._items(_sorted(x), level, "{", "}", self.maxset)

    def repr_frozenset(self, x: frozenset[Any], level: int) -> str:
        if not x:
            return "frozenset()"
        return self._items(_sorted(x), level, "frozenset({", "})", self.maxfrozenset)

    def repr_int(self, x: int, level: int) -> str:
        try:
            return super().repr_int(x, level)
        except ValueError:  # repr() refuses past 4300 digits (or a limit lowered with sys.set_int_max_str_digits())
            return _bits(x)

    def repr_dict(self, x: dict[Any, Any], level: int) -> str:
        if not x:
            return "{}"
        return self._items(_sorted(x), level, "{", "}", self.maxdict,
                           show=lambda k: f"{self.repr1(k, level - 1)}: {self.repr1(x[k], level - 1)}")


def _sorted(items: Any) -> list[Any]:
    """A set's items (a dict's keys) sorted, as reprlib shows them, where they sort."""
    try:
        return sorted(items)
    except Exception:  # noqa: BLE001 - items that do not compare, or whose comparison fails
        return list(items)


# An error quotes what it was given, not a megabyte of it: reprlib cuts a long string's or number's middle
_SHORT = _Short()
_SHORT.maxstring = 60
_SHORT.maxother = 120  # another object's repr: its class's qualified name and address whole (a stream object's)


def short_repr(value: Any) -> str:
    """``repr(value)`` for an error message: a string's or a number's middle cut to ``...`` past about 60
    characters (another object's past 120), a list or tuple cut after 6 items (a dict after 4) and ended in how many
    more it holds."""
    if isinstance(value, int) and value.bit_length() > 4096:  # repr() itself refuses past 4300 digits
        return _bits(value)
    try:
        return _SHORT.repr(value)
    except ValueError:  # an int past a digit limit lowered with sys.set_int_max_str_digits()
        if isinstance(value, int):
            return _bits(value)
        raise


class _ShortJson(_Short):
    """:class:`_Short`'s cuts, with a value in JSON's words: a string in double quotes (its characters that print
    as they are, the others escaped as JSON escapes them), ``null``, ``true``, ``NaN``."""

    def repr_str(self, x: str, level: int) -> str:
        quoted = _json_quoted(x[: self.maxstring])
        if len(quoted) > self.maxstring:  # the middle cut, as reprlib cuts a str's repr
            i = max(0, (self.maxstring - 3) // 2)
            j = max(0, self.maxstring - 3 - i)
            quoted = _json_quoted(x[:i] + x[len(x) - j:])
            quoted = quoted[:i] + self.fillvalue + quoted[len(quoted) - j:]
        return quoted

    def repr_bool(self, x: bool, level: int) -> str:
        return "true" if x else "false"

    def repr_NoneType(self, x: None, level: int) -> str:  # reprlib's name for None's type
        return "null"

    def repr_float(self, x: float, level: int) -> str:
        return json.dumps(x)  # NaN and Infinity as the decoder reads them, where Python writes nan and inf


def _json_quoted(text: str) -> str:
    """``text`` in JSON's double quotes, a character that does not print as it is (a control character, U+2028)
    escaped as JSON escapes it, the others as they are."""
    return "".join(c if c.isprintable() else json.dumps(c)[1:-1] for c in json.dumps(text, ensure_ascii=False))


_SHORT_JSON = _ShortJson()
_SHORT_JSON.maxstring = _SHORT.maxstring
_SHORT_JSON.maxother = _SHORT.maxother


def short_json(value: Any) -> str:
    """What :func:`short_repr` says of ``value``, in JSON's words where ``value`` is what JSON text gives (a str, an
    int, a float, a bool, None, a list or a dict of str keys of them, as far down as it is shown): ``["a", "b"]``,
    ``{"k": null}``, ``NaN``. Another value (a tuple, an array, a dict of other keys: from a caller in Python, not from
    JSON text) is said in Python's words, all of it, where a mix would read as neither."""
    if not _is_json(value, _SHORT_JSON.maxlevel):
        return short_repr(value)
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4096:
        return _bits(value)
    try:
        return _SHORT_JSON.repr(value)
    except ValueError:  # an int past a digit limit lowered with sys.set_int_max_str_digits()
        return short_repr(value)


def _is_json(value: Any, levels: int) -> bool:
    """Whether ``value`` is of the types JSON text gives, down to ``levels`` levels (the rest is not shown)."""
    if type(value) in (str, int, float, bool) or value is None:
        return True
    if levels <= 0:
        return type(value) in (list, dict)
    if type(value) is list:
        return all(_is_json(item, levels - 1) for item in itertools.islice(value, _SHORT_JSON.maxlist))
    if type(value) is dict:
        return all(type(k) is str for k in value) and all(_is_json(v, levels - 1) for v in value.values())
    return False


def _bits(x: int) -> str:
    """An integer too long to write out, as how many bits it has, and its sign: "must be >= 1, not an integer of 16610
    bits" would read as a large number."""
    return f"{'a negative' if x < 0 else 'an'} integer of {x.bit_length()} bits"


def short_path(path: str | os.PathLike[str], *, quoted: bool = True) -> str:
    """``repr(path)`` (``quoted=False``: the path itself) for an error message: past 200 characters, the folders'
    middle cut to ``...`` and the file name kept (its last 120 characters at most), so that a 10 kB path does not
    give a 10 kB line and the file it names can still be told: ``'/data/models/v...vvvv/resnet50.onnx'``."""
    text = os.fspath(path)
    full = repr(text) if quoted else text
    if len(full) <= 200:
        return full
    name = os.path.basename(text.rstrip("/" + os.sep))
    keep = min(max(len(repr(name)) if quoted else len(name) + 1, 80), 120)  # with the separator before it
    return f"{full[:60]}...{full[-keep:]}"


def os_error_text(exc: OSError) -> str:
    """``str(exc)`` with the file names it quotes shortened as :func:`short_path` shortens them."""
    if exc.strerror is None or exc.filename is None:
        return str(exc)
    text = f"[Errno {exc.errno}] {exc.strerror}: {short_path(exc.filename)}"
    return text if exc.filename2 is None else f"{text} -> {short_path(exc.filename2)}"


# The most digits a size's whole part may have, whatever sys.get_int_max_str_digits() allows: no memory or disk is
# near it, and int() would take minutes over it.
_MOST_DIGITS = 10**6
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?|\.[0-9]+)\s*([A-Za-z]*)\s*")  # \d would take any script's digits


def parse_size(value: int | str) -> int:
    """Return ``value`` as a number of bytes.

    Accepts a non-negative integer (an ``int``, or any integer type such as ``numpy.int64``; not a ``bool``) or a
    string such as ``"0"``, ``"512"``, ``"64KiB"``, ``"1.5GiB"`` or ``"2GB"`` (ASCII digits; units are
    case-insensitive; no sign). Raises ``TypeError`` for other types and ``ValueError`` for a negative size, a sign
    (``"-0"``, ``"+4MiB"``), an unknown unit, a size that is not a whole number of bytes, or one of more digits
    than ``int()`` takes from a string (``sys.get_int_max_str_digits()``).
    """
    if not isinstance(value, str):
        n = as_int(value)
        if n is None:
            raise TypeError(f"a size must be an int or a string such as '256MiB', not {short_repr(value)}")
        if n < 0:
            raise ValueError(f"a size cannot be negative: {short_repr(value)}")
        return n
    match = _SIZE.fullmatch(value)
    unsigned = _SIZE.fullmatch(value.strip().removeprefix("-")) if match is None else None
    if unsigned is not None and not unsigned[1].strip("0."):  # "-0", "-0.0MiB": zero, which is not negative
        raise ValueError(f"a size is written without a sign: {short_repr(value)} (write 0)")
    if unsigned is not None:  # "-1", "-2GiB": a size, but negative
        raise ValueError(f"a size cannot be negative: {short_repr(value)}")
    signed = _SIZE.fullmatch(value.strip()[1:]) if match is None and value.strip().startswith("+") else None
    if signed is not None and signed[2].lower() in _UNITS:  # "+4MiB": a size, with a sign
        raise ValueError(f"a size is written without a sign: {short_repr(value)} (write "
                         f"{short_repr(value.strip()[1:].strip())})")
    if match is None:
        raise ValueError(f"not a size: {short_repr(value)} (expected e.g. '512', '64KiB', '1.5GiB', '2GB')")
    number, unit = match.groups()
    scale = _UNITS.get(unit.lower())
    if scale is None:
        known = ", ".join(u for u in ("B", "kB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB"))
        raise ValueError(f"unknown size unit {short_repr(unit)} in {short_repr(value)} (known: {known})")
    whole, _, fraction = number.partition(".")
    digits = len(whole)
    if 0 < sys.get_int_max_str_digits() < digits or digits > _MOST_DIGITS:  # as int() refuses it
        raise ValueError(f"a size of {digits} digits is too large")
    # Computed with ints: decimal.localcontext() sets a context variable, and a finalizer that the collector runs
    # meanwhile and that sets one too (a finalizer's configure(cap_workspace="1MiB")) crashed the interpreter on
    # 3.11 (decimal's current context across Python callbacks, python/cpython#148382). Past its trailing zeros, a
    # fraction of more digits than the largest unit (2**40) has factors of 2 is a whole number of bytes in no unit.
    fraction = fraction.rstrip("0")
    if len(fraction) > 40 or int(fraction or "0") * scale % 10 ** len(fraction):
        raise ValueError(f"{short_repr(value)} is not a whole number of bytes")
    return int(whole or "0") * scale + int(fraction or "0") * scale // 10 ** len(fraction)


def as_int(value: Any) -> int | None:
    """``value`` as an ``int`` where it is an integer of any type (``int``, ``numpy.int64``, ...), else ``None``: a
    ``bool`` (``True == 1``, yet no count), a float, NumPy's bool (no ``__index__``), an array of one element (whose
    ``__index__`` refuses). The one test of "an integer" behind every check that names its argument."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


# Text and binary data: sequences, but of characters or bytes, never a list of values (b"\x02\x04" is no shape (2, 4))
TEXT_OR_BYTES = (str, bytes, bytearray, memoryview)


def is_sequence(value: Any) -> TypeGuard[Sequence[Any]]:
    """Whether ``value`` is a sequence of values (a list, a tuple, a ``range``): text and binary data
    (:data:`TEXT_OR_BYTES`) are not, whose items would be read as characters or as small ints. The one test of "a
    sequence" behind every check of a shape or a per-dimension value."""
    return isinstance(value, Sequence) and not isinstance(value, TEXT_OR_BYTES)


def is_ordered(value: Any) -> TypeGuard[Iterable[Any]]:
    """Whether ``value`` is an ordered collection of values, which an argument taken in order (one entry per layer,
    per pass, per planned stream) must be: any iterable, an iterator too, but text and binary data
    (:data:`TEXT_OR_BYTES`: "fwd" would be ('f', 'w', 'd')), a set or a mapping (no order of their own: a set of str
    iterates in another order each run, as str hashes are randomized; a mapping gives its keys)."""
    return isinstance(value, Iterable) and not isinstance(value, (*TEXT_OR_BYTES, AbstractSet, Mapping))


def checked_ordered(name: str, value: Any, takes: str, why_ordered: str) -> Iterable[Any]:
    """``value``, the argument ``name``, where it is an ordered collection of values (:func:`is_ordered`); else a
    ``TypeError``. ``takes`` says what ``name`` takes; ``why_ordered``, after "a set has no order", why its order
    matters. The one wording of the refusal, for each argument taken in order."""
    if not is_ordered(value):
        why = f": a set has no order, {why_ordered}" if isinstance(value, (set, frozenset)) else ""
        raise TypeError(f"{name} must be {takes}, not {short_repr(value)}{why}")
    return value


def is_choice(value: Any, choices: tuple[str, ...]) -> bool:
    """Whether ``value`` is one of ``choices``, names: only a str is compared with them, as another object's ``==`` may
    raise, or answer an array, whose truth NumPy refuses ("ambiguous") and a one-element array's it takes (an array
    of "cpu" would be the setting "cpu"). The one test of a choice behind every check that names its argument."""
    return isinstance(value, str) and value in choices


def positive_batch(batch: Any, *, prefix: str = "batch ") -> int:
    """``batch`` as an ``int`` where it is a batch size: an integer of any type, 1 to :data:`INT32_MAX`. A
    ``TypeError`` for another type (a float, a ``bool``, an array of one element: :func:`as_int`), a ``ValueError``
    below 1 or above the bound. The one check of every API's ``batch``, and the bound ``--batch`` checks. ``prefix``
    begins the message, naming the batch: the argument's name, or nothing for ``--batch``'s type, whose error
    argparse begins with the flag (``argument --batch: ``)."""
    n = as_int(batch)
    if n is None:
        raise TypeError(f"{prefix}must be a positive int, not {short_repr(batch)}")
    if n < 1:
        raise ValueError(f"{prefix}must be a positive int, not {short_repr(batch)}")
    # A larger batch was refused as the first layer's input_shape, batch not named
    if n > INT32_MAX:
        raise ValueError(f"{prefix}must be at most 2**31 - 1 = {INT32_MAX}, the largest dimension a cuDNN descriptor "
                         f"holds, not {short_repr(batch)}")
    return n


_INTEGER = re.compile(r"\s*-?[0-9]+\s*")  # as sizes take digits: int() would take 1_0 and any script's digits


def ascii_int(text: str) -> int:
    """``text`` as an integer written in ASCII digits; ``ValueError`` otherwise, and ``OverflowError``, saying so,
    for one of more digits than ``int()`` takes from a string (``sys.get_int_max_str_digits()``)."""
    if _INTEGER.fullmatch(text) is None:
        raise ValueError(text)
    digits = len(text.strip().removeprefix("-"))
    if 0 < sys.get_int_max_str_digits() < digits:  # int()'s ValueError would read as no integer
        raise OverflowError(f"an integer of {digits} digits is too large")
    return int(text)


def format_size(nbytes: int) -> str:
    """Format a byte count in the smallest binary unit (up to TiB) that keeps it below 1024 once rounded to two
    decimals: ``"1.5 MiB"``, and ``"1 MiB"`` for 1048575, not ``"1024 KiB"``. ``nbytes`` is an integer of any type, as
    :func:`parse_size` takes (``numpy.int64``); not a ``bool``."""
    n = as_int(nbytes)
    if n is None:
        raise TypeError(f"format_size takes an int, not {short_repr(nbytes)}")
    nbytes = n
    sign = "-" if nbytes < 0 else ""
    n = abs(nbytes)
    if n < 2**10:
        return f"{sign}{n} B"
    for unit, scale in (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40)):
        # hundredths of the unit, rounded half to even in integers: a float quotient overflows past 2**1064 bytes
        hundredths, rest = divmod(n * 100, scale)
        if 2 * rest > scale or (2 * rest == scale and hundredths % 2):
            hundredths += 1
        if hundredths < 1024 * 100:  # 1023.999 KiB rounds to 1024: that is 1 MiB
            break
    whole, frac = divmod(hundredths, 100)
    return f"{sign}{int_text(whole)}{f'.{frac:02d}'.rstrip('0').rstrip('.')} {unit}"


_PART = 10**600  # fewer digits than any limit sys.set_int_max_str_digits() takes (640 at least)


def int_text(n: int, width: int = 0) -> str:
    """The decimal digits of ``n`` (``>= 0``), at least ``width`` of them (zeros first), however many: ``str()``
    refuses past ``sys.get_int_max_str_digits()`` (4300). Computed with ints, not ``decimal.Decimal``, which sets
    the thread's decimal context on first use (a context variable, as parse_size says)."""
    if n < _PART:
        return f"{n:0{width}d}"
    half = n.bit_length() * 30103 // 200000  # about half its digits (log10(2) = 0.30103)
    high, low = divmod(n, 10**half)
    return int_text(high, max(width - half, 0)) + int_text(low, half)


_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def cap_text(cap: int, below: int | None) -> str:
    """A cap (``>= 0``) as ``--cap-workspace`` and ``WSARENA_CAP_WORKSPACE`` take it back: ``cap`` rounded up to an
    eighth of the unit :func:`format_size` shows it in (``"55.125 MiB"``: at most three decimals, each a whole
    number of bytes), or of a smaller unit where that reaches ``below`` (``None``: no limit), the next cap, which
    makes other choices (caps a few bytes apart: ``"1225 KiB"``, ``"1048580 B"``); ``below=cap + 1`` gives the cap
    itself. format_size's two decimals are none: "55.12MiB" is no whole number of bytes, and a size rounded down is
    below the cap, which then refuses algorithms the cap admits."""
    largest = dict(_BINARY)[format_size(cap).rpartition(" ")[2]]
    for scale in (scale for _, scale in _BINARY if scale <= largest):
        step = max(scale // 8, 1)
        shown = -(-cap // step) * step
        if below is None or shown < below:
            break
    for unit, scale in _BINARY[:-1]:  # the largest unit it is a whole number of eighths of
        if shown >= scale and shown * 8 % scale == 0:
            whole, rest = divmod(shown, scale)
            return f"{int_text(whole)}{f'.{rest * 1000 // scale:03d}'.rstrip('0').rstrip('.')} {unit}"
    return f"{int_text(shown)} B"


def exact_cap(cap: int | None) -> str:
    """A setting's size (a cap, a limit) exactly, as the setting takes it back: ``"none"`` for ``None``, else
    ``cap_text(cap, cap + 1)``, itself in the largest binary unit it is a whole eighth of (``"3.5 KiB"``), or in
    bytes (``"4000 B"``). Where an error or a warning names a setting's value, format_size's ``"3.91 KiB"`` is no
    whole number of bytes, which the setting refuses."""
    return "none" if cap is None else cap_text(cap, cap + 1)


def cap_for(nbytes: int) -> str:
    """A workspace (``>= 0``) as a cap that admits it, as the settings take it: ``cap_text(nbytes, None)``, rounded up
    to an eighth of the unit :func:`format_size` writes it in. Where a warning or an error names an algorithm's
    workspace or a request's, it is the cap to set for it: format_size's ``"42.19 KiB"`` for 43200 bytes is no whole
    number of bytes, which cap_workspace refuses, and its ``"4 KiB"`` for 4097 a cap that refuses the request; this
    writes ``"42.25 KiB"`` and ``"4.125 KiB"``."""
    return cap_text(nbytes, None)


def format_seconds(value: float) -> str:
    """A time in the unit that reads best: ``"1.234 s"``, ``"12.35 ms"``, ``"3.2 us"``; ``"1.000 s"`` for 0.999996,
    not ``"1000.00 ms"``, as :func:`format_size` writes ``"1 MiB"`` for 1048575 bytes."""
    if value >= 1 or float(f"{value * 1e3:.2f}") >= 1000:  # rounded up to 1000 of the smaller unit
        return f"{value:.3f} s"
    if value >= 1e-3 or float(f"{value * 1e6:.1f}") >= 1000:
        return f"{value * 1e3:.2f} ms"
    return f"{value * 1e6:.1f} us"


def format_ratio(larger: int, smaller: int) -> str:
    """``larger / smaller`` (both positive, ``larger`` the larger) as a factor for people: one decimal (``"10.3"``),
    or as many more, up to three, as tell it from 1 (``"1.04"``, ``"1.004"``); ``"<1.001"`` below that. A factor
    rounded to ``"1.0"`` would say that the two are the same."""
    ratio = larger / smaller
    for digits in (1, 2, 3):
        text = f"{ratio:.{digits}f}"
        if float(text) != 1:
            return text
    return "<1.001"


def format_percent(fraction: float) -> str:
    """A fraction as a percentage with no digits it does not need: ``0.02`` -> ``"2%"``, ``0.025`` -> ``"2.5%"``."""
    return f"{fraction * 100:g}%"


def write_text(stream: Any, text: str) -> None:
    """Write ``text`` to ``stream``; where the stream's encoding has no character for some of it (a caller's stream
    opened with ``encoding="ascii"``, a path or a model name in the text not ASCII), write it again with those
    characters as backslash escapes, ``\\xe8``, as Python's own stderr writes them: a UnicodeEncodeError is a
    ValueError, which the callers take for a closed stream and would drop the text for. A text stream encodes the
    whole text before it writes any of it, so the failed write left nothing behind."""
    try:
        stream.write(text)
    except UnicodeEncodeError as exc:
        # The stream's encoding, not the error's, which a code page's codec gives as "charmap" (refused_in says why)
        stream.write(escaped(text, getattr(stream, "encoding", None) or refused_in(exc)))


def refused_in(exc: UnicodeEncodeError) -> str:
    """The encoding to escape text in for a stream that names none, whose write refused it with ``exc``: the one
    ``exc`` names, or ASCII where that is "charmap", the name a code page's codec (cp437) gives its errors, which as
    an encoding is latin-1's: its escapes kept a character the page lacks (the ã of cp437), and the second write
    failed too."""
    return "ascii" if exc.encoding == "charmap" else exc.encoding


def escaped(text: str, encoding: str | None) -> str:
    """``text`` with the characters that ``encoding`` has none for as backslash escapes (``\\xe8``), as
    :func:`write_text` writes it; escaped as ASCII where Python has no codec for ``encoding``, or one that cannot
    decode its escapes back; ``text`` itself where ``encoding`` is None or no name (a stream that names none)."""
    if not isinstance(encoding, str):  # None, or what a stand-in for a stream names
        return text
    try:
        return text.encode(encoding, "backslashreplace").decode(encoding)
    except (LookupError, UnicodeError):  # an encoding Python has no codec for, or one that cannot decode it back
        return text.encode("ascii", "backslashreplace").decode("ascii")
