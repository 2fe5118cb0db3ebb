"""``--plot FILE.png``: for ``report``, per-layer workspace as bars and the arena as a line; for ``tune``, the step
time against the cap (needs matplotlib). The PNG is written to exactly the path given, whatever its name ends
with (matplotlib would append ``.png`` to a name without an extension), and whole or not at all: an interruption or
a full disk leaves no part of a PNG there, and an earlier plot stays as it was."""

from __future__ import annotations

import errno
import io
import os
import secrets
import stat
from typing import Any

from ._report_cli import printable
from ._sizes import exact_cap, format_percent, format_seconds, format_size
from ._tune_cli import cap_texts, slowdown_text
from .errors import BackendUnavailableError

__all__ = ["check_writable", "plot_curve", "plot_plan"]

_COLOURS = {"fwd": "#4c72b0", "bwd_data": "#dd8452", "bwd_filter": "#55a868"}
# Up to this many layers, report's plot names each below its bars and grows wider with each; past it, it names none
# and stays as wide as that (a model of 1,200 layers drew a PNG 77,760 pixels wide, of 40,000 one 2.6 million)
_NAMED_LAYERS = 60


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BackendUnavailableError(
            "--plot needs matplotlib: pip install 'wsarena[plot]'"
        ) from None
    return plt


def _save(plt: Any, fig: Any, path: str) -> None:
    """Write ``fig`` as a PNG to ``path`` itself; ``OSError`` when it cannot be written."""
    png = io.BytesIO()  # drawn first, so that a failure to draw leaves the file untouched
    try:
        fig.savefig(png, dpi=120, format="png")
    finally:
        plt.close(fig)
    _write_whole(path, png.getvalue())


def _write_whole(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all: into a new file beside it, then renamed over it. Through a
    symbolic link the file it leads to is replaced, and the link stays. A path that is no regular file (a named
    pipe, ``/dev/stdout``) is written as it is: nothing can be renamed over it. A file replaced keeps its
    permissions, as one written over in place does."""
    mode = _mode(path)
    if mode is not None and not stat.S_ISREG(mode):
        with open(path, "wb") as f:
            f.write(data)
        return
    target = os.path.realpath(path)
    # A new file gets the umask's permissions, as the file open() would make (mkstemp's are private)
    tmp = _beside(target)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), stat.S_IMODE(mode))  # a private plot (0600) stays private
            f.write(data)
        os.replace(tmp, target)
    except BaseException:  # Ctrl-C included: no half-written file left beside the plot either
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _mode(path: str) -> int | None:
    """The mode of what ``path`` leads to, ``None`` where nothing is there yet. Asked of the path itself, not of its
    ``realpath``: ``/dev/stdout`` or a shell's ``/dev/fd/63`` on a pipe leads to the pipe, whose "path" (``pipe:[1]``)
    is no file's."""
    try:
        return os.stat(path).st_mode
    except FileNotFoundError:
        return None


def _beside(target: str) -> str:
    """A name for a new file beside ``target``: random, so that two runs writing the same plot do not write into one
    file, and the plot's cut short, so that a name as long as the file system takes leaves room for the rest."""
    return os.path.join(os.path.dirname(target), f".{os.path.basename(target)[:40]}.{secrets.token_hex(4)}.tmp")


def check_writable(path: str) -> None:
    """Raise the ``OSError`` that writing the plot to ``path`` would, where it can be known before drawing it: a
    folder, or a folder that cannot take the new file (missing, not a folder, not writable), tried with a file made
    and removed there. A path that is no regular file is not opened: a named pipe would wait for its reader."""
    mode = _mode(path)
    if mode is not None and stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    if mode is not None and not stat.S_ISREG(mode):
        return
    tmp = _beside(os.path.realpath(path))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.close(fd)
    finally:
        os.unlink(tmp)


def plot_plan(p: Any, path: str) -> None:
    """Draw ``p`` (a :class:`~wsarena.planner.Plan`) into the PNG file ``path``."""
    plt = _pyplot()
    n = len(p.layers)
    width = 0.8 / max(len(p.passes), 1)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.18 * min(n, _NAMED_LAYERS) * len(p.passes)), 4.5))
    mib = 2**20
    for k, pass_ in enumerate(p.passes):
        xs = [i + (k - (len(p.passes) - 1) / 2) * width for i in range(n)]
        ys = [lp.choices[pass_].workspace_bytes / mib for lp in p.layers]
        ax.bar(xs, ys, width=width, color=_COLOURS.get(pass_), label=pass_)
    streams = f"{p.streams} stream{'s' if p.streams > 1 else ''}"
    ax.axhline(max(p.stream_bytes, default=0) / mib, color="black", linestyle="--",
               label=f"arena per stream ({streams}: total {format_size(p.arena_bytes)})")
    ax.set_xlabel("layer")
    ax.set_ylabel("workspace (MiB)")
    cap = exact_cap(p.cap_workspace)
    # parse_math=False: names are drawn as given, where matplotlib reads a $ pair as mathematics (and fails on it);
    # a tab or a newline escaped, as the table shows it: the font has no glyph for one
    ax.set_title(
        f"{printable(p.model)}: batch {p.batch}, {p.dtype}, {p.backend}, cap {cap} - "
        f"unshared {format_size(p.unshared_bytes)} vs arena {format_size(p.arena_bytes)}",
        parse_math=False,
    )
    if n <= _NAMED_LAYERS:
        ax.set_xticks(range(n))
        ax.set_xticklabels([printable(lp.name) for lp in p.layers], rotation=90, fontsize=6, parse_math=False)
    # "best" weighs every bar against each place: with thousands, slow enough for matplotlib to warn of it
    ax.legend(fontsize=8, loc="best" if n <= _NAMED_LAYERS else "upper right")
    fig.tight_layout()
    _save(plt, fig, path)


