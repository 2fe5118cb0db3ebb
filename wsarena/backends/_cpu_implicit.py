"""The zero-workspace CPU algorithms ("implicit_gemm"): accumulate over kernel offsets on strided views.

For each kernel offset the input elements it reads form a strided view of the input (index arithmetic of
:mod:`._cpu_lowering` keeps padding out of it), so the convolution is a sum over offsets of small GEMMs on
views: ``y[valid] += W[:, :, offset] @ x[shifted]``. No column buffer, no padded copy: the workspace is 0 bytes.

NumPy's ``matmul`` cannot accumulate into its output, so every offset after the first makes one temporary no
larger than the pass's output (the valid region of ``y``, of ``dx``, or for the filter gradient a chunk of
per-row partial products bounded by the size of ``dw``) and adds it in place. These temporaries are NumPy's,
not the arena's; their size does not depend on the algorithm choice elsewhere, only on the output.
"""

from __future__ import annotations

import numpy as np

from ._cpu_lowering import Plan, act_view, merge_pixels, weight_view

__all__ = ["backward_data", "backward_filter", "forward"]

# When the reduction is tiny (depthwise: one channel per group) and the GEMMs would be many and small, a few
# broadcast multiply-adds beat one BLAS call per (pixel row, group). The cost model: an elementwise pass
# costs about 3 ns per output element, a BLAS call about 1.5 us of overhead.
_ELEMENTWISE_MAX_REDUCTION = 4
_CALL_COST_IN_ELEMENTS = 500


def _apply(src: np.ndarray, wmat: np.ndarray, dst: np.ndarray, accumulate: bool) -> None:
    """``dst[pix, g, :] (+)= wmat[g] @ src[pix, g, :]``.

    ``src`` is ``(*pix, G, Mi)``, ``wmat`` ``(G, Mo, Mi)``, ``dst`` ``(*pix, G, Mo)`` (strided views). With
    ``accumulate`` the product goes to one temporary of ``dst``'s size and is added in place.
    """
    npix = src.ndim - 2
    src, dst = merge_pixels([src, dst], npix)
    npix = src.ndim - 2
    mi = src.shape[-1]
    calls = dst.size // (dst.shape[npix - 1] * dst.shape[-1])  # GEMMs: leading pixels x groups
    if mi <= _ELEMENTWISE_MAX_REDUCTION and mi * dst.size < _CALL_COST_IN_ELEMENTS * calls:
        # Broadcast multiply-adds, one per input channel: (*pix, G, 1) * (G, Mo) -> (*pix, G, Mo).
        for j in range(mi):
            term = (src[..., j : j + 1], wmat[:, :, j])
            if accumulate or j > 0:
                np.add(dst, np.multiply(*term), out=dst)
            else:
                np.multiply(*term, out=dst)
        return
    if src.strides[-1] == src.itemsize:
        # Channels contiguous (NHWC): rows are pixels, (pix[-1], Mi) @ (Mi, Mo) per leading pixel and group.
        a = np.moveaxis(src, npix - 1, -2)
        b = wmat.transpose(0, 2, 1)
        d = np.moveaxis(dst, npix - 1, -2)
    else:
        # Channels strided (NCHW): (Mo, Mi) @ (Mi, pix[-1]); the last pixel axis is the contiguous one.
        a = wmat
        b = np.moveaxis(src, npix - 1, -1)
        d = np.moveaxis(dst, npix - 1, -1)
    if accumulate:
        np.add(d, np.matmul(a, b), out=d)
    else:
        np.matmul(a, b, out=d)


def forward(p: Plan, x: np.ndarray, w: np.ndarray, y: np.ndarray) -> None:
    """``y = conv(x, w)`` with no workspace.

    Offsets are ordered with a fully covering one first (when the padding allows one); it is written
    directly with ``out=``. Otherwise ``y`` is zero-filled first. Each later offset makes one temporary of at
    most ``y``'s size.
    """
    g = p.geom
    xp, yp = act_view(x, g.layout, p.groups), act_view(y, g.layout, p.groups)
    wv = weight_view(w, g.layout, p.groups)
    started = p.offsets[0].full_out
    if not started:
        y[...] = 0
    for i, off in enumerate(p.offsets):
        if off.empty:
            continue
        xs, ys = xp[(slice(None), *off.inp)], yp[(slice(None), *off.out)]
        _apply(xs, wv[(Ellipsis, *off.index)], ys, accumulate=i > 0 or not started)


