"""What ``wsarena report`` prints: the table a person reads and the CSV (the command itself is :mod:`wsarena.cli`;
the JSON is :meth:`wsarena.planner.Plan.to_dict`)."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from typing import Any, TextIO

from . import __version__
from ._sizes import exact_cap, format_percent, format_ratio, format_size

__all__ = ["csv_writer", "printable", "render_table", "shape_text", "skipped_note", "write_csv"]


def shape_text(shape: Sequence[int]) -> str:
    """``1x3x224x224``."""
    return "x".join(map(str, shape))


def printable(text: str) -> str:
    """``text`` with each character that would break a line or a column (a newline, a tab, a control character)
    written as its escape, as ``repr`` writes it."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class _CsvRows:
    """What :func:`csv_writer` returns: ``writerow(row)`` writes one row to ``out``, ending in ``"\\n"``."""

    __slots__ = ("buffer", "out", "writer")

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.buffer = io.StringIO()
        # "\r" in the terminator: a field holding a bare "\r" is quoted too, which the writer of Python before
        # 3.11.9 and 3.12.3 does only for a character of its terminator; a reader ends a row at a bare "\r"
        self.writer = csv.writer(self.buffer, lineterminator="\r\n")

    def writerow(self, row: Sequence[Any]) -> None:
        self.writer.writerow(row)
        line = self.buffer.getvalue()
        self.buffer.seek(0)
        self.buffer.truncate()
        self.out.write(line[:-2] + "\n")


def csv_writer(out: TextIO) -> _CsvRows:
    """A CSV writer onto ``out`` whose rows end in ``"\\n"``, with every field that holds a line break quoted (a
    layer name may hold a ``"\\r"``)."""
    return _CsvRows(out)


def _params(g: Any) -> str:
    def one(values: tuple[int, ...]) -> str:
        return str(values[0]) if len(set(values)) == 1 else shape_text(values)

    text = f"s{one(g.stride)} p{one(g.padding)}"
    if any(d != 1 for d in g.dilation):
        text += f" d{one(g.dilation)}"
    if g.groups != 1:
        text += f" g{g.groups}"
    return text


def skipped_note(skipped: Sequence[tuple[str, str]], what: str, limit: int = 5) -> str:
    """The line that says ``what`` (``"these totals"``, ``"this curve"``) leaves out the convolutions a loader
    skipped; empty when there are none."""
    if not skipped:
        return ""
    shown = "; ".join(f"{printable(repr(name))} ({printable(why)})" for name, why in skipped[:limit])
    more = f"; and {len(skipped) - limit} more" if len(skipped) > limit else ""
    return (f"{what} leave out {len(skipped)} conv layer(s) that could not be planned (--skip-unknown): "
            f"{shown}{more}")


