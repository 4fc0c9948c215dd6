"""`flashllm bench embed` on a tiny Qwen3: both engines timed on the same prompts, and their vectors agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashllm.cli import main
from flashllm.testing.tiny_models import build_tiny_model


def test_bench_embed_times_both_engines_on_the_same_vectors(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "m", "qwen3", seed=1)
    out = tmp_path / "embed.json"
    code = main(["bench", "embed", "--model", str(model), "--num-prompts", "5", "--input-len", "12",
                 "--batch-size", "2", "--repeats", "2", "--json", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    assert {k: len(v) for k, v in record["seconds"].items()} == {"flashllm": 2, "transformers": 2}
    assert record["min_cosine"] > 0.9999 and record["speedup"] > 0
    assert record["prompt_tokens_per_s"]["flashllm"] == pytest.approx(record["prompts_per_s"]["flashllm"] * 12)


def test_bench_embed_refuses_zero_prompts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "embed", "--model", str(tmp_path), "--num-prompts", "0"]) == 2
    assert "--num-prompts must be at least 1" in capsys.readouterr().err
