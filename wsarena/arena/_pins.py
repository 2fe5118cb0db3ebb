"""Pins: what tells the arena that a CUDA graph which captured a workspace buffer still exists.

A kernel captured into a graph keeps the workspace address it was given, and every replay writes there. So a
buffer lent to a lease during capture is *pinned* to that graph: the arena never frees it while the graph exists.
CUDA says when the graph is gone through a user object (``cudaUserObjectCreate``) that the graph holds a reference
to: its destructor runs once the graph and every executable graph instantiated from it are destroyed, and their
launches are over. That destructor runs on a CUDA thread, may not call CUDA and must not block; it must not run
Python either (it may run while the interpreter shuts down). So it is libc's ``sem_post`` on a semaphore of the
pin's own, and the arena reads the semaphore's count (``sem_getvalue``) whenever it is about to free the buffer.

The semaphore lives in memory from libc's ``malloc``, not in a Python object: CUDA may post it after the pin is
gone, and even after the interpreter has freed its own objects at exit (a graph destroyed then). It is freed once
its pin is gone and CUDA has posted it (it will never touch it again), or was never given it: :func:`free_posted`
looks at the semaphores of the pins collected since (a spare, made by a second thread's first lease of a capture;
the pins of a collected arena; any pin once its graph and arena are done with it) when a pin is made and when an
arena is closed or collected, and frees each that CUDA has posted, or that no graph was given (its address never
read: a pin dropped by a Ctrl-C as it was made). A pin's collection itself runs no Python code (interrupt rule 5 of
:mod:`~wsarena.arena._interrupts`): a weak reference's callback, ``deque.append``, lists it.

A pin also keeps what else the graph's kernels use that would otherwise be freed while it exists (:meth:`GraphPin.keep`:
the copies a captured call made of its operands, the result it made), until :func:`let_go_kept` finds the pin posted
and, where dropping what it keeps may free device memory at once (``cudaFree``, which a capture forbids), no capture
under way. What the pins of an arena keep is counted as they keep it (:class:`KeptBytes`), so that
:meth:`Arena.stats` reads a number.
A forked child never lets go of what its parent's pins kept: the parent's memory, kept there for good.

``sem_post`` returns an int and CUDA calls it as ``void (*)(void *)``: on the ABIs CUDA runs on (x86-64 System V,
AArch64) a return value the caller ignores stays in a register, so the call is sound.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import os
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Self

from .. import _forksafe
from .._sizes import as_int
from ._interrupts import finish

__all__ = ["HOST_FN", "SEM_POST", "GraphPin", "KeptBytes", "free_posted", "freeing", "let_go_kept", "posted_in_turn"]

_libc = ctypes.CDLL(None, use_errno=True)  # the process's own C library: sem_* live there (or in libpthread)
_sem_init = _libc.sem_init
_sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
_sem_getvalue = _libc.sem_getvalue
_sem_getvalue.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
_malloc = _libc.malloc
_malloc.argtypes = [ctypes.c_size_t]
_malloc.restype = ctypes.c_void_p
_free = _libc.free
_free.argtypes = [ctypes.c_void_p]

SEM_POST: int = ctypes.cast(_libc.sem_post, ctypes.c_void_p).value or 0  # the destructor CUDA runs
HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # what CUDA calls it as (cudaHostFn_t): void (*)(void *)
_SEM_BYTES = 64  # sizeof(sem_t) is 32 on 64-bit glibc and musl; room to spare

# A weak reference to each pin not looked at since it was made or collected, by its semaphore's address (what keeps
# the reference alive: its callback runs only while it is).
_held: dict[int, _PinRef] = {}
# The references of the pins collected since free_posted last looked, listed by their callback (a C call).
_collected: collections.deque[_PinRef] = collections.deque()
# The semaphores of pins collected before CUDA posted them, by address: CUDA may still post each (its graph lives on).
_unposted: dict[int, list[Any]] = {}
# The pins that keep objects for their graphs (GraphPin.keep), by id: each is held here until let_go_kept finds it
# posted, whoever else lets go of it (an arena forgets its captures' pins when it likes).
_keeping: dict[int, GraphPin] = {}
# The pins that keep what may free device memory as it goes (GraphPin.frees), looked at one in turn by each eager lease
# (posted_in_turn): a program that captures with no capture block, no trim, stats or growth lets go of it so. A pin may
# be listed twice (a keep run again after an interrupt), or after it was let go (an interrupt): each such entry goes
# when its turn comes.
freeing: collections.deque[GraphPin] = collections.deque()
# One eager lease in LOOK_EVERY looks (posted_in_turn): a look is a sem_getvalue (some 0.7 us, a third of a bare
# lease), and what a graph gone kept may wait that many more calls
LOOK_EVERY = 32
# next() in one C call, whatever other threads do; any iterator of bools (the tests' and bench_lease's repeat(True))
_looks: Iterator[bool] = itertools.cycle((True,) + (False,) * (LOOK_EVERY - 1))
# In a forked child, the parent's pins and what they keep: the parent's memory, never let go here (_after_fork_in_child)
_parents_keeping: list[dict[int, GraphPin]] = []


class GraphPin:
    """A graph's hold on the buffers it captured: live until CUDA runs the destructor :attr:`destroy` with
    :attr:`address` (``sem_post`` on a semaphore of its own).

    Attributes
    ----------
    blocks : list
        The buffers (the arena's blocks) pinned to the graph, which debug mode checks are never freed while the
        pin is live.
    kept : dict
        What else the graph uses, kept for it (:meth:`keep`), by ``id``.
    tally : KeptBytes or None
        Where what it keeps is counted: its arena's (``None``: nowhere).
    counted : dict
        The ids of the owners of what it keeps that it counted in ``tally``.
    frees : bool
        Whether dropping something it keeps may free device memory at once (:meth:`keep`'s ``frees``).
    """

    __slots__ = ("__weakref__", "_state", "blocks", "counted", "frees", "kept", "tally")

    destroy = SEM_POST

    def __init__(self, tally: KeptBytes | None = None) -> None:
        free_posted()
        address = _malloc(_SEM_BYTES)
        if not address:
            raise MemoryError("malloc of a graph pin's semaphore failed")
        if _sem_init(address, 0, 0) != 0:
            errno = ctypes.get_errno()
            _free(address)
            raise OSError(errno, f"sem_init: {os.strerror(errno)}")
        # the semaphore, whether CUDA has posted it (seen here), and whether its address was read (given to a graph)
        self._state = state = [address, False, False]
        self.blocks: list[Any] = []
        self.kept: dict[int, Any] = {}
        self.tally = tally
        self.counted: dict[int, bool] = {}
        self.frees = False
        _held[address] = _PinRef(self, state)

    @property
    def address(self) -> int:
        """What CUDA passes to the destructor: the semaphore's address. Read, it may have been given to a graph; a pin
        whose address was never read (one dropped as it was being made, by a Ctrl-C) has its semaphore freed after it
        is collected (:func:`free_posted`), posted or not."""
        state = self._state
        state[2] = True
        address: int = state[0]
        return address

    @property
    def released(self) -> bool:
        """Whether CUDA was seen to run the destructor (by :meth:`live`)."""
        released: bool = self._state[1]
        return released

    def live(self) -> bool:
        """Whether a graph still holds this pin (a C call that never blocks).

        It reads the semaphore's count (``sem_getvalue``) rather than taking the post (``sem_trywait``): a post taken
        and not yet recorded when an interrupt lands would be lost, and the pin would read live for good."""
        return not _posted(self._state)

    def keep(self, objects: Iterable[Any], frees: bool = True, counted: bool = True) -> None:
        """Keep ``objects`` (arrays whose memory the graph's kernels write or read) while the graph exists: freed
        meanwhile, their memory would go to the next allocation, which every replay would overwrite. The first
        :func:`let_go_kept` after CUDA posts the pin lets go of them; with ``frees`` (dropping one may free device
        memory at once, ``cudaFree``: not where it goes back to a pool, or is host memory), only once no capture is
        under way. What they hold is counted in :attr:`tally` now, once (:class:`KeptBytes`), unless ``counted`` is
        false (no array: a cuDNN handle or execution plan a captured call used). The first keep of each pin lets go of
        what graphs gone since kept that frees nothing (a capture is under way: this one), so that a program that
        captures again and again, with a pool, holds what the graphs alive keep.

        A Ctrl-C once the keep has begun (:func:`~wsarena.arena._interrupts.finish` runs it) loses none of them: they
        go to the pin in one C call, and the step runs again until it completes, then the interrupt is raised (the
        let-go that follows is idempotent: one cut short leaves the rest to the next)."""
        first = id(self) not in _keeping
        finish(_keep, self, objects if type(objects) is list else list(objects), frees, counted)
        if first:
            let_go_kept(None)

    def never_held(self) -> None:
        """No graph was given this pin (the call that would have failed): post it here, as CUDA would have, so that it
        reads as released and its semaphore is freed once it is collected (:func:`free_posted`). Its address is not
        read (:attr:`address`): a Ctrl-C before the post leaves it a pin no graph was given, freed unposted."""
        HOST_FN(self.destroy)(self._state[0])

    def __repr__(self) -> str:
        return f"GraphPin({'released' if self.released else 'live'})"


def _posted(state: list[Any]) -> bool:
    """Whether CUDA has posted the semaphore of ``state`` (recorded there once seen)."""
    if not state[1]:
        count = ctypes.c_int(0)
        state[1] = _sem_getvalue(state[0], ctypes.byref(count)) == 0 and count.value > 0
    return bool(state[1])


class _PinRef(weakref.ref["GraphPin"]):
    """A weak reference to a pin, which carries the pin's semaphore (its ``state``) and, as the pin is collected,
    lists itself in :data:`_collected`: a C call, where an interrupt cannot land (a ``weakref.finalize``, Python code,
    would lose it)."""

    __slots__ = ("state",)
    state: list[Any]

    def __new__(cls, pin: GraphPin, state: list[Any]) -> Self:
        ref = super().__new__(cls, pin, _collected.append)
        ref.state = state
        return ref


def _keep(pin: GraphPin, objects: list[Any], frees: bool, counted: bool = True) -> None:
    """:meth:`GraphPin.keep`'s one step, idempotent (run again after an interrupt): the pin is marked as keeping what
    may free device memory (``frees``), the objects go to it within one C call (``dict.update`` over a ``zip``); then
    the pin is listed for :func:`let_go_kept`, and what they hold is counted."""
    if frees and not pin.frees:
        freeing.append(pin)  # first: run again after an interrupt, it is listed twice, never not at all
        pin.frees = True
    pin.kept.update(zip(map(id, objects), objects))
    _keeping[id(pin)] = pin
    if counted and pin.tally is not None:
        pin.tally.count(pin, objects)


class KeptBytes:
    """The bytes that the pins of one arena keep (:meth:`GraphPin.keep`), counted as they keep them and as
    :func:`let_go_kept` lets go of them: each memory once, by the ``nbytes`` of the array that owns it (its ``base``,
    for a NumPy or CuPy view; kept, a view keeps all of it), however many views of it, and however many pins, keep it.
    An array's size is read as it is kept (:func:`owner_and_size`), never again: :meth:`Arena.stats` reads
    :attr:`nbytes`, whatever the number of arrays kept.

    Each owner is counted, and taken off, in a step with no call between its stores, so that an interrupt lands
    before or after the whole of it; a pin records the owners it counted (``GraphPin.counted``), so that a step run
    again counts nothing twice. The lock guards a few stores at a time (a forked child finds it free); reentrant, as
    the garbage collector may run a finalizer inside it, at an allocation (never between two stores of a step)."""

    __slots__ = ("lock", "nbytes", "owners")

    def __init__(self) -> None:
        self.lock = _forksafe.rlock()
        self.nbytes = 0
        # id of an owner -> [its nbytes, how many pins count it, the owner (alive while counted: its id is no other's)]
        self.owners: dict[int, list[Any]] = {}

    def count(self, pin: GraphPin, objects: list[Any]) -> None:
        """Count what ``objects``, which ``pin`` keeps, hold that ``pin`` has not counted yet. Idempotent."""
        sized = list(map(owner_and_size, objects))  # the objects' own code runs here, not under the lock
        counted, owners = pin.counted, self.owners
        with self.lock:
            for owner, nbytes in sized:
                key = id(owner)
                if key in counted:
                    continue
                entry = owners.get(key)
                # no call from here to the loop's jump back
                if entry is None:
                    owners[key] = [nbytes, 1, owner]
                    self.nbytes += nbytes
                else:
                    entry[1] += 1
                counted[key] = True

    def uncount(self, pin: GraphPin) -> None:
        """Take off what ``pin`` counted. Idempotent. An owner no pin counts any more is dropped once the lock is let
        go (an array's free may run any code)."""
        dropped: list[Any] = []
        with self.lock:
            self._uncount(pin.counted, dropped)

    def _uncount(self, counted: dict[int, bool], dropped: list[Any]) -> None:
        """:meth:`uncount`'s loop, run under the lock: its own function, for the loop's jump back
        (:mod:`wsarena.arena._interrupts`, rule 8). An owner no pin counts any more goes to ``dropped``."""
        owners = self.owners
        for key in list(counted):
            entry = owners.get(key)
            # no call from here to the append, which runs before its check
            del counted[key]
            if entry is not None:
                entry[1] -= 1
                if not entry[1]:
                    del owners[key]
                    self.nbytes -= entry[0]
                    dropped.append(entry)


_MAX_BASES = 64  # a chain of bases is walked this far at most (a cycle of them would never end)


def owner_and_size(array: Any) -> tuple[Any, int]:
    """The array whose memory ``array`` is (its ``base``, the base's base, ..., as long as that is an array too: it
    has ``nbytes``), and that one's ``nbytes``: what keeping ``array`` keeps. An attribute that cannot be read (a
    property of the object's that raises) counts as absent: a ``base`` so ends the walk there, and an ``nbytes`` so, or
    one that is no integer, counts 0 (as an object with no ``nbytes`` does)."""
    owner = array
    for _ in range(_MAX_BASES):
        try:
            base = getattr(owner, "base", None)
            if base is None or base is owner or getattr(base, "nbytes", None) is None:
                break
        except Exception:  # noqa: BLE001 - the object's own property: the walk ends here
            break
        owner = base
    try:
        nbytes = getattr(owner, "nbytes", None)
        if type(nbytes) is not int:  # an array's own is one: as_int() only for the others
            nbytes = as_int(nbytes) or 0
    except Exception:  # noqa: BLE001 - the object's own property or __index__: counted as none
        nbytes = 0
    return owner, max(nbytes, 0)


def let_go_kept(may_drop: Callable[[], bool] | None) -> None:
    """Let go of what pins kept (:meth:`GraphPin.keep`) for graphs gone since. What a pin keeps that may free device
    memory as it is dropped (``GraphPin.frees``: ``cudaFree``, with an allocator that keeps no pool, which a CUDA graph
    capture under way forbids) goes only where ``may_drop()`` (asked only where there is some) says no capture is
    under way; ``None``: one is (a keep's). A later call lets go of it. The arenas' trim, stats and growth, and the
    end of a :func:`wsarena.capture` block, run this (:func:`~wsarena.arena._lifecycle.release_closed`), and an eager
    lease that finds a pin of :data:`freeing` posted (:func:`~wsarena.arena._lifecycle.let_go_posted`); so does the
    first keep of each pin, with ``None``.

    No lock of wsarena's while the objects go (an array's free may call CUDA). Each pin is let go of in idempotent
    steps, taken off the list last: two callers at once, or a call after one that an interrupt cut short, end the
    same."""
    pins = list(_keeping.values())  # list(): one C call, whatever other threads do
    if may_drop is None:
        pins = [pin for pin in pins if not pin.frees]
    posted = [pin for pin in pins if not pin.live()]
    # A list, not a generator any() leaves suspended: Ctrl-C as such a generator is closed is lost (ignored).
    if [pin for pin in posted if pin.frees] and (may_drop is None or not may_drop()):
        posted = [pin for pin in posted if not pin.frees]
    for pin in posted:
        if pin.tally is not None:
            pin.tally.uncount(pin)
        pin.kept.clear()
        _keeping.pop(id(pin), None)
        if pin.frees:
            with contextlib.suppress(ValueError):  # taken off by posted_in_turn, or by another caller
                freeing.remove(pin)


def posted_in_turn() -> bool:
    """Whether the pin whose turn it is, of those that keep what may free device memory as it goes (:data:`freeing`,
    one looked at every :data:`LOOK_EVERY` calls, the next one at the next look), was posted: what it keeps may be
    let go once no capture is under way. An entry of a pin let go already is taken off. (A C call or two each look:
    ``sem_getvalue``, where the pin was not seen posted yet.)"""
    if not next(_looks):
        return False
    try:
        pin = freeing[0]
        freeing.rotate(-1)
    except IndexError:  # another thread took the last one meanwhile
        return False
    if _keeping.get(id(pin)) is not pin:
        with contextlib.suppress(ValueError):
            freeing.remove(pin)
        return False
    return not pin.live()


def _after_fork_in_child() -> None:
    # What the parent's pins keep is the parent's device memory: let go of here, it would be freed through the array
    # library, which cannot use CUDA in the child, as the parent's workspace buffers are never freed there
    # (_lifecycle.keep_parents_memory). Kept for good; the child's own pins, if any, start afresh.
    _parents_keeping.append(dict(_keeping))
    _keeping.clear()
    freeing.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def free_posted() -> None:
    """Free the semaphores of collected pins that CUDA has posted or no graph was given (never one that CUDA may
    still post).

    No lock: this runs in finalizers too (an arena's, which the collector may run in the middle of this very loop).
    Each pin collected since the last look is taken off :data:`_collected` (one C call, which one caller alone wins)
    and its semaphore listed with those CUDA had not posted; each semaphore is claimed before it is looked at, by
    taking it off that list likewise, and put back if CUDA has not posted it yet. An interrupt in between loses 64
    bytes, never frees them twice.
    """
    while _collected:
        try:
            ref = _collected.popleft()
        except IndexError:  # another caller took the last one
            break
        address = ref.state[0]
        _held.pop(address, None)  # first: listed, it may be freed, and its address be a new pin's
        _unposted[address] = ref.state
    for address in list(_unposted):
        state = _unposted.pop(address, None)
        if state is None:  # another caller's now
            continue
        if not state[2] or _posted(state):
            _free(address)
        else:
            _unposted[address] = state
