"""Time limits for tests that scale with how slowly this machine runs right now (a calibration, not a constant)."""

from __future__ import annotations

import statistics
import time

# The calibration workload's median on `epyc4-2c` (docs/benchmarks.md) when idle (2026-11-29, cpu-bench: 8.9-9.2 ms).
# With the CPU shared by ~10 busy processes it took 33-44 ms, which is the slowdown a test then sees.
IDLE_REFERENCE_S = 0.009
_ROUNDS = 7


def _calibration_work() -> float:
    started = time.perf_counter()
    sum(i * i for i in range(200_000))  # pure interpreter work: slows down with the CPU share it gets
    return time.perf_counter() - started


def slowdown() -> float:
    """How many times slower than the idle reference machine this one runs now (at least 1.0).

    Median of seven ~9 ms rounds of the calibration workload, measured at the call: a test that
    calls it right before its timed section gets a factor for the load it is about to meet.
    """
    return max(1.0, statistics.median(_calibration_work() for _ in range(_ROUNDS)) / IDLE_REFERENCE_S)


def time_limit(seconds_when_idle: float) -> float:
    """`seconds_when_idle` scaled by the current slowdown(): the bound a timed check should use."""
    return seconds_when_idle * slowdown()
