"""``wsarena report --plot FILE.png``: per-layer workspace as bars, the arena as a line (needs matplotlib)."""

from __future__ import annotations

from typing import Any

from .errors import BackendUnavailableError

__all__ = ["plot_plan"]

_COLOURS = {"fwd": "#4c72b0", "bwd_data": "#dd8452", "bwd_filter": "#55a868"}


def plot_plan(p: Any, path: str) -> None:
    """Draw ``p`` (a :class:`~wsarena.planner.Plan`) into the PNG file ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BackendUnavailableError(
            "--plot needs matplotlib: pip install 'wsarena[plot]'"
        ) from None
    n = len(p.layers)
    width = 0.8 / max(len(p.passes), 1)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.18 * n * len(p.passes)), 4.5))
    mib = 2**20
    for k, pass_ in enumerate(p.passes):
        xs = [i + (k - (len(p.passes) - 1) / 2) * width for i in range(n)]
        ys = [lp.choices[pass_].workspace_bytes / mib for lp in p.layers]
        ax.bar(xs, ys, width=width, color=_COLOURS.get(pass_), label=pass_)
    streams = f"{p.streams} stream{'s' if p.streams > 1 else ''}"
    ax.axhline(max(p.stream_bytes, default=0) / mib, color="black", linestyle="--",
               label=f"arena per stream ({streams}: total {p.arena_bytes / mib:.1f} MiB)")
    ax.set_xlabel("layer")
    ax.set_ylabel("workspace (MiB)")
    cap = "none" if p.cap_workspace is None else f"{p.cap_workspace / mib:g} MiB"
    ax.set_title(
        f"{p.model}: batch {p.batch}, {p.dtype}, {p.backend}, cap {cap} - "
        f"unshared {p.unshared_bytes / mib:.1f} MiB vs arena {p.arena_bytes / mib:.1f} MiB"
    )
    if n <= 60:
        ax.set_xticks(range(n))
        ax.set_xticklabels([lp.name for lp in p.layers], rotation=90, fontsize=6)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
