"""The tiled column-buffer CPU algorithms: im2col + GEMM on blocks of output rows, in a small workspace.

Caffe's algorithm with its column matrix cut into tiles of at most :data:`TILE_BYTES` (1 MiB) where one
row allows: a tile is a block of output rows (first spatial dimension) of one image, or several whole
images when one image's matrix is smaller than a tile. Each tile is lowered into the workspace and
multiplied at once, the GEMM writing straight into the output's rows. The workspace is the largest tile's
column matrix. A 1 MiB tile stays in the core's L2 cache between im2col and GEMM, so on large images this
runs as fast as the per-image algorithm with a workspace that does not grow with the image; on small
images (7x7, 14x14) with many channels its GEMMs get short and it is slower than the batch algorithm.

Tile size: ``rows = max(1, TILE_BYTES // (C * kprod * inner * s))`` output rows per tile, where ``inner``
is the product of the output size without its first dimension (1 for 1-D). With ``rows >= O[0]`` a tile
is ``min(N, rows // O[0])`` whole images. The NCHW filter gradient keeps tiles inside one image
(``rows = min(rows, O[0])``), since NCHW images are not adjacent rows of one matrix.
"""

from __future__ import annotations

import math

import numpy as np

from ._cpu_lowering import COL_NCHW, COL_NHWC, Plan, act_view, blocks, col2im, col_view, im2col, rows

__all__ = ["TILE_BYTES", "backward_data", "backward_filter", "forward", "tile_pixels"]

TILE_BYTES = 1 << 20


