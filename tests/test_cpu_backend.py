"""The CPU backend's algorithms (wsarena.backends.cpu) against the independent reference (tests/reference.py).

Tolerances: relative error ``max|out - ref| / max|ref|`` at most 1e-5 for float32 operands and 1e-12 for
float64, where ``ref`` is computed in float64 from the very same (float32-rounded) operands. The random geometries
divide by the magnitude of the sums instead (the pass on the operands' absolute values), as small random cases
can have outputs whose terms cancel. Every run gets
a workspace of exactly ``workspace_size`` bytes filled with NaN bit patterns or other garbage and an output
prefilled with NaN, so an uninitialised read, a short workspace or an accumulate-instead-of-overwrite shows
up as a NaN or a wrong value.
"""

from __future__ import annotations

import itertools
import math
import types
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from wsarena._geometry import conv_geometry
from wsarena.backends import _cpu_backend, _cpu_implicit, _cpu_lowering, _cpu_tiled, cpu

from .reference import error_for_sums, ref_conv_backward_data, ref_conv_backward_filter, ref_conv_forward

TOL = {"float32": 1e-5, "float64": 1e-12}
PASSES = ("fwd", "bwd_data", "bwd_filter")


def _ref_kwargs(g):
    return {"stride": g.stride, "padding": g.padding, "dilation": g.dilation, "groups": g.groups, "layout": g.layout}


def _operands(g, rng):
    x = rng.standard_normal(g.input_shape).astype(g.dtype)
    w = rng.standard_normal(g.weight_shape).astype(g.dtype)
    dy = rng.standard_normal(g.output_shape).astype(g.dtype)
    return x, w, dy


def _references(g, x, w, dy):
    kw = _ref_kwargs(g)
    return {
        "fwd": ref_conv_forward(x, w, **kw),
        "bwd_data": ref_conv_backward_data(dy, w, g.input_shape, **kw),
        "bwd_filter": ref_conv_backward_filter(x, dy, g.weight_shape, **kw),
    }


def _args(pass_, g, x, w, dy):
    """(a, b, out shape) of a pass, as cpu.run takes them."""
    return {
        "fwd": (x, w, g.output_shape),
        "bwd_data": (dy, w, g.input_shape),
        "bwd_filter": (x, dy, g.weight_shape),
    }[pass_]


