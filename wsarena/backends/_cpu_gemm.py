"""The column-buffer CPU algorithms: Caffe's im2col + GEMM (+ col2im), per image or over the whole batch.

The column matrix lives in the caller's workspace; its memory order is chosen so that each group's matrix
is a BLAS operand without copying and the GEMM writes straight into the output array (``np.matmul(out=)``):

- NCHW: per image and group a ``(Cg*kprod, oprod)`` matrix (rows ordered like ``w``'s ``(Cg, *R)``), so
  ``y[n, g] = W_g @ col`` (``w`` reshaped to ``(G, Kg, Cg*kprod)`` is already the left operand).
- NHWC: a ``(B*oprod, kprod*Cg)`` matrix per group with row stride ``C*kprod`` (columns ordered like ``w``'s
  ``(*R, Cg)``), so ``y[:, g] = col @ W_g^T``; over a whole batch that is one GEMM per group.

Workspace layout is ``col`` first, then (NCHW backward-filter over the batch only) a transposed copy of
``dy``. Every byte read from the workspace is written first in the same call (im2col writes zeros where
the kernel reads padding), so its previous content never matters.
"""

from __future__ import annotations

import numpy as np

from ._cpu_lowering import COL_NCHW, COL_NCHW_T, COL_NHWC, Plan, act_view, col2im, col_view, im2col

__all__ = ["backward_data", "backward_filter", "col_elements", "forward", "workspace_elements"]


def col_elements(p: Plan, images: int) -> int:
    """Elements of the column matrix for ``images`` images: ``images * C * kprod * oprod``."""
    return images * p.geom.in_channels * p.kprod * p.oprod


def workspace_elements(pass_: str, p: Plan, batch: bool) -> int:
    """Workspace elements of a column algorithm (``batch``: whole batch, else one image)."""
    g = p.geom
    n = col_elements(p, g.batch if batch else 1)
    if batch and pass_ == "bwd_filter" and g.layout == "NCHW":
        n += g.batch * g.out_channels * p.oprod  # dy transposed to (G, Kg, N, oprod)
    return n


def _carve(workspace: np.ndarray, p: Plan, counts: list[int]) -> list[np.ndarray]:
    """Consecutive 1-D views of ``dtype`` over the uint8 ``workspace``, ``counts`` elements each."""
    views, start = [], 0
    for n in counts:
        nbytes = n * p.itemsize
        views.append(workspace[start : start + nbytes].view(p.geom.dtype))
        start += nbytes
    return views


