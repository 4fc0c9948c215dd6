"""bench/repeats.py: the probes around a timed run, the median run, paired fractions and ratios."""

from __future__ import annotations

import json

import pytest

from flashllm.bench import repeats
from flashllm.bench.repeats import bandwidth_fraction, bracketed_run, median_run, paired_ratio, probed_decode
from flashllm.bench.roofline import Reading


def test_a_run_sits_between_two_probes_and_takes_the_higher() -> None:
    events: list[str] = []
    # the sustained rates rank the other way round from the ceilings, so each maximum is taken on its own
    bandwidths = iter([Reading(20e9, 30e9), Reading(25e9, 26e9), Reading(18e9, 19e9), Reading(22e9, 40e9)])

    def probe() -> Reading:
        events.append("probe")
        return next(bandwidths)

    def timed() -> dict[str, float]:
        events.append("run")
        return {"decode_tokens_per_s": 10.0}

    first, second = bracketed_run(timed, probe), bracketed_run(timed, probe)
    assert events == ["probe", "run", "probe"] * 2
    assert [first["probe_gb_s"], second["probe_gb_s"]] == [[20.0, 25.0], [18.0, 22.0]]
    # the higher neighbour: a dip on one side never raises the run's fraction
    assert [first["ceiling_bandwidth_gb_s"], second["ceiling_bandwidth_gb_s"]] == [25.0, 22.0]
    assert [first["sustained_probe_gb_s"], second["sustained_probe_gb_s"]] == [[30.0, 26.0], [19.0, 40.0]]
    assert [first["sustained_bandwidth_gb_s"], second["sustained_bandwidth_gb_s"]] == [30.0, 40.0]