def _poisoned(nbytes, dtype, kind="nan"):
    """A workspace of exactly ``nbytes`` bytes of garbage: NaN bit patterns, huge values, or random bytes."""
    if kind == "random":
        return np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    value = {"nan": np.nan, "huge": 3e38 if dtype == "float32" else 1e300}[kind]
    item = np.dtype(dtype).itemsize
    pattern = np.full(-(-nbytes // item), value, dtype=dtype).view(np.uint8)
    return pattern[:nbytes].copy()


def _rel_err(out, ref):
    scale = np.abs(ref).max() if ref.size else 0.0
    err = np.abs(out.astype(np.float64) - ref).max() if ref.size else 0.0
    return err / scale if scale > 0 else err


def _check_all(g, seed=0, poison="nan"):
    rng = np.random.default_rng(seed)
    x, w, dy = _operands(g, rng)
    refs = _references(g, x, w, dy)
    magnitudes = _references(g, np.abs(x), np.abs(w), np.abs(dy))
    for pass_ in PASSES:
        a, b, shape = _args(pass_, g, x, w, dy)
        for algo in cpu.ALGORITHMS[pass_]:
            ws = _poisoned(cpu.workspace_size(pass_, algo, g), g.dtype, poison)
            out = np.full(shape, np.nan, dtype=g.dtype)
            cpu.run(pass_, algo, g, a, b, out, ws)
            err = error_for_sums(out, refs[pass_], magnitudes[pass_])
            assert err <= TOL[g.dtype], f"{pass_}/{algo} on {g}: error {err:.3g} relative to the sums' magnitude"


@st.composite
def geometries(draw):
    """Small random geometries over everything the backend supports; sizes keep the reference fast."""
    nd = draw(st.integers(1, 3))
    layout = draw(st.sampled_from(("NCHW", "NHWC")))
    dtype = draw(st.sampled_from(("float32", "float64")))
    groups = draw(st.sampled_from((1, 1, 2, 3)))
    cg = draw(st.sampled_from((1, 1, 2, 3, 5)))  # cg == 1 with groups > 1 is depthwise
    kg = draw(st.sampled_from((1, 2, 4)))
    batch = draw(st.integers(1, 3))
    max_size = (9, 6, 4)[nd - 1]
    kernel, stride, padding, dilation, size = [], [], [], [], []
    for _ in range(nd):
        k = draw(st.integers(1, 3))
        d = draw(st.integers(1, 2))
        p = draw(st.integers(0, 2))
        span = d * (k - 1) + 1
        lo = max(1, span - 2 * p)  # the kernel must fit the padded input; lo gives "as large as" it
        size.append(draw(st.integers(lo, max(lo, max_size))))
        kernel.append(k)
        stride.append(draw(st.integers(1, 3)))
        padding.append(p)
        dilation.append(d)
    c, k_out = groups * cg, groups * kg
    if layout == "NCHW":
        ishape, wshape = (batch, c, *size), (k_out, cg, *kernel)
    else:
        ishape, wshape = (batch, *size, c), (k_out, *kernel, cg)
    return conv_geometry(
        ishape, wshape, stride=stride, padding=padding, dilation=dilation, groups=groups, layout=layout, dtype=dtype
    )


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(g=geometries(), seed=st.integers(0, 2**16), poison=st.sampled_from(("nan", "huge", "random")))
@example(  # terms that cancel: 0.0004 out of sums of 0.35 (an error of 1.6e-5 relative to the output alone)
    g=conv_geometry((1, 2, 3, 2), (1, 1, 3, 2), stride=(2, 1), padding=(1, 1), dilation=(1, 2), layout="NHWC",
                    dtype="float32"),
    seed=1, poison="nan",
)
def test_every_algorithm_matches_the_reference(g, seed, poison):
    _check_all(g, seed, poison)


# Hand-picked cases that random small shapes reach rarely: larger channel counts (many GEMM rows, the
# chunked filter-gradient path), depthwise with a channel multiplier, 1x1 kernels with stride, a kernel
# exactly as large as the padded input, batch 1, and ResNet-like shapes in both layouts.
CASES = [
    # (input_shape NCHW, weight_shape NCHW, kwargs)
    ((2, 16, 12, 11), (24, 16, 3, 3), {"padding": 1}),
    ((3, 16, 13, 13), (8, 16, 3, 3), {"padding": 1, "stride": 2}),
    ((2, 32, 9, 9), (16, 32, 1, 1), {}),
    ((2, 32, 9, 9), (16, 32, 1, 1), {"stride": 2}),
    ((1, 8, 5, 5), (4, 8, 7, 7), {"padding": 1}),  # kernel == padded input: one output pixel
    ((1, 4, 5, 6), (6, 4, 5, 6), {}),  # kernel == input, no padding
    ((2, 12, 10, 10), (12, 1, 3, 3), {"padding": 1, "groups": 12}),  # depthwise
    ((2, 6, 10, 10), (12, 1, 3, 3), {"padding": 2, "dilation": 2, "groups": 6}),  # depthwise, multiplier 2
    ((2, 16, 8, 8), (16, 4, 3, 3), {"padding": 1, "groups": 4}),  # grouped (ResNeXt-like)
    ((2, 3, 23, 23), (16, 3, 7, 7), {"padding": 3, "stride": 2}),  # stem-like
    ((2, 8, 17), (16, 8, 5), {"padding": 2, "stride": 3}),  # 1-D
    ((2, 4, 6, 7, 5), (8, 4, 3, 3, 3), {"padding": 1, "stride": (1, 2, 1)}),  # 3-D
    ((1, 6, 5, 4, 4), (6, 1, 3, 3, 3), {"padding": 1, "groups": 6}),  # 3-D depthwise
    ((3, 2, 4, 4), (2, 1, 1, 1), {"padding": 2, "groups": 2}),  # 1x1 with padding: some outputs read no input
    ((2, 4, 3, 3), (4, 4, 3, 3), {"padding": 4, "dilation": 3}),  # offsets entirely in the padding
    ((2, 4, 12, 12), (6, 4, 3, 3), {"stride": 2}),  # strided, no padding: every offset writes the whole output
    # Kernels longer than their outputs (1100 and 33x34 elements; the last one with stride and dilation):
    # im2col and col2im lower them one output at a time there where the column matrix stays in cache
    ((2, 3, 40), (4, 3, 1100), {"padding": 550}),
    ((1, 2, 9, 10), (3, 2, 33, 34), {"padding": (14, 15), "stride": (1, 2)}),
    ((1, 2, 5, 12), (2, 2, 3, 9), {"padding": (1, 4), "stride": (1, 2), "dilation": (1, 2)}),
]


def _nhwc(shape):
    return (shape[0], *shape[2:], shape[1])


def _hand_picked(case, layout, dtype):
    """The geometry of ``CASES[case]`` in ``layout``."""
    ishape, wshape, kw = CASES[case]
    if layout == "NHWC":
        ishape, wshape = _nhwc(ishape), _nhwc(wshape)
    return conv_geometry(ishape, wshape, layout=layout, dtype=dtype, **kw)


def _check_one_algorithm_per_pass(g, seed, algos, workspace):
    """Run ``algos[pass_]`` on each pass of ``g`` (float64) with the workspace ``workspace(pass_, algo)`` into a
    NaN-filled output, and compare it with the reference."""
    x, w, dy = _operands(g, np.random.default_rng(seed))
    refs = _references(g, x, w, dy)
    for pass_ in PASSES:
        a, b, shape = _args(pass_, g, x, w, dy)
        out = np.full(shape, np.nan)
        cpu.run(pass_, algos[pass_], g, a, b, out, workspace(pass_, algos[pass_]))
        assert _rel_err(out, refs[pass_]) <= TOL["float64"], pass_


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_hand_picked_geometries(case, layout, dtype):
    _check_all(_hand_picked(case, layout, dtype), seed=case)


@pytest.mark.parametrize("gather", [_cpu_implicit._GATHER_CHANNELS, 8, 1])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_implicit_gemm_in_the_smallest_blocks(case, layout, gather, monkeypatch):
    """With the temporaries' floor at one element, gathered rows and filter-gradient partial sums run one
    pixel row per block: the block tiling must still cover every row exactly once.

    With few channels per gathered GEMM (strided NCHW), the kernel offsets that share an output region are
    split into several GEMMs: 1 channel puts one offset in each, 8 two offsets of 3 or 4 channels (the last
    GEMM of 9 offsets gets one). Every GEMM must add to the output, except a first that writes it."""
    monkeypatch.setattr(_cpu_implicit, "SMALL_TEMP", 1)
    monkeypatch.setattr(_cpu_implicit, "_GATHER_CHANNELS", gather)
    g = _hand_picked(case, layout, "float64")
    _check_one_algorithm_per_pass(g, case, dict.fromkeys(PASSES, "implicit_gemm"), lambda pass_, algo: None)


@settings(deadline=None)  # Hypothesis's 200 ms per example, which a loaded machine may exceed at random
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), size=st.integers(1, 40))
def test_blocks_tile_the_leading_axes_exactly_once(shape, size):
    seen = np.zeros(shape, dtype=int)
    for sel in _cpu_lowering.blocks(tuple(shape), size):
        block = seen[sel]
        assert 1 <= block.size <= size
        block += 1
    assert (seen == 1).all()


