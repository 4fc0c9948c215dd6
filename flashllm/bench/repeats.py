"""Timed runs repeated and bracketed by bandwidth probes: `flashllm bench latency | throughput --repeats N`.

A shared VM's memory bandwidth drifts: on the team's 2-core EPYC the read stream moved between 18
and 25 GB/s within one hour, and the fp32 batch-1 decode rate by as much. One probe taken after
all engines ran then says little about the bandwidth an engine had while it ran, and a single
run cannot tell a 0.85 fraction from a 0.75 one. So, where the device's roofline plan says so
(the CPU's), every timed run with --roofline sits between two probes and its fraction of the
bandwidth ceiling divides by the higher of the two: a dip in one probe never flatters the engine.
--repeats N runs each engine N times; the record's numbers are its median run's (the lower of the
two middle ones for an even N), every run is kept under "runs", and the fraction is the median of
the runs' own fractions.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

Numbers = dict[str, Any]


def bracketed_runs(timed: Callable[[], Numbers], repeats: int, probe: Callable[[], float] | None) -> list[Numbers]:
    """`timed()` `repeats` times; with a probe (bytes/s), one before the first run and one after each,
    and each run's "ceiling_bandwidth_gb_s" is the higher of the probes on either side of it."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    before = probe() if probe else None
    runs = []
    for _ in range(repeats):
        numbers = dict(timed())
        if probe is not None:
            after = probe()
            numbers["probe_gb_s"] = [before / 1e9, after / 1e9]
            numbers["ceiling_bandwidth_gb_s"] = max(before, after) / 1e9
            before = after
        runs.append(numbers)
    return runs


def median_run(runs: list[Numbers], key: str) -> Numbers:
    """The run with the median `key` (lower middle for an even count); with several runs, all of
    them under "runs" (in the order they ran)."""
    ordered = sorted(runs, key=lambda run: run[key])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    if len(runs) > 1:
        chosen["runs"] = runs
    return chosen


def bandwidth_fraction(record: Numbers, rate_key: str, streamed_bytes: int) -> float | None:
    """The median over a record's runs of rate / (bracketing bandwidth / bytes per token), each run
    keeping its own as "fraction_of_bandwidth_ceiling"; None when the runs were not bracketed."""
    runs = record.get("runs") or [record]
    if not all("ceiling_bandwidth_gb_s" in run for run in runs):
        return None
    for run in runs:
        run["fraction_of_bandwidth_ceiling"] = run[rate_key] * streamed_bytes / (run["ceiling_bandwidth_gb_s"] * 1e9)
    return statistics.median(run["fraction_of_bandwidth_ceiling"] for run in runs)
