"""The CPU backend's plans (wsarena.backends._cpu_lowering) against their definitions, computed by brute force.

For kernel index ``j`` of one dimension (stride ``s``, padding ``p``, dilation ``d``, ``S`` inputs), output ``o``
reads input ``o*s - p + j*d``: real input where that lies in ``[0, S)``. An offset is one index per dimension.
The plan keeps per dimension what each index reads and makes offsets, blocks of rows and index pairs from it
on use; these tests check what it makes against that definition, offset by offset, and that planning and
running a large kernel keep no Python object per kernel element. The passes' numbers are checked against the
reference in test_cpu_backend.py.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import tracemalloc
import types
import weakref

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from wsarena._geometry import conv_geometry
from wsarena.backends import _cpu_lowering, _cpu_tiled, cpu
from wsarena.backends._cpu_lowering import Axis, plan, rows

from .forking import fork
from .interrupts import interrupt_at_check
from .test_cpu_backend import PASSES, geometries


def _reads(g, i, j):
    """The outputs of dimension ``i`` that read real input at kernel index ``j``, by brute force."""
    s, p, d, size = g.stride[i], g.padding[i], g.dilation[i], g.input_size[i]
    return [o for o in range(g.output_size[i]) if 0 <= o * s - p + j * d < size]


def _expected_offsets(g):
    """Every offset's ``(index, lo, hi, full_out, full_in)``, those whose every output reads real input first."""
    found = []
    for index in itertools.product(*map(range, g.kernel_size)):
        outs = [_reads(g, i, j) for i, j in enumerate(index)]
        lo = tuple(o[0] if o else None for o in outs)
        hi = tuple(o[-1] + 1 if o else None for o in outs)
        full_out = all(len(o) == n for o, n in zip(outs, g.output_size))
        full_in = all(len({o * g.stride[i] - g.padding[i] + j * g.dilation[i] for o in outs[i]}) == g.input_size[i]
                      for i, j in enumerate(index))
        found.append((index, lo, hi, full_out, full_in))
    return sorted(found, key=lambda e: not e[3])  # stable: row-major within each part


@settings(max_examples=40, deadline=None)
@given(size=st.integers(1, 12), k=st.integers(1, 12), s=st.integers(1, 4), p=st.integers(0, 6), d=st.integers(1, 3),
       cut=st.tuples(st.integers(0, 40), st.integers(0, 40)))
def test_an_axis_is_the_outputs_that_read_real_input_per_kernel_index(size, k, s, p, d, cut):
    """Per kernel index: ``[lo, hi)`` are exactly the outputs that read real input, the first reading ``start``;
    and a block of outputs ``[r0, r1)`` is the same in block coordinates."""
    if d * (k - 1) + 1 > size + 2 * p:
        return  # the kernel does not fit the padded input
    g = conv_geometry((1, 1, size), (1, 1, k), stride=s, padding=p, dilation=d)
    out = g.output_size[0]
    whole = Axis.of(size, out, k, s, p, d)
    r0, r1 = sorted(c % (out + 1) for c in cut)
    if r0 == r1:
        r0, r1 = 0, out
    for a, first in ((whole, 0), (whole.block(r0, r1), r0)):
        for j in range(k):
            reads = [o - first for o in _reads(g, 0, j) if first <= o < first + a.outputs]
            lo, hi = int(a.lo[j]), int(a.hi[j])
            assert list(range(lo, hi)) == reads, (j, lo, hi, reads)
            if reads:
                assert a.start[j] == (reads[0] + first) * s - p + j * d


