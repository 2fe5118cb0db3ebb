"""The GPU probes' own logic on the CPU, over stand-ins for the device: a probe that fails on a lent GPU machine
costs its run there, which no test here would otherwise catch."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Self

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


def _bench_gpu_torch():
    spec = importlib.util.spec_from_file_location("bench_gpu_torch", ROOT / "bench" / "bench_gpu_torch.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.parametrize("waits", [False, True], ids=["issues only", "synchronises"])
def test_the_torch_benchmarks_gpu_time_is_the_gpus_own_only_where_the_step_waited_for_nothing(monkeypatch, waits):
    """bench_gpu_torch.py's GPU time is queued behind a spin. A step that synchronises in the middle has the GPU
    wait for the host after it, however short its issue time: its GPU time is said not to be the GPU's own."""
    torch = pytest.importorskip("torch")
    bench = _bench_gpu_torch()
    device = _SpinningDevice()
    for name, value in (("Event", device.Event), ("_sleep", device.sleep), ("synchronize", device.synchronize),
                        ("current_stream", lambda: None)):
        monkeypatch.setattr(torch.cuda, name, value)

    def step() -> None:
        if waits:
            torch.cuda.synchronize()  # as a .item(), a copy to the host or a cudaDeviceSynchronize would

    gpu, spin, own = bench.gpu_ms(step)
    assert (gpu, spin) == (1.0, 1.0) and own is not waits and not device.spinning


class _FakeProfile:
    """Stands for ``torch.profiler.profile``: runs the block, then answers ``events()`` and ``key_averages()`` with
    what it was given; ``fails``: entering it raises, as where CUPTI cannot start."""

    def __init__(self, events: list, averages: list, fails: bool = False) -> None:
        self.given, self.averages, self.fails, self.activities = events, averages, fails, []

    def __call__(self, activities: list) -> Self:
        self.activities.append(set(activities))
        return self

    def __enter__(self) -> Self:
        if self.fails:
            raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def events(self) -> list:
        return self.given

    def key_averages(self) -> list:
        return self.averages


