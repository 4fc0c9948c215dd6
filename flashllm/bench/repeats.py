"""Timed runs repeated, in rounds, and bracketed by bandwidth probes: `flashllm bench latency |
throughput --repeats N`.

A shared VM's memory bandwidth drifts: on `epyc3-2c` (docs/benchmarks.md) the read stream moves
between 18 and 25 GB/s within one hour, and the fp32 batch-1 decode rate by as much. One probe taken after
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
- A batch-1 latency run lasts 10-15 s on that host, and its bandwidth moved within a run: one run
  decoded at 1.09 of the higher of its two probes (both taken in a slow phase), another at 0.74.
  So with --probe-every K (the CPU default), a batch-1 run is timed K decode tokens at a time with
  a probe between chunks, outside the timed spans (probed_decode): each chunk's ceiling is the
  higher probe at its two ends, taken seconds apart rather than a whole run apart.
- A probe (roofline.Reading) gives two rates: the ceiling, its fastest single read, and the
  sustained rate, its bytes over all its back-to-back reads (~0.5 s on the CPU). A run's fraction
  divides by the ceiling; its fraction of the sustained rate is recorded beside it
  ("fraction_of_sustained_bandwidth"): that rate is no ceiling, since the engine passed it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from flashllm.bench.workload import BenchRequest

if TYPE_CHECKING:
    from flashllm.bench.roofline import Reading

Numbers = dict[str, Any]
Probe = Callable[[], "Reading"]


def bracketed_run(timed: Callable[[], Numbers], probe: Probe | None) -> Numbers:
    """`timed()` once; with a probe, one probe just before and one just after: the run's
    "ceiling_bandwidth_gb_s" is the higher ceiling of the two, "sustained_bandwidth_gb_s" the higher sustained rate."""
    before = probe() if probe else None
    numbers = dict(timed())
    if probe is not None:
        numbers.update(_probe_numbers([before, probe()]))
        numbers["ceiling_bandwidth_gb_s"] = max(numbers["probe_gb_s"])
        numbers["sustained_bandwidth_gb_s"] = max(numbers["sustained_probe_gb_s"])
    return numbers


def _probe_numbers(readings: list[Reading]) -> Numbers:
    return {"probe_gb_s": [r.ceiling / 1e9 for r in readings], "sustained_probe_gb_s": [r.sustained / 1e9 for r in readings]}


def probed_decode(tokens: Iterator[object], decode_tokens: int, probe: Probe, every: int) -> Numbers:
    """Time one batch-1 generation `every` decode tokens at a time, with a probe after the prefill
    and after each chunk, outside the timed spans.

    `tokens` yields once per generated token, its first item ending the prefill, and pauses between
    items (a generator driving the engine); `decode_tokens` of them follow the first. Each chunk's
    ceiling (and sustained rate) is the higher probe at its two ends. The run's "ceiling_bandwidth_gb_s" is
    the chunks' ceilings weighted by their time, so rate x bytes per token / it is the bytes the run
    streamed over the bytes its chunks' ceilings allowed in the same time; "sustained_bandwidth_gb_s" the same of the sustained rates.
    """
    if every < 1 or decode_tokens < 1:
        raise ValueError(f"probed_decode needs every >= 1 and decode_tokens >= 1, got {every} and {decode_tokens}")
    start = time.perf_counter()
    _next_token(tokens)
    ttft = time.perf_counter() - start
    probes = [probe()]
    chunks: list[Numbers] = []
    for first in range(0, decode_tokens, every):
        count = min(every, decode_tokens - first)
        start = time.perf_counter()
        for _ in range(count):
            _next_token(tokens)
        seconds = time.perf_counter() - start
        probes.append(probe())
        ends = probes[-2:]
        chunks.append({"tokens": count, "seconds": seconds, "ceiling_gb_s": max(r.ceiling for r in ends) / 1e9,
                       "sustained_gb_s": max(r.sustained for r in ends) / 1e9})
    decode_s = sum(chunk["seconds"] for chunk in chunks)
    return {"ttft_s": ttft, "decode_tokens": decode_tokens, "decode_s": decode_s,
            "decode_tokens_per_s": decode_tokens / decode_s, **_probe_numbers(probes),
            "ceiling_bandwidth_gb_s": sum(c["seconds"] * c["ceiling_gb_s"] for c in chunks) / decode_s,
            "sustained_bandwidth_gb_s": sum(c["seconds"] * c["sustained_gb_s"] for c in chunks) / decode_s,
            "chunks": chunks}


def chunked_record(run: Numbers, prompt_tokens: int) -> Numbers:
    """probed_decode's numbers as an engine's run record (elapsed_s, output_tokens, output and total
    tokens/s, mean_ttft_s), its time the prefill and the chunks, not the probes between them."""
    run = dict(run)
    ttft = run.pop("ttft_s")
    output_tokens = run.pop("decode_tokens") + 1
    elapsed = ttft + run["decode_s"]
    return {"elapsed_s": elapsed, "output_tokens": output_tokens, "output_tokens_per_s": output_tokens / elapsed,
            "total_tokens_per_s": (output_tokens + prompt_tokens) / elapsed, "mean_ttft_s": ttft, **run}


def times_in_chunks(probe: Probe | None, every: int, requests: Sequence[BenchRequest]) -> bool:
    """Whether a run of `requests` is timed by probed_decode: a probe, chunks asked for, and one
    request with decode tokens to time."""
    return probe is not None and every > 0 and len(requests) == 1 and requests[0].output_len > 1


_ENDED = object()


def _next_token(tokens: Iterator[object]) -> None:
    if next(tokens, _ENDED) is _ENDED:
        raise RuntimeError("the generation ended before the tokens probed_decode was told to time")


def median_run(runs: list[Numbers], key: str) -> Numbers:
    """The run with the median `key` (lower middle for an even count); with several runs, all of
    them under "runs" (in the order they ran)."""
    ordered = sorted(runs, key=lambda run: run[key])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    if len(runs) > 1:
        chosen["runs"] = runs
    return chosen


def bandwidth_fraction(record: Numbers, rate_key: str, streamed_bytes: int, of: str = "ceiling") -> float | None:
    """The median over a record's runs of rate / (bracketing bandwidth / bytes per token), each run
    keeping its own as "fraction_of_bandwidth_ceiling" (of="ceiling") or "fraction_of_sustained_bandwidth"
    (of="sustained"); None when the runs were not bracketed."""
    bandwidth_key, fraction_key = FRACTIONS[of]
    runs = record.get("runs") or [record]
    if not all(bandwidth_key in run for run in runs):
        return None
    for run in runs:
        run[fraction_key] = run[rate_key] * streamed_bytes / (run[bandwidth_key] * 1e9)
    return statistics.median(run[fraction_key] for run in runs)


# of -> (the run's bandwidth key, the key its fraction is kept under)
FRACTIONS = {"ceiling": ("ceiling_bandwidth_gb_s", "fraction_of_bandwidth_ceiling"),
              "sustained": ("sustained_bandwidth_gb_s", "fraction_of_sustained_bandwidth")}


def paired_ratio(numerators: list[Numbers], denominators: list[Numbers], key: str) -> float:
    """The median over rounds of numerators[i][key] / denominators[i][key]: two engines compared
    within each round, where both met the same phase of the host (the mean of the middle two for an
    even count)."""
    if len(numerators) != len(denominators) or not numerators:
        raise ValueError(f"paired_ratio needs the same number of runs on both sides, got {len(numerators)} "
                         f"and {len(denominators)}")
    return statistics.median(a[key] / b[key] for a, b in zip(numerators, denominators, strict=True))
