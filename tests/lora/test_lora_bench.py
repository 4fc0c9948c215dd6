"""`flashllm bench throughput --lora`: runs the three engines over the same requests and records their ratios."""

from __future__ import annotations

import json
from pathlib import Path

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