def _profiled(torch, fails: bool = False) -> _FakeProfile:
    """A step's profile: kernels, a copy on the device, the device's side of ``Optimizer.step``'s record_function
    range (a user annotation, no kernel), and the host's calls into the CUDA runtime and driver among its ops."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, device, us, annotation=False):
        return SimpleNamespace(name=name, device_type=device, device_time_total=us, is_user_annotation=annotation)

    events = [event("gemm", cuda, 100.0), event("conv", cuda, 120.0), event("gemm", cuda, 50.0),
              event("Memcpy DtoD (Device -> Device)", cuda, 5.0), event("aten::mm", cpu, 150.0),
              event("Optimizer.step#SGD.step", cuda, 1000.0, annotation=True)]
    averages = [SimpleNamespace(key=key, count=n, device_type=device) for key, n, device in (
        ("cudaStreamSynchronize", 3, cpu), ("cudaMemcpyAsync", 2, cpu), ("cuMemAlloc_v2", 1, cpu),
        ("cudaLaunchKernel", 40, cpu), ("aten::copy_", 2, cpu), ("Optimizer.step#SGD.step", 1, cpu),
        ("Memcpy DtoD (Device -> Device)", 1, cuda))]
    return _FakeProfile(events, averages, fails)


def test_the_torch_benchmarks_profile_counts_the_kernels_and_the_calls_that_wait_copy_or_allocate(monkeypatch):
    """The profiled step's kernels (a copy on the device among them; the device's side of a record_function range
    not: it spans kernels) and the host's calls into CUDA that synchronise, copy or allocate, by name: not its
    launches, not its operators, not a copy on the device. The profile records the host too, where those calls are."""
    torch = pytest.importorskip("torch")
    bench = _bench_gpu_torch()
    prof, steps = _profiled(torch), []
    monkeypatch.setattr(torch.profiler, "profile", prof)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    result = bench.profile_step(lambda: steps.append(1), 2)
    assert steps == [1] and prof.activities == [{torch.profiler.ProfilerActivity.CPU,
                                                 torch.profiler.ProfilerActivity.CUDA}]
    assert result == {
        "kernels": [{"kernel": "gemm", "gpu_ms": 0.15, "calls": 2}, {"kernel": "conv", "gpu_ms": 0.12, "calls": 1}],
        "kernel_count": 4, "kernel_ms": 0.275,
        "api_calls": {"cudaStreamSynchronize": 3, "cudaMemcpyAsync": 2, "cuMemAlloc_v2": 1},
    }


@pytest.mark.filterwarnings("ignore:CUDA is not available:UserWarning")  # the profile keeps to the host here
def test_the_torch_benchmarks_profile_reads_torch_profilers_own_results_and_finds_nothing_on_the_host():
    """profile_step over the real torch.profiler, on the CPU: the attributes it reads exist on its events and on
    key_averages()' entries, and a step of PyTorch's host operators (Optimizer.step's range among them) has no
    kernel and no call into CUDA."""
    torch = pytest.importorskip("torch")
    bench = _bench_gpu_torch()
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        bench.train_step(model, opt, torch.randn(2, 4), torch.tensor([0, 2]), None)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "synchronize", lambda: None)
        result = bench.profile_step(step, 3)
    assert result == {"kernels": [], "kernel_count": 0, "kernel_ms": 0.0, "api_calls": {}}


def test_the_torch_benchmark_counts_the_arenas_growth_over_its_timed_steps_and_prints_the_profile(monkeypatch,
                                                                                                  capsys):
    """bench_gpu_torch.measure on the CPU, over stand-ins for the device, an arena and the profiler: a wsarena row
    has what the arena allocated and grew during the timed steps alone (not the warm-up's, not the steps after),
    with the profile beside; a PyTorch row has no arena counts, and a profiler that cannot start leaves its timings.
    The table prints each, and a row that failed."""
    torch = pytest.importorskip("torch")
    bench = _bench_gpu_torch()
    device = _SpinningDevice()
    for name, value in (("Event", device.Event), ("_sleep", device.sleep), ("synchronize", device.synchronize),
                        ("current_stream", lambda: None), ("reset_peak_memory_stats", lambda: None),
                        ("max_memory_allocated", lambda: 3 << 20), ("max_memory_reserved", lambda: 5 << 20)):
        monkeypatch.setattr(torch.cuda, name, value)
    counters = {"allocations": 0, "growths": 0}
    stats = SimpleNamespace(high_water_bytes=1 << 20, capacity_bytes=2 << 20)
    arena = SimpleNamespace(provider=object(), stats=lambda: SimpleNamespace(**counters, **vars(stats)))
    monkeypatch.setattr(bench, "wsarena", SimpleNamespace(get_arena=lambda device: arena))
    forwards = []
    model = torch.nn.Linear(4, 3)

    def forward_allocates(module: object, inputs: object) -> None:  # every step allocates, the 1st and 3rd grow
        forwards.append(1)
        counters["allocations"] += 1
        counters["growths"] += len(forwards) in (1, 3)

    model.register_forward_pre_hook(forward_allocates)
    args = SimpleNamespace(warmup=2, steps=3, kernels=2)
    x, target = torch.randn(2, 4), torch.tensor([0, 2])
    monkeypatch.setattr(torch.profiler, "profile", _profiled(torch))
    row = bench.measure("wsarena", model, x, target, args, None, probe=False)
    # warm-up 2, timed 3, the GPU time's 3, the profile's 1: the timed steps are the 3rd to the 5th
    assert len(forwards) == 9 and (row["arena_allocations"], row["arena_growths"]) == (3, 1)
    assert row["kernel_count"] == 4 and row["api_calls"]["cudaStreamSynchronize"] == 3
    assert (row["workspace_peak_bytes"], row["arena_bytes"]) == (1 << 20, 2 << 20)
    monkeypatch.setattr(torch.profiler, "profile", _profiled(torch, fails=True))
    torch_row = bench.measure("torch", torch.nn.Linear(4, 3), x, target, args, None, probe=True)
    assert "arena_growths" not in torch_row and torch_row["kernels_error"].startswith("RuntimeError: CUPTI")
    assert torch_row["conv_calls"] == 0 and torch_row["step_ms"] >= 0
    bench.print_summary([torch_row, row, {"name": "wsarena legacy", "error": "CudnnError: not supported"}])
    out = capsys.readouterr().out
    assert "torch: not profiled: RuntimeError: CUPTI_ERROR_NOT_INITIALIZED" in out
    assert ("wsarena: 4 kernels, 0.3 GPU ms; calls that synchronise, copy or allocate: cuMemAlloc_v2 x1, "
            "cudaMemcpyAsync x2, cudaStreamSynchronize x3\n  0.15 ms x2 gemm; 0.12 ms x1 conv\n") in out
    assert "wsarena legacy   failed: CudnnError: not supported" in out
    assert out.rstrip().endswith("arena over the timed steps (0 expected: the warm-up grew it): wsarena 3 allocations, "
                                 "1 growths")


def test_the_device_calls_benchmark_counts_each_way_of_calling_as_bench_results_gives_them(monkeypatch):
    """bench_device_calls.py without a GPU (gpu_check.py runs it with --gpu on one, its counts first): each backend,
    way of calling and pass is counted on the CuPy stand-in, with the counts bench/RESULTS.md gives for a cached
    call."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the checkout and tools/ first as it loads
    spec = importlib.util.spec_from_file_location("bench_device_calls", ROOT / "bench" / "bench_device_calls.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    found = bench.counts(2)
    assert set(found) == {"graph", "legacy"}
    # per way: cudaGetDevice, cudaSetDevice, CuPy Streams entered, cudaStreamIsCapturing per cached call
    expected = {"stream=None, out=": (1, 0, 0, 1), "stream=None": (1, 0, 0, 1),
                "stream=None, out=, cap 0": (1, 0, 0, 1), "stream=s": (3, 0, 1, 1), "with s: stream=s": (1, 0, 0, 1),
                "operands on device 1": (2, 2, 0, 1),
                # through wsarena._interop: CUDA tensors of PyTorch's, arrays with __cuda_array_interface__ alone
                "torch, stream=None, out=": (1, 0, 0, 1), "torch, stream=None": (2, 0, 0, 1),
                "torch, stream=None, out=, a side stream current": (4, 0, 1, 1),
                "torch, operands on device 1": (2, 2, 0, 1), "torch, stream=s": (8, 4, 1, 1),  # s entered as given
                "cuda_array_interface, stream=None, out=": (1, 0, 0, 1), "cuda_array_interface, stream=s": (4, 0, 1, 1),
                "cuda_array_interface, with s: stream=s": (3, 0, 1, 1)}
    torch = importlib.util.find_spec("torch") is not None  # the PyTorch ways are counted where it is installed
    ways = [way for way in bench.ALL_WAYS if torch or not way.startswith("torch")]
    for per_way in found.values():
        assert list(per_way) == ways and set(expected) == set(bench.ALL_WAYS)
        for way, per_pass in per_way.items():
            assert list(per_pass) == ["fwd", "bwd_data", "bwd_filter"]
            for calls in per_pass.values():
                names = ("cudaGetDevice", "cudaSetDevice", "cupy.cuda.Stream.__enter__", "cudaStreamIsCapturing")
                assert tuple(calls.get(name, 0) for name in names) == expected[way], (way, calls)
