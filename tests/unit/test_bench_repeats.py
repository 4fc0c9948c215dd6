"""bench/repeats.py: repeated timed runs, the probes around each, the median run and the paired fractions."""

from __future__ import annotations

import itertools

import pytest

from flashllm.bench.repeats import bandwidth_fraction, bracketed_runs, median_run


def test_each_run_sits_between_two_probes_and_takes_the_higher() -> None:
    events: list[str] = []
    bandwidths = iter([20e9, 25e9, 18e9, 22e9])  # before run 0, after run 0, after run 1, after run 2
    rates = itertools.count(10)

    def probe() -> float:
        events.append("probe")
        return next(bandwidths)

    def timed() -> dict[str, float]:
        events.append("run")
        return {"decode_tokens_per_s": float(next(rates))}

    runs = bracketed_runs(timed, 3, probe)
    assert events == ["probe", "run", "probe", "run", "probe", "run", "probe"]
    assert [r["probe_gb_s"] for r in runs] == [[20.0, 25.0], [25.0, 18.0], [18.0, 22.0]]
    # the higher neighbour: a dip on one side never raises the run's fraction
    assert [r["ceiling_bandwidth_gb_s"] for r in runs] == [25.0, 25.0, 22.0]


def test_without_a_probe_runs_carry_no_bandwidth_and_no_fraction() -> None:
    runs = bracketed_runs(lambda: {"decode_tokens_per_s": 5.0}, 2, None)
    assert runs == [{"decode_tokens_per_s": 5.0}] * 2
    assert bandwidth_fraction(median_run(runs, "decode_tokens_per_s"), "decode_tokens_per_s", 100) is None
    with pytest.raises(ValueError, match="at least 1"):
        bracketed_runs(lambda: {}, 0, None)


@pytest.mark.parametrize("rates,median", [([3.0], 3.0), ([9.0, 1.0, 5.0], 5.0), ([4.0, 8.0, 2.0, 6.0], 4.0)])
def test_the_median_run_is_a_real_run_the_lower_middle_for_even_counts(rates: list[float], median: float) -> None:
    runs = [{"rate": r, "index": i} for i, r in enumerate(rates)]
    chosen = median_run(runs, "rate")
    assert chosen["rate"] == median and chosen["index"] == rates.index(median)
    # one run is the record itself; several stay listed in the order they ran
    assert ("runs" in chosen) == (len(rates) > 1)
    if len(rates) > 1:
        assert [r["index"] for r in chosen["runs"]] == list(range(len(rates)))


def test_the_fraction_is_the_median_of_each_runs_own_fraction() -> None:
    # bytes 1e9 per token: a run at r tokens/s on a b GB/s ceiling reaches r / b of it
    runs = [{"decode_tokens_per_s": 8.0, "ceiling_bandwidth_gb_s": 10.0},
            {"decode_tokens_per_s": 9.0, "ceiling_bandwidth_gb_s": 20.0},
            {"decode_tokens_per_s": 7.0, "ceiling_bandwidth_gb_s": 7.0}]
    record = median_run(runs, "decode_tokens_per_s")
    assert record["decode_tokens_per_s"] == 8.0
    assert bandwidth_fraction(record, "decode_tokens_per_s", 10**9) == pytest.approx(0.8)
    assert [r["fraction_of_bandwidth_ceiling"] for r in record["runs"]] == pytest.approx([0.8, 0.45, 1.0])
