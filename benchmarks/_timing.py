"""Shared timing helper of the benchmark scripts (run as ``python benchmarks/<name>.py``, so
this directory is on ``sys.path``)."""

from __future__ import annotations

import statistics
import time

import torch


def sync(device: torch.device) -> None:
    """Wait for queued CUDA work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_ms(step, device: torch.device, warmup: int, repeats: int):
    """Median wall time of ``step()`` in ms over ``repeats`` calls after ``warmup`` calls, and
    the CUDA peak memory (MiB) of the timed calls (``None`` on CPU)."""
    for _ in range(warmup):
        step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
    return statistics.median(times), peak


def median_us(fn, reps: int) -> float:
    """Median wall time of ``fn()`` in µs over ``reps`` calls (host work: no CUDA sync)."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)