@settings(max_examples=100, deadline=None)
@given(g=geometries())
def test_offsets_are_every_kernel_position_covering_ones_first(g):
    """The plan's offsets, kept or made afresh: every kernel position once, those that read real input at every
    output first, each part in row-major order (the order the passes add in); their fields as defined."""
    p = plan(g)
    expected = _expected_offsets(g)
    for keep in (_cpu_lowering.KEEP, 0):
        _cpu_lowering.forget()
        _cpu_lowering.KEEP, saved = keep, _cpu_lowering.KEEP
        try:
            offsets = list(p.offsets)
        finally:
            _cpu_lowering.KEEP = saved
        assert [o.kernel for o in offsets] == [e[0] for e in expected]
        for o, (index, lo, hi, full_out, full_in) in zip(offsets, expected):
            assert o.empty == (None in lo)
            assert (o.full_out, o.full_in) == (full_out, full_in), index
            if not o.empty:
                assert (o.lo, o.hi) == (lo, hi)
                assert o.out == tuple(slice(a, b) for a, b in zip(lo, hi))
                lengths = [len(range(g.input_size[i])[sl]) for i, sl in enumerate(o.inp)]
                assert lengths == [b - a for a, b in zip(lo, hi)]
    assert p.covered == any(e[3] for e in expected)
    assert p.padded == (not all(e[3] for e in expected))


def test_offsets_read_twice_are_every_offset_each_time(monkeypatch):
    """A plan's offsets, kept or made afresh, are every offset each time they are read: made afresh, they were an
    iterator, which a second read found empty."""
    p = plan(conv_geometry((1, 2, 6, 6), (2, 2, 3, 3), padding=1))
    for keep in (_cpu_lowering.KEEP, 0):
        monkeypatch.setattr(_cpu_lowering, "KEEP", keep)
        _cpu_lowering.forget()
        offsets = p.offsets
        first = list(offsets)
        assert list(offsets) == first
        assert len(first) == len(offsets) == 9
    _cpu_lowering.forget()


def _im2col_by_definition(xp, g, r0, r1):
    """The canonical columns ``(B, *O, G, Cg, *R)`` of output rows ``[r0, r1)``: the input each (output, kernel
    index) pair reads, from an explicitly zero-padded copy."""
    pad = np.pad(xp, [(0, 0), *((p, p) for p in g.padding), (0, 0), (0, 0)])
    osize = (r1 - r0, *g.output_size[1:])
    col = np.empty((xp.shape[0], *osize, *xp.shape[-2:], *g.kernel_size), xp.dtype)
    first = (r0, *[0] * (g.nd - 1))  # the block's first output per dimension
    for kernel in itertools.product(*map(range, g.kernel_size)):
        reads = tuple(
            slice(f * s + j * d, f * s + j * d + (n - 1) * s + 1, s)
            for f, j, n, s, d in zip(first, kernel, osize, g.stride, g.dilation)
        )
        col[(Ellipsis, *kernel)] = pad[(slice(None), *reads)]
    return col


@settings(max_examples=150, deadline=None)
@given(g=geometries(), cut=st.tuples(st.integers(0, 40), st.integers(0, 40)), seed=st.integers(0, 2**16))
def test_im2col_writes_what_each_output_reads_at_each_kernel_index(g, cut, seed):
    """im2col, kept or made afresh, on the whole image or a block of rows, whichever way it cuts the dimensions:
    every column is the input its output reads at its kernel index, or zero in the padding; the columns start
    as NaN, so one left unwritten shows."""
    p = plan(g)
    o0 = p.osize[0]
    r0, r1 = sorted(c % (o0 + 1) for c in cut)
    if r0 == r1:
        r0, r1 = 0, o0
    x = np.random.default_rng(seed).standard_normal(g.input_shape)
    xp = _cpu_lowering.act_view(x, g.layout, g.groups)
    expected = _im2col_by_definition(xp, g, r0, r1)
    for keep in (_cpu_lowering.KEEP, 0):
        _cpu_lowering.forget()
        _cpu_lowering.KEEP, saved = keep, _cpu_lowering.KEEP
        try:
            col = np.full(expected.shape, np.nan)
            _cpu_lowering.im2col(xp, col, p, x, 0, rows(p, r0, r1))
        finally:
            _cpu_lowering.KEEP = saved
        np.testing.assert_array_equal(col, expected)
    _cpu_lowering.forget()