# ----------------------------------------------------------------------------------------------- workspace


def _tile_pixels(g, pass_, tile_bytes):
    """Output pixels of the largest tile, from the formula documented in _cpu_tiled."""
    s = np.dtype(g.dtype).itemsize
    o0, inner = g.output_size[0], math.prod(g.output_size[1:])
    rows = max(1, tile_bytes // (g.in_channels * math.prod(g.kernel_size) * inner * s))
    if pass_ == "bwd_filter" and g.layout == "NCHW":
        rows = min(rows, o0)
    return min(g.batch, rows // o0) * o0 * inner if rows >= o0 else rows * inner


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("tile_rows", [2, 100])
def test_workspace_formulas(layout, dtype, batch, tile_rows, monkeypatch):
    ishape, wshape = (batch, 6, 11, 9), (8, 3, 3, 2)
    if layout == "NHWC":
        ishape, wshape = _nhwc(ishape), _nhwc(wshape)
    g = conv_geometry(ishape, wshape, stride=(2, 1), padding=1, dilation=(1, 2), groups=2, layout=layout, dtype=dtype)
    s = np.dtype(dtype).itemsize
    kprod, oprod = 3 * 2, math.prod(g.output_size)
    assert g.output_size == (6, 9)
    tile_bytes = tile_rows * g.in_channels * kprod * 9 * s  # tiles of 2 rows, or of whole images
    monkeypatch.setattr(_cpu_tiled, "TILE_BYTES", tile_bytes)
    col = g.in_channels * kprod * oprod * s  # one image's column matrix
    tile = {pass_: g.in_channels * kprod * _tile_pixels(g, pass_, tile_bytes) * s for pass_ in PASSES}
    expected = {
        "fwd": {"implicit_gemm": 0, "gemm_tiled": tile["fwd"], "gemm_per_image": col, "gemm_batch": batch * col},
        "bwd_data": {
            "implicit_gemm": 0,
            "col2im_tiled": tile["bwd_data"],
            "col2im_per_image": col,
            "col2im_batch": batch * col,
        },
        "bwd_filter": {
            "implicit_gemm": 0,
            "im2col_tiled": tile["bwd_filter"],
            "im2col_per_image": col,
            "im2col_batch": batch * col + (batch * g.out_channels * oprod * s if layout == "NCHW" else 0),
        },
    }
    if tile_rows == 2:
        assert all(t == col // 3 for t in tile.values())  # 2 of 6 rows
    for pass_ in PASSES:
        assert set(cpu.ALGORITHMS[pass_]) == set(expected[pass_])
        sizes = {algo: cpu.workspace_size(pass_, algo, g) for algo in cpu.ALGORITHMS[pass_]}
        assert sizes == expected[pass_]
        if batch > 1 and tile_rows == 2:
            assert len(set(sizes.values())) == 4, sizes  # four families, four different sizes
            assert list(sizes.values()) == sorted(sizes.values())  # ALGORITHMS lists them smallest first


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_tiled_algorithms_one_row_per_tile(case, layout, monkeypatch):
    """With tiles of one output row, every block-of-rows path of the tiled algorithms runs."""
    monkeypatch.setattr(_cpu_tiled, "TILE_BYTES", 1)
    g = _hand_picked(case, layout, "float64")
    tiled = {pass_: cpu.ALGORITHMS[pass_][1] for pass_ in PASSES}
    assert all(algo.endswith("_tiled") for algo in tiled.values())
    _check_one_algorithm_per_pass(
        g, case, tiled, lambda pass_, algo: _poisoned(cpu.workspace_size(pass_, algo, g), "float64")
    )


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_kept_and_made_afresh_plans_give_the_same_bits(case, layout, monkeypatch):
    """Past _cpu_lowering.KEEP items a plan makes its offsets, blocks of rows and boxes in each call instead of
    keeping them: the same copies and adds in the same order, so the very same bits, for every algorithm, on
    whole images and in tiles of one row."""
    g = _hand_picked(case, layout, "float32")
    x, w, dy = _operands(g, np.random.default_rng(case))
    for tile_bytes in (_cpu_tiled.TILE_BYTES, 1):
        monkeypatch.setattr(_cpu_tiled, "TILE_BYTES", tile_bytes)
        outs = []
        for keep in (10**9, 0):
            monkeypatch.setattr(_cpu_lowering, "KEEP", keep)
            _cpu_lowering.forget()
            found = {}
            for pass_ in PASSES:
                a, b, shape = _args(pass_, g, x, w, dy)
                for algo in cpu.ALGORITHMS[pass_]:
                    out = np.full(shape, np.nan, dtype=g.dtype)
                    cpu.run(pass_, algo, g, a, b, out, _poisoned(cpu.workspace_size(pass_, algo, g), g.dtype))
                    found[algo] = out.tobytes()
            outs.append(found)
        assert outs[0] == outs[1]
    _cpu_lowering.forget()


def _share(size, k, s, p, d):
    """The share of one dimension's (output, kernel index) pairs that read real input, by brute force."""
    out = (size + 2 * p - d * (k - 1) - 1) // s + 1
    return Fraction(sum(0 <= o * s - p + j * d < size for o in range(out) for j in range(k)), out * k)


# Geometries whose columns read real input in shares around _cpu_lowering.BLANK (2/3): per dimension (size, kernel,
# stride, padding, dilation), each dimension's share, then the geometry's, below, at or above 2/3.
NEAR_BLANK = [
    ((2, 2, 2, 1, 1),),  # 1/2
    ((5, 3, 1, 3, 2),),  # 13/21
    ((9, 2, 2, 3, 1),),  # 9/14
    ((3, 2, 1, 1, 2),),  # 2/3
    ((8, 4, 3, 3, 1),),  # 11/16
    ((5, 2, 1, 2, 2),),  # 5/7
    ((5, 3, 3, 1, 1),),  # 5/6
    ((6, 2, 1, 1, 2), (5, 3, 2, 1, 1)),  # 5/6 * 7/9 = 35/54
    ((5, 4, 2, 1, 1), (3, 2, 2, 1, 1)),  # 7/8 * 3/4 = 21/32
    ((4, 3, 2, 1, 1), (5, 2, 1, 1, 2)),  # 5/6 * 4/5 = 2/3
    ((9, 2, 2, 1, 1), (4, 2, 1, 1, 2)),  # 9/10 * 3/4 = 27/40
    ((9, 2, 2, 1, 1), (6, 5, 2, 1, 1), (4, 5, 2, 1, 1)),  # 9/10 * 9/10 * 4/5 = 81/125
    ((8, 3, 1, 1, 2), (5, 4, 2, 1, 1), (8, 2, 1, 1, 3)),  # 8/9 * 7/8 * 6/7 = 2/3
    ((9, 3, 2, 1, 1), (8, 2, 1, 1, 2), (6, 3, 2, 1, 1)),  # 13/15 * 7/8 * 8/9 = 91/135
]


def test_the_geometries_around_the_blank_share_are_on_both_sides_of_it():
    """NEAR_BLANK has, in 1, 2 and 3 dimensions, geometries that read real input in less than 2/3 of their columns,
    in exactly 2/3 and in more."""
    for nd in (1, 2, 3):
        shares = {math.prod(_share(*dim) for dim in dims) for dims in NEAR_BLANK if len(dims) == nd}
        third = Fraction(2, 3)
        assert min(shares) < third < max(shares) and third in shares, (nd, shares)
    assert _cpu_lowering.BLANK == 2 / 3


@pytest.mark.parametrize("tile_bytes", [None, 1])
@pytest.mark.parametrize("case", range(len(NEAR_BLANK)))
def test_blocks_around_the_blank_share_give_the_same_bits_and_match_the_reference(case, tile_bytes, monkeypatch):
    """im2col zeroes a column matrix first where less than BLANK of its columns read real input, and zeroes around
    each box elsewhere. Around that share (exactly 2/3 among them), in 1, 2 and 3 dimensions with stride, dilation
    and groups, in both layouts, on whole images and in tiles of one row: every algorithm gives the same bits
    whichever way each block is zeroed (BLANK 0: never first; 2: always first), and those match the reference
    (float64, 1e-12 relative to the largest output)."""
    dims = NEAR_BLANK[case]
    share = math.prod(_share(*dim) for dim in dims)
    size, k, s, p, d = zip(*dims)
    layout = ("NCHW", "NHWC")[case % 2]
    groups, cg = ((1, 3), (2, 2), (3, 1))[case % 3]
    c, kout = groups * cg, groups * 2
    ishape, wshape = ((2, c, *size), (kout, cg, *k)) if layout == "NCHW" else ((2, *size, c), (kout, *k, cg))
    g = conv_geometry(ishape, wshape, stride=s, padding=p, dilation=d, groups=groups, layout=layout, dtype="float64")
    if tile_bytes is not None:
        monkeypatch.setattr(_cpu_tiled, "TILE_BYTES", tile_bytes)
    x, w, dy = _operands(g, np.random.default_rng(case))
    refs = _references(g, x, w, dy)
    whole = _cpu_lowering.rows(_cpu_lowering.plan(g), 0, g.output_size[0])
    outs = []
    for blank in (0, _cpu_lowering.BLANK, 2):
        monkeypatch.setattr(_cpu_lowering, "BLANK", blank)
        _cpu_lowering.forget()  # the lowerings kept say how they zero
        first = _cpu_lowering._lowering(_cpu_lowering.plan(g), whole)[1]
        at_share = share == Fraction(2, 3) and blank == 2 / 3  # a product of floats falls either side of it
        assert first == (share < blank) or at_share, (share, blank, first)
        found = {}
        for pass_ in PASSES:
            a, b, shape = _args(pass_, g, x, w, dy)
            for algo in cpu.ALGORITHMS[pass_]:
                out = np.full(shape, np.nan)
                cpu.run(pass_, algo, g, a, b, out, _poisoned(cpu.workspace_size(pass_, algo, g), g.dtype))
                assert _rel_err(out, refs[pass_]) <= TOL["float64"], (pass_, algo, blank)
                found[algo] = out.tobytes()
        outs.append(found)
    assert outs[0] == outs[1] == outs[2]
    _cpu_lowering.forget()


def test_workspace_larger_than_needed_and_unaligned():
    g = conv_geometry((2, 4, 7, 7), (5, 4, 3, 3), padding=1, dtype="float32")
    rng = np.random.default_rng(1)
    x, w, dy = _operands(g, rng)
    refs = _references(g, x, w, dy)
    for pass_ in PASSES:
        a, b, shape = _args(pass_, g, x, w, dy)
        for algo in cpu.ALGORITHMS[pass_]:
            n = cpu.workspace_size(pass_, algo, g)
            for ws in (_poisoned(n + 13, g.dtype), _poisoned(n + 1, g.dtype)[1:]):  # odd size; odd address
                out = np.full(shape, np.nan, dtype=g.dtype)
                cpu.run(pass_, algo, g, a, b, out, ws)
                assert _rel_err(out, refs[pass_]) <= TOL["float32"]


def test_workspace_too_small_is_a_value_error():
    g = conv_geometry((2, 4, 7, 7), (5, 4, 3, 3), padding=1)
    x, w, _ = _operands(g, np.random.default_rng(0))
    y = np.empty(g.output_shape, np.float32)
    n = cpu.workspace_size("fwd", "gemm_batch", g)
    with pytest.raises(ValueError, match=str(n)):
        cpu.run("fwd", "gemm_batch", g, x, w, y, np.zeros(n - 1, np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        cpu.run("fwd", "gemm_batch", g, x, w, y, np.zeros(n // 4, np.float32))
    cpu.run("fwd", "implicit_gemm", g, x, w, y, None)  # zero workspace needs none


def test_an_array_in_the_other_byte_order_is_refused_saying_what_it_is():
    """cpu.run() named the dtype as NumPy writes it (">f4"), with nothing to say why float32 was refused; it says
    what it is, as the ops and the planner do."""
    g = conv_geometry((2, 4, 7, 7), (5, 4, 3, 3), padding=1)
    x, w, _ = _operands(g, np.random.default_rng(0))
    y = np.empty(g.output_shape, np.float32)
    other = np.dtype("float32").newbyteorder()  # ">f4" on a little-endian machine, "<f4" on a big-endian one
    with pytest.raises(TypeError) as info:
        cpu.run("fwd", "implicit_gemm", g, x.astype(other), w, y, None)
    assert str(info.value) == (f"a has dtype {other} (float32 in the other byte order from this machine's, which no "
                               "backend computes in); the geometry says float32")
    with pytest.raises(TypeError) as info:
        cpu.run("fwd", "implicit_gemm", g, x, w.astype(np.float64), y, None)
    assert str(info.value) == "b has dtype float64; the geometry says float32"


def test_zero_size_batch_touches_no_workspace():
    g = conv_geometry((0, 4, 7, 7), (6, 2, 3, 3), padding=1, groups=2, dtype="float64")
    x, w, dy = _operands(g, np.random.default_rng(0))
    for pass_ in PASSES:
        a, b, shape = _args(pass_, g, x, w, dy)
        for algo in cpu.ALGORITHMS[pass_]:
            # Nothing to compute, no workspace, whatever the algorithm: the per-image and tiled formulas said one
            # image's or one tile's, the batch ones 0, and a forced algorithm above a cap of 0 was refused
            assert cpu.workspace_size(pass_, algo, g) == 0
            ws = np.full(64, 0xAB, np.uint8)
            out = np.full(shape, np.nan)
            cpu.run(pass_, algo, g, a, b, out, ws)
            assert (ws == 0xAB).all()
            if pass_ == "bwd_filter":
                assert (out == 0).all()  # the gradient summed over no images
            else:
                assert out.size == 0
            cpu.run(pass_, algo, g, a, b, out, None)


# --------------------------------------------------------------------------------------- names and order


def test_unknown_pass_or_algorithm_is_a_value_error():
    g = conv_geometry((1, 2, 5, 5), (2, 2, 3, 3))
    with pytest.raises(ValueError, match="'bwd'"):
        cpu.candidates("bwd", g)
    with pytest.raises(ValueError, match="'bwd'"):
        cpu.workspace_size("bwd", "implicit_gemm", g)
    with pytest.raises(ValueError, match="'winograd'"):
        cpu.workspace_size("fwd", "winograd", g)
    with pytest.raises(ValueError, match="'col2im_batch'"):
        cpu.workspace_size("fwd", "col2im_batch", g)  # an algorithm of another pass
    x, w, _ = _operands(g, np.random.default_rng(0))
    y = np.empty(g.output_shape, np.float32)
    with pytest.raises(ValueError, match="'fft'"):
        cpu.run("fwd", "fft", g, x, w, y, None)
    with pytest.raises(ValueError, match="'forward'"):
        cpu.run("forward", "implicit_gemm", g, x, w, y, None)


def test_bad_arrays_are_rejected():
    g = conv_geometry((1, 2, 5, 5), (2, 2, 3, 3))
    x, w, _ = _operands(g, np.random.default_rng(0))
    y = np.empty(g.output_shape, np.float32)
    with pytest.raises(ValueError, match="shape"):
        cpu.run("fwd", "implicit_gemm", g, x[:, :1], w, y, None)
    with pytest.raises(TypeError, match="dtype"):
        cpu.run("fwd", "implicit_gemm", g, x.astype(np.float64), w, y, None)
    with pytest.raises(ValueError, match="contiguous"):
        yt = np.empty(g.output_shape[::-1], np.float32).T
        cpu.run("fwd", "implicit_gemm", g, x, w, yt, None)
    with pytest.raises(TypeError, match="float32 or float64"):
        cpu.run("fwd", "implicit_gemm", g.with_dtype("float16"), x, w, y, None)


def test_candidates_are_every_algorithm_in_a_geometry_aware_order():
    dense = conv_geometry((2, 64, 14, 14), (64, 64, 3, 3), padding=1)
    large = conv_geometry((2, 16, 40, 40), (8, 16, 3, 3), padding=1)
    nhwc = conv_geometry((2, 40, 40, 16), (8, 3, 3, 16), padding=1, layout="NHWC")
    pointwise = conv_geometry((2, 8, 9, 9), (16, 8, 1, 1))
    depthwise = conv_geometry((2, 64, 30, 30), (64, 1, 3, 3), padding=1, groups=64)
    tiny = conv_geometry((1, 1, 4, 4), (1, 1, 3, 3))
    for pass_ in PASSES:
        implicit, tiled, per_image, batch = cpu.ALGORITHMS[pass_]
        for g in (dense, large, nhwc, pointwise, depthwise, tiny):
            assert sorted(cpu.candidates(pass_, g)) == sorted(cpu.ALGORITHMS[pass_])
        assert cpu.candidates(pass_, pointwise)[0] == implicit  # one GEMM on the operands themselves
        assert cpu.candidates(pass_, depthwise)[0] == (per_image if pass_ == "fwd" else implicit)
        assert cpu.candidates(pass_, dense)[0] == batch  # small images: the batch GEMM
        assert cpu.candidates(pass_, dense)[-1] == implicit
        assert cpu.candidates(pass_, large)[0] == (batch if pass_ == "bwd_filter" else per_image)
        assert cpu.candidates(pass_, large)[-2:] == [tiled, implicit]  # the small-workspace fallbacks
        assert cpu.candidates(pass_, nhwc)[0] == implicit  # long merged rows, no copy
        assert cpu.candidates(pass_, tiny)[0] == batch  # fewest NumPy calls


def test_a_search_returns_the_candidates_fastest_first(fresh_arena, monkeypatch):
    """The backend's exhaustive search runs every candidate once and ranks them by time. A fake clock gives
    each algorithm a known duration (no real run is timed); the first candidate is the slowest."""
    g = conv_geometry((2, 4, 8, 8), (6, 4, 3, 3), padding=1, dtype="float64")
    x, w, _ = _operands(g, np.random.default_rng(0))
    y = np.full(g.output_shape, np.nan)
    backend = _cpu_backend.CpuBackend()
    cands = backend.candidates("fwd", g)
    seconds = {c.algo: len(cands) - i for i, c in enumerate(cands)}
    now, real_run = [0.0], cpu.run_unchecked

    def run(pass_, algo, *args):
        real_run(pass_, algo, *args)
        now[0] += seconds[algo]

    monkeypatch.setattr(cpu, "run_unchecked", run)
    monkeypatch.setattr(_cpu_backend, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    with fresh_arena.lease(max(c.workspace_bytes for c in cands)) as ws:
        got = backend.measure("fwd", g, x, w, y, ws, cands, None)
    assert [(c.algo, c.workspace_bytes) for c in got] == [(c.algo, c.workspace_bytes) for c in cands[::-1]]
    assert [c.time_ms for c in got] == pytest.approx([seconds[c.algo] * 1e3 for c in cands[::-1]])
    assert _rel_err(y, ref_conv_forward(x, w, **_ref_kwargs(g))) <= TOL["float64"]  # the runs were real


def test_a_search_times_the_others_when_some_run_out_of_memory_of_their_own(fresh_arena, monkeypatch):
    """Those that ran out are named in PartlyTimed (a MemoryError) beside those timed; when none could be timed,
    the first MemoryError itself is raised, as before."""
    from wsarena.backends import PartlyTimed

    g = conv_geometry((2, 4, 8, 8), (6, 4, 3, 3), padding=1, dtype="float64")
    x, w, _ = _operands(g, np.random.default_rng(0))
    y = np.empty(g.output_shape)
    backend = _cpu_backend.CpuBackend()
    cands = backend.candidates("fwd", g)
    short, real_run = {cands[0].algo, cands[-1].algo}, cpu.run_unchecked

    def run(pass_, algo, *args):
        if algo in short:
            raise MemoryError(f"{algo}'s temporaries")
        real_run(pass_, algo, *args)

    monkeypatch.setattr(cpu, "run_unchecked", run)
    with fresh_arena.lease(max(c.workspace_bytes for c in cands)) as ws:
        with pytest.raises(PartlyTimed) as info:
            backend.measure("fwd", g, x, w, y, ws, cands, None)
        assert info.value.failed == [cands[0], cands[-1]]
        assert sorted(c.algo for c in info.value.timed) == sorted(c.algo for c in cands[1:-1])
        assert all(c.time_ms is not None for c in info.value.timed)
        short = {c.algo for c in cands}
        with pytest.raises(MemoryError, match=f"^{cands[0].algo}'s temporaries$") as info:
            backend.measure("fwd", g, x, w, y, ws, cands, None)
        assert type(info.value) is MemoryError


# ------------------------------------------------------------------------------ the reference, checked


def _adjoint_products(g, seed):
    rng = np.random.default_rng(seed)
    x, w, dy = (a.astype(np.float64) for a in _operands(g, rng))
    kw = _ref_kwargs(g)
    y = ref_conv_forward(x, w, **kw)
    dx = ref_conv_backward_data(dy, w, x.shape, **kw)
    dw = ref_conv_backward_filter(x, dy, w.shape, **kw)
    return np.vdot(y, dy), np.vdot(x, dx), np.vdot(w, dw)


@settings(max_examples=40, deadline=None)
@given(g=geometries(), seed=st.integers(0, 2**16))
def test_reference_backward_passes_are_adjoints_of_forward(g, seed):
    """<conv(x, w), dy> == <x, bwd_data(dy, w)> == <w, bwd_filter(x, dy)> (the definition of the gradients)."""
    a, b, c = _adjoint_products(g, seed)
    scale = max(abs(a), abs(b), abs(c), 1.0)
    assert abs(a - b) <= 1e-12 * scale * 10 and abs(a - c) <= 1e-12 * scale * 10, (a, b, c)


@pytest.mark.parametrize(
    "ishape, wshape, kw",
    [
        ((2, 3, 11), (4, 3, 3), {"stride": 2, "padding": 1, "dilation": 1, "groups": 1}),
        ((2, 4, 9, 8), (6, 2, 3, 2), {"stride": (2, 1), "padding": (1, 2), "dilation": (1, 2), "groups": 2}),
        ((1, 6, 7, 7), (6, 1, 3, 3), {"stride": 1, "padding": 1, "dilation": 2, "groups": 6}),
        ((2, 2, 5, 6, 4), (4, 2, 2, 3, 1), {"stride": (1, 2, 1), "padding": (1, 0, 1), "dilation": 1, "groups": 1}),
    ],
)
def test_reference_forward_matches_torch(ishape, wshape, kw):
    torch = pytest.importorskip("torch", reason="torch is not installed (optional; used only for this check)")
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(ishape), rng.standard_normal(wshape)
    conv = {3: torch.nn.functional.conv1d, 4: torch.nn.functional.conv2d, 5: torch.nn.functional.conv3d}[len(ishape)]
    expected = conv(torch.from_numpy(x), torch.from_numpy(w), **kw).numpy()
    for layout in ("NCHW", "NHWC"):
        xl, wl = (x, w) if layout == "NCHW" else (np.moveaxis(x, 1, -1), np.moveaxis(w, 1, -1))
        got = ref_conv_forward(xl, wl, layout=layout, **kw)
        if layout == "NHWC":
            got = np.moveaxis(got, -1, 1)
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def test_implicit_gemms_moveaxis_is_numpys():
    a = np.empty((2, 3, 4, 5, 6))
    for n in range(1, 3):
        for source in itertools.permutations(range(-5, 5), n):
            for destination in itertools.permutations(range(-5, 5), n):
                if len({s % 5 for s in source}) < n or len({d % 5 for d in destination}) < n:
                    continue
                args = (source[0], destination[0]) if n == 1 else (source, destination)
                want = np.moveaxis(a, *args)
                got = _cpu_implicit._moveaxis(a, *args)
                assert (got.shape, got.strides) == (want.shape, want.strides), args


def test_a_row_whose_column_matrix_streams_through_memory_ranks_implicit_gemm_first():
    """A column algorithm lowers one output row at the least: a 1x4096 kernel's row over 8x4096 images of 2 channels
    is 128 MiB of columns, while implicit_gemm goes over an output of 256 KiB once per kernel offset."""
    long = conv_geometry((1, 2, 8, 4096), (2, 2, 1, 4096), padding=(0, 2048))
    shorter = conv_geometry((1, 2, 8, 1024), (2, 2, 1, 1024), padding=(0, 512))  # a row of 8 MiB
    large_output = long.with_batch(64)  # 16 MiB of output
    many_channels = conv_geometry((1, 64, 64, 64, 64), (64, 64, 3, 3, 3), padding=1)  # a row of 27 MiB, 64 MiB out
    # A row of 256 MiB, 32 times an output of 8 MiB, which leaves the cache at every kernel offset: implicit_gemm
    # took 58-128 s a forward pass here in one run and 15-16 s in another, the per-image algorithm 10-18 s.
    wide = conv_geometry((8, 16, 8, 2048), (16, 16, 1, 2048), padding=(0, 1024))
    for pass_ in PASSES:
        implicit, tiled, per_image, batch = cpu.ALGORITHMS[pass_]
        assert cpu.candidates(pass_, long) == [implicit, tiled, per_image, batch]
        assert cpu.candidates(pass_, long.with_dtype("float64")) == [implicit, tiled, per_image, batch]
        for g in (shorter, large_output, many_channels, wide):
            assert cpu.candidates(pass_, g)[0] != implicit


def test_implicit_gemm_ranks_first_from_a_row_of_16_tiles_over_an_output_under_8_tiles_or_2_for_the_data_gradient():
    """The row's bound is at 16 times, by the dtype's tile: a 1x1024 kernel over rows of 4096 outputs makes rows of
    2**22 elements, 16 tiles of float32 (4 MiB); 4095 outputs are a row short. A 1x512 kernel's row is 16 tiles of
    float64, not of float32. The output's, over two rows of 4096 (2**13 elements a channel): under 8 tiles, 255
    output channels of float32 (2**21 elements is 8 tiles), 127 of float64; under 2 tiles for the data gradient, 63
    and 31."""

    def rows(width, kernel, channels=1, dtype="float32"):  # one image of two rows, one input channel
        return conv_geometry((1, 1, 2, width + kernel - 1), (channels, 1, 1, kernel), dtype=dtype)

    for pass_ in PASSES:
        implicit = cpu.ALGORITHMS[pass_][0]
        tiles = 2 if pass_ == "bwd_data" else 8
        channels = {"float32": tiles * 32, "float64": tiles * 16}  # output channels of `tiles` tiles over 2 rows
        for g in (rows(4096, 1024), rows(4096, 512, dtype="float64"), rows(4096, 1024, channels["float32"] - 1),
                  rows(4096, 1024, channels["float64"] - 1, dtype="float64")):
            assert cpu.candidates(pass_, g)[0] == implicit, g
        for g in (rows(4095, 1024), rows(4096, 512), rows(4095, 512, dtype="float64"),
                  rows(4096, 1024, channels["float32"]), rows(4096, 1024, channels["float64"], dtype="float64")):
            assert cpu.candidates(pass_, g)[0] != implicit, g


def test_the_geometries_timed_at_the_bounds_rank_as_measured():
    """What ``bench/bench_cpu_conv.py --ranking`` timed (float32, one BLAS thread, the algorithms in turn): the order
    pinned, never a time. The first of each was as fast as the fastest or within the noise of the run (10 to 20 %)."""
    # A 3x3x3 kernel over 64 channels at 64^3: one image's column matrix 1.7 GiB, a tile (one plane) 27 MiB.
    volume = conv_geometry((1, 64, 64, 64, 64), (64, 64, 3, 3, 3), padding=1)
    # 3x3 kernels over 64 channels at 224x224 (VGG) and 570x570 (U-Net): 110 and 709 MiB an image, tiles of 1 MiB.
    vgg = conv_geometry((2, 64, 224, 224), (64, 64, 3, 3), padding=1)
    unet = conv_geometry((1, 64, 570, 570), (64, 64, 3, 3))
    # Over more channels the tiles are one row of 136, 102 and 54 pixels, whose GEMMs are short.
    narrow = [conv_geometry((1, 256, 138, 138), (256, 256, 3, 3)), conv_geometry((1, 512, 104, 104), (256, 512, 3, 3)),
              conv_geometry((1, 1024, 56, 56), (512, 1024, 3, 3))]
    # Column matrices past the cache in tiles of 204 and 224 pixels (80 and 55 MiB an image).
    short_tiles = [conv_geometry((1, 256, 16384), (256, 256, 5), padding=2),
                   conv_geometry((1, 128, 112, 112), (128, 128, 3, 3), padding=1)]
    # A 1x64 kernel over 16 channels at 8x8192 (a row of 32 MiB, 4 MiB out), at 2 rows (1 MiB and a column out) and
    # at 16 (8 MiB and two columns); a 1x4096 kernel over 4 images of 2 channels at 8x4096 (1 MiB and 4 columns).
    rows = {h: conv_geometry((1, 16, h, 8192), (16, 16, 1, 64), padding=(0, 32)) for h in (2, 8, 16)}
    long = conv_geometry((4, 2, 8, 4096), (2, 2, 1, 4096), padding=(0, 2048))
    for pass_ in PASSES:
        implicit, tiled, per_image, batch = cpu.ALGORITHMS[pass_]
        column = [per_image, batch] if pass_ != "bwd_filter" else [batch, per_image]
        wide = [tiled, per_image, batch, implicit]
        assert cpu.candidates(pass_, volume) == ([*column, tiled, implicit] if pass_ == "bwd_data" else wide)
        assert cpu.candidates(pass_, volume.with_batch(2)) == cpu.candidates(pass_, volume)
        assert cpu.candidates(pass_, vgg) == wide
        assert cpu.candidates(pass_, unet) == wide
        for g in narrow + short_tiles:
            assert cpu.candidates(pass_, g) == [*column, tiled, implicit], g
        assert cpu.candidates(pass_, rows[2]) == [implicit, tiled, per_image, batch]
        assert cpu.candidates(pass_, long) == [implicit, tiled, per_image, batch]
        if pass_ == "bwd_data":
            assert cpu.candidates(pass_, rows[8]) == [*column, tiled, implicit]
            assert cpu.candidates(pass_, rows[16]) == [*column, tiled, implicit]
        else:
            assert cpu.candidates(pass_, rows[8]) == [implicit, tiled, per_image, batch]
            assert cpu.candidates(pass_, rows[16]) == wide


def test_the_tiled_algorithm_ranks_first_from_an_image_of_64_tiles_in_tiles_of_256_output_pixels():
    """NCHW, a 2x2 kernel over 64 channels: rows of 256 outputs make rows of 2**16 column elements, so one image's
    column matrix is 64 float32 tiles (2**24 elements) from 256 rows, 64 float64 tiles from 128; a row short is
    under. A 3x3 kernel over 64 channels: rows of 256 outputs make rows of 147456 column elements, a tile each (more
    than half a float32 tile), so tiles of 256 output pixels; 255 outputs make tiles of 255. Both bounds are an
    image's and a tile's, whatever the batch. NHWC keeps its order, so do grouped layers (the per-image algorithm
    first) and the data gradient of rows of 16 tiles (a 3x3x3 kernel over 64 channels at 64^3)."""

    def image(height, width, kernel=2, dtype="float32", **kw):  # no padding: the output is kernel - 1 smaller
        return conv_geometry((1, 64, height + kernel - 1, width + kernel - 1), (64, 64, kernel, kernel), dtype=dtype,
                             **kw)

    nhwc = conv_geometry((1, 512, 512, 64), (64, 2, 2, 64), stride=2, layout="NHWC")  # 256x256 out
    volume = conv_geometry((1, 64, 64, 64, 64), (64, 64, 3, 3, 3), padding=1)
    grouped = conv_geometry((1, 64, 257, 257), (64, 32, 2, 2), groups=2)  # image(256, 256) in two groups
    for pass_ in PASSES:
        implicit, tiled, per_image, batch = cpu.ALGORITHMS[pass_]
        for g in (image(256, 256), image(128, 256, dtype="float64"), image(256, 256).with_batch(4),
                  image(200, 256, kernel=3)):
            assert cpu.candidates(pass_, g) == [tiled, per_image, batch, implicit], g
        for g in (image(255, 256), image(127, 256, dtype="float64"), image(200, 255, kernel=3), nhwc,
                  image(255, 256).with_batch(4), image(200, 255, kernel=3).with_batch(4)):
            assert cpu.candidates(pass_, g)[0] != tiled, g
        assert cpu.candidates(pass_, grouped) == [per_image, tiled, implicit, batch]
        assert (cpu.candidates(pass_, volume)[0] == tiled) == (pass_ != "bwd_data")
