"""Aggregate serving-benchmark timings: throughput and mean / p50 / p90 / p99 of TTFT, TPOT, ITL, E2E."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from flashllm.bench.serve_client import RequestResult

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100), interpolating linearly between the two nearest ranks.

    Rank r = q/100 * (n - 1) in the sorted values; this is numpy's default ("linear") method.
    """
    if not values:
        raise ValueError("percentile of an empty list")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_samples(results: Sequence[RequestResult]) -> dict[str, list[float]]:
    """Samples in seconds per metric over the successful requests: one TTFT / TPOT / E2E per
    request (TPOT only where at least 2 tokens came back) and every gap between consecutive output
    tokens' arrival stamps for ITL (serve_client.RequestResult)."""
    ok = [r for r in results if r.success]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2e": [r.e2e for r in ok],
    }


def summarize(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    """Counts, throughputs (per second of `duration`) and latency statistics in milliseconds.

    A statistic over no samples (e.g. TPOT when every request produced one token) is None.
    """
    if not duration > 0:
        raise ValueError(f"benchmark duration must be > 0 s, got {duration}")
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        # False where a server packed several tokens into a chunk without saying how many: ITL is then per chunk
        "per_token_stamps": all(r.per_token for r in ok),
    }
    for name, samples in latency_samples(results).items():
        ms = [s * 1000.0 for s in samples]
        summary[f"mean_{name}_ms"] = sum(ms) / len(ms) if ms else None
        for q in PERCENTILES:
            summary[f"p{q}_{name}_ms"] = percentile(ms, q) if ms else None
    return summary


def per_request(results: Sequence[RequestResult]) -> list[dict[str, Any]]:
    """One JSON-ready row per request: times in ms, and each output token's arrival (token_times_ms,
    rounded to 0.01 ms; one stamp per chunk where per_token is false)."""
    rows = []
    for r in results:
        tpot = r.tpot
        rows.append({"success": r.success, "prompt_tokens": r.prompt_len, "output_tokens": r.output_tokens,
                     "ttft_ms": r.ttft * 1000.0, "tpot_ms": None if tpot is None else tpot * 1000.0,
                     "e2e_ms": r.e2e * 1000.0, "per_token": r.per_token,
                     "token_times_ms": [round(t * 1000.0, 2) for t in r.token_times], "error": r.error})
    return rows


def format_table(summary: dict[str, Any]) -> str:
    """A fixed-width text table of `summarize`'s output for the terminal."""
    lines = ["=" * 20 + " Serving benchmark " + "=" * 20]
    rows: list[tuple[str, Any]] = [
        ("Successful requests", summary["completed"]), ("Failed requests", summary["failed"]),
        ("Duration (s)", summary["duration_s"]), ("Total input tokens", summary["total_input_tokens"]),
        ("Total output tokens", summary["total_output_tokens"]),
        ("Request throughput (req/s)", summary["request_throughput"]),
        ("Output token throughput (tok/s)", summary["output_throughput"]),
        ("Total token throughput (tok/s)", summary["total_token_throughput"]),
    ]
    for name in LATENCY_METRICS:
        rows.append((f"-- {name.upper()} (ms)", ""))
        rows += [(f"Mean {name.upper()}", summary[f"mean_{name}_ms"])]
        rows += [(f"P{q} {name.upper()}", summary[f"p{q}_{name}_ms"]) for q in PERCENTILES]
    for label, value in rows:
        text = "n/a" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40}{text:>19}")
    lines.append("=" * 59)
    return "\n".join(lines)
