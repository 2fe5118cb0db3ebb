"""What ``wsarena tune`` and ``wsarena cache`` print (the command itself is :mod:`wsarena.cli`)."""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
from decimal import Decimal, localcontext
from typing import Any

from . import __version__
from ._config import _cache_path
from ._report_cli import csv_writer, printable, skipped_note
from ._sizes import cap_text, exact_cap, format_percent, format_seconds, format_size, short_repr

__all__ = ["apply_line", "cache_output", "cap_texts", "max_slowdown_arg", "render_curve", "slowdown_text",
           "tune_output", "uncached_apply"]


# A decimal number (ASCII digits, an optional exponent) and an optional percent sign: not "inf", "nan", "1_0" or "0x1"
_SLOWDOWN = re.compile(r"\s*((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)\s*(%?)\s*")


def max_slowdown_arg(text: str) -> float:
    """``--max-slowdown``: a percentage (``2%``) or a fraction below 1 (``0.02``).

    A number of 1 or more without ``%`` is refused rather than read as a fraction: ``--max-slowdown 5`` would
    otherwise allow a step five times slower (500 %) where 5 % was surely meant. ``500%`` says it plainly.
    """
    match = _SLOWDOWN.fullmatch(text)
    unsigned = _SLOWDOWN.fullmatch(text.strip().removeprefix("-")) if match is None else None
    if unsigned is not None and not unsigned[1].lower().partition("e")[0].strip("0."):  # "-0", "-0.0%": zero
        raise argparse.ArgumentTypeError(f"a slowdown is written without a sign: {short_repr(text)} (write 0)")
    if unsigned is not None:
        raise argparse.ArgumentTypeError(f"a slowdown cannot be negative: {short_repr(text)}")
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a percentage (2%) or a fraction (0.02), not {short_repr(text)}")
    number, percent = match.groups()
    value = float(number)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite slowdown (2% or 0.02), not {short_repr(text)}")
    if percent:
        return value / 100
    # the number as written, not its float: 0.99999999999999999 is below 1, though its nearest float is 1.0 (a
    # float other than 1.0 tells it alone, and Decimal() refuses an exponent of 19 digits: 1e-99999999999999999999)
    if value > 1 or (value == 1 and Decimal(number) >= 1):
        said = f"{short_repr(text.strip())} is read as a fraction"
        if len(number) > 24:  # not quoted three times more
            raise argparse.ArgumentTypeError(f"{said}, a slowdown of 100% or more: end it with % for a percentage")
        percent = _percent(number)
        written = re.sub(r"\.(?=[eE]|$)", "", number)  # "5." -> "5": "write 5.% for 5. percent" read oddly
        raise argparse.ArgumentTypeError(
            f"{said}, a slowdown of {percent}: write {written}% for {written} percent, or {percent} if you mean it"
        )
    return value


def _percent(number: str) -> str:
    """The decimal fraction ``number`` as a percentage, exactly: ``"5"`` -> ``"500%"``, ``"0.1e1"`` -> ``"100%"``,
    ``"1e300"`` -> ``"1e+302%"``."""
    with localcontext(prec=len(number) + 3):  # every digit of the number, and two more before the point
        percent = Decimal(number).scaleb(2).normalize()
    plain = f"{percent:f}"
    return (plain if len(plain) <= 30 else str(percent).lower()) + "%"


def slowdown_text(value: float, max_slowdown: float) -> str:
    """A point's slowdown, ``n/a`` where it has none (slower than an uncapped step timed at 0): a percentage to two
    decimals, or as many more, up to ten, as make it read on the side of ``max_slowdown`` (as
    :func:`~wsarena._sizes.format_percent` writes it) that tune judged it: a cap refused at 2.003 % under 2 % reads
    ``"+2.003%"``, not ``"+2.00%"``, and one taken at 1.2358 % under 1.236 % ``"+1.236%"``, not ``"+1.24%"``."""
    from .tuning import _within

    if not math.isfinite(value):
        return "n/a"
    within, limit = _within(value, max_slowdown), Decimal(format_percent(max_slowdown)[:-1])
    for digits in range(2, 11):
        text = f"{value:+.{digits}%}"
        if (Decimal(text[:-1]) <= limit) == within:
            return text
    return f"{value:+.2%}"  # none does: a limit of more digits than format_percent shows


def cap_texts(curve: Any) -> dict[int | None, str]:
    """Each point's cap as the table, the recommendation and the plot show it, for ``--cap-workspace`` or
    ``WSARENA_CAP_WORKSPACE`` to take back: a size at least the cap and below the next one, which makes the same
    choices (:func:`~wsarena._sizes.cap_text`)."""
    caps = [q.cap_workspace_bytes for q in curve if q.cap_workspace_bytes is not None]
    texts: dict[int | None, str] = {cap: cap_text(cap, below) for cap, below in zip(caps, [*caps[1:], None])}
    texts[None] = "none"
    return texts


