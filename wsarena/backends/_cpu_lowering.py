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

A plan keeps these bounds per dimension and kernel index (:class:`Axis`), the sum of the kernel's sizes, and
planning (all the workspace sizes, and so ``wsarena report``, need) makes nothing per kernel element. An
offset, one kernel index per dimension, is made from its dimensions' bounds where an algorithm walks the
offsets; what the algorithms make from the bounds (offsets, blocks of rows, boxes and their index pairs,
windows) is kept in the plan's memo, up to :data:`KEEP` items across all plans, and made afresh in each call
beyond. What a run of one pass and algorithm keeps is its own (:func:`begin_run`), and a run that finds no room
takes that of runs that have not run since it last did, or as many of its runs as they ran in a row (:func:`_keep`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np

from .. import _forksafe
from .._geometry import ConvGeometry
from .._pass import Pass

__all__ = [
    "KEEP",
    "Axis",
    "Offset",
    "Offsets",
    "Plan",
    "Rows",
    "act_view",
    "begin_run",
    "blocks",
    "col2im",
    "col_view",
    "forget",
    "im2col",
    "merge_pixels",
    "plan",
    "rows",
    "strided",
    "weight_view",
]


class Offset(NamedTuple):
    """One kernel position and the part of the output that reads real (non-padding) input there.

    ``kernel`` is the position's index per spatial dimension. ``out`` slices the output's spatial dimensions
    (step 1), ``inp`` the matching input elements (step = stride); ``lo``/``hi`` bound the valid outputs per
    dimension. ``full_out``: every output reads real input at this position; ``full_in``: every input element
    is read (so a scatter-add can start with a copy).
    """

    kernel: tuple[int, ...]
    out: tuple[slice, ...]
    inp: tuple[slice, ...]
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    empty: bool
    full_out: bool
    full_in: bool


# The plans keep up to this many items in all (offsets, boxes, blocks of rows, windows) of what the algorithms
# make from their axes, a few hundred bytes each (25 to 40 MiB in all): the per-call cost of a small convolution
# is Python's. Beyond, they are made afresh in each call, and used as they come, so that what the plans hold
# does not grow with their number, kernels or tiles; those calls make a NumPy call or two per item anyway.
KEEP = 1 << 16


@dataclasses.dataclass(frozen=True, eq=False)
class Axis:
    """One spatial dimension of a block of outputs, per kernel index ``j``: the outputs ``[lo[j], hi[j])`` (block
    coordinates) that read real input, the first of them input ``start[j]``, the next ones every ``stride``.

    Arrays have one entry per kernel index, so a plan holds the sum of its kernel sizes, not their product;
    an offset is one index per dimension, and its fields are those of its dimensions (:func:`_offsets`).
    """

    lo: np.ndarray
    hi: np.ndarray  # >= lo; hi == lo where no output reads real input
    start: np.ndarray  # 0 where hi == lo
    stride: int
    outputs: int  # block length
    inputs: int  # input length
    whole: bool  # the block is every output of the dimension

    @classmethod
    def of(cls, size: int, out: int, k: int, s: int, p: int, d: int) -> Axis:
        """The whole dimension: ``size`` inputs, ``out`` outputs, kernel ``k``, stride, padding, dilation."""
        shift = np.arange(k, dtype=np.int64) * d - p  # input read by output 0
        lo = np.where(shift < 0, -(shift // s), 0)  # ceil(-shift / s) for negative shift
        last = size - 1 - shift
        hi = np.maximum(lo, np.where(last >= 0, np.minimum(out, last // s + 1), 0))
        return cls(lo, hi, np.where(hi > lo, lo * s + shift, 0), s, out, size, True)

    def block(self, r0: int, r1: int) -> Axis:
        """This (whole) dimension's outputs ``[r0, r1)``, in block coordinates."""
        lo, hi = np.maximum(self.lo, r0), np.minimum(self.hi, r1)
        live = hi > lo
        start = np.where(live, self.start + (lo - self.lo) * self.stride, 0)
        lo = np.where(live, lo - r0, 0)
        whole = r0 == 0 and r1 == self.outputs
        return Axis(lo, np.where(live, hi - r0, 0), start, self.stride, r1 - r0, self.inputs, whole)

    @property
    def live(self) -> np.ndarray:
        """Per kernel index: some output of the block reads real input."""
        return self.hi > self.lo

    @property
    def full_out(self) -> np.ndarray:
        """Per kernel index: every output of the block reads real input."""
        return (self.lo == 0) & (self.hi == self.outputs)

    @property
    def full_in(self) -> np.ndarray:
        """Per kernel index: the whole dimension's outputs read every input."""
        n = self.hi - self.lo
        return (n == self.inputs) & ((self.stride == 1) | (n == 1)) & self.whole

    def _slices(self, js: np.ndarray) -> tuple[list[slice], list[slice]]:
        """The ``out`` and ``inp`` slices of the live kernel indices ``js``."""
        lo, hi, start = self.lo[js], self.hi[js], self.start[js]
        stop = start + (hi - lo - 1) * self.stride + 1
        steps = itertools.repeat(self.stride)
        return list(map(slice, lo.tolist(), hi.tolist())), list(map(slice, start.tolist(), stop.tolist(), steps))

    @property
    def parts(self) -> list[tuple[int, slice, slice]]:
        """``(j, out, inp)`` per live kernel index ``j``: what the boxes of im2col and col2im are made of (made at
        each access: what is made from them is kept)."""
        js = np.flatnonzero(self.live)
        return list(zip(js.tolist(), *self._slices(js)))

    @property
    def entries(self) -> list[tuple]:
        """``(j, out, inp, lo, hi, empty, full_out, full_in)`` per kernel index: the pieces of an :class:`Offset`."""
        lo, hi = self.lo.tolist(), self.hi.tolist()
        inp = [slice(0, 0)] * len(lo)
        for j, _, reads in self.parts:
            inp[j] = reads
        return list(zip(
            range(len(lo)), map(slice, lo, hi), inp, lo, hi, (~self.live).tolist(), self.full_out.tolist(),
            self.full_in.tolist(),
        ))


def _ordered(items: list[list[tuple]], full: list[list[bool]]) -> Iterator[tuple]:
    """Combinations of one item per dimension (an item starts with its kernel index ``j``) in the offsets' order:
    row-major, those whose every index is ``full`` (every output reads real input there) first, when there
    are any. A covering offset first lets the forward pass write it with ``out=`` instead of zero-filling and
    adding; the adds of a pass keep this order (the rounding depends on it)."""
    if not all(any(f) for f in full):
        yield from itertools.product(*items)
        return
    yield from itertools.product(*([x for x in dim if f[x[0]]] for dim, f in zip(items, full)))
    yield from _partial(items, full, 0)


def _partial(items: list[list[tuple]], full: list[list[bool]], i: int) -> Iterator[tuple]:
    """Row-major combinations of ``items[i:]`` with some index not ``full``."""
    if i == len(items):
        return
    for x in items[i]:
        rest = _partial(items, full, i + 1) if full[i][x[0]] else itertools.product(*items[i + 1 :])
        for tail in rest:
            yield (x, *tail)


def _offsets(axes: tuple[Axis, ...]) -> Iterator[Offset]:
    """Every :class:`Offset` of ``axes`` (the whole image's), in :func:`_ordered` order."""
    for parts in _ordered([a.entries for a in axes], [a.full_out.tolist() for a in axes]):
        kernel, out, inp, lo, hi, empty, fo, fi = zip(*parts)
        yield Offset(kernel, out, inp, lo, hi, any(empty), all(fo), all(fi))


class _Owner:
    """A run of one pass and algorithm on one plan (or what is made outside a run, under ``None``): the keys of the
    plan's memo that it keeps, the items they hold, how many times it ran, and when it last ran and the runs before
    (ticks of :data:`_TICKS`)."""

    __slots__ = ("count", "items", "keys", "last", "memo", "runs", "stale", "swept")

    def __init__(self, memo: dict) -> None:
        self.memo = memo
        self.keys: list[Any] = []
        self.items = 0
        self.last = 0
        self.count = 0  # its runs
        self.runs = [0] * _LOOKBACK  # the tick of its run i - 1 at i % _LOOKBACK, for its last runs i (0: none)
        self.swept = -1  # the run (its tick) whose owners to let go were looked for
        self.stale: list[_Owner] = []  # those, the oldest last


_TICKS = itertools.count(1)  # one per run
_LOOKBACK = 8  # the runs an owner remembers, and so the most runs in a row that count (:func:`_stopped`)
_running = threading.local()  # .owner: the run last begun in this thread
# Guards the owners' keys and counts, _held and _total: plans are shared by threads, and two that read the count
# before either added to it would both take the same room (or keep one key twice).
_KEEPING = _forksafe.lock()
_held: dict[_Owner, None] = {}  # the owners that keep items
_total = 0  # the items they keep
# The owners (a plan's calls) of the plans gone from the cache of plans, whose items the next keep lets go of: a
# kept block of rows holds its plan's axes, and what these keep would stay counted (and held) until a run needs
# their room. Appended to by the plans' finalizers, which take no lock (they may run under one).
_gone: list[dict] = []


def begin_run(p: Plan, pass_: str, algo: str) -> None:
    """A run of ``algo`` for ``pass_`` on ``p`` starts in this thread: what it keeps is its own (:func:`_keep`)."""
    owner = p.calls.get((pass_, algo))
    if owner is None:
        owner = p.calls.setdefault((pass_, algo), _Owner(p.memo))
    owner.runs[owner.count % _LOOKBACK] = owner.last
    owner.count += 1
    owner.last = next(_TICKS)
    _running.owner = owner


def _owner(p: Plan) -> _Owner:
    """The run this thread is in, if on ``p``; else ``p``'s owner of what is made outside a run."""
    owner = getattr(_running, "owner", None)
    if owner is not None and owner.memo is p.memo:
        return owner
    found = p.calls.get(None)
    return found if found is not None else p.calls.setdefault(None, _Owner(p.memo))


def _stopped(owner: _Owner, other: _Owner) -> bool:
    """Whether ``owner``'s run may take ``other``'s room: before this run, ``owner`` ran as many times since
    ``other`` last ran as ``other`` ran in a row then (once at least, :data:`_LOOKBACK` times at most).

    Once is a steady loop's rule: its other calls have all run since its previous run, a call that stopped has
    not. Calls that each run twice in a row, in turn (A A B B), would take each other's room in every turn by it:
    in a call's second run of a turn, the other has not run since its first. The price: a call that ran ``n`` times
    in a row and stopped gives its room to a loop's run ``n + 1`` after it, not its second."""
    n, last = 1, other.last  # other's runs in a row (no other run between), to its last
    while n < min(other.count, _LOOKBACK) and other.runs[(other.count - n) % _LOOKBACK] == last - n:
        n += 1
    return n <= owner.count and other.last < owner.runs[(owner.count - n) % _LOOKBACK]


def _spare(owner: _Owner) -> int:
    """Under :data:`_KEEPING`: the items of the owners ``owner`` may let go (:func:`_stopped`; a steady loop's
    other calls have all run since its previous run). Looked for once a run."""
    if owner.swept != owner.last:
        owner.swept = owner.last
        owner.stale = sorted((o for o in _held if _stopped(owner, o)), key=lambda o: -o.last)
    return sum(o.items for o in owner.stale if _stopped(owner, o))


def _let_go(owner: _Owner) -> None:
    """Under :data:`_KEEPING`: ``owner``'s items, out of its plan's memo."""
    global _total
    for key in owner.keys:
        owner.memo.pop(key, None)
    _total -= owner.items
    owner.keys, owner.items = [], 0
    _held.pop(owner, None)


def _going(calls: dict) -> None:
    """A plan's finalizer: its calls' items are let go of at the next keep (if it made any: a plan only planned
    has none)."""
    if calls:
        _gone.append(calls)


def _let_go_of_gone() -> None:
    """Under :data:`_KEEPING`: the items of the plans gone from the cache (:data:`_gone`), each plan's calls taken off
    once let go of (a Ctrl-C meanwhile leaves them to the next keep; finalizers append meanwhile)."""
    while _gone:
        for owner in list(_gone[0].values()):
            _let_go(owner)
        del _gone[0]


def forget() -> None:
    """Let go of every item the plans keep."""
    with _KEEPING:
        _gone.clear()
        for owner in list(_held):
            _let_go(owner)


def _keep(p: Plan, key: Any, build: Callable[[list[Iterable]], Any], *parts: Iterable) -> Any:
    """``build(found)``, ``found`` being ``parts`` as tuples where the room for :data:`KEEP` items holds them all,
    then kept under ``key`` as this run's (or what another thread kept there first); else as iterators to read
    once.

    The room is what the plans do not keep, and what the owners that have not run since this one's previous run
    keep (since its runs before, as many as those ran in a row: :func:`_stopped`): those are let go, the least
    recently run first, once this run needs their room. So a steady loop's calls keep what they made first, and
    take the room of calls that stopped (a search's other candidates, geometries no longer seen), not each other's;
    a call's first run lets go of nothing."""
    global _total
    owner = _owner(p)
    with _KEEPING:
        if _gone:
            _let_go_of_gone()
        room = free = KEEP - _total + _spare(owner)
    found: list[Iterable] = []
    for part in parts:
        items = iter(part)
        head = tuple(itertools.islice(items, room + 1)) if room >= 0 else ()
        room -= len(head)
        found.append(head if room >= 0 else itertools.chain(head, items))
    result = build(found)
    if room < 0:
        return result
    count = max(1, free - room)
    with _KEEPING:
        held = p.memo.get(key)
        if held is not None:
            return held
        _make_room(owner, count)
        if _total + count <= KEEP:
            # The stores first, the one call last: a Ctrl-C, or a thread switch (and another thread's fork), comes
            # after a call, and one after the append found the key kept and counted by no owner held.
            _held[owner] = None
            owner.items += count
            _total += count
            p.memo[key] = result
            owner.keys.append(key)
    return result


def _make_room(owner: _Owner, count: int) -> None:
    """Let go of what the owners that stopped before ``owner`` keep, the least recently run first, until ``count``
    more items fit. :func:`_keep`'s loop, run under ``_KEEPING``: its own function, for the loop's jump back
    (:mod:`wsarena.arena._interrupts`, rule 8)."""
    while _total + count > KEEP and owner.stale:
        stale = owner.stale.pop()
        if _stopped(owner, stale):
            _let_go(stale)


def _kept(p: Plan, key: Any, make: Callable[[], Iterable]) -> Iterable:
    """``make()``'s items: kept in ``p.memo`` under ``key`` as a tuple where there is room (:func:`_keep`), else
    made afresh."""
    found = p.memo.get(key)
    if found is None:
        found = _keep(p, key, lambda parts: parts[0], make())
    return found


class Offsets:
    """Every kernel offset of a plan, fully covering ones first (then row-major): each iteration goes through all
    of them, kept (:func:`_keep`) or made afresh."""

    __slots__ = ("_plan",)

    def __init__(self, p: Plan) -> None:
        self._plan = p

    def __iter__(self) -> Iterator[Offset]:
        p = self._plan
        found = p.memo.get("offsets")
        if found is None:
            found = _kept(p, "offsets", lambda: _offsets(p.axes))
        return iter(found)

    def __len__(self) -> int:
        return self._plan.kprod


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """What every algorithm needs to know about a geometry, computed once (cached per geometry).

    Kernel offsets are made on use from ``axes`` (:attr:`offsets`), and kept in ``memo`` where there is room: the
    workspace sizes need none, and their number is the kernel's product of sizes.
    """

    geom: ConvGeometry
    groups: int
    cg: int  # input channels per group
    kg: int  # output channels per group
    kprod: int  # kernel elements
    oprod: int  # output pixels per image
    osize: tuple[int, ...]  # output size per spatial dimension
    axes: tuple[Axis, ...]  # per spatial dimension
    padded: bool  # some offset reads padding (im2col must write zeros)
    covered: bool  # some offset reads real input at every output (the first of :attr:`offsets`)
    itemsize: int
    shapes: dict[str, tuple[tuple[int, ...], ...]]  # per pass: the shapes of (a, b, out)
    memo: dict = dataclasses.field(default_factory=dict)  # views, row blocks and offsets, filled lazily
    calls: dict = dataclasses.field(default_factory=dict)  # (pass, algorithm) or None: its _Owner

    @property
    def offsets(self) -> Offsets:
        """Every kernel offset, fully covering ones first (then row-major), as often as it is iterated."""
        return Offsets(self)


@functools.lru_cache(maxsize=512)
def plan(geom: ConvGeometry) -> Plan:
    """The cached :class:`Plan` of ``geom`` (512 at most: what one that leaves the cache kept is let go of)."""
    osz = geom.output_size
    axes = tuple(
        Axis.of(*dim)
        for dim in zip(geom.input_size, osz, geom.kernel_size, geom.stride, geom.padding, geom.dilation)
    )
    made = Plan(
        geom=geom,
        groups=geom.groups,
        cg=geom.in_channels // geom.groups,
        kg=geom.out_channels // geom.groups,
        kprod=math.prod(geom.kernel_size),
        oprod=math.prod(osz),
        osize=tuple(osz),
        axes=axes,
        padded=not all(a.full_out.all() for a in axes),
        covered=all(a.full_out.any() for a in axes),
        itemsize=np.dtype(geom.dtype).itemsize,
        shapes={p: geom.operand_shapes(p) for p in Pass},
    )
    weakref.finalize(made, _going, made.calls).atexit = False  # out of the cache: what it keeps goes
    return made


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


@dataclasses.dataclass(frozen=True, eq=False)
class Rows:
    """A block of output rows ``[row0, row0 + osize[0])`` (first spatial dimension): a tiled algorithm lowers one
    block of rows at a time into a column buffer of the block's size."""

    row0: int
    osize: tuple[int, ...]
    padded: bool  # some offset reads padding within the block
    whole: tuple[Axis, ...]  # the plan's axes

    @property
    def axes(self) -> tuple[Axis, ...]:
        """The plan's axes, the first restricted to the block (block coordinates); made at each access (what is
        made from them is kept, where the plan has room, and the first has the kernel's length)."""
        r0, r1 = self.row0, self.row0 + self.osize[0]
        if r0 == 0 and r1 == self.whole[0].outputs:
            return self.whole
        return (self.whole[0].block(r0, r1), *self.whole[1:])


def rows(p: Plan, r0: int, r1: int) -> Rows:
    """The :class:`Rows` of output rows ``[r0, r1)`` (kept, where the plan has room); ``rows(p, 0, O[0])`` is the
    whole image."""
    key = ("rows", r0, r1)
    found = p.memo.get(key)
    if found is not None:
        return found
    # Every offset reads real input at every output of the block where every kernel index of the first
    # dimension reads rows [r0, r1) and those of the others read every output.
    first = p.axes[0]
    full = int(first.lo.max()) <= r0 and int(first.hi.min()) >= r1 and all(a.full_out.all() for a in p.axes[1:])
    made = Rows(r0, (r1 - r0, *p.osize[1:]), not full, p.axes)
    return _keep(p, key, lambda parts: made, (made,))


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
        made = (shape, strides, (block.row0 * g.stride[0] - g.padding[0]) * st[1])
        found = _keep(p, key, lambda parts: made, (made,))
    shape, strides, start = found
    return strided(root, offset + start, shape, strides)


def im2col(xp: np.ndarray, col: np.ndarray, p: Plan, root: np.ndarray, offset: int, block: Rows | None = None) -> None:
    """Lower the pixel-major input ``xp`` ``(B, *S, G, Cg)`` into the canonical column view ``col``.

    ``xp`` is a view of the C-contiguous activation ``root`` starting ``offset`` bytes into it; ``block``
    selects a block of output rows (default: the whole image), whose size ``col`` has. Every element of
    ``col`` is written (zeros where the kernel reads padding), so ``col`` may start as garbage. Without
    padding this is one strided copy; with padding, per box of :func:`_lowering` its frames zeroed and one
    copy, or where a third of the columns or more read padding, all zeroed first and one copy per box.
    """
    block = block or rows(p, 0, p.osize[0])
    if not block.padded:
        np.copyto(col, _window(xp, p, root, offset, block))
        return
    axes, blank, dead, boxes = _lowering(p, block)
    if blank:
        col[...] = 0
    for frame in dead:
        col[frame] = 0
    for frames, xp_index, col_index in boxes:
        for frame in frames:
            col[frame] = 0
        col[col_index] = xp[xp_index] if axes is None else xp[xp_index].transpose(axes)


def col2im(col: np.ndarray, xp: np.ndarray, p: Plan, block: Rows | None = None, overwrite: bool = True) -> None:
    """Scatter-add the canonical column view ``col`` into the pixel-major ``xp`` ``(B, *S, G, Cg)``.

    With ``overwrite`` ``xp`` is set (its first covering offset copied, or zeros first); otherwise the
    columns are added to what ``xp`` holds (a tiled algorithm adds block after block). ``block`` selects
    the output rows ``col`` holds (default: the whole image). Within one box of :func:`_boxes` distinct
    columns add to distinct inputs, so each box's in-place add on a strided view is race-free and makes no
    temporary; every input receives its columns in the order of the plan's offsets, box after box.
    """
    boxes = _boxes(p, block or rows(p, 0, p.osize[0]), overwrite)
    if boxes.first is not None:
        np.copyto(xp[boxes.first[0]], col[boxes.first[1]])
    elif overwrite:
        xp[...] = 0
    for xp_index, col_index in boxes.lead:
        dst = xp[xp_index]
        np.add(dst, col[col_index], out=dst)
    for xp_index, col_index in boxes.rest:
        dst = xp[xp_index] if boxes.axes is None else xp[xp_index].transpose(boxes.axes)
        np.add(dst, col[col_index], out=dst)


# im2col zeroes a block's whole column matrix first, then copies what reads real input, where less than this share
# of its columns reads real input: a memset then the copies writes the real ones twice, but makes one NumPy call
# a box instead of up to 1 + 2 * dimensions (zeroing the lines around the box, which are strided where a
# dimension is cut by output). Elsewhere it writes each column once, zeros box by box.
BLANK = 2 / 3

# An NCHW column matrix of at most this many bytes per image stays in cache while copies stride across its
# output axes, its innermost ones: only then is one of its dimensions cut by output (tiles, small images).
IN_CACHE = 1 << 20


def _cuts(p: Plan, block: Rows, axes: tuple[Axis, ...]) -> list[tuple[bool, Axis]]:
    """Per dimension of ``block`` (whose ``axes`` these are): whether im2col and col2im cut it by output, and the
    axis they cut.

    In one dimension the pairs (output ``o``, kernel index ``j``) that read real input form a band. It is cut
    into boxes by kernel index (for each ``j``, the outputs ``[lo, hi)``: one input slice of step stride) or
    by output (for each ``o``, the kernel indices that read real input: one input slice of step dilation),
    whichever makes fewer. NHWC keeps its channels innermost either way. NCHW has its output axes innermost:
    a box of one kernel index writes runs of whole output rows, a box of one output breaks them, which is
    slower once the matrix is out of cache; so NCHW is cut by output only in blocks whose matrix is at most
    :data:`IN_CACHE` bytes per image, or in a dimension of one output (a tile of one row), where both write
    the same runs. Cut by output, the axis is the band seen from the outputs: its "kernel" is the block's
    outputs and its "outputs" are the kernel indices, stride and dilation swapping roles.
    """
    g = p.geom
    cached = g.layout == "NHWC" or g.in_channels * p.kprod * math.prod(block.osize) * p.itemsize <= IN_CACHE
    cuts = []
    for i, a in enumerate(axes):
        r0 = block.row0 if i == 0 else 0
        t = Axis.of(g.input_size[i], len(a.lo), a.outputs, g.dilation[i], g.padding[i] - r0 * g.stride[i], g.stride[i])
        by_output = (cached or a.outputs == 1) and bool(np.count_nonzero(t.live) < np.count_nonzero(a.live))
        cuts.append((by_output, t if by_output else a))
    return cuts


def _lowering(p: Plan, block: Rows) -> tuple[tuple[int, ...] | None, bool, tuple, Iterable[tuple]]:
    """What :func:`im2col` writes on a block that reads padding: ``(axes, blank, dead, boxes)``.

    Each dimension is cut as :func:`_cuts` says. A piece of a cut is a line of the dimension's (output,
    kernel index) pairs, one kernel index or one output, of which a part reads real input; a box is one piece
    per dimension. Per box, ``(frames, xp index, col index)``: the column indices of the rest of its lines
    (zeroed), then its copy, so that the columns of one box are written together (as they were offset by
    offset: out of cache, zeroing all frames first and copying after writes the lines twice). ``dead``
    zeroes the lines that read no real input. With ``blank`` (less than :data:`BLANK` of the block's columns
    read real input) the whole matrix is zeroed first instead, and there are no frames and no ``dead``.
    ``axes`` as in :func:`_boxes`. Kept where the plan has room.
    """
    key = ("lowering", block.row0, block.osize)
    found = p.memo.get(key)
    if found is not None:
        return found
    cuts = _cuts(p, block, block.axes)
    nd = len(cuts)
    lead = (slice(None),)
    reads = math.prod(float((a.hi - a.lo).sum()) / (a.outputs * len(a.lo)) for _, a in cuts)
    blank = reads < BLANK
    dims: list[list[tuple[Any, ...]]] = []
    dead = []
    spans: list[tuple[slice, slice]] = []  # per dimension: (output, kernel) items, first live line to last
    for i, (by_output, a) in enumerate(cuts):
        pieces: list[tuple[Any, ...]] = []  # (box's (output, kernel) items, line's, the rest's, input slice)
        for at, seg, inp in a.parts:
            lo, hi = seg.start, seg.stop
            rest = ([slice(0, lo)] if lo > 0 else []) + ([slice(hi, None)] if hi < a.outputs else [])
            if by_output:
                pieces.append(((at, seg), (at, slice(None)), [(at, s) for s in rest], inp))
            else:
                pieces.append(((seg, at), (slice(None), at), [(s, at) for s in rest], inp))
        dims.append(pieces)
        # The lines that read no real input, within the earlier dimensions' live spans (the rest is zero already)
        for at in np.flatnonzero(~a.live).tolist():
            line = (at, slice(None)) if by_output else (slice(None), at)
            outs, kers = zip(*spans, line, *[(slice(None), slice(None))] * (nd - 1 - i))
            dead.append((*lead, *outs, Ellipsis, *kers))
        live = np.flatnonzero(a.live)
        span = slice(int(live[0]), int(live[-1]) + 1) if len(live) else slice(0, 0)
        spans.append((span, slice(None)) if by_output else (slice(None), span))

    def boxes() -> Iterator[tuple]:
        for cell in itertools.product(*dims):
            frames = []
            for i in range(nd):
                for part in cell[i][2]:
                    outs, kers = zip(*(*(c[0] for c in cell[:i]), part, *(c[1] for c in cell[i + 1 :])))
                    frames.append((*lead, *outs, Ellipsis, *kers))
            outs, kers = zip(*(c[0] for c in cell))
            yield tuple(frames), (*lead, *(c[3] for c in cell)), (*lead, *outs, Ellipsis, *kers)

    axes = _axes(cuts)
    if blank:
        dead, dims = [], [[(box, line, [], inp) for box, line, _, inp in pieces] for pieces in dims]
    return _keep(p, key, lambda parts: (axes, blank, tuple(parts[0]), parts[1]), dead, boxes())


def _axes(cuts: list[tuple[bool, Axis]]) -> tuple[int, ...] | None:
    """The transpose of an xp box ``(B, *S, G, Cg)`` to its column box ``(B, *O kept, G, Cg, *R kept)``, where a
    dimension is cut by output (its output is one, its kernel indices a range)."""
    if not any(by_output for by_output, _ in cuts):
        return None
    nd = len(cuts)
    kept = [1 + i for i, (by_output, _) in enumerate(cuts) if not by_output]
    return (0, *kept, nd + 1, nd + 2, *(1 + i for i, (by_output, _) in enumerate(cuts) if by_output))


class _Boxes(NamedTuple):
    """What im2col copies and col2im adds on a block of rows that reads padding: ``(xp index, col index)``
    pairs, made by :func:`_boxes`."""

    first: tuple | None  # col2im's with overwrite: the first offset that reads every input, copied
    lead: Iterable[tuple]  # one per covering offset (but first), row-major
    axes: tuple[int, ...] | None  # transposes an xp box of ``rest`` to its column box's axes, where one must
    rest: Iterable[tuple]  # the boxes of the other offsets, in the order of the adds


def _minus(ranges: tuple[tuple[int, int], ...], boxes: list[tuple[tuple[int, int], ...]]) -> list[tuple]:
    """The box of kernel indices ``ranges`` (one ``[lo, hi)`` per dimension) less ``boxes``, as boxes."""
    cells = [ranges]
    for box in boxes:
        left = []
        for cell in cells:
            common = tuple((max(lo, a), min(hi, b)) for (lo, hi), (a, b) in zip(cell, box))
            if any(lo >= hi for lo, hi in common):
                left.append(cell)
                continue
            for i, ((lo, hi), (a, b)) in enumerate(zip(cell, common)):
                left.extend((*common[:i], part, *cell[i + 1 :]) for part in ((lo, a), (b, hi)) if part[0] < part[1])
        cells = left
    return cells


def _boxes(p: Plan, block: Rows, overwrite: bool) -> _Boxes:
    """The boxes of ``block``'s (output, kernel index) pairs that read real input, in the order col2im adds them.

    Each dimension is cut as :func:`_cuts` says; a box is one cut piece per dimension. The order of the adds
    is the plan's offsets' (the rounding depends on it): with ``overwrite``, first the first offset that reads
    every input (copied), then the covering offsets row-major, then the others row-major. So the covering
    offsets and ``first`` are taken out of the boxes, and those come with each dimension cut by output taken
    from its last output to its first: an input's columns then arrive in increasing kernel index there, as
    they do by kernel index elsewhere. A kernel longer than the block's outputs in a dimension (a tile of a
    few rows, a long 1-D kernel) then takes one box per output there instead of one per kernel index. Kept
    where the plan has room.
    """
    key = ("boxes", block.row0, block.osize, overwrite)
    found = p.memo.get(key)
    if found is not None:
        return found
    lead = (slice(None),)
    axes = block.axes
    first: tuple | None = None
    index: tuple[int, ...] | None = None
    if overwrite:
        # The first offset that reads every input: among the covering ones (which come first) if one of them
        # does, else among the others; either way each dimension's first such index.
        fi = [np.flatnonzero(a.full_in) for a in axes]
        both = [np.flatnonzero(a.full_in & b.full_out) for a, b in zip(axes, p.axes)]
        picks = both if all(len(b) for b in both) else fi
        if all(len(f) for f in picks):
            index = tuple(int(f[0]) for f in picks)
            _, out, inp = zip(*(a.entries[j][:3] for a, j in zip(axes, index)))
            first = lead + inp, (*lead, *out, Ellipsis, *index)
    full = [np.flatnonzero(a.full_out) for a in p.axes]  # an interval per dimension
    spans = tuple((int(f[0]), int(f[-1]) + 1) for f in full) if all(len(f) for f in full) else None
    skip: list[tuple[tuple[int, int], ...]] = []  # what the boxes leave out: the covering offsets, first
    if spans is not None:
        skip.append(spans)
    if index is not None:
        skip.append(tuple((j, j + 1) for j in index))

    def covering() -> Iterator[tuple]:
        if spans is None:
            return
        parts = [[x for x in a.parts if lo <= x[0] < hi] for a, (lo, hi) in zip(axes, spans)]
        for combo in itertools.product(*parts):
            kernel, out, inp = zip(*combo)
            if kernel != index:
                yield lead + inp, (*lead, *out, Ellipsis, *kernel)

    cuts = _cuts(p, block, axes)

    def others() -> Iterator[tuple]:
        pieces: list[list[tuple[Any, ...]]] = []  # per dimension: (kernel range, output, input slice or start, step)
        for (by_output, a), d in zip(cuts, p.geom.dilation):
            if by_output:
                pieces.append([((j.start, j.stop), o, inp.start, d) for o, j, inp in reversed(a.parts)])
            else:
                pieces.append([((j, j + 1), out, inp, None) for j, out, inp in a.parts])
        for cell in itertools.product(*pieces):
            ranges = tuple(c[0] for c in cell)
            for sub in _minus(ranges, skip) if skip else [ranges]:
                inp, out, ker = [], [], []
                for (rng, item, reads, step), (u, v) in zip(cell, sub):
                    if step is None:  # by kernel index: a single one
                        inp.append(reads)
                        ker.append(u)
                    else:
                        start = reads + (u - rng[0]) * step
                        inp.append(slice(start, start + (v - u - 1) * step + 1, step))
                        ker.append(slice(u, v))
                    out.append(item)
                yield (*lead, *inp), (*lead, *out, Ellipsis, *ker)

    transpose = _axes(cuts)
    return _keep(p, key, lambda parts: _Boxes(first, parts[0], transpose, parts[1]), covering(), others())


def merge_pixels(views: list[np.ndarray], npix: int) -> list[np.ndarray]:
    """Merge adjacent leading (pixel) axes ``0..npix-1`` of all ``views`` wherever every view allows it.

    Axes ``i`` and ``i+1`` merge when, in every view, ``stride[i] == stride[i+1] * shape[i+1]`` (the pair
    walks memory like one axis). The views must agree on the leading shape. Returns views of the same
    memory whose leading axes are the merged pixel axes; longer pixel axes make larger GEMMs. (``reshape``
    merges exactly such axes without copying; the check below makes sure no copy slipped in, because a
    copy of an output view would silently drop the writes.)
    """
    shapes = _merged(npix, tuple([v.shape for v in views]), tuple([v.strides for v in views]))
    if shapes is None:
        return views
    out = []
    for v, sh in zip(views, shapes):
        r = v.reshape(sh)
        if r.size and not np.may_share_memory(r, v):  # pragma: no cover - reshape copied after all
            raise AssertionError("merge_pixels: reshape made a copy")
        out.append(r)
    return out


@functools.lru_cache(maxsize=2048)
def _merged(
    npix: int, shapes: tuple[tuple[int, ...], ...], strides: tuple[tuple[int, ...], ...]
) -> tuple[tuple[int, ...], ...] | None:
    """The shapes :func:`merge_pixels` gives its views, or ``None`` where no axes merge (cached: the implicit
    algorithms ask once per kernel offset, and a small call spent a few microseconds a time working it out).

    Each pair of axes is tested as it is: merging a pair keeps its outer axis's ``stride * shape``, which is
    all that the test of the pair outside it reads.
    """
    joins = [i for i in range(npix - 1) if all(st[i] == st[i + 1] * sh[i + 1] for sh, st in zip(shapes, strides))]
    if not joins:
        return None
    merged = []
    for shape in shapes:
        sh = list(shape)
        for i in reversed(joins):
            sh[i] *= sh.pop(i + 1)
        merged.append(tuple(sh))
    return tuple(merged)