def backward_data(p: Plan, dy: np.ndarray, w: np.ndarray, dx: np.ndarray) -> None:
    """``dx = conv_transpose(dy, w)`` with no workspace: per offset ``dx[shifted] += W_k^T @ dy[valid]``.

    An offset whose reads cover the whole input (stride 1, no clipping) is written first with ``out=``;
    otherwise ``dx`` is zero-filled. Each later offset makes one temporary of at most ``dx``'s size (for one
    offset distinct outputs touch distinct inputs, so the strided in-place add is exact).
    """
    g = p.geom
    dyp, dxp = act_view(dy, g.layout, p.groups), act_view(dx, g.layout, p.groups)
    wv = weight_view(w, g.layout, p.groups)
    first = next((o for o in p.offsets if o.full_in and not o.empty), None)
    if first is None:
        dx[...] = 0
    for off in ([first] if first is not None else []) + [o for o in p.offsets if o is not first]:
        if off.empty:
            continue
        dys, dxs = dyp[(slice(None), *off.out)], dxp[(slice(None), *off.inp)]
        wk_t = wv[(Ellipsis, *off.index)].transpose(0, 2, 1)  # (G, Cg, Kg)
        _apply(dys, wk_t, dxs, accumulate=off is not first)


def backward_filter(p: Plan, x: np.ndarray, dy: np.ndarray, dw: np.ndarray) -> None:
    """``dw = sum over images and pixels of dy ⊗ x[shifted]`` with no workspace, one kernel offset at a time.

    Per offset, the pixel axes that can be merged become the GEMM's contraction; the remaining leading pixel
    axes (e.g. images, and rows when a row is clipped by padding) are batched in chunks of ``max(1, kprod//2)``
    GEMMs whose ``(chunk, G, Kg, Cg)`` product (at most half of ``dw``) is summed (one more temporary of
    ``dw/kprod``) into ``dw[..., offset]``. Depthwise (one channel per group) uses ``einsum``, which makes no
    temporary.
    """
    g = p.geom
    xp, dyp = act_view(x, g.layout, p.groups), act_view(dy, g.layout, p.groups)
    wv = weight_view(dw, g.layout, p.groups)
    chunk = max(1, p.kprod // 2)
    for off in p.offsets:
        dwk = wv[(Ellipsis, *off.index)]  # (G, Kg, Cg) view into dw
        if off.empty:
            dwk[...] = 0
            continue
        dys, xs = dyp[(slice(None), *off.out)], xp[(slice(None), *off.inp)]
        npix = dys.ndim - 2
        dys, xs = merge_pixels([dys, xs], npix)
        npix = dys.ndim - 2
        if p.cg == 1:
            pix = "abcd"[:npix]  # summed over: images and pixels
            np.einsum(f"{pix}gk,{pix}g->gk", dys, xs[..., 0], out=dwk[..., 0])
            continue
        a = np.moveaxis(dys, npix - 1, -1)  # (*lead, G, Kg, L)
        b = np.moveaxis(xs, npix - 1, -2)  # (*lead, G, L, Cg)
        lead = a.shape[: npix - 1]
        if not lead:
            dwk[...] = np.matmul(a, b)
            continue
        first = True
        for idx in np.ndindex(*lead[:-1]):
            for start in range(0, lead[-1], chunk):
                sel = (*idx, slice(start, start + chunk))
                part = np.matmul(a[sel], b[sel])  # (<=chunk, G, Kg, Cg)
                if first:
                    np.sum(part, axis=0, out=dwk)
                    first = False
                elif part.shape[0] == 1:
                    np.add(dwk, part[0], out=dwk)
                else:
                    np.add(dwk, part.sum(axis=0), out=dwk)
