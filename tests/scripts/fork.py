"""Fork while other threads are inside wsarena; prints what happened as one JSON object.

    python tests/scripts/fork.py SCENARIO FORKS

``busy``: four threads run convolutions on lanes of their own and on their default lanes; the process forks
FORKS times; each child runs the same convolutions on the same lanes, checks them against the parent's results
and exits 0. ``held``: at each fork one thread holds a lease on a lane (inside its ``with`` block) and another is
growing a second lane (its allocation waits); the child leases both lanes. ``device``: a device arena (host memory
standing in for a GPU's) holds a live lease and a reserved stream at the fork; the child must not give the parent's
buffers to the provider (not in trim, close, collection or exit), and leases and ``get_arena(0)`` say why they
cannot be had. ``first``: in this fresh process (``import wsarena`` done, no convolution yet), four threads start
their first convolution and the process forks FORKS times at once, 1 ms apart, while they are inside it (the first
call is where modules imported on first use would be imported); each child runs one convolution, checks it against
the float64 reference and exits 0. A child that has not exited within 10 s is killed and counted as a hang.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import warnings

import numpy as np

import wsarena
from wsarena.arena import Arena, HostProvider, get_arena, set_arena

SCENARIO, FORKS = sys.argv[1], int(sys.argv[2])
warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+ warns about fork() in a threaded process
rng = np.random.default_rng(0)
x = rng.standard_normal((2, 8, 12, 12)).astype(np.float32)
w = rng.standard_normal((8, 8, 3, 3)).astype(np.float32)
LANES = ["L0", "L1", "L2", "L3", None]
if SCENARIO == "first":
    from tests.reference import ref_conv_forward  # NumPy only: the process makes no convolution before the forks

    reference = ref_conv_forward(x, w, padding=1)


def convolve(lane: object) -> np.ndarray:
    y = wsarena.conv_forward(x, w, padding=1, stream=lane)
    return wsarena.conv_backward_data(y, w, input_shape=x.shape, padding=1, stream=lane)


expected = convolve(None) if SCENARIO != "first" else None


def child_first() -> int:
    y = wsarena.conv_forward(x, w, padding=1)
    return 0 if np.abs(y - reference).max() <= 1e-5 * np.abs(reference).max() else 1


def child_busy() -> int:
    for lane in LANES:
        if not np.array_equal(convolve(lane), expected):
            return 1
    return 0


class GatedProvider(HostProvider):
    """Host memory whose allocations wait for ``gate`` while ``slow`` is set."""

    def __init__(self) -> None:
        self.slow = False
        self.gate = threading.Event()

    def allocate(self, size: int, *, stream: object = None) -> object:
        if self.slow:
            self.gate.wait(10)
        return super().allocate(size, stream=stream)


def child_held(arena: Arena, provider: GatedProvider) -> int:
    provider.slow = False  # the gate's own lock may be held by a thread that does not exist here
    for lane in ("held", "growing", None):
        with arena.lease(1 << 20, stream=lane) as ws:
            ws.array[:] = 1
    return 0 if arena.stats().leases == 0 else 1


PARENT = os.getpid()


class Recording(HostProvider):
    """Host memory standing in for a GPU's; a free in a child is reported on stderr (it must free nothing)."""

    device_id = 0

    def current_stream(self) -> int:
        return 0

    def deallocate(self, buffer: object, *, stream: object = None) -> None:
        if os.getpid() != PARENT:
            print(f"a forked child freed the parent's {buffer!r}", file=sys.stderr, flush=True)
        super().deallocate(buffer, stream=stream)


def child_device(arena: Arena) -> int:
    import gc

    from wsarena.errors import BackendUnavailableError

    try:
        with arena.lease(4096, stream=3):
            return 1
    except RuntimeError as exc:
        if "forked" not in str(exc):
            return 1
    try:
        get_arena(0)
        return 1
    except BackendUnavailableError as exc:
        if "forked" not in str(exc):
            return 1
    arena.trim()
    arena.close()
    gc.collect()
    with get_arena("cpu").lease(4096):  # the host arena still works
        pass
    sys.exit(0)  # through atexit, which releases device arenas in the parent: here it must free nothing


def run_child(body: object, *args: object) -> None:
    try:
        code = body(*args)  # type: ignore[operator]
    except SystemExit as exc:
        raise SystemExit(exc.code) from None
    except BaseException:  # noqa: BLE001 - any failure is the child's exit status
        import traceback

        traceback.print_exc()
        code = 1
    os._exit(code)


def _wait(pid: int, deadline: float) -> tuple[bool, int]:
    """(hung, exit status) of child ``pid``, killed if still running at ``deadline``."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return False, status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return True, 0
        time.sleep(0.002)


def _fork_at_once() -> tuple[int, int, int]:
    """FORKS children 1 ms apart, from the moment the threads start, then wait for them all."""
    pids = []
    for _ in range(FORKS):
        pid = os.fork()
        if pid == 0:
            run_child(child_first)
        pids.append(pid)
        time.sleep(0.001)
    deadline = time.monotonic() + 10
    results = [_wait(pid, deadline) for pid in pids]
    return len(pids), sum(h for h, _ in results), sum(code != 0 for h, code in results if not h)


def main() -> dict[str, object]:
    stop = threading.Event()
    threads: list[threading.Thread] = []
    arena = provider = None
    if SCENARIO == "busy":
        def busy(lane: object) -> None:
            while not stop.is_set():
                convolve(lane)
                convolve(None)

        threads = [threading.Thread(target=busy, args=(lane,)) for lane in LANES[:4]]
    elif SCENARIO == "held":
        provider = GatedProvider()
        arena = Arena(provider)
        set_arena("cpu", arena)

        def hold() -> None:
            while not stop.is_set():
                with arena.lease(1 << 20, stream="held"):
                    time.sleep(0.002)

        def grow() -> None:
            n = 1 << 20
            while not stop.is_set():
                n += 1 << 16
                arena.reserve(n, stream="growing")
                if n > 4 << 20:  # start again small: every reserve grows the lane
                    n = 1 << 20
                    arena.trim()

        provider.slow = True
        threads = [threading.Thread(target=hold), threading.Thread(target=grow)]
    elif SCENARIO == "device":
        arena = Arena(Recording())
        set_arena(0, arena)
        live = arena.lease(4096, stream=3).__enter__()
        arena.reserve(1 << 20, stream=4)
    else:
        threads = [threading.Thread(target=convolve, args=(lane,)) for lane in LANES[:4]]
    for thread in threads:
        thread.start()
    if SCENARIO == "first":
        forks, hangs, failed = _fork_at_once()
    else:
        time.sleep(0.05)
        forks = hangs = failed = 0
        for _ in range(FORKS):
            if provider is not None:
                provider.gate.clear()
                threading.Timer(0.003, provider.gate.set).start()
            pid = os.fork()
            if pid == 0:
                if SCENARIO == "busy":
                    run_child(child_busy)
                elif SCENARIO == "held":
                    run_child(child_held, arena, provider)
                else:
                    run_child(child_device, arena)
            forks += 1
            hung, code = _wait(pid, time.monotonic() + 10)
            hangs += hung
            failed += code != 0
    stop.set()
    if provider is not None:
        provider.slow = False
        provider.gate.set()
    for thread in threads:
        thread.join()
    if SCENARIO == "device":
        live.__exit__(None, None, None)
    return {"scenario": SCENARIO, "forks": forks, "hangs": hangs, "failed": failed}


print(json.dumps(main()), flush=True)