def _searched(t: Any) -> str:
    """Where the distinct calls' times came from: timed now, the search cache, or this process's memory."""
    known = len(t.measured) - t.timed_calls - t.cached_calls
    sources = [f"{t.timed_calls} timed", f"{t.cached_calls} from the search cache"]
    if known > 0:
        sources.append(f"{known} searched before in this process")
    said = f"{len(t.measured)} distinct calls (pass and geometry): {', '.join(sources)}; {t.search_seconds:.1f} s"
    if t.untimed_calls:
        said += (f"; {t.untimed_calls} with algorithms memory kept from being ranked or timed, which the curve "
                 "leaves out (free memory and tune again)")
    return said


def render_curve(t: Any) -> str:
    """The curve a person reads: a header, one row per cap, and the recommendation."""
    p = t.uncapped
    lines = [
        f"wsarena {__version__} tune: {printable(p.model)}",
        (
            f"backend {p.backend} ({printable(p.device)})  dtype {p.dtype}  layout {p.layout}  batch {p.batch}  "
            f"streams {p.streams}  passes {','.join(p.passes)}"
        ),
        _searched(t),
        "",
    ]
    head = ["cap", "arena", "step time", "slowdown"]
    caps = cap_texts(t.curve)
    rows = [
        [caps[q.cap_workspace_bytes], format_size(q.arena_bytes), format_seconds(q.step_seconds),
         slowdown_text(q.slowdown, t.max_slowdown)]
        for q in t.curve
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    lines.append("  ".join("-" * w for w in widths))
    for q, row in zip(t.curve, rows):
        mark = "  <- recommended" if q.cap_workspace_bytes == t.recommended_cap_bytes else ""
        lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths)) + mark)
    best, fastest = t.recommended, t.curve[-1]
    within = format_percent(t.max_slowdown)
    arena = format_size(best.arena_bytes)
    if best.arena_bytes < fastest.arena_bytes:
        arena, uncapped = _apart(best.arena_bytes, fastest.arena_bytes)
        saving = f" instead of {uncapped} uncapped"
    else:  # it saves nothing; the cap still bounds a later, larger call
        smaller = [q for q in t.curve if q.arena_bytes < best.arena_bytes]
        saving = ", as uncapped: no cap gives a smaller one"
        if smaller:
            arena, next_one = _apart(best.arena_bytes, smaller[-1].arena_bytes)
            saving = (f", as uncapped: no smaller one keeps the slowdown within {within} "
                      f"(the next, {next_one}, {_costs(smaller[-1], t.max_slowdown)})")
    if any(not math.isfinite(q.slowdown) for q in t.curve):
        lines.append(f"n/a: slower than the uncapped step, which timed at {format_seconds(fastest.step_seconds)}; "
                     "no --max-slowdown admits it")
    lines += [
        "",
        (
            f"recommended cap (slowdown within {within}): {caps[best.cap_workspace_bytes]}: "
            f"step {format_seconds(best.step_seconds)} ({slowdown_text(best.slowdown, t.max_slowdown)}), "
            f"arena {arena}{saving}"
        ),
        f"use it with: {apply_line(t)}",
    ]
    if p.skipped:
        lines.append(skipped_note(p.skipped, "these figures"))
    return "\n".join(lines) + "\n"


def _apart(nbytes: int, other: int) -> tuple[str, str]:
    """Two arenas' sizes as a line compares them: with their bytes too where they read alike (a few bytes apart),
    so that "1 MiB instead of 1 MiB" does not read as no saving."""
    text, other_text = format_size(nbytes), format_size(other)
    if text == other_text:
        return f"{text} ({nbytes} B)", f"{other_text} ({other} B)"
    return text, other_text


def _costs(q: Any, max_slowdown: float) -> str:
    """What a point costs against no cap: its slowdown, or its step time where it has no slowdown."""
    if math.isfinite(q.slowdown):
        return f"costs {slowdown_text(q.slowdown, max_slowdown)}"
    return f"takes {format_seconds(q.step_seconds)}"