class FakeClock:
    """perf_counter for repeats.probed_decode: tokens and probes advance it by what they cost."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def _fake_generation(clock: FakeClock, costs: list[float], events: list[str]):
    for cost in costs:
        clock.now += cost
        events.append("token")
        yield cost


@pytest.mark.parametrize("every", [4, 3])
def test_a_chunked_run_is_timed_between_probes_and_weighs_each_chunks_ceiling(monkeypatch: pytest.MonkeyPatch,
                                                                             every: int) -> None:
    clock = FakeClock()
    monkeypatch.setattr(repeats, "time", clock)
    events: list[str] = []
    rates = iter([10e9, 20e9, 30e9, 15e9, 40e9])
    sustained = iter([50e9, 22e9, 31e9, 60e9, 41e9])  # their order differs from the ceilings'

    def probe() -> Reading:  # a probe costs 5 s, none of it the engine's
        events.append("probe")
        clock.now += 5.0
        return Reading(next(rates), next(sustained))

    costs = [2.0] + [0.1] * 4 + [0.2] * 4  # prefill, then 8 decode tokens whose speed halves
    run = probed_decode(_fake_generation(clock, costs, events), 8, probe, every)
    chunks = [costs[1 + i:1 + i + every] for i in range(0, 8, every)]
    assert events == ["token", "probe"] + [e for chunk in chunks for e in ["token"] * len(chunk) + ["probe"]]
    assert run["ttft_s"] == pytest.approx(2.0) and run["decode_s"] == pytest.approx(1.2)
    assert run["decode_tokens_per_s"] == pytest.approx(8 / 1.2)
    assert run["probe_gb_s"] == pytest.approx([10.0, 20.0, 30.0, 15.0, 40.0][:len(chunks) + 1])
    assert [c["tokens"] for c in run["chunks"]] == [len(c) for c in chunks]
    assert [c["seconds"] for c in run["chunks"]] == pytest.approx([sum(c) for c in chunks])
    # each chunk against the higher probe at its two ends, weighted by its time
    ends = run["probe_gb_s"]
    ceilings = [max(ends[i], ends[i + 1]) for i in range(len(chunks))]
    assert [c["ceiling_gb_s"] for c in run["chunks"]] == pytest.approx(ceilings)
    assert run["ceiling_bandwidth_gb_s"] == pytest.approx(
        sum(sum(c) * g for c, g in zip(chunks, ceilings, strict=True)) / 1.2)
    # the sustained rates alike, from the same probes
    tops = run["sustained_probe_gb_s"]
    assert tops == pytest.approx([50.0, 22.0, 31.0, 60.0, 41.0][:len(chunks) + 1])
    tops_at_ends = [max(tops[i], tops[i + 1]) for i in range(len(chunks))]
    assert [c["sustained_gb_s"] for c in run["chunks"]] == pytest.approx(tops_at_ends)
    assert run["sustained_bandwidth_gb_s"] == pytest.approx(sum(sum(c) * g for c, g in zip(chunks, tops_at_ends, strict=True)) / 1.2)
    # as a run record: 9 tokens in the prefill's and the chunks' 3.2 s, the 5 s probes left out
    record = repeats.chunked_record(run, prompt_tokens=5)
    assert (record["elapsed_s"], record["output_tokens"], record["mean_ttft_s"]) == pytest.approx((3.2, 9, 2.0))
    assert record["output_tokens_per_s"] == pytest.approx(9 / 3.2)
    assert record["total_tokens_per_s"] == pytest.approx(14 / 3.2)
    # so the fraction is the bytes streamed over the bytes the chunks' ceilings allowed in their time
    bytes_per_token = 1e9
    assert bandwidth_fraction(run, "decode_tokens_per_s", int(bytes_per_token)) == pytest.approx(
        8 * bytes_per_token / sum(sum(c) * g * 1e9 for c, g in zip(chunks, ceilings, strict=True)))


def test_a_chunked_run_that_ends_early_fails() -> None:
    with pytest.raises(RuntimeError, match="ended before"):
        probed_decode(iter([None] * 3), 4, lambda: Reading(1e9, 1e9), 2)
    with pytest.raises(ValueError, match="every >= 1"):
        probed_decode(iter([None] * 3), 2, lambda: Reading(1e9, 1e9), 0)


def test_without_a_probe_a_run_carries_no_bandwidth_and_no_fraction() -> None:
    runs = [bracketed_run(lambda: {"decode_tokens_per_s": 5.0}, None) for _ in range(2)]
    assert runs == [{"decode_tokens_per_s": 5.0}] * 2
    assert bandwidth_fraction(median_run(runs, "decode_tokens_per_s"), "decode_tokens_per_s", 100) is None


def test_a_paired_ratio_compares_within_rounds() -> None:
    # per round 2, 3 and 1: median 2; the ratio of the two medians (4 / 4) would divide runs of
    # different rounds
    fast = [{"rate": 10.0}, {"rate": 3.0}, {"rate": 4.0}]
    slow = [{"rate": 5.0}, {"rate": 1.0}, {"rate": 4.0}]
    assert paired_ratio(fast, slow, "rate") == 2.0
    assert paired_ratio([{"rate": 3.0}, {"rate": 6.0}], [{"rate": 1.0}, {"rate": 1.0}], "rate") == 4.5
    with pytest.raises(ValueError, match="same number of runs"):
        paired_ratio(fast, slow[:2], "rate")


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
    runs = [{"decode_tokens_per_s": 8.0, "ceiling_bandwidth_gb_s": 10.0, "sustained_bandwidth_gb_s": 16.0},
            {"decode_tokens_per_s": 9.0, "ceiling_bandwidth_gb_s": 20.0, "sustained_bandwidth_gb_s": 30.0},
            {"decode_tokens_per_s": 7.0, "ceiling_bandwidth_gb_s": 7.0, "sustained_bandwidth_gb_s": 7.0}]
    record = median_run(runs, "decode_tokens_per_s")
    assert record["decode_tokens_per_s"] == 8.0
    assert bandwidth_fraction(record, "decode_tokens_per_s", 10**9) == pytest.approx(0.8)
    assert [r["fraction_of_bandwidth_ceiling"] for r in record["runs"]] == pytest.approx([0.8, 0.45, 1.0])
    # of the sustained rate: 0.5, 0.3 and 1.0, each run kept beside its fraction of the ceiling
    assert bandwidth_fraction(record, "decode_tokens_per_s", 10**9, of="sustained") == pytest.approx(0.5)
    assert [r["fraction_of_sustained_bandwidth"] for r in record["runs"]] == pytest.approx([0.5, 0.3, 1.0])
    assert [r["fraction_of_bandwidth_ceiling"] for r in record["runs"]] == pytest.approx([0.8, 0.45, 1.0])


def test_repeats_run_rounds_of_every_engine_and_pair_ratios_within_rounds(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path) -> None:
    from flashllm.bench import offline, shapes
    from flashllm.cli import build_parser

    events: list[str] = []
    flash = {"none": [10.0, 5.0, 8.0], "w8a16": [25.0, 12.5, 20.0]}  # 2.5x fp32 in every round
    llama = [9.0, 5.0, 10.0]      # flashllm / llama.cpp per round: 1.11, 1.0, 0.8
    hf_best = [8.0, 4.0, 6.4]     # flashllm / best transformers batch: 1.25 in every round

    def flashllm_run(args, model_dir, quant_type, requests):
        events.append(quant_type)
        rate = flash[quant_type][events.count(quant_type) - 1]
        info = {"device": "cpu", "quantized_lm_head": False, "loaded_weight_bytes": 1, "streamed_weight_bytes": 1}
        return {"output_tokens_per_s": rate, "decode_tokens_per_s": rate}, info, ["request"]

    def transformers_round(args, model_dir, requests, device):
        events.append("transformers")
        best = hf_best[events.count("transformers") - 1]
        return ([{"batch_size": 1, "output_tokens_per_s": best / 2}, {"batch_size": 16, "output_tokens_per_s": best}],
                {"ttft_s": 0.1, "decode_tokens_per_s": best})

    def llama_cpp(args, model_dir, requests):
        events.append("llama.cpp")
        rate = llama[events.count("llama.cpp") - 1]
        return {"batch_size": 1, "output_tokens_per_s": rate, "decode_tokens_per_s": rate, "gguf": "m.gguf"}

    monkeypatch.setattr(offline, "_flashllm_run", flashllm_run)
    monkeypatch.setattr(offline, "_transformers_round", transformers_round)
    monkeypatch.setattr(offline, "_llama_cpp", llama_cpp)
    monkeypatch.setattr(offline, "_llama_cpp_ready", lambda args: None)
    monkeypatch.setattr(shapes, "parameter_bytes", lambda model_dir: 1)
    monkeypatch.setattr(offline, "_transformers_streamed_bytes", lambda model_dir, dtype: 1)  # no config.json here
    out = tmp_path / "record.json"
    args = build_parser().parse_args(["bench", "latency", "--model", str(tmp_path), "--quant_type", "none,w8a16",
                                      "--baseline", "transformers", "llama.cpp", "--baseline-batch-sizes", "1,16",
                                      "--repeats", "3", "--json", str(out)])
    assert offline.run_offline(args) == 0
    assert events == ["none", "w8a16", "transformers", "llama.cpp"] * 3
    record = json.loads(out.read_text())
    assert record["flashllm"]["decode_tokens_per_s"] == 8.0 and len(record["flashllm"]["runs"]) == 3
    assert [r["speedup_vs_first"] for r in record["quant_runs"]] == [1.0, 2.5]
    # paired within rounds: the median of 1.11, 1.0 and 0.8, not the medians' ratio 8 / 9
    assert record["speedup_vs_llama_cpp"] == 1.0
    assert record["speedup_vs_best_transformers"] == pytest.approx(1.25)
    assert record["decode_speedup_vs_transformers"] == pytest.approx(1.25)
    assert [r["output_tokens_per_s"] for r in record["transformers"]] == [3.2, 6.4]
    assert record["llama.cpp"][0]["decode_tokens_per_s"] == 9.0 and record["llama.cpp"][0]["gguf"] == "m.gguf"
    assert record["speedup_method"].startswith("median over rounds")