def _columns(p: Plan, workspace: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
    """The column matrix of ``step`` images at the start of ``workspace``: its memory, and its view in the order
    im2col and col2im take for the layout (``COL_NCHW`` or ``COL_NHWC``)."""
    (mem,) = _carve(workspace, p, [col_elements(p, step)])
    return mem, col_view(mem, COL_NCHW if p.geom.layout == "NCHW" else COL_NHWC, step, p)


def forward(p: Plan, x: np.ndarray, w: np.ndarray, y: np.ndarray, workspace: np.ndarray, batch: bool) -> None:
    """``y = conv(x, w)``: im2col of ``B`` images (1 or the batch) into the workspace, then one batched GEMM."""
    g = p.geom
    G, kg, n = p.groups, p.kg, g.batch
    step = n if batch else 1
    mem, col = _columns(p, workspace, step)
    xp = act_view(x, g.layout, G)
    colm: np.ndarray
    if g.layout == "NCHW":
        wm = w.reshape(G, kg, -1)  # (G, Kg, Cg*kprod)
        colm = mem.reshape(step, G, -1, p.oprod)  # (B, G, Cg*kprod, oprod)
        ym = y.reshape(n, G, kg, p.oprod)
        for b in range(0, n, step):
            im2col(xp[b : b + step], col, p, x, b * x.strides[0])
            np.matmul(wm, colm, out=ym[b : b + step])
    else:
        wmt = w.reshape(G, kg, -1).transpose(0, 2, 1)  # (G, kprod*Cg, Kg)
        colm = mem.reshape(step * p.oprod, G, -1).transpose(1, 0, 2)  # (G, B*oprod, kprod*Cg)
        ym = y.reshape(n, p.oprod, G, kg)
        for b in range(0, n, step):
            im2col(xp[b : b + step], col, p, x, b * x.strides[0])
            yb = ym[b : b + step].reshape(step * p.oprod, G, kg).transpose(1, 0, 2)  # (G, B*oprod, Kg)
            np.matmul(colm, wmt, out=yb)


def backward_data(
    p: Plan, dy: np.ndarray, w: np.ndarray, dx: np.ndarray, workspace: np.ndarray, batch: bool
) -> None:
    """``dx = conv_transpose(dy, w)``: one GEMM into the column buffer (``W^T @ dy``), then col2im into ``dx``."""
    g = p.geom
    G, kg, n = p.groups, p.kg, g.batch
    step = n if batch else 1
    mem, col = _columns(p, workspace, step)
    dxp = act_view(dx, g.layout, G)
    colm: np.ndarray
    if g.layout == "NCHW":
        wmt = w.reshape(G, kg, -1).transpose(0, 2, 1)  # (G, Cg*kprod, Kg)
        colm = mem.reshape(step, G, -1, p.oprod)
        dym = dy.reshape(n, G, kg, p.oprod)
        for b in range(0, n, step):
            np.matmul(wmt, dym[b : b + step], out=colm)
            col2im(col, dxp[b : b + step], p)
    else:
        wm = w.reshape(G, kg, -1)  # (G, Kg, kprod*Cg)
        colm = mem.reshape(step * p.oprod, G, -1).transpose(1, 0, 2)
        dym = dy.reshape(n, p.oprod, G, kg)
        for b in range(0, n, step):
            dyb = dym[b : b + step].reshape(step * p.oprod, G, kg).transpose(1, 0, 2)  # (G, B*oprod, Kg)
            np.matmul(dyb, wm, out=colm)
            col2im(col, dxp[b : b + step], p)


def backward_filter(
    p: Plan, x: np.ndarray, dy: np.ndarray, dw: np.ndarray, workspace: np.ndarray, batch: bool
) -> None:
    """``dw = sum_n dy[n] @ im2col(x[n])^T``.

    Per image: the first image's GEMM writes ``dw`` directly, each later one makes one ``dw``-sized temporary
    and adds it. Over the batch: one GEMM per group contracting over all images and pixels at once; in NCHW
    that needs ``dy`` regrouped to ``(G, Kg, N, oprod)`` in the workspace (its images are not adjacent).
    """
    g = p.geom
    G, kg, n = p.groups, p.kg, g.batch
    dwm = dw.reshape(G, kg, -1)
    xp = act_view(x, g.layout, G)
    if batch:
        if g.layout == "NCHW":
            mem, dyt = _carve(workspace, p, [col_elements(p, n), n * g.out_channels * p.oprod])
            np.copyto(dyt.reshape(G, kg, n, p.oprod), dy.reshape(n, G, kg, p.oprod).transpose(1, 2, 0, 3))
            im2col(xp, col_view(mem, COL_NCHW_T, n, p), p, x, 0)
            colm = mem.reshape(G, -1, n * p.oprod).transpose(0, 2, 1)  # (G, N*oprod, Cg*kprod)
            np.matmul(dyt.reshape(G, kg, n * p.oprod), colm, out=dwm)
        else:
            (mem,) = _carve(workspace, p, [col_elements(p, n)])
            im2col(xp, col_view(mem, COL_NHWC, n, p), p, x, 0)
            colm = mem.reshape(n * p.oprod, G, -1).transpose(1, 0, 2)  # (G, N*oprod, kprod*Cg)
            np.matmul(dy.reshape(n * p.oprod, G, kg).transpose(1, 2, 0), colm, out=dwm)
        return
    mem, col = _columns(p, workspace, 1)
    if g.layout == "NCHW":
        colm = mem.reshape(G, -1, p.oprod).transpose(0, 2, 1)  # (G, oprod, Cg*kprod)
        dym = dy.reshape(n, G, kg, p.oprod)
    else:
        colm = mem.reshape(p.oprod, G, -1).transpose(1, 0, 2)  # (G, oprod, kprod*Cg)
        dym = dy.reshape(n, p.oprod, G, kg).transpose(0, 2, 3, 1)  # (N, G, Kg, oprod)
    for b in range(n):
        im2col(xp[b : b + 1], col, p, x, b * x.strides[0])
        if b == 0:
            np.matmul(dym[b], colm, out=dwm)
        else:
            np.add(dwm, np.matmul(dym[b], colm), out=dwm)
