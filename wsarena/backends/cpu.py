"""The CPU convolution algorithms: NumPy only, four families per pass with different workspace sizes.

This is the convolution Caffe runs and shares its column buffer for (im2col, one GEMM, col2im), plus the
zero-workspace variant that cuDNN calls implicit GEMM. Like cuDNN's algorithms, each one states the exact
scratch memory it needs (:func:`workspace_size`) and uses nothing else: :func:`run` takes a caller-owned
``uint8`` workspace (in practice a lease from the arena) and carves its buffers out of it with
``workspace[:nbytes].view(dtype)``. GEMM results go straight into the output with ``np.matmul(out=)``.

Notation: ``N`` batch, ``C``/``K`` input/output channels, ``G`` groups, ``Cg = C/G``, ``Kg = K/G``,
``kprod`` = product of the kernel size, ``oprod`` = product of the output size, ``s`` = itemsize of the
dtype (4 for float32, 8 for float64).

=============  =====================  ==============================================================
pass           algorithm              workspace bytes
=============  =====================  ==============================================================
fwd            ``implicit_gemm``      0 (NumPy's temporaries at most ``y + F``; strided NCHW below)
fwd            ``gemm_tiled``         ``C * kprod * T * s`` (one tile's column matrix, about 1 MiB)
fwd            ``gemm_per_image``     ``C * kprod * oprod * s`` (one image's column matrix)
fwd            ``gemm_batch``         ``N * C * kprod * oprod * s`` (the whole batch's)
bwd_data       ``implicit_gemm``      0 (temporaries at most ``min(dx, N * C * oprod) + F``)
bwd_data       ``col2im_tiled``       ``C * kprod * T * s``
bwd_data       ``col2im_per_image``   ``C * kprod * oprod * s``
bwd_data       ``col2im_batch``       ``N * C * kprod * oprod * s``
bwd_filter     ``implicit_gemm``      0 (temporaries at most ``max(dw/2, SMALL_TEMP, F, K + n*C) + n*F``)
bwd_filter     ``im2col_tiled``       ``C * kprod * T * s`` (tiles within one image in NCHW)
bwd_filter     ``im2col_per_image``   ``C * kprod * oprod * s``
bwd_filter     ``im2col_batch``       ``N * C * kprod * oprod * s``, plus ``N * K * oprod * s`` in NCHW
=============  =====================  ==============================================================

A zero-size batch needs no workspace with any algorithm (:func:`run` computes nothing but ``dw``'s zeros).

``T`` is the pixel count of the largest tile of output rows (see :mod:`._cpu_tiled`): with ``inner`` the
output size without its first dimension ``O0`` and ``rows = max(1, 2**20 // (C * kprod * inner * s))``
(capped at ``O0`` for the NCHW filter gradient), ``T = rows * inner`` if ``rows < O0``, else
``T = min(N, rows // O0) * O0 * inner`` (whole images). ``ALGORITHMS`` lists each pass's algorithms in
this order; where one image's column matrix exceeds a tile the sizes grow along it (strictly for
``N > 1``), while on small images a tile holds several whole images, up to the whole batch. For ``N == 1``
the per-image and batch column matrices coincide (the NCHW batch filter gradient still adds its ``dy``
copy). The formulas do not special-case 1x1
kernels: a pointwise convolution is run without any copy by ``implicit_gemm``, which :func:`candidates`
lists first for it.

Padding is index arithmetic (see :mod:`._cpu_lowering`), never a padded copy, so no formula has a padding
term.

``implicit_gemm`` takes no workspace, but NumPy makes temporaries of its own (``matmul`` cannot accumulate,
so ``out += a @ b`` needs one). The table gives their peak in elements, which
``_cpu_implicit.scratch_elements`` computes: ``y``, ``dx``, ``dw`` are the output's sizes, ``F = K * Cg``
one kernel offset's filter (the contiguous copy of a filter slice BLAS cannot read, counted in NCHW with
kernels of more than one element), ``SMALL_TEMP = 2**18`` (1 MiB of float32) the budget of the
blocks the algorithm sizes itself, and ``n`` the most kernel offsets one GEMM gathers: 1, except for NCHW
with a stride, where offsets that share an output region go together, up to ``max(1, 512 // Cg)``. There
the forward pass holds ``n * F + max(SMALL_TEMP, n * C + K)``. Depthwise filter gradients (``Cg == 1``) make
none. Each step drops its temporaries before the next makes its own, and a block never holds more than its
budget unless one pixel (of gathered copies) or one row (of products) needs more. NumPy's iterator buffers
come on top (at most three of ``numpy.getbufsize()`` elements, in ufuncs on strided operands). None of it
depends on the workspace an algorithm was given, so no workspace formula counts it. Where memory is too short
for it, the ``MemoryError`` sends the call to the next algorithm, as an arena that cannot grow does
(:func:`wsarena.algos.run_with_fallback`), and only when none can run is it a ``NoAlgorithmFitsError``.
The column algorithms' own temporaries are documented with each: at most one output-sized array per step.

Algorithms
----------
``implicit_gemm`` (all passes)
    Loop over kernel offsets; per offset one batched GEMM on strided views of the operands, restricted to
    the outputs that read real input (see :mod:`._cpu_implicit` for how views become large GEMMs). Forward
    and backward-data write a fully covering offset directly and accumulate the rest through one temporary
    of at most the output's size; depthwise layers use broadcast multiply-adds (and ``einsum`` for the
    filter gradient) instead of tiny GEMMs. Cost: one pass over the output per kernel offset.
``gemm_tiled`` / ``col2im_tiled`` / ``im2col_tiled``
    Caffe's algorithm on tiles of output rows whose column matrix is at most 1 MiB where one row allows
    (see :mod:`._cpu_tiled`): im2col of the tile, one GEMM writing the output's rows. Backward-data zeroes
    ``dx`` and adds tile after tile; the filter gradient adds one ``dw``-sized temporary per tile after the
    first.
``gemm_per_image`` / ``col2im_per_image`` / ``im2col_per_image``
    Caffe's: per image, im2col into the column buffer then one GEMM per group (``y = W @ col``); backward
    data is ``col = W^T @ dy`` then col2im (scatter-add, no temporary); the filter gradient accumulates one
    ``dw``-sized temporary per image after the first.
``gemm_batch`` / ``col2im_batch`` / ``im2col_batch``
    The same over the whole batch at once: one im2col, one batched GEMM call (in NHWC, and for the NCHW
    filter gradient, a single GEMM per group with the batch folded into the GEMM's long dimension).
"""

