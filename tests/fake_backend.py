"""A backend whose algorithms have known workspaces and times, so that the search cache and the tuning curve are
checked against numbers worked out by hand."""

from __future__ import annotations

import contextlib

import numpy as np

from wsarena.arena import Arena
from wsarena.arena.testing import RecordingProvider
from wsarena.backends import Candidate


class TableBackend:
    """``table[(pass, out_channels)]`` lists ``(algo, workspace_bytes, time_ms)`` for the layers with that many
    output channels, in heuristic order; ``measure`` reports exactly these times (``time_ms`` ``None``: the
    backend's search rejects that algorithm). ``measured`` records each timed ``(pass, out_channels)``."""

    name = "fake"
    retry_errors = ()

    def __init__(self, table, *, device="fake device 1", memory=None):
        self.table = table
        self.device = device
        self.measured = []
        fail = None if memory is None else (lambda nbytes: nbytes > memory)
        self._arena = Arena(RecordingProvider(fail=fail))

    def rows(self, pass_, geom):
        return self.table[(pass_, geom.out_channels)]

    def device_label(self):
        return self.device

    def device_key(self):
        return self.device

    def search_environment(self):
        return {"device": self.device}

    def arena(self):
        return self._arena

    def context(self, arrays, stream):
        return contextlib.nullcontext()

    def may_share_memory(self, a, b):
        return False

    def check_dtype(self, dtype):
        pass

    def random(self, shape, dtype):
        return np.zeros(shape, dtype="float32")

    def empty(self, shape, dtype):
        return np.zeros(shape, dtype="float32")

    def graph_allocated(self, array):
        return False

    def frees_when_dropped(self, array):
        return False

    def algorithms(self, pass_):
        return tuple(dict.fromkeys(a for (p, _), rows in self.table.items() if p == pass_ for a, _, _ in rows))

    def workspace_size(self, pass_, algo, geom):
        return next(n for a, n, _ in self.rows(pass_, geom) if a == algo)

    def candidates(self, pass_, geom):
        return [Candidate(a, n) for a, n, _ in self.rows(pass_, geom)]

    def measure(self, pass_, geom, a, b, out, workspace, candidates, stream):
        assert all(c.workspace_bytes <= workspace.nbytes for c in candidates)
        self.measured.append((pass_, geom.out_channels))
        times = {algo: ms for algo, _, ms in self.rows(pass_, geom)}
        timed = [Candidate(c.algo, c.workspace_bytes, times[c.algo]) for c in candidates if times[c.algo] is not None]
        return sorted(timed, key=lambda c: c.time_ms)

    def run(self, pass_, candidate, geom, a, b, out, workspace, stream):
        out[...] = 0

