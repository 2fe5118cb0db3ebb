"""What a convolution captured into a CUDA graph allocates besides its workspace: the copies of operands that are not
C-contiguous, a result made without out=. Without a GPU: the CPU backend over a provider whose capture status the
test sets (wsarena.arena.testing), as tests/test_capture.py does."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import wsarena
from tests.reference import ref_conv_forward
from wsarena import ops
from wsarena.arena import Arena, set_arena
from wsarena.arena.testing import RecordingProvider

TOL = {"rtol": 1e-4, "atol": 1e-4}  # float32 against the float64 reference


@pytest.fixture
def provider():
    """The CPU backend's arena over a RecordingProvider, whose lanes the test captures."""
    provider = RecordingProvider()
    previous = set_arena("cpu", Arena(provider))
    yield provider
    set_arena("cpu", previous)


@pytest.fixture
def freed(monkeypatch):
    """What the ops make, logged as each is freed: "copy" (an operand's C-contiguous copy) or "result"."""
    log = []
    contiguous, new_output = ops._contiguous, ops._new_output

    def copy(array):
        made = contiguous(array)
        if made is not array:
            weakref.finalize(made, log.append, "copy")
        return made

    def output(record, empty):
        made = new_output(record, empty)
        weakref.finalize(made, log.append, "result")
        return made

    monkeypatch.setattr(ops, "_contiguous", copy)
    monkeypatch.setattr(ops, "_new_output", output)
    return log


def strided_operands():
    """x, a view of every other pixel, and w in Fortran order: each copied for a call."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 16, 16)).astype(np.float32)[:, :, ::2, ::2]
    w = np.asfortranarray(rng.standard_normal((4, 3, 3, 3)).astype(np.float32))
    return x, w


def reference(x, w):
    return ref_conv_forward(x.astype(np.float64), w.astype(np.float64), padding=1)


def test_a_first_call_during_capture_makes_no_copy_before_it_raises(provider, freed, monkeypatch):
    """A call whose algorithm cannot be chosen during a capture raises CaptureError before anything is enqueued: no
    copy of its operands either, whose copying kernel the graph would run. Once, the copies came first."""
    copies = []
    contiguous = ops._contiguous

    def counted(array):
        made = contiguous(array)
        if made is not array:
            copies.append(made.shape)
        return made

    monkeypatch.setattr(ops, "_contiguous", counted)
    x, w = strided_operands()
    graph = provider.begin_capture("lane")
    with pytest.raises(wsarena.CaptureError, match="run the step once before capturing"):
        wsarena.conv_forward(x, w, padding=1, stream="lane")
    provider.end_capture(graph)
    gc.collect()
    assert copies == [] and freed == ["result"]  # allocated, never written
    graph.close()
    wsarena.conv_forward(x, w, padding=1, stream="lane")
    assert copies == [x.shape, w.shape]