from __future__ import annotations

import math

import numpy as np

from .._geometry import ITEMSIZES, ConvGeometry, byte_order_note
from .._pass import Pass
from .._sizes import short_repr
from . import _cpu_gemm, _cpu_implicit, _cpu_tiled
from ._cpu_lowering import begin_run, plan

__all__ = ["ALGORITHMS", "candidates", "run", "run_unchecked", "workspace_size"]

ALGORITHMS: dict[str, tuple[str, ...]] = {
    "fwd": ("implicit_gemm", "gemm_tiled", "gemm_per_image", "gemm_batch"),
    "bwd_data": ("implicit_gemm", "col2im_tiled", "col2im_per_image", "col2im_batch"),
    "bwd_filter": ("implicit_gemm", "im2col_tiled", "im2col_per_image", "im2col_batch"),
}

DTYPES = ("float32", "float64")


def _check(pass_: str, algo: str | None = None) -> tuple[str, ...]:
    algos = ALGORITHMS[Pass(pass_)]
    if algo is not None and algo not in algos:
        raise ValueError(f"unknown cpu algorithm {short_repr(algo)} for pass {pass_!r}; expected one of {algos}")
    return algos


# The family of each algorithm name, in ALGORITHMS' column order.
_FAMILIES = ("implicit", "tiled", "per_image", "batch")
_KINDS = {algo: kind for algos in ALGORITHMS.values() for algo, kind in zip(algos, _FAMILIES)}


def _kind(algo: str) -> str:
    """The family of an algorithm name: ``"implicit"``, ``"tiled"``, ``"per_image"`` or ``"batch"``."""
    return _KINDS[algo]


