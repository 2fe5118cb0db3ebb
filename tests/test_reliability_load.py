"""Threads on lanes of their own, on one shared lane and on their default lanes, in debug mode (every live lease is
checked against the others for overlap, released bytes are poisoned): every result equals the serial run's, no
overlap is found, and the resident memory stays flat from round to round."""

import threading

import numpy as np

import wsarena
from wsarena.arena import get_arena

RNG = np.random.default_rng(0)
SHAPES = [((2, 8, 16, 16), (8, 8, 3, 3), 1, 1), ((2, 16, 8, 8), (16, 16, 1, 1), 1, 0), ((2, 8, 16, 16), (16, 8, 3, 3), 2, 1)]
OPERANDS = []
for x_shape, w_shape, stride, padding in SHAPES:
    x = RNG.standard_normal(x_shape).astype(np.float32)
    w = RNG.standard_normal(w_shape).astype(np.float32)
    y_shape = wsarena.conv_forward(x, w, stride=stride, padding=padding).shape
    OPERANDS.append((x, w, RNG.standard_normal(y_shape).astype(np.float32), stride, padding))


def _calls(lane):
    """Every pass of every layer on ``lane``."""
    results = []
    for x, w, dy, stride, padding in OPERANDS:
        results.append(wsarena.conv_forward(x, w, stride=stride, padding=padding, stream=lane))
        results.append(wsarena.conv_backward_data(dy, w, x.shape, stride=stride, padding=padding, stream=lane))
        results.append(wsarena.conv_backward_filter(x, dy, w.shape, stride=stride, padding=padding, stream=lane))
    return results


def _resident_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def load(threads=4, rounds=6):
    """Run the load; return ``(calls, overlaps, mismatches, resident bytes after each round)``."""
    serial = _calls("serial")
    counts = {"calls": 0, "overlaps": 0, "mismatches": 0}
    lock = threading.Lock()
    resident = []

    def worker(t):
        for lane in (f"own-{t}", "shared", None):
            try:
                results = _calls(lane)
            except AssertionError:  # debug mode found two live leases overlapping
                with lock:
                    counts["overlaps"] += 1
                continue
            mismatches = sum(not np.array_equal(a, b) for a, b in zip(results, serial))
            with lock:
                counts["calls"] += len(results)
                counts["mismatches"] += mismatches

    for _ in range(rounds):
        workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
        for each in workers:
            each.start()
        for each in workers:
            each.join(60)
        resident.append(_resident_bytes())
    return counts["calls"], counts["overlaps"], counts["mismatches"], resident


def test_threads_on_own_and_shared_lanes_match_the_serial_run_with_flat_memory():
    wsarena.configure(debug=True)
    calls, overlaps, mismatches, resident = load()
    assert calls == 4 * 6 * 3 * 3 * len(SHAPES)
    assert overlaps == 0 and mismatches == 0
    assert max(resident[2:]) <= resident[1] + (16 << 20), [r >> 20 for r in resident]  # MiB, round by round
    stats = get_arena("cpu").stats()
    assert stats.leases == 0
    # the lanes of the exited workers were swept with their threads: the named lanes and this thread's are left
    assert len(stats.streams) <= 4 + 1 + 1 + 1
