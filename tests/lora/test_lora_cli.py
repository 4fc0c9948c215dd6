"""`flashllm predict --lora_path` and `generate --lora-path` give what peft's merged model gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("peft")

from flashllm.cli import main  # noqa: E402
from flashllm.testing.tiny_lora import build_peft_adapter, load_peft_model  # noqa: E402
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402


def _predict(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    argv = ["predict", "--model_name_or_path", str(model), "--data_file", str(data), "--output_file", str(out),
            "--device", "cpu", "--max_length", "12", "--decode_strategy", "greedy_search", *extra]
    assert main(argv) == 0
    return [json.loads(line)["output"] for line in out.read_text().splitlines()]


def test_predict_lora_path_equals_peft_merged_checkpoint(tmp_path: Path) -> None:
    base = build_tiny_model(tmp_path / "base", "qwen2", seed=6)
    adapter = build_peft_adapter(base, tmp_path / "adapter", seed=3, std=0.2)
    merged = tmp_path / "merged"
    load_peft_model(base, adapter).merge_and_unload().save_pretrained(merged)
    for path in base.iterdir():  # the tokenizer and its chat template
        if path.suffix != ".safetensors" and not (merged / path.name).exists():
            shutil.copy(path, merged / path.name)
    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(json.dumps({"src": s}) for s in ("Hello there", "Name a color", "2+2")) + "\n")
    with_lora = _predict(base, data, tmp_path / "a.jsonl", "--lora_path", str(adapter))
    assert with_lora == _predict(merged, data, tmp_path / "b.jsonl")
    assert with_lora != _predict(base, data, tmp_path / "c.jsonl")