# Output pixels per image from which an image's own GEMM is big enough for BLAS and its column matrix is
# better kept per image (cache) than built for the whole batch; below it, the batch GEMM wins.
_LARGE_IMAGE = 512
# Below this many elements in the whole batch's column matrix (256 KiB of float32) a call is dominated by
# Python overhead, and the batch column algorithm makes the fewest NumPy calls (implicit_gemm makes a few
# per kernel offset).
_SMALL_PROBLEM = 1 << 16
# A column algorithm lowers one output row at the least (the tiled one's smallest tile); where that row's column
# matrix is this many tiles, every column algorithm streams it through memory, while implicit_gemm's pass over the
# output per kernel offset stays in cache if the output is under _OUTPUT_IN_CACHE tiles (a long kernel over few
# channels), or under _DX_IN_CACHE tiles for the data gradient, whose per-image col2im keeps up with it beyond.
_ROW_PAST_CACHE = 16
_OUTPUT_IN_CACHE = 8
_DX_IN_CACHE = 2
# Where one image's column matrix is this many tiles (twice the 32 MiB cache of the machine measured), the per-image
# and batch algorithms stream it through memory, and the tiled one, lowering a tile of at least _WIDE_TILE output
# pixels at a time (its GEMMs as efficient as an image's), is as fast or faster in a workspace that stays in cache.
_IMAGE_PAST_CACHE = 64
_WIDE_TILE = 256