def test_im2col_zeroes_a_block_mostly_of_padding_first(monkeypatch):
    """Where less than BLANK of a block's columns read real input (a kernel longer than the image), im2col zeroes
    the whole matrix and then copies box by box; elsewhere it zeroes around each box. Either way, kept or made
    afresh, in tiles of one row or on the whole image, every column is what its output reads at its kernel index
    (the columns start as NaN)."""
    monkeypatch.setattr(_cpu_tiled, "TILE_BYTES", 1)
    cases = [
        (conv_geometry((2, 2, 3, 40), (2, 2, 1, 160), padding=(0, 80)), True),  # 1/4 of the columns read input
        (conv_geometry((2, 5, 9, 3), (3, 7, 7, 1), padding=3, groups=3, layout="NHWC"), True),  # 7x7 over 5x9
        (conv_geometry((2, 3, 6, 6), (4, 3, 3, 3), padding=1), False),
    ]
    for g, blank in cases:
        p = plan(g)
        x = np.random.default_rng(0).standard_normal(g.input_shape)
        xp = _cpu_lowering.act_view(x, g.layout, g.groups)
        for r0, r1 in ((0, p.osize[0]), (1, 2)):
            expected = _im2col_by_definition(xp, g, r0, r1)
            for keep in (_cpu_lowering.KEEP, 0):
                monkeypatch.setattr(_cpu_lowering, "KEEP", keep)
                _cpu_lowering.forget()
                block = rows(p, r0, r1)
                assert _cpu_lowering._lowering(p, block)[1] == blank
                col = np.full(expected.shape, np.nan)
                _cpu_lowering.im2col(xp, col, p, x, 0, block)
                np.testing.assert_array_equal(col, expected)
    _cpu_lowering.forget()


def _col2im_offset_by_offset(col, xp, p, r0, r1, overwrite):
    """col2im by its definition on output rows ``[r0, r1)``: offset by offset in the plan's order, the columns of
    the outputs that read real input added to the inputs they read; with ``overwrite`` on the whole image, the
    first offset that reads every input copied first (else zeros)."""
    offsets = list(p.offsets)
    first = next((o for o in offsets if o.full_in), None) if overwrite and (r0, r1) == (0, p.osize[0]) else None
    if overwrite and first is None:
        xp[...] = 0
    s0 = p.geom.stride[0]
    for o in ([first] if first else []) + [o for o in offsets if o is not first]:
        lo, hi = max(o.lo[0], r0), min(o.hi[0], r1)
        if o.empty or hi <= lo:
            continue
        start = o.inp[0].start + (lo - o.lo[0]) * s0
        xp_index = (slice(None), slice(start, start + (hi - lo - 1) * s0 + 1, s0), *o.inp[1:])
        col_index = (slice(None), slice(lo - r0, hi - r0), *o.out[1:], Ellipsis, *o.kernel)
        if o is first:
            xp[xp_index] = col[col_index]
        else:
            xp[xp_index] += col[col_index]


@settings(max_examples=150, deadline=None)
@given(g=geometries(), cut=st.tuples(st.integers(0, 40), st.integers(0, 40)), overwrite=st.booleans(),
       seed=st.integers(0, 2**16))
def test_col2im_adds_in_the_offsets_order(g, cut, overwrite, seed):
    """col2im, kept or made afresh, on the whole image or a block of rows, gives the very bits of adding offset
    by offset in the plan's order, whichever way its boxes cut the dimensions: an input's columns arrive in the
    same order. Magnitudes from 1e-6 to 1e6 make float32 sums differ in another order."""
    p = plan(g)
    o0 = p.osize[0]
    r0, r1 = sorted(c % (o0 + 1) for c in cut)
    if r0 == r1:
        r0, r1 = 0, o0
    rng = np.random.default_rng(seed)

    def scaled(shape):
        return (rng.standard_normal(shape) * 10.0 ** rng.uniform(-6, 6, shape)).astype(np.float32)

    col = scaled((2, r1 - r0, *p.osize[1:], p.groups, p.cg, *g.kernel_size))
    xp = scaled((2, *g.input_size, p.groups, p.cg))
    expected = xp.copy()
    _col2im_offset_by_offset(col, expected, p, r0, r1, overwrite)
    for keep in (_cpu_lowering.KEEP, 0):
        _cpu_lowering.forget()
        _cpu_lowering.KEEP, saved = keep, _cpu_lowering.KEEP
        try:
            got = xp.copy()
            _cpu_lowering.col2im(col, got, p, rows(p, r0, r1), overwrite)
        finally:
            _cpu_lowering.KEEP = saved
        assert got.tobytes() == expected.tobytes()
    _cpu_lowering.forget()


