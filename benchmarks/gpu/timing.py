"""Device time of a callable on a GPU: CUDA events around each call, the median of several."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def median_ms(run: Callable[[], object], repeats: int) -> float:
    """Milliseconds of device time per call of `run` (typically a CUDA graph's replay), median over `repeats`."""
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)
