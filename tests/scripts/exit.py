"""End a process in an odd state; before it ends, check that every lane serves another thread.

    python tests/scripts/exit.py CASE KIND

KIND: ``host`` (the cpu arena, convolutions) or ``device`` (an arena keyed by CUDA streams over host memory, whose
provider reports any double or foreign free, installed as device 0). CASE: ``live_lease`` (a lease never
released), ``threads_mid_call`` (daemon threads in the middle of leases and convolutions), ``after_close`` (the
arena closed, a new one made), ``exception`` (a ValueError propagates out of a lease, uncaught), ``interrupt``
(KeyboardInterrupt propagates out of a convolution, uncaught), ``exit_in_lease`` (``sys.exit(3)`` inside a lease).
Prints ``usable N/N`` (lanes that served another thread) before the process ends.
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np

import wsarena
from wsarena.arena import Arena, get_arena, set_arena
from wsarena.arena.testing import RecordingProvider

CASE, KIND = sys.argv[1], sys.argv[2]
if KIND == "device":
    set_arena(0, Arena(RecordingProvider(device_id=0)))
    arena, lanes = get_arena(0), [3, 4, None]
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
    for lane in ("t1", "t2") if KIND == "host" else (5, 6):
        threading.Thread(target=lambda lane=lane: [work(lane) for _ in iter(int, 1)], daemon=True).start()
    time.sleep(0.05)
    report()
elif CASE == "after_close":
    arena.close()
    try:
        work(lanes[0])
        raise AssertionError("a closed arena leased")
    except RuntimeError:
        pass
    if KIND == "device":
        set_arena(0, Arena(RecordingProvider(device_id=0)))
    arena = get_arena(0 if KIND == "device" else "cpu")
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