def _tile_rows(pass_: str, p: Plan) -> int:
    g = p.geom
    per_row = g.in_channels * p.kprod * math.prod(p.osize[1:]) * p.itemsize
    r = max(1, TILE_BYTES // per_row)
    if pass_ == "bwd_filter" and g.layout == "NCHW":
        r = min(r, p.osize[0])
    return r


def tile_pixels(pass_: str, p: Plan) -> int:
    """Output pixels of the largest tile (the workspace holds ``C * kprod`` elements per pixel)."""
    r, o0, inner = _tile_rows(pass_, p), p.osize[0], math.prod(p.osize[1:])
    if r >= o0:
        return min(p.geom.batch, r // o0) * o0 * inner
    return r * inner


def _tiles(pass_: str, p: Plan):
    """``(n0, n1, r0, r1)``: images ``[n0, n1)``, output rows ``[r0, r1)`` of each, for every tile in order."""
    o0 = p.osize[0]
    for sel in blocks((p.geom.batch, o0), _tile_rows(pass_, p)):
        images = sel[0]
        r = sel[1] if len(sel) > 1 else slice(0, o0)
        yield images.start, min(images.stop, p.geom.batch), r.start, min(r.stop, o0)


def _rows_view(a: np.ndarray, p: Plan, n0: int, n1: int, r0: int, r1: int, channels_first: bool) -> np.ndarray:
    """The output-shaped array ``a`` (``y`` or ``dy``) restricted to a tile, its pixels merged.

    NCHW -> ``(b, G, Kg, T)``; NHWC -> ``(b * T, G, Kg)``, with ``T = (r1 - r0) * inner``. Both merges are
    views (the rows of a tile are adjacent in memory, and so are whole images in NHWC).
    """
    g, inner, b = p.geom, math.prod(p.osize[1:]), n1 - n0
    out: np.ndarray
    if channels_first:
        v = a.reshape(g.batch, p.groups, p.kg, p.osize[0], inner)[n0:n1, :, :, r0:r1]
        out = v.reshape(b, p.groups, p.kg, (r1 - r0) * inner)
    else:
        v = a.reshape(g.batch, p.osize[0], inner, p.groups, p.kg)[n0:n1, r0:r1]
        out = v.reshape(b * (r1 - r0) * inner, p.groups, p.kg)
    assert np.may_share_memory(out, a)  # a view, never a copy (writes would be lost)
    return out


def _col(workspace: np.ndarray, p: Plan, b: int, block) -> tuple[np.ndarray, np.ndarray]:
    """The tile's column buffer: canonical view for im2col/col2im and its GEMM matrix view."""
    t = b * math.prod(block.osize)
    mem = workspace[: p.geom.in_channels * p.kprod * t * p.itemsize].view(p.geom.dtype)
    if p.geom.layout == "NCHW":
        return col_view(mem, COL_NCHW, b, p, block.osize), mem.reshape(b, p.groups, -1, t // b)
    return col_view(mem, COL_NHWC, b, p, block.osize), mem.reshape(t, p.groups, -1).transpose(1, 0, 2)


def forward(p: Plan, x: np.ndarray, w: np.ndarray, y: np.ndarray, workspace: np.ndarray) -> None:
    """``y = conv(x, w)`` tile by tile: im2col of the tile, one GEMM per group writing ``y``'s rows."""
    g = p.geom
    nchw = g.layout == "NCHW"
    xp = act_view(x, g.layout, p.groups)
    wm = w.reshape(p.groups, p.kg, -1)  # (G, Kg, Cg*kprod) or (G, Kg, kprod*Cg)
    for n0, n1, r0, r1 in _tiles("fwd", p):
        block = rows(p, r0, r1)
        col, colm = _col(workspace, p, n1 - n0, block)
        im2col(xp[n0:n1], col, p, x, n0 * x.strides[0], block)
        out = _rows_view(y, p, n0, n1, r0, r1, nchw)
        if nchw:
            np.matmul(wm, colm, out=out)
        else:
            np.matmul(colm, wm.transpose(0, 2, 1), out=out.transpose(1, 0, 2))


def backward_data(p: Plan, dy: np.ndarray, w: np.ndarray, dx: np.ndarray, workspace: np.ndarray) -> None:
    """``dx = conv_transpose(dy, w)`` tile by tile: ``col = W^T @ dy[tile]``, then col2im adds it into ``dx``.

    Neighbouring tiles read overlapping input rows, so ``dx`` is zeroed first and every tile adds.
    """
    g = p.geom
    nchw = g.layout == "NCHW"
    dxp = act_view(dx, g.layout, p.groups)
    wm = w.reshape(p.groups, p.kg, -1)
    dx[...] = 0
    for n0, n1, r0, r1 in _tiles("bwd_data", p):
        block = rows(p, r0, r1)
        col, colm = _col(workspace, p, n1 - n0, block)
        dyt = _rows_view(dy, p, n0, n1, r0, r1, nchw)
        if nchw:
            np.matmul(wm.transpose(0, 2, 1), dyt, out=colm)
        else:
            np.matmul(dyt.transpose(1, 0, 2), wm, out=colm)
        col2im(col, dxp[n0:n1], p, block, overwrite=False)


def backward_filter(p: Plan, x: np.ndarray, dy: np.ndarray, dw: np.ndarray, workspace: np.ndarray) -> None:
    """``dw = sum over tiles of dy[tile] @ im2col(x)[tile]^T``.

    The first tile's GEMM writes ``dw``; each later tile makes one ``dw``-sized temporary and adds it.
    """
    g = p.geom
    nchw = g.layout == "NCHW"
    xp = act_view(x, g.layout, p.groups)
    dwm = dw.reshape(p.groups, p.kg, -1)
    first = True
    for n0, n1, r0, r1 in _tiles("bwd_filter", p):
        block = rows(p, r0, r1)
        col, colm = _col(workspace, p, n1 - n0, block)
        im2col(xp[n0:n1], col, p, x, n0 * x.strides[0], block)
        dyt = _rows_view(dy, p, n0, n1, r0, r1, nchw)
        if nchw:  # one image per tile: (G, Kg, T) @ (G, T, Cg*kprod)
            a, b = dyt[0], colm[0].transpose(0, 2, 1)
        else:  # (G, Kg, b*T) @ (G, b*T, kprod*Cg)
            a, b = dyt.transpose(1, 2, 0), colm
        if first:
            np.matmul(a, b, out=dwm)
            first = False
        else:
            np.add(dwm, np.matmul(a, b), out=dwm)
