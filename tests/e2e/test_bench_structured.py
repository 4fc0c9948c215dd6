"""`flashllm bench structured` on the demo model: the record's arms, ratios and time to first token (not their values)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("llguidance")

from flashllm.cli import main  # noqa: E402
from flashllm.models.demo import demo_model_dir  # noqa: E402
from flashllm.structured import mask  # noqa: E402


def test_bench_structured_writes_every_arm(tmp_path: Path) -> None:
    out = tmp_path / "structured.json"
    code = main(["bench", "structured", "--model", str(demo_model_dir()), "--batch-size", "3", "--output-len", "8",
                 "--repeats", "2", "--max-model-len", "128", "--json", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    assert record["invalid_outputs"] == 0
    assert {k: len(v) for k, v in record["tokens_per_s"].items()} == {
        "unconstrained": 2, "json_schema": 2, "json_schema_masks_after_forward": 2}
    assert all(rate > 0 for rates in record["tokens_per_s"].values() for rate in rates)
    assert record["ratio"] > 0 and record["ratio_masks_after_forward"] > 0
    assert record["ttft_new_schema_ms"] > 0 and record["ttft_unconstrained_ms"] > 0
    assert mask.PREFETCH  # the arm that turns it off turns it back on


def test_bench_structured_refuses_a_zero_batch(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "structured", "--model", str(demo_model_dir()), "--batch-size", "0"]) == 2
    assert "--batch-size must be at least 1" in capsys.readouterr().err
