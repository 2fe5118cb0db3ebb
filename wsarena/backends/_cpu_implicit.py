"""The zero-workspace CPU algorithms ("implicit_gemm"): accumulate over kernel offsets on strided views.

For each kernel offset the input elements it reads form a strided view of the input (index arithmetic of
:mod:`._cpu_lowering` keeps padding out of it), so the convolution is a sum over offsets of GEMMs on views:
``y[valid] += W[:, :, offset] @ x[shifted]``. No column buffer, no padded copy: the workspace is 0 bytes.

How each offset's GEMM is shaped decides the speed:

- pixel axes that walk memory alike are merged (a 1x1 stride-1 layer is one GEMM per image, or over the
  whole batch in NHWC);
- a stride-1 box of pixels is computed as one GEMM over the flat range from its first to its last element
  (:func:`_box`), instead of one small GEMM per image row;
- NCHW rows read with stride > 1 are no BLAS operand, so blocks of them are gathered into a temporary first;
- a reduction over one channel (depthwise) is a broadcast multiply instead of a GEMM.

NumPy's ``matmul`` cannot accumulate into its output, so every offset after the first makes one temporary no
larger than the pass's output (the valid region of ``y`` or ``dx``) and adds it in place; gathered blocks and
the filter gradient's partial products are sized against a budget (``SMALL_TEMP``, or half of ``dw``). A
step's temporaries are dropped before the next step makes its own, so the peak is one step's:
:func:`scratch_elements` gives it per pass. These temporaries are NumPy's, not the arena's, and do not
depend on what workspace the other algorithms need.

The price of having no column matrix: the output is read and written once per kernel offset, so layers with
few input channels and a large kernel (a 7x7 RGB stem) run several times slower than with im2col.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from ._cpu_lowering import Plan, act_view, blocks, merge_pixels, strided, weight_view

__all__ = ["backward_data", "backward_filter", "forward", "scratch_elements"]

# In the row-by-row fallback, a few broadcast multiply-adds beat one BLAS call per (pixel row, group) when the
# reduction is tiny and the GEMMs many. Cost model: an elementwise pass costs about 3 ns per output element,
# a BLAS call about 1.5 us of overhead. A reduction over one channel (depthwise) is always elementwise.
_ELEMENTWISE_MAX_REDUCTION = 4
_CALL_COST_IN_ELEMENTS = 500

# Temporaries whose size the algorithm chooses (blocks of gathered rows) may always use this many elements
# (1 MiB of float32), even where the pass's output is smaller: enough for GEMMs of a useful size, and far
# below any column buffer.
SMALL_TEMP = 1 << 18

# Gathered (strided NCHW) kernel offsets that share an output region are multiplied together, up to this
# many input channels per GEMM.
_GATHER_CHANNELS = 512


def _moveaxis(a: np.ndarray, source: int | tuple[int, ...], destination: int | tuple[int, ...]) -> np.ndarray:
    """``numpy.moveaxis``, its axes' order cached: NumPy's takes some 3 us a call to work it out, and the algorithms
    below move axes a few times per kernel offset."""
    return a.transpose(_moved(a.ndim, source, destination))


@functools.lru_cache(maxsize=1024)
def _moved(ndim: int, source: int | tuple[int, ...], destination: int | tuple[int, ...]) -> tuple[int, ...]:
    """The transpose of ``numpy.moveaxis(a, source, destination)`` for an ``a`` of ``ndim`` axes."""
    src = [n % ndim for n in ((source,) if isinstance(source, int) else source)]
    dst = [n % ndim for n in ((destination,) if isinstance(destination, int) else destination)]
    order = [n for n in range(ndim) if n not in src]
    for d, n in sorted(zip(dst, src)):
        order.insert(d, n)
    return tuple(order)


def _blas_operand(wmat: np.ndarray) -> np.ndarray:
    """``wmat`` itself if BLAS can read it (a unit stride in a matrix axis), else a contiguous copy.

    One kernel offset's filter slice ``(G, Kg, Cg)`` of an NCHW filter has strides ``kprod`` apart in both
    matrix axes; NumPy's ``matmul`` would then fall back to its slow non-BLAS loop. The copy is ``K * Cg``
    elements, ``1/kprod`` of the filter.
    """
    if wmat.strides[-1] == wmat.itemsize or wmat.strides[-2] == wmat.itemsize:
        return wmat
    return np.ascontiguousarray(wmat)


def _product(src: np.ndarray, wmat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``t[b, l, g, :] = wmat[g] @ src[b, l, g, :]`` for a view ``src`` ``(B, L, G, Mi)``.

    Returns ``(root, t)``: the fresh C-contiguous result and ``t``, its ``(B, L, G, Mo)`` view (which starts
    at ``root``'s first element). The result is laid out like ``src``: ``L`` innermost for NCHW.
    """
    b, length, g, mi = src.shape
    mo = wmat.shape[1]
    if src.strides[-1] == src.itemsize:  # channels contiguous (NHWC): rows are pixels
        root = np.empty((b, g, length, mo), dtype=src.dtype)
        if mi == 1:  # a 1-term sum: no GEMM
            np.multiply(src.transpose(0, 2, 1, 3), wmat[:, None, :, 0], out=root)
        else:
            np.matmul(src.transpose(0, 2, 1, 3), _blas_operand(wmat).transpose(0, 2, 1), out=root)
        return root, root.transpose(0, 2, 1, 3)
    root = np.empty((b, g, mo, length), dtype=src.dtype)  # channels strided (NCHW): (Mo, Mi) @ (Mi, L)
    if mi == 1:
        np.multiply(src.transpose(0, 2, 3, 1), wmat, out=root)
    else:
        np.matmul(_blas_operand(wmat), src.transpose(0, 2, 3, 1), out=root)
    return root, root.transpose(0, 3, 1, 2)


