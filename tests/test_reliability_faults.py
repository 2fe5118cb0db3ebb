"""Out of memory, injected at every allocation of a ResNet-50-like forward and backward run, inside algorithms, and
for real under an address-space limit: every call either gives the right result (another algorithm ran) or raises
the documented ``NoAlgorithmFitsError``; afterwards no lease is live, the statistics agree with the provider, and
the next run succeeds."""

import numpy as np
import pytest

import wsarena
from wsarena import algos, ops
from wsarena.arena import Arena
from wsarena.arena.testing import RecordingProvider
from wsarena.backends import cpu
from wsarena.backends._cpu_backend import CpuBackend
from wsarena.errors import NoAlgorithmFitsError

from .reference import ref_conv_backward_data, ref_conv_backward_filter, ref_conv_forward
from .reliability import run_script

TOL = 1e-4  # float32 against the float64 reference, relative to the largest value


def _layers():
    """The first ResNet-50 layer of each kind (7x7/2 stem, 1x1, 3x3, 3x3/2, 1x1/2), on 1/8 of the image, batch 2."""
    seen, layers = set(), []
    for layer in wsarena.load_model("resnet50"):
        kind = (layer.weight_shape[2:], layer.stride)
        if kind in seen:
            continue
        seen.add(kind)
        _, c, h, w = layer.input_shape
        layers.append(((2, c, max(h // 8, 7), max(w // 8, 7)), layer.weight_shape, layer.stride, layer.padding))
    return layers


LAYERS = _layers()


def _operands():
    rng = np.random.default_rng(0)
    runs = []
    for x_shape, w_shape, stride, padding in LAYERS:
        x = rng.standard_normal(x_shape).astype(np.float32)
        w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32)
        dy = rng.standard_normal(ref_conv_forward(x[:1], w, stride=stride, padding=padding).shape[1:])
        dy = np.broadcast_to(dy, (x.shape[0], *dy.shape)).astype(np.float32)
        expected = (
            ref_conv_forward(x, w, stride=stride, padding=padding),
            ref_conv_backward_data(dy, w, x.shape, stride=stride, padding=padding),
            ref_conv_backward_filter(x, dy, w.shape, stride=stride, padding=padding),
        )
        runs.append((x, w, np.ascontiguousarray(dy), stride, padding, expected))
    return runs


RUNS = _operands()


def _step():
    """Forward, backward-data and backward-filter of every layer, the backward passes each on a lane of their own
    (as concurrent streams would be): the outcome of each call, in order."""
    outcomes = []
    for i, (x, w, dy, stride, padding, expected) in enumerate(RUNS):
        geometry = {"stride": stride, "padding": padding}
        calls = (
            (wsarena.conv_forward, (x, w), geometry),
            (wsarena.conv_backward_data, (dy, w, x.shape), {**geometry, "stream": f"data{i}"}),
            (wsarena.conv_backward_filter, (x, dy, w.shape), {**geometry, "stream": f"dw{i}"}),
        )
        for (op, args, kwargs), want in zip(calls, expected):
            try:
                got = op(*args, **kwargs)
            except NoAlgorithmFitsError:
                outcomes.append("typed error")
                continue
            error = np.abs(got - want).max() / np.abs(want).max()
            outcomes.append("correct" if error <= TOL else f"wrong by {error:.2e}")
    return outcomes


def _consistent(arena, provider):
    stats = arena.stats()
    assert stats.leases == 0
    assert stats.allocations - stats.frees == len(provider.held)
    assert stats.capacity_bytes + stats.retired_bytes == provider.held_bytes


class FailingNth(RecordingProvider):
    """Host memory whose ``n``-th allocation (counted from 1) raises MemoryError."""

    def __init__(self, n):
        super().__init__()
        self.n, self.calls = n, 0

        def fail(size):
            self.calls += 1
            return self.calls == self.n

        self.fail = fail


@pytest.mark.filterwarnings("ignore::wsarena.errors.MemoryFallbackWarning")  # fallbacks on purpose
@pytest.mark.parametrize("search", ["heuristic", "exhaustive"])
def test_a_failed_allocation_anywhere_in_a_run_falls_back_or_raises_the_typed_error(monkeypatch, search):
    monkeypatch.setenv("WSARENA_ALGO_SEARCH", search)
    n, survived, typed = 1, 0, 0
    while True:
        provider = FailingNth(n)
        arena = Arena(provider)
        monkeypatch.setattr(CpuBackend, "arena", lambda self, arena=arena: arena)
        algos.cache_clear()
        ops.records_clear()
        outcomes = _step()
        assert set(outcomes) <= {"correct", "typed error"}, (n, outcomes)
        _consistent(arena, provider)
        if provider.calls < n:  # the run made fewer allocations: every one of them has failed once
            break
        survived += outcomes.count("typed error") == 0
        typed += outcomes.count("typed error")
        assert set(_step()) == {"correct"}, n  # the next run succeeds
        _consistent(arena, provider)
        arena.close()
        assert provider.held == []
        n += 1
    assert n > 8  # the run did allocate, on many lanes


@pytest.mark.filterwarnings("ignore::wsarena.errors.MemoryFallbackWarning")  # fallbacks on purpose
def test_a_memory_error_inside_any_algorithm_falls_back(monkeypatch):
    """NumPy's own temporaries (implicit_gemm's are as large as the output) running out: the k-th algorithm run
    of the run raises MemoryError, for every k."""
    provider = RecordingProvider()
    arena = Arena(provider)
    monkeypatch.setattr(CpuBackend, "arena", lambda self: arena)
    real = cpu.run_unchecked
    k = 1
    while True:
        runs = 0

        def run(*args, k=k):
            nonlocal runs
            runs += 1
            if runs == k:
                raise MemoryError("Unable to allocate 306. MiB for an array")
            return real(*args)

        monkeypatch.setattr(cpu, "run_unchecked", run)
        outcomes = _step()
        assert set(outcomes) == {"correct"}, (k, outcomes)  # another algorithm always has the memory here
        _consistent(arena, provider)
        if runs < k:
            break
        k += 1
    assert k > len(LAYERS) * 3


def test_when_every_algorithm_runs_out_of_memory_the_error_is_typed_and_the_arena_usable(fresh_arena, monkeypatch):
    real = cpu.run_unchecked

    def run(*args):
        raise MemoryError("Unable to allocate 306. MiB for an array")

    monkeypatch.setattr(cpu, "run_unchecked", run)
    x, w = RUNS[1][0], RUNS[1][1]
    with pytest.raises(NoAlgorithmFitsError, match="out of memory") as info:
        wsarena.conv_forward(x, w)
    assert isinstance(info.value.__cause__, MemoryError)
    assert fresh_arena.stats().leases == 0
    monkeypatch.setattr(cpu, "run_unchecked", real)
    np.testing.assert_allclose(wsarena.conv_forward(x, w), ref_conv_forward(x, w), rtol=1e-4, atol=1e-4)


def test_under_a_real_memory_limit_the_convolution_falls_back():
    """An address-space limit that leaves 2 MiB: implicit_gemm's temporaries (6 MiB) cannot be had, and the tiled
    algorithm's 1 MiB workspace can. It used to end in NumPy's 'Unable to allocate 6.01 MiB'. The fallback is
    said once, at the script's line, and nothing else is written to stderr."""
    result = run_script("oom.py", 2)
    assert result.returncode == 0, result.stderr
    said = result.stderr.splitlines()
    assert len(said) == 2 and "oom.py" in said[0], result.stderr  # the warning's line, then the line's source
    assert "MemoryFallbackWarning: gemm_tiled" in said[0] and "in place of implicit_gemm" in said[0]
    assert "ran out of memory of its own" in said[0]
    found = __import__("json").loads(result.stdout)
    assert found["relative_error"] <= TOL and found["workspace_bytes"] > 0


def test_under_a_real_memory_limit_with_nothing_to_fall_back_to_the_error_is_typed():
    result = run_script("oom.py", 2, 0)  # cap 0: only implicit_gemm may run, and its temporaries do not fit
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("wsarena.errors.NoAlgorithmFitsError: out of memory"), result.stderr