def test_a_kernel_longer_than_its_outputs_is_cut_by_output():
    """A dimension whose kernel is longer than the block's outputs is lowered one output at a time (the kernel
    indices that read real input from it), an ordinary one one kernel index at a time. NCHW, whose output axes
    are innermost, only where its column matrix stays in cache or the dimension has one output in the block."""

    def cuts(g, r0=0, r1=None):
        p = plan(g)
        block = rows(p, r0, p.osize[0] if r1 is None else r1)
        return [by_output for by_output, _ in _cpu_lowering._cuts(p, block, block.axes)]

    assert cuts(conv_geometry((1, 2, 5, 12), (2, 2, 3, 9), padding=(1, 4), stride=(1, 2), dilation=(1, 2))) == [
        False, True]
    ordinary = conv_geometry((1, 2, 9, 9), (2, 2, 3, 3), padding=1)
    assert cuts(ordinary) == [False, False]
    assert cuts(ordinary, 4, 5) == [True, False]  # a tile of one row
    replk = {"padding": 15, "groups": 32}
    assert cuts(conv_geometry((1, 32, 7, 7), (32, 1, 31, 31), **replk)) == [False, False]  # 5.8 MiB of columns
    assert cuts(conv_geometry((1, 7, 7, 32), (32, 31, 31, 1), layout="NHWC", **replk)) == [True, True]
    assert cuts(conv_geometry((1, 32, 28, 28), (32, 1, 31, 31), **replk), 5, 6) == [True, False]  # one row
    assert cuts(conv_geometry((1, 1, 7, 7), (1, 1, 31, 31), padding=15)) == [True, True]  # 184 KiB


def _traced(fn):
    """``(result, peak, kept)``: what ``fn`` returns, and the bytes it allocated at its peak and still holds
    (Python objects and NumPy arrays), ``result`` held."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        result = fn()
        now, peak = tracemalloc.get_traced_memory()
        return result, peak - before, now - before
    finally:
        tracemalloc.stop()


def test_planning_a_large_kernel_makes_nothing_per_kernel_element():
    """What the report asks for each layer (the plan and the workspace sizes) holds the sum of the kernel's
    sizes, not their product: a 300x300 kernel (90,000 offsets, some 60 MiB when the plan made them all)."""
    g = conv_geometry((1, 1, 300, 300), (1, 1, 300, 300), padding=150)
    plan.cache_clear()
    _cpu_lowering.forget()

    def planned():
        sizes = [cpu.workspace_size(p, a, g) for p, algos in cpu.ALGORITHMS.items() for a in algos]
        return plan(g), sizes

    _, peak, kept = _traced(planned)
    assert peak < 256 << 10 and kept < 256 << 10, (peak, kept)


def _run_every_algorithm(g, algos=4):
    _outputs(g, {algo for names in cpu.ALGORITHMS.values() for algo in names[:algos]})
    return plan(g)


def test_running_a_large_kernel_keeps_nothing_per_tile_and_offset(monkeypatch):
    """Every algorithm of every pass on a 1-D kernel of 1100 in tiles of one row: the plan keeps what is made for
    the whole image and a few boxes per tile, 0.8 MiB, not each tile's offsets (41 x 1100, 22 MiB)."""
    monkeypatch.setattr(_cpu_tiled, "TILE_BYTES", 1)
    g = conv_geometry((1, 2, 40), (2, 2, 1100), padding=550, dtype="float64")
    plan.cache_clear()
    _cpu_lowering.forget()
    _, _, kept = _traced(lambda: _run_every_algorithm(g))
    assert kept < 2 << 20, kept