def _apply(src: np.ndarray, wmat: np.ndarray, dst: np.ndarray, accumulate: bool) -> None:
    """``dst[pix, g, :] (+)= wmat[g] @ src[pix, g, :]``, one GEMM per leading pixel index and group.

    ``src`` is ``(*pix, G, Mi)``, ``wmat`` ``(G, Mo, Mi)``, ``dst`` ``(*pix, G, Mo)`` (strided views). Pixel
    axes that walk memory alike are merged first, so a whole image (NCHW) or batch (NHWC) can be one GEMM.
    With ``accumulate`` the product goes to one temporary of ``dst``'s size and is added in place.
    """
    src, dst = merge_pixels([src, dst], src.ndim - 2)
    _apply_merged(src, wmat, dst, accumulate)


def _apply_merged(src: np.ndarray, wmat: np.ndarray, dst: np.ndarray, accumulate: bool) -> None:
    """:func:`_apply` on views whose pixel axes :func:`merge_pixels` merged already."""
    npix = src.ndim - 2
    mi = src.shape[-1]
    calls = dst.size // (dst.shape[npix - 1] * dst.shape[-1])  # GEMMs: leading pixels x groups
    if mi == 1 or (mi <= _ELEMENTWISE_MAX_REDUCTION and mi * dst.size < _CALL_COST_IN_ELEMENTS * calls):
        # Broadcast multiply-adds, one per input channel: (*pix, G, 1) * (G, Mo) -> (*pix, G, Mo).
        for j in range(mi):
            term = (src if mi == 1 else src[..., j : j + 1], wmat[:, :, j])  # src[..., 0:1] is src
            if accumulate or j > 0:
                np.add(dst, np.multiply(*term), out=dst)
            else:
                np.multiply(*term, out=dst)
        return
    wmat = _blas_operand(wmat)
    if src.strides[-1] == src.itemsize:
        # Channels contiguous (NHWC): rows are pixels, (pix[-1], Mi) @ (Mi, Mo) per leading pixel and group.
        a = _moveaxis(src, npix - 1, -2)
        b = wmat.transpose(0, 2, 1)
        d = _moveaxis(dst, npix - 1, -2)
    else:
        # Channels strided (NCHW): (Mo, Mi) @ (Mi, pix[-1]); the last pixel axis is the contiguous one.
        a = wmat
        b = _moveaxis(src, npix - 1, -1)
        d = _moveaxis(dst, npix - 1, -1)
    if accumulate:
        np.add(d, np.matmul(a, b), out=d)
    else:
        np.matmul(a, b, out=d)


