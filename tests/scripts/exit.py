"""End a process in an odd state; before it ends, check that every lane serves another thread.

    python tests/scripts/exit.py CASE KIND

KIND: ``host`` (the cpu arena, convolutions) or ``device`` (an arena keyed by CUDA streams over host memory, whose
provider reports any double or foreign free, installed as device 0). CASE: ``live_lease`` (a lease never
released), ``threads_mid_call`` (daemon threads in the middle of leases and convolutions), ``after_close`` (the
arena closed, a new one made), ``exception`` (a ValueError propagates out of a lease, uncaught), ``interrupt``
(KeyboardInterrupt propagates out of a convolution, uncaught), ``exit_in_lease`` (``sys.exit(3)`` inside a lease),
``lock_held`` (a daemon thread holds the arena's lock, as a thread stopped inside its bookkeeping would).
Prints ``usable N/N`` (lanes that served another thread) before the process ends. For ``device``, an exit handler
that runs after wsarena's (registered before the first device arena, as CuPy's are) prints ``after exit: N held``
(device buffers not given back to the provider) and what a lease on a new stream got then (``refused: REASON`` or
``granted``); with ``lock_held`` only ``after exit`` (wsarena's handler leaves an arena whose lock it cannot take).
"""

from __future__ import annotations

import atexit
import sys
import threading
import time

import numpy as np

import wsarena
from wsarena.arena import Arena, get_arena, set_arena
from wsarena.arena.testing import RecordingProvider

CASE, KIND = sys.argv[1], sys.argv[2]
providers: list[RecordingProvider] = []


def device_arena() -> Arena:
    providers.append(RecordingProvider(device_id=0))
    set_arena(0, Arena(providers[-1]))
    return get_arena(0)


def after_exit() -> None:
    if CASE == "lock_held":
        print("after exit", flush=True)
        return
    if CASE == "threads_mid_call":  # the daemon threads go on leasing from the released arena: they end quietly
        for thread in threading.enumerate():
            if thread.daemon:
                thread.join(timeout=5.0)
        print(f"daemon threads running: {sum(t.daemon for t in threading.enumerate())}", flush=True)
    held = sum(len(provider.held) for provider in providers)
    try:
        with arena.lease(4096, stream=9):
            lease = "granted"
    except RuntimeError as exc:
        lease = f"refused: {exc}"
    print(f"after exit: {held} held, lease {lease}", flush=True)


if KIND == "device":
    atexit.register(after_exit)  # before wsarena registers its own, so it runs after it
    arena, lanes = device_arena(), [3, 4, None]
else:
    arena, lanes = get_arena("cpu"), ["a", "b", None]
x = np.random.default_rng(0).standard_normal((2, 4, 10, 10)).astype(np.float32)
w = np.random.default_rng(1).standard_normal((4, 4, 3, 3)).astype(np.float32)


def work(lane: object) -> None:
    if KIND == "host":
        wsarena.conv_forward(x, w, padding=1, stream=lane)
    with arena.lease(1 << 16, stream=lane) as ws:
        ws.array[:] = 1


def report() -> None:
    usable = []
    for lane in lanes:
        thread = threading.Thread(target=lambda lane=lane: (work(lane), usable.append(lane)))
        thread.start()
        thread.join(10)
    print(f"usable {len(usable)}/{len(lanes)}", flush=True)


for lane in lanes:
    work(lane)
if CASE == "live_lease":
    held = arena.lease(1 << 20, stream=lanes[0]).__enter__()
    held.array[:] = 3
    lanes = lanes[1:]  # the held lane waits for its lease, which outlives the process
    report()
elif CASE == "threads_mid_call":

    def zero_byte_leases(lane: object) -> None:  # as a call whose algorithm needs no workspace leases
        with arena.lease(0, stream=lane):
            pass

    def reserves(lane: object) -> None:
        arena.reserve(1 << 16, stream=lane)

    if KIND == "host":
        calls = [(work, "t1"), (work, "t2")]
    else:  # each way a device arena released at exit can be asked for memory
        calls = [(work, 5), (zero_byte_leases, 6), (reserves, 7)]
    for call, lane in calls:
        threading.Thread(target=lambda call=call, lane=lane: [call(lane) for _ in iter(int, 1)], daemon=True).start()
    time.sleep(0.05)
    report()
elif CASE == "after_close":
    arena.close()
    try:
        work(lanes[0])
        raise AssertionError("a closed arena leased")
    except RuntimeError:
        pass
    arena = device_arena() if KIND == "device" else get_arena("cpu")
    report()
elif CASE == "exception":
    report()
    with arena.lease(4096, stream=lanes[0]):
        raise ValueError("boom")
elif CASE == "interrupt":
    report()
    with arena.lease(4096, stream=lanes[0]):
        raise KeyboardInterrupt
elif CASE == "exit_in_lease":
    report()
    with arena.lease(4096, stream=lanes[0]):
        sys.exit(3)
elif CASE == "lock_held":
    report()
    taken = threading.Event()

    def hold() -> None:
        arena._lock.acquire()
        taken.set()
        threading.Event().wait()

    threading.Thread(target=hold, daemon=True).start()
    taken.wait(10)
