"""Round-robin timing shared by the micro-benchmarks in this folder."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds per callable, timing them round-robin so machine noise hits every contender alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}