def _box(root: np.ndarray, ap: np.ndarray, box: tuple[slice, ...], wmat: np.ndarray, dst: np.ndarray,
         accumulate: bool, limit: int, unit: int, pitch: list[int]) -> None:
    """``dst (+)= wmat @ ap[box]`` for a box of the pixel-major ``ap`` ``(B, *S, G, Mi)``: ``box`` is every image,
    then one step-1 slice per spatial dimension.

    A box narrower than its rows is not one matrix, so the row method would make one small GEMM per row.
    Instead this runs one GEMM per image over the *flat* range from the box's first to its last element
    (rows wrap into the next; the products at wrapped positions are computed and never read), then adds the
    box back out of the temporary through a strided view with the input's row pitch. The temporary is at
    most ``limit`` elements (images are chunked to stay under it); a box too large even for one image, or
    one that is a single matrix already, goes through :func:`_apply`. ``ap`` is a view of the C-contiguous
    activation ``root`` that starts at its first element; ``unit`` is the byte distance between spatial
    neighbours in that memory (one element in NCHW, one pixel's channels in NHWC); ``pitch`` is
    :func:`_pitch` of ``ap``.
    """
    src, merged = merge_pixels([ap[box], dst], len(box))
    if src.ndim <= 4:
        _apply_merged(src, wmat, merged, accumulate)
        return
    size = dst.shape[1:-2]  # the box's
    flat = sum([(e - 1) * pt for e, pt in zip(size, pitch)]) + 1
    per_image = flat * dst.shape[-2] * dst.shape[-1]
    if per_image > limit:
        _apply_merged(src, wmat, merged, accumulate)
        return
    n, st = ap.shape[0], ap.strides
    origin = sum([s.start * b for s, b in zip(box[1:], st[1:])])  # bytes from root's start to the box's first element
    chunk = limit // per_image
    for b0 in range(0, n, chunk):
        b = min(chunk, n - b0)
        rows = strided(root, origin + b0 * st[0], (b, flat, *ap.shape[-2:]), (st[0], unit, *st[-2:]))
        troot, t = _product(rows, wmat)  # t: (b, flat, G, Mo)
        ts = t.strides
        tv = strided(troot, 0, (b, *size, *t.shape[2:]), (ts[0], *[pt * ts[1] for pt in pitch], *ts[2:]))
        d = dst[b0 : b0 + b]
        if accumulate:
            np.add(d, tv, out=d)
        else:
            np.copyto(d, tv)
        del troot, t, tv  # the next chunk's product is not made while this one's is alive


def _pitch(ap: np.ndarray) -> list[int]:
    """Per spatial dimension of the pixel-major ``ap`` ``(B, *S, G, Mi)``, the pixels between its neighbours: row-major,
    from the shape, not from strides."""
    size = ap.shape[1:-2]
    return [math.prod(size[d + 1 :]) for d in range(len(size))]


