"""A storm of interrupts into a loop of wsarena calls; prints what happened as one JSON object.

    python tests/scripts/storm.py MODE SOURCE SECONDS PERIOD_MS [MIN_DELIVERED]

MODE: ``lease`` (the caller's own ``with arena.lease(...) as ws:`` on one lane, in one frame), ``ops`` (forward and
backward-data convolutions on a lane and on the thread's default lane), ``contend`` (leases of a lane that two
other threads lease all the time), ``ops_contend`` (convolutions on that shared lane). SOURCE: ``thread`` (a
thread sends SIGINT to the process every PERIOD_MS) or ``itimer`` (``signal.setitimer`` raises SIGALRM, whose
handler raises KeyboardInterrupt as Ctrl-C does). The handler raises only while the loop is inside the code under
test (from entering a lease or a convolution to leaving it, two interrupts in a row included), where the loop
catches KeyboardInterrupt as a program that stops on Ctrl-C and goes on would; any other exception is counted.
Afterwards, in the same frame (``ws`` still bound), it counts the leases left live and checks that every lane
serves this thread and another one.

With MIN_DELIVERED, the storm goes on past SECONDS until that many interrupts have landed in the code under test
(30 s more at most): a loaded machine delivers fewer a second, and a storm that reached the loop only a few times
proves little.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import sys
import threading
import time

import numpy as np

import wsarena
from wsarena.arena import get_arena

MODE, SOURCE, SECONDS, PERIOD = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]) / 1000
MIN_DELIVERED = int(sys.argv[5]) if len(sys.argv) > 5 else 0
LONGEST = 30.0  # seconds past SECONDS that a storm short of MIN_DELIVERED may go on
LANES = ("L", "shared", None)
arena = get_arena("cpu")
x = np.random.default_rng(0).standard_normal((1, 2, 6, 6)).astype(np.float32)
w = np.random.default_rng(1).standard_normal((2, 2, 3, 3)).astype(np.float32)
delivered = 0
armed = False  # the loop is inside the code under test
errors: collections.Counter[str] = collections.Counter()
stop = threading.Event()
go = False  # the storm starts once the loop does


def interrupt(signum: int, frame: object) -> None:
    global delivered
    if armed:
        delivered += 1
        raise KeyboardInterrupt


def contender() -> None:
    while not stop.is_set():
        with arena.lease(4096, stream="shared") as ws:
            ws.array[:1] = 2
            time.sleep(0.0005)


def storm() -> None:
    me = os.getpid()
    while not go:
        time.sleep(0.001)
    while not stop.is_set():
        os.kill(me, signal.SIGINT)
        time.sleep(PERIOD)


def usable(lane: object) -> bool:
    """Whether another thread can lease ``lane`` (None: its own default lane) within 10 s."""
    done = []
    thread = threading.Thread(target=lambda: done.append(arena.lease(4096, stream=lane).__enter__().__exit__()))
    thread.start()
    thread.join(10)
    return done == [None]


def main() -> dict[str, object]:
    global go, armed
    lane = "shared" if "contend" in MODE else "L"
    iterations = 0
    ws = None
    for each in (lane, None):  # the first calls import, choose and cache: not what is under test
        wsarena.conv_forward(x, w, padding=1, stream=each)
        wsarena.conv_backward_data(x, w, input_shape=x.shape, padding=1, stream=each)
    contenders = [threading.Thread(target=contender) for _ in range(2 if "contend" in MODE else 0)]
    for thread in contenders:
        thread.start()
    end = time.monotonic() + SECONDS
    if SOURCE == "itimer":
        signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, PERIOD, PERIOD)
    else:
        signal.signal(signal.SIGINT, interrupt)
        sys.setswitchinterval(0.0005)  # the sending thread needs the GIL to send: let it have it often
        threading.Thread(target=storm, daemon=True).start()
    go = True
    while time.monotonic() < end or (delivered < MIN_DELIVERED and time.monotonic() < end + LONGEST):
        try:
            armed = True
            if MODE in ("lease", "contend"):
                with arena.lease(4096, stream=lane) as ws:
                    ws.array[:1] = 1
            else:
                wsarena.conv_forward(x, w, padding=1, stream=lane)
                wsarena.conv_backward_data(x, w, input_shape=x.shape, padding=1)
            armed = False
            iterations += 1
        except KeyboardInterrupt:
            armed = False  # no place between the raise and here where a signal handler runs
        except Exception as exc:  # noqa: BLE001 - counted: the figures say which
            armed = False
            errors[f"{type(exc).__name__}: {exc}"[:100]] += 1
    signal.setitimer(signal.ITIMER_REAL, 0)
    stop.set()
    for thread in contenders:
        thread.join()
    live = arena.stats().leases  # ws, the last Workspace, is still bound here
    own = 0
    for each in LANES:
        try:
            with arena.lease(4096, stream=each):
                own += 1
        except RuntimeError as exc:
            errors[f"after: {exc}"[:100]] += 1
    others = sum(usable(each) for each in LANES)
    del ws
    return {
        "mode": MODE, "source": SOURCE, "iterations": iterations, "delivered": delivered,
        "errors": dict(errors), "leases_live": live, "lanes": len(LANES), "usable_here": own,
        "usable_elsewhere": others,
    }


print(json.dumps(main()))