def _curve_csv(t: Any) -> str:
    """One row per point; then, as ``report``'s CSV does, one per conv layer the loader left out: its name in
    ``skipped_layer`` and why in ``skipped_reason`` (both empty on the points), and every figure empty, so that the
    rows show what the curve lacks."""
    out = io.StringIO()
    writer = csv_writer(out)
    writer.writerow(["cap_workspace_bytes", "arena_bytes", "step_seconds", "slowdown", "recommended", "skipped_layer",
                     "skipped_reason"])
    for q in t.curve:
        cap = "" if q.cap_workspace_bytes is None else q.cap_workspace_bytes
        recommended = "true" if q.cap_workspace_bytes == t.recommended_cap_bytes else "false"
        slowdown = repr(q.slowdown) if math.isfinite(q.slowdown) else ""  # none, as the JSON's null
        writer.writerow([cap, q.arena_bytes, repr(q.step_seconds), slowdown, recommended, "", ""])
    for name, why in t.uncapped.skipped:
        writer.writerow(["", "", "", "", "", name, why])
    return out.getvalue()


def apply_line(t: Any) -> str:
    """The settings that run the calls as the curve times them: the recommended cap, and the exhaustive search, which
    takes the fastest timed algorithm that fits it from the search cache that tuning filled (nothing is timed again
    on this machine). Under the default heuristic search the cap bounds each call all the same, but the heuristics'
    algorithms are not the ones timed, and the step time is not the curve's."""
    return f"WSARENA_CAP_WORKSPACE={t.recommended_cap_bytes} WSARENA_ALGO_SEARCH=exhaustive"


def tune_output(t: Any, fmt: str) -> str:
    """``fmt``: ``table``, ``json``, ``csv``, or ``apply`` (the one line that sets the recommended cap)."""
    if fmt == "apply":
        return apply_line(t) + "\n"
    if fmt == "json":
        return json.dumps(t.to_dict(), indent=2) + "\n"
    if fmt == "csv":
        return _curve_csv(t)
    return render_curve(t)


# How the text of `wsarena cache info` names where the folder comes from (searchcache.source()); the others are
# a function's name: configure(), config().
_SOURCES = {"environment": "WSARENA_CACHE_DIR", "default": "the user cache folder"}


def _off_value(variable: str) -> str:
    """The value, as the user wrote it, of the variable that turned the cache off (``off``, ``none``, ``None``)."""
    raw = os.environ.get(variable, "").strip()
    return raw if raw and _cache_path(raw) is None else "off"  # changed since it was read: the setting's own word


def _cache_off() -> str:
    """That the search cache is off, and which setting turned it off."""
    from . import searchcache

    source, env = searchcache.source(), searchcache.ENV_VAR
    if source == "environment":
        off = f"{env}={_off_value(env)}"
    elif source == "default":  # the user cache folder: it is off where no home folder can be found
        off = f"no home folder for the user cache folder: set HOME, XDG_CACHE_HOME or {env}"
    else:
        off = f"set by {source}()"
    return f"the search cache is off ({off})"


def uncached_apply() -> str | None:
    """Where the search cache is off, what ``--apply`` warns of: the job's exhaustive search cannot read the times
    tune took (:func:`apply_line`); ``None`` where it is on."""
    from . import searchcache

    if searchcache.cache_dir() is not None:
        return None
    return (f"{_cache_off()}: nothing tune timed is kept, so a job run with WSARENA_ALGO_SEARCH=exhaustive times "
            "every call again, and may choose other algorithms than those the curve timed")


def cache_output(action: str, fmt: str) -> str:
    """``wsarena cache info`` or ``clear``, as ``text`` or ``json``."""
    from . import searchcache

    data = searchcache.info() if action == "info" else searchcache.clear()
    if fmt == "json":
        return json.dumps(data, indent=2) + "\n"
    source = searchcache.source()
    if data["directory"] is None:
        return f"{_cache_off()}\n"
    where = _SOURCES.get(source, f"{source}()")
    directory = printable(data["directory"])  # a folder's name, as an entry's strings, may hold a newline or an escape
    if action == "clear":
        unreadable = f" and {data['unreadable']} unreadable file(s)" if data["unreadable"] else ""
        return f"removed {data['removed']} entries{unreadable} ({format_size(data['freed_bytes'])}) from {directory}\n"
    cap = data["max_size_bytes"]
    limit = "no limit" if cap is None else f"limit {exact_cap(cap)}"  # as the setting takes it
    lines = [
        f"search cache: {directory} (from {where})",
        f"entries: {data['entries']} ({format_size(data['size_bytes'])}; {limit})",
    ]
    if data["unreadable"]:
        lines.append(f"unreadable files (replaced when their call is searched again): {data['unreadable']}")
    for env in data["environments"]:
        backend, device, version, api = (printable(str(env[k])) for k in ("backend", "device", "wsarena", "api"))
        api = f", {api} API" if env["api"] else ""
        lines.append(f"  {env['entries']:>6}  {backend}: {device} (wsarena {version}{api})")
    return "\n".join(lines) + "\n"