def _gathered(srcs: list[np.ndarray], wmats: list[np.ndarray], dst: np.ndarray, accumulate: bool, limit: int) -> None:
    """``dst (+)= sum_i wmats[i] @ srcs[i]`` for views ``(*pix, G, Mi)`` that BLAS cannot read.

    Neither matrix axis of a strided NCHW view (stride > 1) has unit stride, and NumPy's ``matmul`` would
    fall back to its slow non-BLAS loop. So blocks of pixels of every source are copied side by side into a
    contiguous ``(G, sum Mi, pixels)`` temporary and multiplied with one GEMM per group against the filters
    concatenated along their input channels. Gathering several kernel offsets that share ``dst`` (the same
    valid output region) makes one longer GEMM and one pass over the output instead of several: what keeps
    a 7x7 stem with 3 input channels from touching its output 49 times. Blocks (whole rows where one fits)
    are sized so the copy and the product together stay within ``limit`` elements (at least one pixel); a
    block's temporaries are dropped before the next block's are made.
    """
    src0 = srcs[0]
    npix = src0.ndim - 2
    g, mo = src0.shape[-2], dst.shape[-1]
    mis = [s.shape[-1] for s in srcs]
    mi = sum(mis)
    wcat = np.concatenate(wmats, axis=-1) if len(wmats) > 1 else _blas_operand(wmats[0])  # (G, Mo, sum Mi)
    for sel in blocks(src0.shape[:npix], max(1, limit // ((mi + mo) * g))):
        d = dst[sel]
        pix = d.shape[:npix]
        buf = np.empty((g, mi, math.prod(pix)), dtype=dst.dtype)
        start = 0
        for s, m in zip(srcs, mis):
            part = buf[:, start : start + m].reshape(g, m, *pix)
            np.copyto(_moveaxis(part, (0, 1), (-2, -1)), s[sel])
            start += m
        t = np.matmul(wcat, buf)  # (G, Mo, pixels): one GEMM per group
        del buf, part
        tv = _moveaxis(t.reshape(g, mo, *pix), (0, 1), (-2, -1))
        if accumulate:
            np.add(d, tv, out=d)
        else:
            np.copyto(d, tv)
        del t, tv


def _unit(a: np.ndarray, layout: str) -> int:
    """Bytes between spatial neighbours of a C-contiguous activation."""
    return a.itemsize * (1 if layout == "NCHW" else a.shape[-1])


def forward(p: Plan, x: np.ndarray, w: np.ndarray, y: np.ndarray) -> None:
    """``y = conv(x, w)`` with no workspace.

    Offsets are ordered with a fully covering one first (when the padding allows one); it is written
    directly (with ``out=`` when its input is one matrix per image). Otherwise ``y`` is zero-filled first.
    Each later offset makes one temporary of at most ``y``'s size. With stride 1 every offset's input is a
    box and runs as one GEMM per image (see :func:`_box`); with a larger stride the inputs are strided rows
    and it runs one GEMM per row (NHWC), or gathers blocks of rows into a temporary first (NCHW, where the
    strided rows are no BLAS operand): the offsets that share an output region are gathered together
    (:func:`_gathered`), copy and product within ``SMALL_TEMP`` elements per block.
    """
    g = p.geom
    xp, yp = act_view(x, g.layout, p.groups), act_view(y, g.layout, p.groups)
    wv = weight_view(w, g.layout, p.groups)
    unit_stride = all(s == 1 for s in g.stride)
    started = p.covered  # the first offset reads real input at every output
    if not started:
        y[...] = 0
    if not unit_stride and g.layout == "NCHW" and p.cg > 1:
        # Strided NCHW rows must be gathered anyway: gather the offsets that share an output region
        # together (at most _GATHER_CHANNELS input channels per GEMM).
        for k, part in enumerate(_gather_groups(p)):
            srcs = [xp[(slice(None), *o.inp)] for o in part]
            wks = [wv[(Ellipsis, *o.kernel)] for o in part]
            _gathered(srcs, wks, yp[(slice(None), *part[0].out)], not (started and k == 0), SMALL_TEMP)
        return
    unit, pitch = _unit(x, g.layout), _pitch(xp)
    for i, off in enumerate(p.offsets):
        if off.empty:
            continue
        at: tuple[Any, ...] = (Ellipsis, *off.kernel)
        ys, wk = yp[(slice(None), *off.out)], wv[at]
        acc = i > 0 or not started
        if unit_stride:  # the input slices are of step 1
            _box(x, xp, (slice(None), *off.inp), wk, ys, acc, y.size, unit, pitch)
        else:
            _apply(xp[(slice(None), *off.inp)], wk, ys, accumulate=acc)


def backward_data(p: Plan, dy: np.ndarray, w: np.ndarray, dx: np.ndarray) -> None:
    """``dx = conv_transpose(dy, w)`` with no workspace: per offset ``dx[shifted] += W_k^T @ dy[valid]``.

    An offset whose reads cover the whole input (stride 1, no clipping) is written first; otherwise ``dx``
    is zero-filled. Each later offset makes one temporary of at most ``dx``'s size (for one offset distinct
    outputs touch distinct inputs, so the strided in-place add is exact). The ``dy`` side of every offset is
    a step-1 box, so each offset is one GEMM per image (:func:`_box`) whatever the stride.
    """
    g = p.geom
    dyp, dxp = act_view(dy, g.layout, p.groups), act_view(dx, g.layout, p.groups)
    wv = weight_view(w, g.layout, p.groups)
    first = next((o for o in p.offsets if o.full_in and not o.empty), None)
    if first is None:
        dx[...] = 0
    skip = None if first is None else first.kernel
    rest = (o for o in p.offsets if not o.empty and o.kernel != skip)
    unit, pitch = _unit(dy, g.layout), _pitch(dyp)
    for off in itertools.chain([first] if first is not None else [], rest):
        dxs = dxp[(slice(None), *off.inp)]
        at: tuple[Any, ...] = (Ellipsis, *off.kernel)
        wk_t = wv[at].transpose(0, 2, 1)  # (G, Cg, Kg)
        _box(dy, dyp, (slice(None), *off.out), wk_t, dxs, off is not first, dx.size, unit, pitch)


def backward_filter(p: Plan, x: np.ndarray, dy: np.ndarray, dw: np.ndarray) -> None:
    """``dw = sum over images and pixels of dy ⊗ x[shifted]`` with no workspace, one kernel offset at a time.

    Per offset, the pixel axes that can be merged become the GEMM's contraction ``L``; the remaining leading
    pixel axes (images, and rows when padding clips a row) are summed over in blocks, whichever way needs the
    smaller temporary per row:

    - products: one GEMM per row, ``(block, G, Kg, Cg)`` partial products summed into ``dw[..., offset]``;
    - gathered: the block's pixels of ``dy`` and ``x`` (whole rows where they fit) copied side by side into
      contiguous ``(G, Kg, P)`` and ``(G, P, Cg * n)`` temporaries, one GEMM contracting over all of them.
      Always used when the ``x`` rows are no BLAS operand (NCHW with stride > 1).

    Blocks are sized so each step's copies or products stay within ``max(dw.size / 2, SMALL_TEMP)`` elements
    (plus the ``n * dw / kprod`` product of the ``n`` offsets gathered together), at least one row of
    products or one pixel of copies: a small filter (a 7x7 stem's ``dw`` is 9408 elements) must not force one
    GEMM per pixel row. In NCHW with stride > 1, offsets that read the same ``dy`` rows are
    gathered together (:func:`_gather_groups`), so ``dy`` is copied once per group rather than per offset.
    Depthwise (one channel per group) uses ``einsum``, which makes no temporary.
    """
    g = p.geom
    xp, dyp = act_view(x, g.layout, p.groups), act_view(dy, g.layout, p.groups)
    wv = weight_view(dw, g.layout, p.groups)
    G, kg, cg = p.groups, p.kg, p.cg
    for off in p.offsets:
        if off.empty:
            at: tuple[Any, ...] = (Ellipsis, *off.kernel)
            wv[at] = 0
    for offs in _gather_groups(p):
        dwks = [wv[(Ellipsis, *o.kernel)] for o in offs]  # (G, Kg, Cg) views into dw
        dys = dyp[(slice(None), *offs[0].out)]
        xss = [xp[(slice(None), *o.inp)] for o in offs]
        npix = dys.ndim - 2
        dys, *xss = merge_pixels([dys, *xss], npix)
        npix = dys.ndim - 2
        if cg == 1:
            pix = "abcd"[:npix]  # summed over: images and pixels
            np.einsum(f"{pix}gk,{pix}g->gk", dys, xss[0][..., 0], out=dwks[0][..., 0])
            continue
        lead, length, nl, ng = dys.shape[: npix - 1], dys.shape[npix - 1], npix - 1, len(offs)
        blas_b = xss[0].strides[-1] == xss[0].itemsize or xss[0].strides[npix - 1] == xss[0].itemsize
        gather = ng > 1 or not blas_b or length * (kg + cg) < kg * cg
        budget = max(dw.size // 2, SMALL_TEMP)
        if gather:  # blocks of pixels (whole rows where one fits), G * (Kg + Cg * ng) elements each
            steps = blocks(dys.shape[:npix], max(1, budget // (G * (kg + cg * ng))))
        else:  # blocks of rows, each row's product G * Kg * Cg elements
            a = _moveaxis(dys, npix - 1, -1)  # (*lead, G, Kg, L)
            b = _moveaxis(xss[0], npix - 1, -2)  # (*lead, G, L, Cg)
            steps = blocks(lead, max(1, budget // (G * kg * cg)))
        first = True
        for sel in steps:
            if gather:
                dyb = dys[sel]  # (*pix, G, Kg)
                pix = dyb.shape[:npix]
                ac = np.empty((G, kg, math.prod(pix)), dtype=dw.dtype)
                np.copyto(_moveaxis(ac.reshape(G, kg, *pix), (0, 1), (npix, npix + 1)), dyb)
                bc = np.empty((G, math.prod(pix), cg * ng), dtype=dw.dtype)
                for j, xs in enumerate(xss):
                    view = bc[:, :, j * cg : (j + 1) * cg].reshape(G, *pix, cg)
                    np.copyto(_moveaxis(view, 0, npix), xs[sel])
                part = np.matmul(ac, bc)  # (G, Kg, Cg * ng): every offset of the group at once
                del ac, bc, view  # before the next block's copies are made
            else:
                part = np.matmul(a[sel], b[sel]).sum(axis=tuple(range(nl)))  # (G, Kg, Cg)
            for j, dwk in enumerate(dwks):
                pj = part[:, :, j * cg : (j + 1) * cg]
                if first:
                    np.copyto(dwk, pj)
                else:
                    np.add(dwk, pj, out=dwk)
            del part, pj
            first = False


def _gather_groups(p: Plan) -> Iterable[list]:
    """The non-empty offsets, grouped for :func:`forward` and :func:`backward_filter`.

    NCHW rows read with stride > 1 must be gathered; offsets that read the same region of the output
    (same valid outputs) are then gathered together, up to ``_GATHER_CHANNELS`` input channels, so one GEMM
    covers them all. Otherwise every offset is its own group.
    """
    g = p.geom
    if g.layout != "NCHW" or all(s == 1 for s in g.stride) or p.cg == 1:
        return ([o] for o in p.offsets if not o.empty)
    shared: dict[tuple, list] = {}
    for o in p.offsets:
        if not o.empty:
            shared.setdefault((o.lo, o.hi), []).append(o)
    per = max(1, _GATHER_CHANNELS // p.cg)
    return [offs[j : j + per] for offs in shared.values() for j in range(0, len(offs), per)]


def scratch_elements(pass_: str, p: Plan) -> int:
    """The most elements of NumPy temporaries ``pass_`` holds at once on ``p``: the figure ``cpu.py`` documents.

    With ``F = K * Cg`` (one kernel offset's filter) and ``n`` the most kernel offsets one gathered GEMM
    takes (1 unless strided NCHW):

    - ``fwd``: ``y + F``; strided NCHW with ``Cg > 1`` (gathered rows) ``n * F + max(SMALL_TEMP, n * C + K)``;
    - ``bwd_data``: ``min(dx, N * C * oprod) + F`` (with a stride, one offset reaches a fraction of ``dx``);
    - ``bwd_filter``: ``max(dw / 2, SMALL_TEMP, F, K + n * C) + n * F``; depthwise (``Cg == 1``) 0.

    ``F`` in the first two is the contiguous copy of a filter slice BLAS cannot read (NCHW, a kernel larger
    than one element), else 0. Every step drops its temporaries before the next step makes its own, so
    these are peaks, not sums over steps. NumPy's iterator buffers (a few of ``numpy.getbufsize()``
    elements in a ufunc on strided operands) come on top.
    """
    g = p.geom
    f = g.out_channels * p.cg
    copy = f if g.layout == "NCHW" and p.kprod > 1 else 0
    n = max((len(offs) for offs in _gather_groups(p)), default=1)
    if pass_ == "bwd_filter":
        if p.cg == 1:
            return 0
        return max(f * p.kprod // 2, SMALL_TEMP, f, g.out_channels + n * g.in_channels) + n * f
    if pass_ == "fwd" and g.layout == "NCHW" and p.cg > 1 and any(s > 1 for s in g.stride):
        return (n * f if n > 1 else copy) + max(SMALL_TEMP, n * g.in_channels + g.out_channels)
    if pass_ == "fwd":
        return math.prod(g.output_shape) + copy
    # One offset's products are its valid outputs' worth of input channels: under a stride, a fraction of dx.
    return min(math.prod(g.input_shape), g.batch * g.in_channels * p.oprod) + copy