def _held():
    """The items the plans keep, as their owners count them, checked against the total and the plans' memos."""
    owners = list(_cpu_lowering._held)
    items = sum(o.items for o in owners)
    assert items == _cpu_lowering._total
    for o in owners:
        assert all(key in o.memo for key in o.keys)
    return items


def test_the_plans_keep_at_most_keep_items_in_all(monkeypatch):
    """Past KEEP items in all, across plans, nothing more is kept: ten geometries of a 1x600 kernel over 16 channels
    (a column matrix out of cache, lowered one kernel index at a time, 600 boxes a tile, 16 tiles) run in turn, in
    tiles of one row, keep 760 items between them (0.3 MiB), where each plan kept up to KEEP items of its own
    (6,160 items, 1.2 MiB), and their passes give the bits they give keeping nothing."""
    monkeypatch.setattr(_cpu_tiled, "TILE_BYTES", 1)
    geometries = [conv_geometry((1, 16, 16, 20 + i), (4, 16, 1, 600), padding=(0, 300), dtype="float64")
                  for i in range(10)]
    monkeypatch.setattr(_cpu_lowering, "KEEP", 0)
    _cpu_lowering.forget()
    expected = [_outputs(g, ("gemm_tiled",)) for g in geometries]
    assert _held() == 0
    monkeypatch.setattr(_cpu_lowering, "KEEP", 1000)

    def loop():
        for _ in range(3):
            for g, out in zip(geometries, expected):
                assert _outputs(g, ("gemm_tiled",)) == out

    _, _, kept = _traced(loop)
    assert 0 < _held() <= 1000
    assert kept < 3 << 18, kept


def test_a_plan_out_of_the_cache_lets_go_of_what_it_kept():
    """A plan that leaves the cache of plans lets go of the items it kept, and they count no more. They stayed kept
    until a later run needed their room, and a kept block of rows holds its plan's axes (0.1 MiB for a kernel of
    4096): a sweep of input lengths held the axes of up to KEEP / 2 plans (two items each), some 3 GiB, past the
    cache's 512. Here 24 lengths of a 1-D kernel of 4096, the cache cleared after every 6."""
    plan.cache_clear()
    _cpu_lowering.forget()
    gone = []
    for i in range(25):
        g = conv_geometry((1, 1, 4096 + i), (1, 1, 4096), dtype="float64")
        _outputs(g, ("gemm_batch",))
        if i < 24:
            gone.append(weakref.ref(plan(g).axes[0]))
        if i % 6 == 5:
            plan.cache_clear()
    assert sum(ref() is not None for ref in gone) == 0
    assert _held() == sum(owner.items for owner in plan(g).calls.values()) > 0
    _cpu_lowering.forget()


def _outputs(g, algos):
    """The bytes of the outputs of ``algos`` (names, of any pass) on ``g``, from fixed operands."""
    rng = np.random.default_rng(0)
    x, w, dy = (rng.standard_normal(s) for s in (g.input_shape, g.weight_shape, g.output_shape))
    operands = {
        "fwd": (x, w, g.output_shape), "bwd_data": (dy, w, g.input_shape), "bwd_filter": (x, dy, g.weight_shape)
    }
    found = []
    for pass_ in PASSES:
        a, b, shape = operands[pass_]
        for algo in cpu.ALGORITHMS[pass_]:
            if algo in algos:
                out = np.empty(shape)
                cpu.run(pass_, algo, g, a, b, out, np.empty(cpu.workspace_size(pass_, algo, g), np.uint8))
                found.append(out.tobytes())
    return found


def _counted(monkeypatch):
    """A list that counts the blocks of rows im2col and col2im make their boxes for, kept or not."""
    made = []
    cuts = _cpu_lowering._cuts

    def counted(p, block, axes):
        made.append(block.row0)
        return cuts(p, block, axes)

    monkeypatch.setattr(_cpu_lowering, "_cuts", counted)
    return made


