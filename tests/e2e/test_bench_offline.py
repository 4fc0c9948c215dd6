"""`flashllm bench throughput | latency` on a tiny model: a ShareGPT-layout file, baselines, roofline fractions, JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flashllm.cli import main
from flashllm.testing.tiny_models import build_tiny_model

CONVERSATIONS = [
    {"conversations": [{"from": "human", "value": "the quick brown fox jumps over the lazy dog " * 2},
                       {"from": "gpt", "value": "a lazy dog sleeps all day long"}]},
    {"conversations": [{"from": "gpt", "value": "a reply with no question is skipped"}]},
    {"conversations": [{"from": "human", "value": "what is the capital of france and why"},
                       {"from": "gpt", "value": "paris, because the kings lived there"}]},
]


@pytest.fixture(autouse=True)
def small_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU plan's probes over 64 MiB and a 512-wide GEMM, not 1 GiB and 2048: these tests check how the
    records are put together, and a 1 GiB probe read ten times around every run made them ~1 min longer."""
    from dataclasses import replace

    from flashllm.bench import roofline

    monkeypatch.setitem(roofline.PLANS, "cpu", replace(roofline.CPU_PLAN, copy_bytes=64 << 20, read_bytes=64 << 20,
                                                       matmul_n=512))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the bench asks for a 4096-token context unless told otherwise
    return build_tiny_model(tmp_path_factory.mktemp("bench") / "llama", "llama", seed=0,
                            max_position_embeddings=4096)