def candidates(pass_: str, geom: ConvGeometry) -> list[str]:
    """This geometry's algorithms for ``pass_``, fastest expected first (every algorithm, in a fixed order).

    The order comes from timing every algorithm on ResNet-50's layers (plus depthwise and grouped ones) at
    batch 4 on a 2-core AVX-512 machine with OpenBLAS, one BLAS thread (stable against noise); the bounds on large
    column matrices from ``bench/bench_cpu_conv.py --ranking`` on a 2-core AMD EPYC (AVX2, 32 MiB of L3 cache).

    - Pointwise (1x1 kernel, stride 1, no padding): ``implicit_gemm`` first. Its single offset is the whole
      input, so it is exactly one GEMM on the operands themselves, with no copy and no workspace.
    - Small problems (whole-batch column matrix of at most 65536 elements): the batch column algorithm,
      which makes the fewest NumPy calls (one copy, one GEMM; ``implicit_gemm`` makes a few per offset).
    - Depthwise (one input channel per group, several groups): ``implicit_gemm`` first (broadcast
      multiply-adds and ``einsum``; a column matrix is ``kprod`` times the input for GEMMs of one row),
      except the NCHW forward pass, where short image rows make the offset-by-offset adds slower than im2col.
    - One output row's column matrix at least 16 tiles (1 MiB each) and an output under 8 tiles (under 2 for the
      data gradient): ``implicit_gemm`` first, then the tiled column algorithm. A column algorithm lowers a row at
      the least, so each streams its column matrix through memory, while ``implicit_gemm`` goes over an output that
      stays in cache once per kernel offset: a 1x4096 kernel over 4 NCHW images of 2 channels at 8x4096 (1 MiB out)
      2.3 to 8.8 times faster than every column algorithm, whose column matrix is 1 GiB an image; a 1x64 kernel
      over one 8x8192 image of 16 channels (4 MiB out) 1.4 to 2.3 times faster than the per-image algorithm forward
      and 1.1 to 1.3 times than the batch one for the filter gradient. Not where the output is larger: over 8
      images of 16 channels at 8x2048 (8 MiB out) a 1x2048 kernel's per-image algorithm is 1.3 times faster
      forward; nor for the data gradient from 2 tiles out, where the per-image col2im keeps up with it and is up to
      twice as fast (the 1x64 kernel over 4 to 16 rows).
    - NCHW, ungrouped, one image's column matrix at least 64 tiles in tiles of at least 256 output pixels: the
      tiled algorithm first, then per image, batch, ``implicit_gemm``. The per-image and batch algorithms stream
      that matrix through memory, the tiled one lowers a tile at a time into a workspace that stays in cache, in
      GEMMs as wide as an image's: a 3x3x3 kernel over 64 channels at 64^3 forward 0.79 to 1.04 times the per-image
      algorithm's time in 27 MiB of workspace where that takes 1.7 GiB an image, a 3x3 kernel over 64 channels at
      224x224 or 570x570 0.66 to 1.0 times in 1 MiB. Not in narrower tiles (136 pixels or fewer: up to 2.5 times
      slower over 256 to 1024 channels at 138x138 to 56x56), nor for the data gradient of rows of 16 tiles, whose
      tiles' GEMMs over few output channels are up to twice as slow as the per-image col2im.
    - NHWC, stride 1, large images (``oprod >= 512``): ``implicit_gemm`` first. Image rows merge into long
      GEMMs over the unpadded views and nothing is copied; then the tiled column algorithm.
    - Grouped: NCHW the per-image column algorithm, NHWC the tiled one (its short rows of ``Cg`` channels
      make large column copies slow).
    - Otherwise the column algorithms: per image first for large images (its GEMM is already large and
      its column matrix smaller), the whole batch first for small ones (one GEMM with the batch folded in
      uses BLAS far better on 7x7 or 14x14 outputs) and for the NCHW filter gradient (one GEMM instead of
      a ``dw``-sized temporary per image). Then the tiled one: within 10-30 % of those on large images in
      1 MiB, but a few NumPy calls per kernel offset and tile (a 7x7 stem lowered in 8 tiles per image is
      2-3x slower), and short GEMMs on small images. ``implicit_gemm`` is last: it touches the output once
      per kernel offset.
    """
    implicit, tiled, per_image, batch = _check(pass_)
    pointwise = all(k == 1 for k in geom.kernel_size) and all(s == 1 for s in geom.stride) and not any(geom.padding)
    large = math.prod(geom.output_size) >= _LARGE_IMAGE
    unit_stride = all(s == 1 for s in geom.stride)
    nhwc = geom.layout == "NHWC"
    if pointwise:
        return [implicit, tiled, per_image, batch]
    if geom.batch * geom.in_channels * math.prod(geom.kernel_size) * math.prod(geom.output_size) <= _SMALL_PROBLEM:
        return [batch, per_image, tiled, implicit]
    if geom.groups > 1 and geom.in_channels == geom.groups:
        if not nhwc and pass_ == "fwd":
            return [per_image, tiled, batch, implicit]
        return [implicit, tiled, per_image, batch]
    inner = math.prod(geom.output_size[1:])
    row = geom.in_channels * math.prod(geom.kernel_size) * inner
    tile = _cpu_tiled.TILE_BYTES // ITEMSIZES[geom.dtype]
    long_row = row >= _ROW_PAST_CACHE * tile
    in_cache = _DX_IN_CACHE if pass_ == "bwd_data" else _OUTPUT_IN_CACHE
    if long_row and math.prod(geom.output_shape) < in_cache * tile:
        return [implicit, tiled, per_image, batch]
    if nhwc and unit_stride and large:
        return [implicit, tiled, per_image, batch]
    if geom.groups > 1:
        return [tiled, implicit, per_image, batch] if nhwc else [per_image, tiled, implicit, batch]
    image = row * geom.output_size[0]  # one image's column matrix
    wide_tile = max(1, tile // row) * inner >= _WIDE_TILE  # a tile's output pixels, rows of an image
    if not nhwc and image >= _IMAGE_PAST_CACHE * tile and wide_tile and not (long_row and pass_ == "bwd_data"):
        return [tiled, per_image, batch, implicit]
    if large and not (pass_ == "bwd_filter" and not nhwc):
        return [per_image, batch, tiled, implicit]
    return [batch, per_image, tiled, implicit]


def workspace_size(pass_: str, algo: str, geom: ConvGeometry) -> int:
    """Exact workspace bytes of ``algo`` for ``pass_`` on ``geom`` (see the table in the module docstring); 0 for a
    zero-size batch, which :func:`run` computes without a workspace."""
    _check(pass_, algo)
    kind = _kind(algo)
    if kind == "implicit" or not geom.batch:
        return 0
    p = plan(geom)
    return _workspace_elements(pass_, kind, p) * p.itemsize


def _workspace_elements(pass_: str, kind: str, p) -> int:
    if kind == "tiled":
        return p.geom.in_channels * p.kprod * _cpu_tiled.tile_pixels(pass_, p)
    return _cpu_gemm.workspace_elements(pass_, p, batch=kind == "batch")


def _check_arrays(pass_: str, p, a, b, out) -> None:
    for name, arr, shape in zip(("a", "b", "out"), (a, b, out), p.shapes[pass_]):
        if type(arr) is not np.ndarray and not isinstance(arr, np.ndarray):
            raise TypeError(f"{name} must be a NumPy array, not {type(arr).__name__}")
        if arr.shape != shape:
            raise ValueError(f"{name} has shape {arr.shape}; {pass_} on this geometry needs {shape}")
        if arr.dtype != p.geom.dtype:
            note = byte_order_note(arr.dtype)
            raise TypeError(f"{name} has dtype {arr.dtype}{note}; the geometry says {p.geom.dtype}")
        if not arr.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
    if not out.flags.writeable:
        raise ValueError("out must be writeable")


def run(pass_: str, algo: str, geom: ConvGeometry, a, b, out, workspace) -> None:
    """Run one convolution pass with ``algo``, overwriting ``out``.

    Parameters
    ----------
    pass_ : {"fwd", "bwd_data", "bwd_filter"}
        ``fwd``: ``a = x``, ``b = w``, ``out = y``; ``bwd_data``: ``a = dy``, ``b = w``, ``out = dx``;
        ``bwd_filter``: ``a = x``, ``b = dy``, ``out = dw``.
    algo : str
        One of ``ALGORITHMS[pass_]``.
    geom : ConvGeometry
        The checked geometry; the arrays must have its shapes, layout and dtype (float32 or float64) and be
        C-contiguous.
    a, b, out : numpy.ndarray
        Operands and result. ``out`` is overwritten, never accumulated into.
    workspace : numpy.ndarray or None
        1-D ``uint8`` array of at least ``workspace_size(pass_, algo, geom)`` bytes, any content. Only the
        first ``workspace_size`` bytes are used. ``None`` is accepted where that size is 0.

    Raises
    ------
    ValueError
        Unknown pass or algorithm, wrong shapes, non-contiguous arrays, or a workspace that is too small.
    TypeError
        Non-NumPy arrays or a dtype other than the geometry's.

    Notes
    -----
    A zero-size batch touches no workspace: ``y``/``dx`` are empty and ``dw`` is set to zeros (the
    gradient summed over no images).
    """
    _check(pass_, algo)
    kind = _kind(algo)
    if geom.dtype not in DTYPES:
        raise TypeError(f"the cpu backend computes in {' or '.join(DTYPES)}, not {geom.dtype}")
    p = plan(geom)
    _check_arrays(pass_, p, a, b, out)
    if geom.batch == 0:
        if pass_ == "bwd_filter":
            out[...] = 0
        return
    if kind != "implicit":
        need = _workspace_elements(pass_, kind, p) * p.itemsize
        if not isinstance(workspace, np.ndarray) or workspace.dtype != np.uint8 or workspace.ndim != 1:
            raise ValueError(f"workspace must be a 1-D uint8 NumPy array, not {short_repr(workspace)}")
        if workspace.nbytes < need:
            raise ValueError(f"workspace has {workspace.nbytes} bytes; {pass_}/{algo} on this geometry needs {need}")
        if not workspace.flags.c_contiguous:
            raise ValueError("workspace must be contiguous")
    run_unchecked(pass_, algo, geom, a, b, out, workspace)


def run_unchecked(pass_: str, algo: str, geom: ConvGeometry, a, b, out, workspace) -> None:
    """:func:`run` without its argument checks, for callers that made them already (the ops do, per call).

    The arguments must be what :func:`run` accepts, with a non-empty batch. A small call spends as long in
    those checks as in its arithmetic; NumPy still bounds-checks every view, so a wrong argument raises
    rather than touching memory outside the arrays.
    """
    kind = _kind(algo)
    p = plan(geom)
    begin_run(p, pass_, algo)
    if kind == "implicit":
        if pass_ == "fwd":
            _cpu_implicit.forward(p, a, b, out)
        elif pass_ == "bwd_data":
            _cpu_implicit.backward_data(p, a, b, out)
        else:
            _cpu_implicit.backward_filter(p, a, b, out)
        return
    if kind == "tiled":
        {"fwd": _cpu_tiled.forward, "bwd_data": _cpu_tiled.backward_data, "bwd_filter": _cpu_tiled.backward_filter}[
            pass_
        ](p, a, b, out, workspace)
        return
    batch = kind == "batch"
    if pass_ == "fwd":
        _cpu_gemm.forward(p, a, b, out, workspace, batch)
    elif pass_ == "bwd_data":
        _cpu_gemm.backward_data(p, a, b, out, workspace, batch)
    else:
        _cpu_gemm.backward_filter(p, a, b, out, workspace, batch)
