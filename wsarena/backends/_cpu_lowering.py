"""Index arithmetic shared by the CPU convolution algorithms: views, kernel offsets, im2col and col2im.

Every algorithm works on *pixel-major canonical views* of its operands, whatever the memory layout:

- an activation ``x`` (``N, C, *S`` for NCHW or ``N, *S, C`` for NHWC) is seen as ``(N, *S, G, Cg)``;
- a filter ``w`` (``K, Cg, *R`` or ``K, *R, Cg``) is seen as ``(G, Kg, Cg, *R)``;
- a column matrix, whatever its memory order, is seen as ``(B, *O, G, Cg, *R)``.

These are views (``transpose``/``reshape`` of contiguous arrays), never copies, so one piece of index
arithmetic serves both layouts; the layout only decides which memory order is cheap for the GEMM.

Padding is handled by index arithmetic, not by a padded copy. For kernel index ``j`` in one spatial
dimension (stride ``s``, padding ``p``, dilation ``d``, input length ``S``, output length ``O``), output ``o``
reads input ``i = o*s - p + j*d``, which lies inside the input exactly for ``o`` in ``[lo, hi)`` with
``lo = max(0, ceil((p - j*d) / s))`` and ``hi = min(O, floor((S - 1 + p - j*d) / s) + 1)``. Outputs outside
``[lo, hi)`` read padding (zeros): im2col writes zeros there, the other algorithms skip them.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any

import numpy as np

from .._geometry import ConvGeometry
from .._pass import Pass

__all__ = [
    "Offset",
    "Plan",
    "Rows",
    "act_view",
    "blocks",
    "col2im",
    "col_view",
    "im2col",
    "merge_pixels",
    "plan",
    "rows",
    "strided",
    "weight_view",
]


@dataclasses.dataclass(frozen=True)
class Offset:
    """One kernel position and the part of the output that reads real (non-padding) input there.

    ``out`` slices the output's spatial dimensions (step 1), ``inp`` the matching input elements (step =
    stride); ``lo``/``hi`` bound the valid outputs per dimension. ``full_out``: every output reads real
    input at this position; ``full_in``: every input element is read (so a scatter-add can start with a copy).
    """

    index: tuple[int, ...]
    out: tuple[slice, ...]
    inp: tuple[slice, ...]
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    empty: bool
    full_out: bool
    full_in: bool
    full_out_rest: bool = False  # full_out in every dimension but the first


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every algorithm needs to know about a geometry, computed once (cached per geometry)."""

    geom: ConvGeometry
    groups: int
    cg: int  # input channels per group
    kg: int  # output channels per group
    kprod: int  # kernel elements
    oprod: int  # output pixels per image
    osize: tuple[int, ...]  # output size per spatial dimension
    offsets: tuple[Offset, ...]  # a fully covering offset first when there is one
    padded: bool  # some offset reads padding (im2col must write zeros)
    itemsize: int
    shapes: dict[str, tuple[tuple[int, ...], ...]]  # per pass: the shapes of (a, b, out)
    memo: dict = dataclasses.field(default_factory=dict, compare=False)  # views and row blocks, filled lazily


