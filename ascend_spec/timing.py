"""Timing device work: wait until a device has run what was queued on it, and the median seconds of a call.
Warm-up's step costs for adaptive K and the benchmarks time through here; nothing here knows a model or a graph.
"""
from __future__ import annotations

import time
from typing import Callable

import torch


def wait_for(device: torch.device) -> None:
    """Block until ``device`` has run the work queued on it (a CUDA graph's or an NPU's replay returns at launch)."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def time_call(fn: Callable[[], object], repeats: int, device: torch.device | None = None) -> float:
    """Median seconds of ``repeats`` calls (after one untimed call), each until ``device`` has run what it queued (timed
    at launch, every K of a CUDA-graph step costs about the same)."""
    dev = device or torch.device("cpu")
    fn()
    wait_for(dev)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        wait_for(dev)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