def plot_curve(t: Any, path: str) -> None:
    """Draw ``t`` (a :class:`~wsarena.tuning.Tuning`): step time against the cap, into the PNG file ``path``."""
    plt = _pyplot()
    mib = 2**20
    finite = [q for q in t.curve if q.cap_workspace_bytes is not None]
    uncapped = t.curve[-1]
    fig, ax = plt.subplots(figsize=(8.0, 4.5))
    ax.step([q.cap_workspace_bytes / mib for q in finite], [q.step_seconds * 1e3 for q in finite], where="post",
            marker="o", markersize=3, color="#4c72b0", label="step time under the cap")
    ax.axhline(uncapped.step_seconds * 1e3, color="black", linestyle="--", linewidth=1,
               label=f"no cap: {format_seconds(uncapped.step_seconds)}, arena {format_size(uncapped.arena_bytes)}")
    best = t.recommended
    ax.axvline(best.cap_workspace_bytes / mib, color="#dd8452", linestyle=":",
               label=f"recommended cap {cap_texts(t.curve)[best.cap_workspace_bytes]} "
               f"({slowdown_text(best.slowdown, t.max_slowdown)}, max slowdown {format_percent(t.max_slowdown)})")
    # Linear from 0 to the smallest cap above it, logarithmic beyond: caps span 0 to gigabytes.
    linthresh = max(min((q.cap_workspace_bytes for q in finite if q.cap_workspace_bytes), default=mib) / mib, 1e-3)
    ax.set_xscale("symlog", linthresh=linthresh)
    ax.set_ylabel("step time, sum of the chosen algorithms (ms)")
    p = t.uncapped
    # at a point's cap, a stream's largest chosen workspace is the cap: every stream's where each may run any layer
    if p.streams == 1:
        arena = "the arena needs the same"
    elif t.shared_streams:
        arena = f"the arena needs as much on each of its {p.streams} streams"
    else:  # streams=[...]: a stream holds the largest workspace of the layers given to it
        arena = f"the arena needs up to as much on each of its {p.streams} streams"
    ax.set_xlabel(f"workspace cap (MiB; {arena})")
    ax.set_title(f"{printable(p.model)}: batch {p.batch}, {p.dtype}, {p.backend} ({printable(p.device)}), "
                 f"{'+'.join(p.passes)}", fontsize=9, parse_math=False)
    # at least the linear part: a curve whose only cap is 0 (every call has a zero-workspace algorithm that is
    # fastest) would otherwise have an empty axis, which matplotlib warns about
    ax.set_xlim(left=0, right=max(max(q.cap_workspace_bytes for q in finite) / mib * 1.5, linthresh))
    ax.set_xticks([x for x in ax.get_xticks() if x == 0 or x >= linthresh])
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    _save(plt, fig, path)
