"""Timed runs repeated, in rounds, and bracketed by bandwidth probes: `flashllm bench latency |
throughput --repeats N`.

A shared VM's memory bandwidth drifts: on the team's 2-core EPYC the read stream moved between 18
and 25 GB/s within one hour, and the fp32 batch-1 decode rate by as much. One probe taken after
all engines ran then says little about the bandwidth an engine had while it ran, and a single
run cannot tell a 0.85 fraction from a 0.75 one. So:
- --repeats N runs N rounds, each running every engine once (flashllm per quant type, then the
  baselines), so a slow phase of the host lands on one round of every engine, not on all runs of
  one. A ratio of two engines is the median over rounds of the ratio within a round
  (paired_ratio); an engine's record is its median run (the lower of the two middle ones for an
  even N), with every run kept under "runs".
- Where the device's roofline plan says so (the CPU's), every timed run with --roofline sits
  between two probes, and its fraction of the bandwidth ceiling divides by the higher of the two,
  so a dip in one probe never flatters the engine. The record's fraction is the median of the
  runs' own fractions.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

Numbers = dict[str, Any]


def bracketed_run(timed: Callable[[], Numbers], probe: Callable[[], float] | None) -> Numbers:
    """`timed()` once; with a probe (bytes/s), one probe just before and one just after, and the
    run's "ceiling_bandwidth_gb_s" is the higher of the two."""
    before = probe() if probe else None
    numbers = dict(timed())
    if probe is not None:
        after = probe()
        numbers["probe_gb_s"] = [before / 1e9, after / 1e9]
        numbers["ceiling_bandwidth_gb_s"] = max(before, after) / 1e9
    return numbers


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


def paired_ratio(numerators: list[Numbers], denominators: list[Numbers], key: str) -> float:
    """The median over rounds of numerators[i][key] / denominators[i][key]: two engines compared
    within each round, where both met the same phase of the host (the mean of the middle two for an
    even count)."""
    if len(numerators) != len(denominators) or not numerators:
        raise ValueError(f"paired_ratio needs the same number of runs on both sides, got {len(numerators)} "
                         f"and {len(denominators)}")
    return statistics.median(a[key] / b[key] for a, b in zip(numerators, denominators, strict=True))
