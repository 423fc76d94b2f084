"""The one way work is timed here: warm up, synchronise the device around each run, keep the times.

CUDA runs kernels asynchronously, so a clock read right after a launch measures the launch: each
timed run sits between two :func:`mooncake_kernels.device.sync` calls (a no-op off CUDA). Self-profiling
(``instance/profile.py``) and the benchmarks (``bench/model/measure.py``,
``bench/model/gpu_roofs.py``, the memcpy reference of ``bench/store/summary.py``) all time through :func:`run_times` or :func:`best_seconds`; on a shared machine the best run is the
one least disturbed by others, so that is what is compared with roofs and fitted.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from mooncake_kernels.device import sync


def timed(fn: Callable[[], object], device: torch.device | str | None,
          clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of one call of ``fn``, the device synchronised before and after it."""
    sync(device)   # work queued earlier must not be counted
    t0 = clock()
    fn()
    sync(device)   # nor only the launch of this
    return clock() - t0


def run_times(fn: Callable[[], object], device: torch.device | str | None, repeats: int, *,
              warmup: int = 0, clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """``warmup`` untimed calls (first calls pay allocation and thread start-up), then the
    seconds of each of ``repeats`` timed ones."""
    for _ in range(warmup):
        fn()
    return [timed(fn, device, clock) for _ in range(repeats)]


def best_seconds(fn: Callable[[], object], device: torch.device | str | None, repeats: int, *,
                 warmup: int = 0, clock: Callable[[], float] = time.perf_counter) -> float:
    """The fastest of :func:`run_times`."""
    return min(run_times(fn, device, repeats, warmup=warmup, clock=clock))