def _run(tmp_path: Path, *argv: str) -> dict:
    out = tmp_path / "record.json"
    assert main(["bench", *argv, "--device", "cpu", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_throughput_on_sharegpt_with_transformers_and_roofline(model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(CONVERSATIONS))
    record = _run(tmp_path, "throughput", "--model", str(model_dir), "--dataset", "sharegpt", "--dataset-path",
                  str(data), "--num-prompts", "5", "--baseline", "transformers", "--baseline-batch-sizes", "1,2",
                  "--roofline")
    from flashllm.llm import LLM

    tokenizer = LLM(str(model_dir), device="cpu").tokenizer
    usable = [c["conversations"] for c in CONVERSATIONS if c["conversations"][0]["from"] == "human"]
    assert record["num_requests"] == len(usable) == 2
    # EOS ignored: exactly the reply lengths are generated
    assert record["flashllm"]["output_tokens"] == sum(len(tokenizer.encode(t[1]["value"])) for t in usable)
    assert [r["batch_size"] for r in record["transformers"]] == [1, 2]
    roof = record["roofline"]
    assert roof["read_bandwidth_gb_s"] > 0 and roof["copy_bandwidth_gb_s"] > 0 and roof["matmul_gflop_s"] > 0
    assert roof["ceiling_bandwidth"] == "read stream"  # the CPU's convention; a GPU run divides by the copy
    assert roof["matmul_probes_gflop_s"] == [roof["matmul_gflop_s"]]  # one round: the roofline's probe alone
    assert record["speedup_vs_best_transformers"] == pytest.approx(
        record["flashllm"]["output_tokens_per_s"] / max(r["output_tokens_per_s"] for r in record["transformers"]))
    # the fractions are each engine's own rate over the ceilings recorded beside them
    assert record["fraction_of_compute_ceiling"]["flashllm"] == pytest.approx(
        record["flashllm"]["total_tokens_per_s"] / record["compute_ceiling_tokens_per_s"])
    assert set(record["fraction_of_compute_ceiling"]) == {"flashllm", "transformers_batch1", "transformers_batch2"}
    # the ceiling counts what a step streams: an untied model's input embedding table is not read whole
    assert 0 < record["streamed_weight_bytes"] < record["loaded_weight_bytes"]
    assert record["decode_ceiling_batch1_tokens_per_s"] == pytest.approx(
        roof["read_bandwidth_gb_s"] * 1e9 / record["streamed_weight_bytes"])


def test_compute_ceiling_counts_the_model_flops(model_dir: Path) -> None:
    """2 x matmul parameters + attention, from the module shapes of the loaded transformers model."""
    import torch
    from transformers import AutoModelForCausalLM

    from flashllm.bench.shapes import flops_per_token

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    linear = sum(m.weight.numel() for m in hf.modules() if isinstance(m, torch.nn.Linear))
    cfg = hf.config
    q_dim = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    context = 37.5
    assert flops_per_token(model_dir, context) == pytest.approx(
        2 * linear + cfg.num_hidden_layers * 4 * q_dim * context)


def test_latency_compares_quant_types_and_transformers_in_one_run(model_dir: Path, tmp_path: Path) -> None:
    record = _run(tmp_path, "latency", "--model", str(model_dir), "--input-len", "16", "--output-len", "12",
                  "--quant_type", "none,w8a16,a8w8", "--baseline", "transformers", "--baseline-batch-sizes", "1",
                  "--roofline")
    runs = record["quant_runs"]
    assert [r["quant_type"] for r in runs] == ["none", "w8a16", "a8w8"]
    assert all(r["output_tokens"] == 12 and r["decode_tokens_per_s"] > 0 for r in runs)
    assert runs[0]["speedup_vs_first"] == 1.0
    assert runs[1]["speedup_vs_first"] == pytest.approx(runs[1]["decode_tokens_per_s"] / runs[0]["decode_tokens_per_s"])
    # int8 weights hold fewer bytes than the float ones
    assert runs[1]["loaded_weight_bytes"] < runs[0]["loaded_weight_bytes"]
    assert record["flashllm"]["decode_tokens_per_s"] == runs[0]["decode_tokens_per_s"]
    hf = record["transformers_latency"]
    assert hf["ttft_s"] > 0 and hf["decode_tokens_per_s"] > 0
    fractions = record["fractions_of_bandwidth_ceiling"]
    # every engine's batch-1 run is bracketed by read probes on the CPU; the ceiling is the higher of the two
    assert len(hf["probe_gb_s"]) == 2 and hf["ceiling_bandwidth_gb_s"] == max(hf["probe_gb_s"])
    assert fractions["transformers"] == pytest.approx(
        hf["decode_tokens_per_s"] * record["transformers_streamed_bytes"] / (hf["ceiling_bandwidth_gb_s"] * 1e9))
    assert fractions.keys() == record["fractions_of_sustained_bandwidth"].keys() == {"flashllm", "transformers"}
    a8w8 = runs[2]
    # one chunk of 11 tokens between two probes: its time-weighted ceiling is the higher probe, up to
    # the rounding of seconds x ceiling / seconds
    assert a8w8["ceiling_bandwidth_gb_s"] == pytest.approx(max(a8w8["probe_gb_s"]), rel=1e-12)
    assert a8w8["fraction_of_sustained_bandwidth"] == pytest.approx(
        a8w8["decode_tokens_per_s"] * a8w8["streamed_weight_bytes"] / (a8w8["sustained_bandwidth_gb_s"] * 1e9))
    assert a8w8["fraction_of_bandwidth_ceiling"] == pytest.approx(
        a8w8["decode_tokens_per_s"] * a8w8["streamed_weight_bytes"] / (a8w8["ceiling_bandwidth_gb_s"] * 1e9))


def test_repeated_latency_runs_report_the_median_against_their_own_probes(model_dir: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from flashllm.bench import offline

    between: list[float] = []  # a GEMM probe after every round but the last, faked fast

    def fake_gemm_probe(dtype: torch.dtype, device: str) -> float:
        between.append(1e15 + len(between))
        return between[-1]

    monkeypatch.setattr(offline, "_gemm_probe", fake_gemm_probe)
    record = _run(tmp_path, "latency", "--model", str(model_dir), "--input-len", "16", "--output-len", "8",
                  "--quant_type", "none,w8a16", "--baseline", "transformers", "--baseline-batch-sizes", "1",
                  "--repeats", "3", "--roofline")
    flash = record["flashllm"]
    runs = flash["runs"]
    assert len(runs) == 3 and all(r["output_tokens"] == 8 for r in runs)
    # the record is its median run, a run that happened
    rates = sorted(r["decode_tokens_per_s"] for r in runs)
    assert flash["decode_tokens_per_s"] == rates[1]
    # each run between its own two CPU read probes
    assert all(len(r["probe_gb_s"]) == 2 and min(r["probe_gb_s"]) > 0 for r in runs)
    own = sorted(r["decode_tokens_per_s"] * record["streamed_weight_bytes"] / (max(r["probe_gb_s"]) * 1e9)
                 for r in runs)
    assert record["fraction_of_bandwidth_ceiling"] == pytest.approx(own[1])
    assert record["bandwidth_fraction_method"].startswith("median over runs")
    w8 = record["quant_runs"][1]
    # rounds: int8 against fp32 within each round, the median of the three ratios
    assert w8["speedup_vs_first"] == pytest.approx(sorted(
        a["decode_tokens_per_s"] / b["decode_tokens_per_s"] for a, b in zip(w8["runs"], runs, strict=True))[1])
    assert len(w8["runs"]) == 3 and w8["fraction_of_bandwidth_ceiling"] == pytest.approx(sorted(
        r["decode_tokens_per_s"] * w8["streamed_weight_bytes"] / (r["ceiling_bandwidth_gb_s"] * 1e9)
        for r in w8["runs"])[1])
    # the baseline is repeated too, each run between its own probes, its fraction the median of theirs
    hf = record["transformers_latency"]
    assert len(hf["runs"]) == 3 and hf["decode_tokens_per_s"] == sorted(r["decode_tokens_per_s"] for r in hf["runs"])[1]
    assert all(len(r["probe_gb_s"]) == 2 for r in hf["runs"])
    assert record["fractions_of_bandwidth_ceiling"]["transformers"] == pytest.approx(sorted(
        r["decode_tokens_per_s"] * record["transformers_streamed_bytes"] / (max(r["probe_gb_s"]) * 1e9) for r in hf["runs"])[1])
    assert len(record["transformers"][0]["runs"]) == 3
    # the compute ceiling takes the best GEMM probe: the two between rounds, then the roofline's own
    probes = record["roofline"]["matmul_probes_gflop_s"]
    assert len(probes) == 3 and probes[:2] == [g / 1e9 for g in between]
    assert record["roofline"]["matmul_gflop_s"] == max(probes) == between[-1] / 1e9


def test_a_one_request_latency_run_is_timed_in_chunks_between_probes(model_dir: Path, tmp_path: Path) -> None:
    record = _run(tmp_path, "latency", "--model", str(model_dir), "--input-len", "16", "--output-len", "12",
                  "--roofline", "--probe-every", "4")
    flash = record["flashllm"]
    assert flash["output_tokens"] == 12 and [c["tokens"] for c in flash["chunks"]] == [4, 4, 3]
    probes = flash["probe_gb_s"]
    assert len(probes) == 4 and min(probes) > 0  # after the prefill, then after each chunk
    assert [c["ceiling_gb_s"] for c in flash["chunks"]] == [max(probes[i:i + 2]) for i in range(3)]
    assert flash["decode_s"] == pytest.approx(sum(c["seconds"] for c in flash["chunks"]))
    assert flash["decode_tokens_per_s"] == pytest.approx(11 / flash["decode_s"])
    # the probes are not the engine's time
    assert flash["elapsed_s"] == pytest.approx(flash["mean_ttft_s"] + flash["decode_s"])
    weighted = sum(c["seconds"] * c["ceiling_gb_s"] for c in flash["chunks"]) / flash["decode_s"]
    assert flash["ceiling_bandwidth_gb_s"] == pytest.approx(weighted)
    assert record["fraction_of_bandwidth_ceiling"] == pytest.approx(
        flash["decode_tokens_per_s"] * record["streamed_weight_bytes"] / (weighted * 1e9))
    # the same probes' rates over all their reads are recorded beside the ceiling (their fastest
    # read): a sustained rate never passes its own fastest read, so its fraction is the higher
    rates = flash["sustained_probe_gb_s"]
    assert len(rates) == 4 and all(p <= c for p, c in zip(rates, probes, strict=True))
    assert [c["sustained_gb_s"] for c in flash["chunks"]] == [max(rates[i:i + 2]) for i in range(3)]
    sustained = sum(c["seconds"] * c["sustained_gb_s"] for c in flash["chunks"]) / flash["decode_s"]
    assert flash["sustained_bandwidth_gb_s"] == pytest.approx(sustained)
    assert record["fractions_of_sustained_bandwidth"]["flashllm"] == pytest.approx(
        flash["decode_tokens_per_s"] * record["streamed_weight_bytes"] / (sustained * 1e9))
    assert record["fractions_of_sustained_bandwidth"]["flashllm"] >= record["fraction_of_bandwidth_ceiling"]


def test_the_chunked_runs_tokens_are_generates_tokens(model_dir: Path) -> None:
    from flashllm import LLM, SamplingParams
    from flashllm.bench.offline import _engine_tokens

    llm = LLM(str(model_dir), device="cpu", max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, detokenize=False)
    prompt = list(range(3, 40))
    (expected,) = llm.generate([prompt], params)
    assert list(_engine_tokens(llm.engine, prompt, params)) == list(expected.outputs[0].token_ids)
    stopped = _engine_tokens(llm.engine, prompt, params)
    next(stopped), next(stopped)
    stopped.close()  # a caller that stops early leaves no request holding KV blocks
    assert not llm.engine.has_unfinished()


def test_a_single_run_without_roofline_keeps_the_flat_record(model_dir: Path, tmp_path: Path) -> None:
    record = _run(tmp_path, "latency", "--model", str(model_dir), "--input-len", "16", "--output-len", "4")
    assert "runs" not in record["flashllm"] and "probe_gb_s" not in record["flashllm"]
    assert record["flashllm"]["output_tokens"] == 4


@pytest.mark.parametrize("bad", ["0", "-2", "two"])
def test_repeats_must_be_a_positive_whole_number(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "latency", "--repeats", bad])
    assert "--repeats: must be a whole number of at least 1" in capsys.readouterr().err


def test_repeated_throughput_runs_compute_their_prompts_again(model_dir: Path, tmp_path: Path) -> None:
    # 130-token prompts fill two 64-token blocks: without the reset between runs the second run
    # would find every full block of every prompt in the prefix cache and skip its prefill
    record = _run(tmp_path, "throughput", "--model", str(model_dir), "--num-prompts", "3", "--input-len", "130",
                  "--output-len", "2", "--repeats", "2")
    runs = record["flashllm"]["runs"]
    assert [r["prefix_cache_hit_rate"] for r in runs] == [0.0, 0.0]
    assert record["flashllm"]["output_tokens_per_s"] == min(r["output_tokens_per_s"] for r in runs)


def test_reset_prefix_cache_forgets_the_cached_prompt(model_dir: Path) -> None:
    from flashllm.llm import LLM
    from flashllm.sampling_params import SamplingParams

    llm = LLM(str(model_dir), device="cpu", max_model_len=512)
    prompt, params = list(range(5, 135)), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    first = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == first
    assert llm.engine.block_manager.prefix_cache_hit_rate == 0.5  # the second prompt's two blocks hit
    llm.reset_prefix_cache()
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == first
    assert llm.engine.block_manager.prefix_cache_hit_rate == 0.0
