"""Threads on lanes of their own, on one shared lane and on their default lanes, in debug mode (every live lease is
checked against the others for overlap, released bytes are poisoned): every result equals the serial run's, no
overlap is found, and the resident memory stays flat from round to round."""

import threading

import numpy as np
import pytest

import wsarena
from wsarena.arena import get_arena

RNG = np.random.default_rng(0)
SHAPES = [((2, 8, 16, 16), (8, 8, 3, 3), 1, 1), ((2, 16, 8, 8), (16, 16, 1, 1), 1, 0),
          ((2, 8, 16, 16), (16, 8, 3, 3), 2, 1)]
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


@pytest.mark.filterwarnings("ignore::wsarena.errors.MemoryFallbackWarning")  # fallbacks on purpose
def test_threads_under_memory_pressure_fall_back_with_a_trimming_thread_and_compute_right(monkeypatch):
    """The same calls in four threads on an arena whose provider grants 16 KiB at most, while another thread trims
    and reads the arena: the refused growths are recorded and deferred under contention, every call falls back to
    an algorithm that fits, and each result matches the float64 reference (float32: 1e-4)."""
    from wsarena.arena import Arena
    from wsarena.arena.testing import RecordingProvider
    from wsarena.backends._cpu_backend import CpuBackend

    from .reference import ref_conv_backward_data, ref_conv_backward_filter, ref_conv_forward

    refused = []
    provider = RecordingProvider(fail=lambda n: n > 16 << 10 and not refused.append(n))
    arena = Arena(provider)
    monkeypatch.setattr(CpuBackend, "arena", lambda self: arena)
    wsarena.configure(debug=True)
    want = []
    for x, w, dy, stride, padding in OPERANDS:
        x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
        want.append(ref_conv_forward(x64, w64, stride=stride, padding=padding))
        want.append(ref_conv_backward_data(dy64, w64, x.shape, stride=stride, padding=padding))
        want.append(ref_conv_backward_filter(x64, dy64, w.shape, stride=stride, padding=padding))
    errors, wrong = [], []
    done = threading.Event()

    def worker(t):
        try:
            for _ in range(5):
                for lane in (f"own-{t}", "shared", None):
                    for got, ref in zip(_calls(lane), want):
                        if not np.allclose(got, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max())):
                            wrong.append(lane)
        except Exception as exc:  # noqa: BLE001 - any escape is the failure this test looks for
            errors.append(exc)

    def trimmer():
        while not done.is_set():
            arena.trim()
            arena.stats()
            arena.defers_growth(1 << 20, stream="shared", fallback=0)

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    trimming = threading.Thread(target=trimmer)
    trimming.start()
    for each in workers:
        each.start()
    for each in workers:
        each.join(120)
    done.set()
    trimming.join(30)
    assert errors == [] and wrong == []
    assert refused  # the provider did refuse: the calls ran their fallbacks
    stats = arena.stats()
    assert stats.leases == 0 and provider.held_bytes == stats.capacity_bytes + stats.retired_bytes
