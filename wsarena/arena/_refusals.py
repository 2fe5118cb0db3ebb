"""What an arena remembers of the growths its provider refused, so that a call with a fallback does not ask again on
every call.

Out of memory is seldom a passing state: a step whose convolution could not get R bytes of workspace will not get
them on its next call either, and asking again is not free. CuPy's memory pool answers a failed ``cudaMalloc`` by
freeing every cached block it holds, running Python's garbage collector and asking again; PyTorch's caching
allocator frees its whole cache, which synchronizes the device, before it raises. A convolution whose first choice
does not fit would pay that on every call, where the algorithm it falls back to costs microseconds (PyTorch keeps
the plan that ran after such a failure, and asks no more).

So the arena times each refusal. After a growth to R bytes or more is refused again (the second refusal in a row;
a single one costs nothing later), a caller that has a fallback is told not to ask for R or more
(:meth:`Arena.defers_growth`) for :data:`WAIT_FACTOR` times as long as that refusal took, doubled with each further
refusal in a row (what the pool's dropped cache costs the allocations after it is not in the refusal's own time, and
a workspace larger than the device is refused for ever), at most :data:`LONGEST_WAIT` seconds: asking then costs
about one percent of the time or less, whatever the model's size, and memory freed meanwhile is found within that
wait. A lease itself always asks, as does ``reserve``. A growth to R or more that the provider grants, or
``Arena.trim()`` (what a caller who has freed memory of their own may call), forgets the refusals; a refusal of a
smaller growth starts a record of its own.

One record per arena, not per stream: the memory is the device's (or the host's), whichever stream asks for it.
Every method runs with the arena's lock held.
"""

from __future__ import annotations

import time

__all__ = ["LONGEST_WAIT", "WAIT_FACTOR"]

WAIT_FACTOR = 100  # a wait this many times the refusal's own duration (doubled with each further one in a row)
LONGEST_WAIT = 60.0  # seconds: memory freed meanwhile is found within a minute, however slow the refusal

clock = time.monotonic  # what refusals are timed and waits measured by (a test may set its own)


class Refusals:
    """The smallest growth the provider refused since it last granted one as large (``nbytes``, 0: none), the
    refusals in a row of that size or more (``times``), and until when (``until``, by :data:`clock`) a caller with a
    fallback is told not to ask for as much."""

    __slots__ = ("nbytes", "times", "until")

    def __init__(self) -> None:
        self.nbytes = 0
        self.times = 0
        self.until = 0.0

    def refused(self, size: int, seconds: float, now: float) -> None:
        """The provider refused a growth to ``size`` bytes, in ``seconds``, ending at ``now``."""
        if not self.times or size < self.nbytes:  # the first refusal, or a smaller growth's: a record of its own
            self.nbytes, self.times = size, 0
        self.times += 1
        if self.times == 1:
            self.until = 0.0  # a single refusal costs nothing later
        else:
            doubled = 1 << min(self.times - 2, 30)
            self.until = now + min(WAIT_FACTOR * seconds * doubled, LONGEST_WAIT)

    def defers(self, size: int, now: float) -> bool:
        """Whether a caller with a fallback should not ask for a growth to ``size`` bytes at ``now``."""
        return self.times > 1 and size >= self.nbytes and now < self.until

    def granted(self, size: int) -> None:
        """The provider granted a growth to ``size`` bytes: a refusal of as much or less is forgotten."""
        if self.times and size >= self.nbytes:
            self.forget()

    def forget(self) -> None:
        self.nbytes = self.times = 0
        self.until = 0.0