def _dim_range(size: int, out: int, j: int, s: int, p: int, d: int) -> tuple[int, int]:
    shift = j * d - p
    lo = max(0, -(shift // s)) if shift < 0 else 0  # ceil(-shift / s) for negative shift
    hi = min(out, (size - 1 - shift) // s + 1) if size - 1 - shift >= 0 else 0
    return lo, max(lo, hi)


@functools.lru_cache(maxsize=512)
def plan(geom: ConvGeometry) -> Plan:
    """The cached :class:`Plan` of ``geom``."""
    nd = geom.nd
    osz = geom.output_size
    offsets = []
    for index in itertools.product(*(range(k) for k in geom.kernel_size)):
        out, inp, los, his = [], [], [], []
        full_in = True
        for i in range(nd):
            s, p, d = geom.stride[i], geom.padding[i], geom.dilation[i]
            lo, hi = _dim_range(geom.input_size[i], osz[i], index[i], s, p, d)
            start = lo * s - p + index[i] * d
            out.append(slice(lo, hi))
            inp.append(slice(start, start + (hi - lo - 1) * s + 1, s) if hi > lo else slice(0, 0))
            los.append(lo)
            his.append(hi)
            if not (hi - lo == geom.input_size[i] and (s == 1 or hi - lo == 1)):
                full_in = False
        empty = any(h <= l for l, h in zip(los, his))
        full_out = all(l == 0 and h == o for l, h, o in zip(los, his, osz))
        rest = all(l == 0 and h == o for l, h, o in zip(los[1:], his[1:], osz[1:]))
        offsets.append(Offset(index, tuple(out), tuple(inp), tuple(los), tuple(his), empty, full_out, full_in, rest))
    # A covering offset first: the forward pass then writes it with out= instead of zero-filling and adding.
    offsets.sort(key=lambda o: not o.full_out)
    return Plan(
        geom=geom,
        groups=geom.groups,
        cg=geom.in_channels // geom.groups,
        kg=geom.out_channels // geom.groups,
        kprod=math.prod(geom.kernel_size),
        oprod=math.prod(osz),
        osize=tuple(osz),
        offsets=tuple(offsets),
        padded=not all(o.full_out for o in offsets),
        itemsize=np.dtype(geom.dtype).itemsize,
        shapes={p: geom.operand_shapes(p) for p in Pass},
    )


def act_view(a: np.ndarray, layout: str, groups: int) -> np.ndarray:
    """``(N, C, *S)`` or ``(N, *S, C)`` -> the pixel-major view ``(N, *S, G, Cg)`` (no copy)."""
    shape, axes = _act_layout(a.shape, layout, groups)
    v = a.reshape(shape)
    return v if axes is None else v.transpose(axes)


@functools.lru_cache(maxsize=1024)
def _act_layout(shape: tuple[int, ...], layout: str, groups: int) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """The reshape and transpose of :func:`act_view` (cached: small calls spend microseconds building them)."""
    n, nd = shape[0], len(shape) - 2
    if layout == "NCHW":
        c, sp = shape[1], shape[2:]
        return (n, groups, c // groups, *sp), (0, *range(3, 3 + nd), 1, 2)
    c, sp = shape[-1], shape[1:-1]
    return (n, *sp, groups, c // groups), None


def weight_view(w: np.ndarray, layout: str, groups: int) -> np.ndarray:
    """``(K, Cg, *R)`` or ``(K, *R, Cg)`` -> the view ``(G, Kg, Cg, *R)`` (no copy)."""
    k, nd = w.shape[0], w.ndim - 2
    if layout == "NCHW":
        return w.reshape(groups, k // groups, *w.shape[1:])
    v = w.reshape(groups, k // groups, *w.shape[1:])
    return v.transpose(0, 1, 2 + nd, *range(2, 2 + nd))


# Column memory orders, as labels: b = image, o = output pixel axes, g = group, c = channel in group,
# r = kernel axes. The canonical view every helper indexes is ("b", "o", "g", "c", "r").
COL_NCHW = ("b", "g", "c", "r", "o")  # per (image, group) a (Cg*kprod, oprod) matrix: W @ col
COL_NCHW_T = ("g", "c", "r", "b", "o")  # per group a (Cg*kprod, B*oprod) matrix: dy @ col^T over the batch
COL_NHWC = ("b", "o", "g", "r", "c")  # per group a (B*oprod, kprod*Cg) matrix with row stride C*kprod
_CANON = ("b", "o", "g", "c", "r")


def col_view(
    mem: np.ndarray, order: tuple[str, ...], batch: int, p: Plan, osize: tuple[int, ...] | None = None
) -> np.ndarray:
    """Canonical ``(B, *O, G, Cg, *R)`` view of a column buffer ``mem`` laid out as ``order``.

    ``osize`` is the output size the buffer covers (default: the whole output; a block of rows for tiles).
    """
    osize = osize or p.osize
    layout = p.memo.get((order, batch, osize))
    if layout is None:
        g = p.geom
        sizes = {"b": (batch,), "o": osize, "g": (p.groups,), "c": (p.cg,), "r": g.kernel_size}
        shape: list[int] = []
        axes: dict[str, list[int]] = {}
        pos = 0
        for label in order:
            axes[label] = list(range(pos, pos + len(sizes[label])))
            shape.extend(sizes[label])
            pos += len(sizes[label])
        layout = p.memo[(order, batch, osize)] = (tuple(shape), tuple(a for label in _CANON for a in axes[label]))
    return mem.reshape(layout[0]).transpose(layout[1])


def strided(root: np.ndarray, offset: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
    """A view of the C-contiguous array ``root`` starting ``offset`` bytes in, with any shape and strides.

    What ``numpy.lib.stride_tricks.as_strided`` does, through the ``ndarray`` constructor on ``root``'s buffer:
    a microsecond instead of ten, which matters for small convolutions, and NumPy checks the bounds.
    """
    return np.ndarray(shape, root.dtype, root, offset, strides)


@dataclasses.dataclass(frozen=True)
class Rows:
    """The kernel offsets of a block of output rows ``[row0, row0 + osize[0])`` (first spatial dimension).

    Same fields as the plan's offsets, in the block's coordinates: a tiled algorithm lowers one block of
    rows at a time into a column buffer of the block's size.
    """

    row0: int
    osize: tuple[int, ...]
    offsets: tuple[Offset, ...]
    padded: bool  # some offset reads padding within the block


def rows(p: Plan, r0: int, r1: int) -> Rows:
    """The (cached) :class:`Rows` of output rows ``[r0, r1)``; ``rows(p, 0, O[0])`` is the whole image."""
    key = ("rows", r0, r1)
    found = p.memo.get(key)
    if found is not None:
        return found
    s0 = p.geom.stride[0]
    whole = r0 == 0 and r1 == p.osize[0]
    offsets = []
    for off in p.offsets:
        lo, hi = max(off.lo[0], r0), min(off.hi[0], r1)
        if off.empty or hi <= lo:
            lo = hi = r0
        start = off.inp[0].start + (lo - off.lo[0]) * s0 if hi > lo else 0
        inp0 = slice(start, start + (hi - lo - 1) * s0 + 1, s0) if hi > lo else slice(0, 0)
        los, his = (lo - r0, *off.lo[1:]), (hi - r0, *off.hi[1:])
        offsets.append(
            Offset(
                index=off.index,
                out=(slice(lo - r0, hi - r0), *off.out[1:]),
                inp=(inp0, *off.inp[1:]),
                lo=los,
                hi=his,
                empty=off.empty or hi <= lo,
                full_out=not off.empty and lo == r0 and hi == r1 and off.full_out_rest,
                full_in=off.full_in and whole,
            )
        )
    found = p.memo[key] = Rows(
        row0=r0,
        osize=(r1 - r0, *p.osize[1:]),
        offsets=tuple(offsets),
        padded=not all(o.full_out for o in offsets),
    )
    return found


def blocks(shape: tuple[int, ...], size: int):
    """Index tuples that tile the leading axes ``shape`` in boxes of at most ``size`` elements (at least one).

    Each box is a tuple of slices over the first axes (the remaining axes whole), so selecting it from a
    view keeps a view; consecutive boxes follow row-major order. With ``shape = (images, rows)``: whole
    images while ``size`` holds at least one, else blocks of rows of one image.
    """
    if not shape:
        yield ()
        return
    inner = math.prod(shape[1:])
    if size >= inner or len(shape) == 1:
        step = max(1, size // max(inner, 1))
        for start in range(0, shape[0], step):
            yield (slice(start, start + step),)
        return
    for i in range(shape[0]):
        for rest in blocks(shape[1:], size):
            yield (slice(i, i + 1), *rest)


def _window(xp: np.ndarray, p: Plan, root: np.ndarray, offset: int, block: Rows) -> np.ndarray:
    """Sliding-window view ``(B, *O, G, Cg, *R)`` of an unpadded pixel-major input (valid only without padding).

    ``xp`` is a view of the C-contiguous ``root`` whose first element is ``offset`` bytes into it; the window
    covers the output rows of ``block``, which must read no padding.
    """
    key = ("window", xp.shape, xp.strides, block.row0, block.osize)
    found = p.memo.get(key)
    if found is None:
        g = p.geom
        nd = g.nd
        st = xp.strides
        shape = (xp.shape[0], *block.osize, *xp.shape[nd + 1 :], *g.kernel_size)
        strides = (
            st[0],
            *(st[1 + i] * g.stride[i] for i in range(nd)),
            *st[nd + 1 :],
            *(st[1 + i] * g.dilation[i] for i in range(nd)),
        )
        # A block that reads no padding starts at input row row0*stride - padding (>= 0); in every other
        # dimension the padding is 0 (any padding there would be read by kernel index 0 at output 0).
        found = p.memo[key] = (shape, strides, (block.row0 * g.stride[0] - g.padding[0]) * st[1])
    shape, strides, start = found
    return strided(root, offset + start, shape, strides)


def im2col(xp: np.ndarray, col: np.ndarray, p: Plan, root: np.ndarray, offset: int, block: Rows | None = None) -> None:
    """Lower the pixel-major input ``xp`` ``(B, *S, G, Cg)`` into the canonical column view ``col``.

    ``xp`` is a view of the C-contiguous activation ``root`` starting ``offset`` bytes into it; ``block``
    selects a block of output rows (default: the whole image), whose size ``col`` has. Every element of
    ``col`` is written (zeros where the kernel reads padding), so ``col`` may start as garbage. Without
    padding this is one strided copy; with padding, one copy per kernel offset plus zeroed frames.
    """
    nd = p.geom.nd
    block = block or rows(p, 0, p.osize[0])
    if not block.padded:
        np.copyto(col, _window(xp, p, root, offset, block))
        return
    lead = (slice(None),)
    for off in block.offsets:
        at: tuple[Any, ...] = (Ellipsis, *off.index)
        dst = col[at]  # (B, *O, G, Cg)
        if off.empty:
            dst[...] = 0
            continue
        # Zero the frame of outputs that read padding: per dimension, the slabs below lo and above hi.
        for i in range(nd):
            before = lead + (slice(None),) * i
            if off.lo[i] > 0:
                dst[before + (slice(0, off.lo[i]),)] = 0
            if off.hi[i] < dst.shape[1 + i]:
                dst[before + (slice(off.hi[i], None),)] = 0
        dst[lead + off.out] = xp[lead + off.inp]


def col2im(col: np.ndarray, xp: np.ndarray, p: Plan, block: Rows | None = None, overwrite: bool = True) -> None:
    """Scatter-add the canonical column view ``col`` into the pixel-major ``xp`` ``(B, *S, G, Cg)``.

    With ``overwrite`` ``xp`` is set (its first covering offset copied, or zeros first); otherwise the
    columns are added to what ``xp`` holds (a tiled algorithm adds block after block). ``block`` selects
    the output rows ``col`` holds (default: the whole image). For one kernel offset distinct outputs read
    distinct inputs, so each offset's in-place add on a strided view is race-free and makes no temporary.
    """
    first, rest = _scatter(p, block or rows(p, 0, p.osize[0]), overwrite)
    if first is not None:
        np.copyto(xp[first[0]], col[first[1]])
    elif overwrite:
        xp[...] = 0
    for dst_index, src_index in rest:
        dst = xp[dst_index]
        np.add(dst, col[src_index], out=dst)


def _scatter(p: Plan, block: Rows, overwrite: bool) -> tuple[tuple | None, tuple]:
    """The (cached) ``(xp index, col index)`` pairs of :func:`col2im`: the offset copied first, then those added."""
    key = ("scatter", block.row0, block.osize, overwrite)
    found = p.memo.get(key)
    if found is None:
        lead = (slice(None),)

        def pair(o: Offset) -> tuple[tuple, tuple]:
            return lead + o.inp, (*lead, *o.out, Ellipsis, *o.index)

        live = [o for o in block.offsets if not o.empty]
        first = next((o for o in live if o.full_in), None) if overwrite else None
        found = p.memo[key] = (None if first is None else pair(first), tuple(pair(o) for o in live if o is not first))
    return found


def merge_pixels(views: list[np.ndarray], npix: int) -> list[np.ndarray]:
    """Merge adjacent leading (pixel) axes ``0..npix-1`` of all ``views`` wherever every view allows it.

    Axes ``i`` and ``i+1`` merge when, in every view, ``stride[i] == stride[i+1] * shape[i+1]`` (the pair
    walks memory like one axis). The views must agree on the leading shape. Returns views of the same
    memory whose leading axes are the merged pixel axes; longer pixel axes make larger GEMMs. (``reshape``
    merges exactly such axes without copying; the check below makes sure no copy slipped in, because a
    copy of an output view would silently drop the writes.)
    """
    shapes = [list(v.shape) for v in views]
    strides = [list(v.strides) for v in views]
    merged = False
    i = npix - 2
    while i >= 0:
        if all(st[i] == st[i + 1] * sh[i + 1] for sh, st in zip(shapes, strides)):
            for sh, st in zip(shapes, strides):
                sh[i] *= sh.pop(i + 1)
                st[i] = st.pop(i + 1)
            merged = True
        i -= 1
    if not merged:
        return views
    out = []
    for v, sh in zip(views, shapes):
        r = v.reshape(sh)
        if r.size and not np.may_share_memory(r, v):  # pragma: no cover - reshape copied after all
            raise AssertionError("merge_pixels: reshape made a copy")
        out.append(r)
    return out