def test_a_steady_loop_takes_the_room_of_calls_that_stopped(monkeypatch):
    """A call that ran once (a search's candidate that was not chosen) keeps what it made while there is room; the
    call that then runs again and again finds little, but from its second run on takes that room, and from its
    third makes nothing: its 12 tiles' boxes are kept. The plans kept what was made first, and the loop made its
    boxes afresh in every run."""
    monkeypatch.setattr(_cpu_tiled, "TILE_BYTES", 1)
    monkeypatch.setattr(_cpu_lowering, "KEEP", 100)
    g = conv_geometry((1, 2, 12, 12), (2, 2, 5, 5), padding=2, dtype="float64")
    made = _counted(monkeypatch)
    _cpu_lowering.forget()
    expected = _outputs(g, ("gemm_tiled",))
    _cpu_lowering.forget()
    _outputs(g, ("col2im_tiled",))  # 12 tiles: 94 items
    assert _held() > 90
    runs = []
    for _ in range(3):
        made.clear()
        assert _outputs(g, ("gemm_tiled",)) == expected
        runs.append(len(made))
    assert runs[0] == 12 and runs[2] == 0, runs
    assert _held() <= 100


def test_a_steady_loop_larger_than_the_room_keeps_what_it_kept_first(monkeypatch):
    """Two calls that run in turn, 72 and 94 items in a room of 100, do not take each other's room: the first keeps
    its boxes, the second makes most of its own in each run. Letting go of the first's for the second's would
    make both of them afresh in every run."""
    monkeypatch.setattr(_cpu_tiled, "TILE_BYTES", 1)
    monkeypatch.setattr(_cpu_lowering, "KEEP", 100)
    _cpu_lowering.forget()
    g = conv_geometry((1, 2, 12, 12), (2, 2, 5, 5), padding=2, dtype="float64")
    made = _counted(monkeypatch)
    for _ in range(3):
        made.clear()
        _outputs(g, ("gemm_tiled",))
        first = len(made)
        _outputs(g, ("col2im_tiled",))
        second = len(made) - first
    assert first == 0 and second > 6, (first, second)
    assert _held() <= 100


def test_calls_that_run_more_than_once_in_a_row_in_turn_keep_what_they_kept_first(monkeypatch):
    """Two calls that run twice (or three times) in a row, in turn, 72 and 78 items in a room of 100 (A A B B): the
    first keeps its boxes, the second makes what it could not keep in each run. A call's second run of a turn found
    the other not run since its first and took its room, so each made its boxes afresh in its first run of a turn
    and again to keep them in its second (43 tiles' boxes a turn, 18 now; three in a row 43, now 27)."""
    monkeypatch.setattr(_cpu_tiled, "TILE_BYTES", 1)
    monkeypatch.setattr(_cpu_lowering, "KEEP", 100)
    first, second = (conv_geometry((1, 2, h, 12), (2, 2, 5, 5), padding=2, dtype="float64") for h in (12, 13))
    made = _counted(monkeypatch)
    for times in (2, 3):
        _cpu_lowering.forget()
        for _ in range(3):
            runs = []
            for g in (first, second):
                for _ in range(times):
                    made.clear()
                    _outputs(g, ("gemm_tiled",))
                    runs.append(len(made))
        assert runs[:times] == [0] * times and all(0 < n < 13 for n in runs[times:]), runs
        assert _held() <= 100


