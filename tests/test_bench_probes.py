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