def render_table(p: Any) -> str:
    """The report a person reads: a header, one row per layer, and the totals."""
    cap = exact_cap(p.cap_workspace)  # as --cap-workspace takes it back: one rounded may choose otherwise
    if getattr(p, "max_slowdown", None) is not None:  # --max-slowdown chose it: say so, and from what
        cap += f" (the smallest within a {format_percent(p.max_slowdown)} slowdown)"
    lines = [
        f"wsarena {__version__} workspace report: {printable(p.model)}",
        (
            f"backend {p.backend} ({printable(p.device)})  dtype {p.dtype}  layout {p.layout}  batch {p.batch}  "
            f"cap {cap}  streams {p.streams}  search {p.search}"
        ),
        "",
    ]
    head = ["layer", "input", "weight", "params"]
    for pass_ in p.passes:
        head += [f"{pass_} algo", "workspace"]
    rows = []
    for lp in p.layers:
        g = lp.geometry
        name = printable(lp.name) + (" (T)" if lp.transposed else "")
        row = [name, shape_text(g.input_shape), shape_text(g.weight_shape), _params(g)]
        for pass_ in p.passes:
            c = lp.choices[pass_]
            row += [c.algo, format_size(c.workspace_bytes)]
        rows.append(row)
    numeric = {i for i, h in enumerate(head) if h == "workspace"}
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]

    def fmt(cells: list[str]) -> str:
        padded = (c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "  ".join(padded).rstrip()

    lines.append(fmt(head))
    lines.append(fmt(["-" * w for w in widths]))
    lines += [fmt(r) for r in rows]
    lines.append("")
    n_calls = len(p.layers) * len(p.passes)
    totals = [
        (f"unshared: one workspace per layer and pass ({n_calls})", format_size(p.unshared_bytes)),
        ("wsarena arena: the largest workspace per stream", format_size(p.arena_bytes) + _per_stream(p)),
        _saving(p),
    ]
    label_width = max(len(label) for label, _ in totals)
    value_width = max(len(value.split(" (")[0]) for _, value in totals)
    for label, value in totals:
        amount, _, rest = value.partition(" (")
        lines.append(f"{label + ':':<{label_width + 1}}  {amount:>{value_width}}" + (f" ({rest}" if rest else ""))
    if p.skipped:
        lines.append(skipped_note(p.skipped, "these totals"))
    if any(lp.transposed for lp in p.layers):
        lines.append("(T) a transposed convolution, reported as the convolution whose backward-data it runs")
    return "\n".join(lines) + "\n"


def _per_stream(p: Any) -> str:
    """What each stream holds, in brackets after the arena's total: one line at any stream count (every stream's
    figure is in the JSON's ``stream_bytes``); empty for one stream, whose figure is the total."""
    if p.streams == 1:
        return ""
    least, most = min(p.stream_bytes), max(p.stream_bytes)
    if least == most:
        return f" ({p.streams} streams of {format_size(most)} each)"
    return f" ({p.streams} streams of {format_size(least)} to {format_size(most)})"


def _saving(p: Any) -> tuple[str, str]:
    """The last totals line: what the arena saves, or, when several streams each hold the largest workspace,
    how much more than unshared it holds."""
    if p.saved_bytes < 0:
        ratio = f"{format_ratio(p.arena_bytes, p.unshared_bytes)}x as much"
        return "the arena holds more than unshared", f"{format_size(-p.saved_bytes)} ({ratio})"
    if not p.arena_bytes:
        ratio = "no workspace at all"
    elif not p.saved_bytes:  # one call needs workspace, say: "1.0x less" would read as a saving
        ratio = "the arena is as large as unshared"
    else:
        ratio = f"{format_ratio(p.unshared_bytes, p.arena_bytes)}x less"
    return "saved", f"{format_size(p.saved_bytes)} ({ratio})"


def write_csv(p: Any, out: TextIO) -> None:
    """One row per layer; then one per convolution the loader left out (``--skip-unknown``): its name, empty
    shapes and workspaces, ``skipped`` as each pass's algorithm and, in the last column, ``skipped_reason`` (empty
    on the layers' rows), as the JSON's ``skipped_layers`` gives it, so that the rows show what the figures lack."""
    writer = csv_writer(out)
    head = ["name", "input_shape", "weight_shape", "stride", "padding", "dilation", "groups", "transposed"]
    for pass_ in p.passes:
        head += [f"{pass_}_algo", f"{pass_}_workspace_bytes"]
    writer.writerow([*head, "skipped_reason"])
    for lp in p.layers:
        g = lp.geometry
        shapes = (g.input_shape, g.weight_shape, g.stride, g.padding, g.dilation)
        row: list[Any] = [lp.name, *(shape_text(v) for v in shapes)]
        row += [g.groups, "true" if lp.transposed else "false"]
        for pass_ in p.passes:
            row += [lp.choices[pass_].algo, lp.choices[pass_].workspace_bytes]
        writer.writerow([*row, ""])
    for name, why in p.skipped:
        writer.writerow([name, "", "", "", "", "", "", ""] + ["skipped", ""] * len(p.passes) + [why])