@settings(max_examples=300, deadline=None)
@given(calls=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 12)), min_size=1, max_size=12))
def test_a_run_takes_the_room_of_calls_that_stopped_as_the_whole_history_says(calls):
    """Runs of four calls, each some times in a row (past the runs an owner remembers too): after each run, whether
    it may take another call's room (:func:`_cpu_lowering._stopped`) is what the whole history says: the other ran
    ``n`` times in a row to its last run (at most ``_LOOKBACK``), and this call ran ``n`` times since, before this
    run."""
    plans = [types.SimpleNamespace(calls={}, memo={}) for _ in range(4)]  # fresh owners, counted from no run
    history: list[int] = []
    for call, times in calls:
        for _ in range(times):
            _cpu_lowering.begin_run(plans[call], "fwd", "gemm_tiled")
            history.append(call)
            owner = plans[call].calls["fwd", "gemm_tiled"]
            for other, p in enumerate(plans):
                if other == call or not p.calls:
                    continue
                last = max(i for i, c in enumerate(history) if c == other)
                n = 1
                while n < _cpu_lowering._LOOKBACK and last >= n and history[last - n] == other:
                    n += 1
                since = history[last + 1 : -1].count(call)
                assert _cpu_lowering._stopped(owner, p.calls["fwd", "gemm_tiled"]) == (since >= n), (history, other)


_KEEPING_CODE = {
    f.__code__ for f in (_cpu_lowering._keep, _cpu_lowering._let_go, _cpu_lowering._spare, _cpu_lowering._stopped)
}


def _each_kept_item_counted_once(plans):
    """What a forked child, or the code after a Ctrl-C, finds: every key of ``plans``' memos that holds kept items
    is one held owner's, and the total is what the held owners count (an owner's keys may be gone from its memo
    already, where a letting go was cut short: they are let go again)."""
    owners = list(_cpu_lowering._held)
    owned = [(id(o.memo), key) for o in owners for key in o.keys]
    kept = [(id(p.memo), key) for p in plans for key in p.memo
            if key == "offsets" or key[0] in ("rows", "lowering", "boxes", "window")]
    assert len(set(owned)) == len(owned) and set(kept) <= set(owned), set(kept) - set(owned)
    assert sum(o.items for o in owners) == _cpu_lowering._total
    assert all(o in _cpu_lowering._held for p in plans for o in p.calls.values() if o.items)


def _fork(waits, child):
    waits.append(fork(child))


def test_a_ctrl_c_or_a_fork_while_keeping_leaves_each_kept_item_counted_once(monkeypatch):
    """A Ctrl-C at each place in keeping and letting go where CPython may deliver one, one run each, leaves every
    kept item counted once, and so does a thread switch there (where another thread may fork: its child starts
    with the state as it is). A Ctrl-C, or a fork, just after the key kept was added to its run's keys left those
    items kept and counted by none, and their run out of those that hold items: never let go while their plan
    lived."""
    monkeypatch.setattr(_cpu_lowering, "KEEP", 15)  # 10 items a call
    first = conv_geometry((1, 2, 6, 6), (2, 2, 3, 3), padding=1, dtype="float64")
    second = conv_geometry((1, 2, 7, 6), (2, 2, 3, 3), padding=1, dtype="float64")
    plans = [plan(first), plan(second)]

    def loop():  # the first keeps, the second takes its room at its second run and lets go of what it kept
        for g in (first, second, second):
            _outputs(g, ("gemm_batch",))

    def skip(code):
        return code not in _KEEPING_CODE

    def child():  # a fork's: the lock is free, the count whole, and keeping goes on
        _each_kept_item_counted_once(plans)
        loop()
        _each_kept_item_counted_once(plans)
        return _cpu_lowering._total

    for forks in (False, True):
        n = 1
        while True:
            _cpu_lowering.forget()
            for p in plans:
                p.memo.clear()
            waits: list = []
            instead = functools.partial(_fork, waits, child) if forks else None
            fired = interrupt_at_check(n, loop, skip=skip, instead=instead)
            assert len(waits) == (fired and forks) and all(0 < wait() <= 15 for wait in waits)
            _each_kept_item_counted_once(plans)
            if not fired:
                break
            n += 1
        assert n > 50, n
        assert [o.memo for o in _cpu_lowering._held] == [plans[1].memo]  # the second let go of the first's
    _cpu_lowering.forget()


