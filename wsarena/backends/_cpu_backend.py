"""The ``cpu`` backend: NumPy arrays, the GEMM convolutions of :mod:`wsarena.backends.cpu`."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..arena import get_arena
from . import Candidate, PartlyTimed, cpu

_OVERLAP_WORK = 10_000  # numpy.shares_memory's search budget for the exact overlap test


class CpuBackend:
    name = "cpu"
    retry_errors: tuple[type[BaseException], ...] = ()  # every CPU algorithm runs every geometry

    def device_label(self) -> str:
        return "cpu"

    def device_key(self) -> Any:
        return "cpu"

    def context(self, arrays: Sequence[Any], stream: Any) -> Any:
        return contextlib.nullcontext()

    def may_share_memory(self, a: Any, b: Any) -> bool:
        if not np.may_share_memory(a, b):  # disjoint bounds: the common case, in constant time
            return False
        # Overlapping bounds may still be disjoint elements (an output between strided input images). Solve
        # that exactly within a small budget; past it, count as shared (refusing is safe, corrupting is not).
        try:
            return bool(np.shares_memory(a, b, max_work=_OVERLAP_WORK))  # type: ignore[arg-type]  # stubs: -1, 0 only
        except np.exceptions.TooHardError:
            return True

    def arena(self) -> Any:
        return get_arena("cpu")

    def check_dtype(self, dtype: str) -> None:
        if dtype not in cpu.DTYPES:
            raise TypeError(f"the cpu backend computes in {' or '.join(cpu.DTYPES)}, not {dtype}")

    def empty(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    def graph_allocated(self, array: Any) -> bool:
        return False

    def frees_when_dropped(self, array: Any) -> bool:
        return False  # host memory

    def random(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.random.default_rng(0).standard_normal(shape, dtype=np.float32 if dtype == "float32" else np.float64)

    def candidates(self, pass_: str, geom: Any) -> list[Candidate]:
        return [Candidate(algo, cpu.workspace_size(pass_, algo, geom)) for algo in cpu.candidates(pass_, geom)]

    def algorithms(self, pass_: str) -> tuple[str, ...]:
        return cpu.ALGORITHMS[pass_]

    def workspace_size(self, pass_: str, algo: str, geom: Any) -> int:
        return cpu.workspace_size(pass_, algo, geom)

    def measure(
        self, pass_: str, geom: Any, a: Any, b: Any, out: Any, workspace: Any, candidates: Sequence[Candidate],
        stream: Any,
    ) -> list[Candidate]:
        timed, failed = [], []
        error: MemoryError | None = None
        for cand in candidates:
            start = time.perf_counter()
            try:
                cpu.run_unchecked(pass_, cand.algo, geom, a, b, out, workspace.array)
            except MemoryError as exc:  # NumPy's temporaries: the others may still be timed
                failed.append(cand)
                error = error or exc
                continue
            timed.append(Candidate(cand.algo, cand.workspace_bytes, (time.perf_counter() - start) * 1e3))
        timed.sort(key=lambda c: c.time_ms or 0.0)  # every one was just timed
        if error is not None:
            if not timed:
                raise error
            raise PartlyTimed(timed, failed) from error
        return timed

    def run(
        self, pass_: str, candidate: Candidate, geom: Any, a: Any, b: Any, out: Any, workspace: Any, stream: Any
    ) -> None:
        # The ops checked the arrays against geom and leased workspace_size bytes for this candidate.
        cpu.run_unchecked(pass_, candidate.algo, geom, a, b, out, workspace.array)
