"""The GPU probes' own logic on the CPU, over stand-ins for the device: a probe that fails on a lent GPU machine
costs its run there, which no test here would otherwise catch."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from wsarena.arena.testing import RecordingProvider

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("probe_refusal_cost", ROOT / "bench" / "probe_refusal_cost.py")
assert _spec is not None and _spec.loader is not None
refusal_cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(refusal_cost)


def _fake_torch(total_memory: int, calls: list[str]) -> SimpleNamespace:
    cuda = SimpleNamespace(
        synchronize=lambda: calls.append("sync"),
        _sleep=lambda cycles: calls.append(f"sleep {cycles}"),
        get_device_properties=lambda device: SimpleNamespace(total_memory=total_memory),
    )
    return SimpleNamespace(cuda=cuda)


def test_the_refusal_probe_asks_more_than_the_device_has_after_queuing_work_and_gives_each_block_back():
    calls: list[str] = []
    provider = RecordingProvider(device_id=0, fail=lambda n: n > 1 << 30)  # a device of 1 GiB
    row = refusal_cost.probe(provider, _fake_torch(1 << 30, calls), blocks=3, block=4096, busy_cycles=7)
    assert set(row) == {"refusal_ms", "warm_ms", "after_ms"} and all(v >= 0 for v in row.values())
    assert len(provider.allocations) == 9 and provider.held == []  # three rounds of three blocks, all given back
    assert calls.index("sleep 7") < len(calls) - 2  # queued before the refusal, then the last round synchronizes


def test_the_refusal_probe_says_so_where_the_provider_grants_more_than_the_device_has():
    provider = RecordingProvider(device_id=0)
    with pytest.raises(RuntimeError, match="more than the device has"):
        refusal_cost.probe(provider, _fake_torch(1 << 20, []), blocks=1, block=4096, busy_cycles=0)


_spec = importlib.util.spec_from_file_location("bench_gpu_pressure", ROOT / "bench" / "bench_gpu_pressure.py")
assert _spec is not None and _spec.loader is not None
pressure = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pressure)


@pytest.mark.filterwarnings("ignore::wsarena.errors.MemoryFallbackWarning")  # fallbacks on purpose
def test_the_pressure_benchmark_compares_an_arena_that_remembers_with_one_that_asks_and_restores_the_gate(
    monkeypatch, refusal_clock
):
    """bench_gpu_pressure.py's measurement on the cpu backend: the provider refuses every first choice, each refusal
    taking 10 ms of the test's clock, which stands still. Each round runs on a new arena, closed and the pools reset
    after it: the arena that remembers asks in its warm-up step and in its first counted one, and not again; the
    other asks on every call that needs a growth; the gate is the arena's own again afterwards, also after a
    failure."""
    import numpy as np

    import wsarena
    from wsarena.arena import Arena, set_arena

    from .arena_helpers import refusing

    x = np.random.default_rng(0).standard_normal((2, 8, 16, 16))
    w = np.random.default_rng(1).standard_normal((8, 8, 3, 3))
    steps = []

    def make():
        provider = RecordingProvider()
        refusing(provider, refusal_clock, 0.01)
        return provider

    def step():
        steps.append(wsarena.conv_forward(x, w, padding=1, stream="lane"))

    installed, resets = [], []

    def install(arena):
        installed.append(arena)
        set_arena("cpu", arena)

    previous = set_arena("cpu", None)
    try:
        rows = pressure.measure(step, {"host": make}, install, lambda: None, lambda: resets.append(1), lambda: 7, 3, 2)
    finally:
        set_arena("cpu", previous)
    # a new arena each round: the warm-up step asks once, the first counted one again, then the wait holds
    assert rows["host, remembers"]["asks_per_step"] == round(2 / 6, 2) and rows["host, asks"]["asks_per_step"] == 1
    assert rows["host, asks"]["refusals_per_step"] == 1 and len(steps) == 2 * 2 * (1 + 3)
    assert len(installed) == len(set(map(id, installed))) == 4 and all(a.closed for a in installed)
    assert len(resets) == 4 and rows["host, asks"]["free_bytes_at_start"] == 7
    gate = vars(Arena)["refusing"]

    def failing():
        raise RuntimeError("the step failed")

    with pytest.raises(RuntimeError, match="the step failed"):
        pressure.measure(failing, {"host": make}, install, lambda: None, lambda: resets.append(1), lambda: 0, 1, 1)
    assert vars(Arena)["refusing"] is gate and installed[-1].closed and len(resets) == 5


class _SpinningDevice:
    """Stand-ins for the ``torch.cuda`` calls of bench_gpu_torch's GPU time: ``_sleep`` starts a spin that runs
    until something waits for the device (``synchronize``); an event recorded behind the spin is reached only then."""

    def __init__(self) -> None:
        self.spinning = False
        device = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.behind_spin = False

            def record(self, stream: object = None) -> None:
                self.behind_spin = device.spinning

            def query(self) -> bool:
                return not (self.behind_spin and device.spinning)

            def synchronize(self) -> None:
                device.spinning = False

            def elapsed_time(self, end: object) -> float:
                return 1.0

        self.Event = Event

    def sleep(self, cycles: int) -> None:
        self.spinning = True

    def synchronize(self) -> None:
        self.spinning = False


@pytest.mark.parametrize("waits", [False, True], ids=["issues only", "synchronises"])
def test_the_torch_benchmarks_gpu_time_is_the_gpus_own_only_where_the_step_waited_for_nothing(monkeypatch, waits):
    """bench_gpu_torch.py's GPU time is queued behind a spin. A step that synchronises in the middle has the GPU
    wait for the host after it, however short its issue time: its GPU time is said not to be the GPU's own."""
    torch = pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("bench_gpu_torch", ROOT / "bench" / "bench_gpu_torch.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    device = _SpinningDevice()
    for name, value in (("Event", device.Event), ("_sleep", device.sleep), ("synchronize", device.synchronize),
                        ("current_stream", lambda: None)):
        monkeypatch.setattr(torch.cuda, name, value)

    def step() -> None:
        if waits:
            torch.cuda.synchronize()  # as a .item(), a copy to the host or a cudaDeviceSynchronize would

    gpu, spin, own = bench.gpu_ms(step)
    assert (gpu, spin) == (1.0, 1.0) and own is not waits and not device.spinning