def test_threads_keeping_at_once_keep_at_most_keep_items_each_counted_once(monkeypatch):
    """Plans are shared by threads. Two that make items for different keys at once, each having read the
    count before the other added to it, keep no more than KEEP between them; two that make one key, the second
    done after the first checked for it, count its items once."""
    monkeypatch.setattr(_cpu_lowering, "KEEP", 3)
    p = plan(conv_geometry((1, 1, 5), (1, 1, 3)))

    def held():
        return sum(len(p.memo[key]) for key in "xyz" if key in p.memo)

    _cpu_lowering.forget()
    both_read = threading.Barrier(2, timeout=10)

    def make():  # two items, the end once the other thread has read the count too
        yield from "ab"
        both_read.wait()

    threads = [threading.Thread(target=_cpu_lowering._kept, args=(p, key, make)) for key in "xy"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert held() == _held() == 2  # one key kept, not both (4 items)

    _cpu_lowering.forget()
    monkeypatch.setattr(_cpu_lowering, "KEEP", 4)
    checked, made = threading.Event(), threading.Event()

    def late():  # made once the other thread has kept the key
        checked.set()
        assert made.wait(10)
        return "ab"

    second = threading.Thread(target=_cpu_lowering._kept, args=(p, "z", late))
    second.start()
    assert checked.wait(10)
    assert _cpu_lowering._kept(p, "z", lambda: "ab") == ("a", "b")
    made.set()
    second.join()
    assert held() == _held() == 2
    _cpu_lowering.forget()


def _merged_by_definition(views, npix):
    """The shapes merge_pixels gives ``views``: pairs of pixel axes merged from the innermost out, each tested on the
    shapes and strides the merges inside it left (None where none merge)."""
    shapes, strides = [list(v.shape) for v in views], [list(v.strides) for v in views]
    merged = False
    for i in reversed(range(npix - 1)):
        if all(st[i] == st[i + 1] * sh[i + 1] for sh, st in zip(shapes, strides)):
            for sh, st in zip(shapes, strides):
                sh[i] *= sh.pop(i + 1)
                st[i] = st.pop(i + 1)
            merged = True
    return [tuple(sh) for sh in shapes] if merged else None


_AXIS_KINDS = ("whole", "whole", "reversed", "stepped", "broadcast")


def _view(shape, kinds):
    """A view of ``shape`` over an arange, each axis whole, reversed (a negative stride), every other element of one
    twice as long, or broadcast (stride 0)."""
    sizes = [2 * s if k == "stepped" else 1 if k == "broadcast" else s for s, k in zip(shape, kinds)]
    base = np.arange(math.prod(sizes), dtype=np.float64).reshape(sizes)
    cut = base[tuple(slice(None, None, -1 if k == "reversed" else 2 if k == "stepped" else 1) for k in kinds)]
    return np.broadcast_to(cut, shape)


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(0, 3), min_size=2, max_size=5),
       kinds=st.lists(st.lists(st.sampled_from(_AXIS_KINDS), min_size=5, max_size=5), min_size=1, max_size=3),
       npix=st.integers(1, 5))
def test_merge_pixels_merges_the_pairs_of_axes_that_walk_memory_alike_in_every_view(shape, kinds, npix):
    """Views of one shape whose axes are whole, reversed, stepped or broadcast (zero-size ones too) merge as the
    definition says, into views of their memory; the same shapes with other strides (C-contiguous copies, which
    merge every pair) get their own shapes, before and after."""
    npix = min(npix, len(shape))
    views = [_view(shape, k[: len(shape)]) for k in kinds]
    copies = [np.ascontiguousarray(v) for v in views]
    for vs in (copies, views, copies, views):
        want = _merged_by_definition(vs, npix)
        merged = _cpu_lowering.merge_pixels(vs, npix)
        for v, m, sh in zip(vs, merged, want or [v.shape for v in vs]):
            assert m.shape == sh, (v.shape, v.strides, npix)
            assert np.array_equal(m.ravel(), v.ravel()) and (v.size == 0 or np.shares_memory(m, v))
