"""`flashllm bench throughput --lora`: runs the three engines over the same requests and records their ratios."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashllm.cli import main
from flashllm.testing.tiny_models import build_tiny_model


def test_bench_throughput_lora_records_paired_ratios(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "m", "llama", seed=2, tokenizer=False)
    out = tmp_path / "lora.json"
    argv = ["bench", "throughput", "--model", str(model), "--lora", "2", "--lora-rank", "4", "--lora-merged",
            "--num-prompts", "3", "--input-len", "8", "--output-len", "4", "--device", "cpu", "--repeats", "2",
            "--json", str(out)]
    assert main(argv) == 0
    record = json.loads(out.read_text())
    assert record["num_adapters"] == 2 and record["lora_rank"] == 4 and record["num_requests"] == 3
    for engine in ("base", "lora", "merged"):
        assert len(record[engine]["runs"]) == 2
        assert all(run["output_tokens"] == 12 for run in record[engine]["runs"])  # 3 requests x 4 tokens each
    ratio = [r["output_tokens_per_s"] / b["output_tokens_per_s"]
             for r, b in zip(record["lora"]["runs"], record["base"]["runs"], strict=True)]
    assert min(ratio) <= record["lora_vs_base"] <= max(ratio)


def test_bench_lora_only_merged_pins_one_kv_block_count(tmp_path: Path) -> None:
    """--lora-only-merged runs base and merged alone; both engines hold the KV block count the first one sized."""
    model = build_tiny_model(tmp_path / "m", "llama", seed=3, tokenizer=False)
    out = tmp_path / "merged.json"
    argv = ["bench", "throughput", "--model", str(model), "--lora", "1", "--lora-rank", "4", "--lora-merged",
            "--lora-only-merged", "--num-prompts", "2", "--input-len", "8", "--output-len", "3", "--device", "cpu",
            "--repeats", "2", "--json", str(out)]
    assert main(argv) == 0
    record = json.loads(out.read_text())
    assert "lora" not in record and "lora_vs_base" not in record
    assert [run["position_in_round"] for run in record["merged"]["runs"]] == [1, 0]  # the order rotates
    assert isinstance(record["num_kv_blocks"], int) and record["num_kv_blocks"] > 0
    assert {run["num_kv_blocks"] for run in record["merged"]["runs"] + record["base"]["runs"]} == {
        record["num_kv_blocks"]}
    assert all(run["output_tokens"] == 6 for run in record["merged"]["runs"] + record["base"]["runs"])


def test_bench_lora_only_merged_needs_merged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "throughput", "--model", str(tmp_path), "--lora", "1", "--lora-only-merged"]) != 0
    assert "add --lora-merged" in capsys.readouterr().err
