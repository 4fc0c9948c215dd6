"""The CLI as a user runs it: predict over JSONL files, generate, devices."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from flashllm.cli import main
from flashllm.testing.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2", seed=4)


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _predict(model: Path | None, data: Path, out: Path, *extra: str) -> int:
    argv = ["predict", "--data_file", str(data), "--output_file", str(out), "--device", "cpu",
            "--max_length", "8", "--batch_size", "4", *(extra or ("--decode_strategy", "greedy_search"))]
    if model is not None:
        argv += ["--model_name_or_path", str(model)]
    return main(argv)


def test_predict_writes_one_result_per_line(qwen_dir: Path, tmp_path: Path) -> None:
    data = _write(tmp_path / "in.jsonl", [
        json.dumps({"src": "Hello there", "tgt": "hi"}),
        json.dumps({"src": ["What is 2+2?", "4", "And 3+3?"]}),
        json.dumps([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]),
        "",
        json.dumps({"src": "你好，世界"}),
    ])
    out = tmp_path / "out.jsonl"
    assert _predict(qwen_dir, data, out) == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 4
    assert rows[0]["src"] == "Hello there" and rows[0]["tgt"] == "hi"
    assert all(isinstance(r["output"], str) and r["finish_reason"] in ("stop", "length") for r in rows)


def test_predict_kebab_case_and_paddle_flags_are_accepted(qwen_dir: Path, tmp_path: Path) -> None:
    data = _write(tmp_path / "in.jsonl", [json.dumps({"src": "abc"})])
    out = tmp_path / "out.jsonl"
    argv = ["predict", "--model-name-or-path", str(qwen_dir), "--data-file", str(data), "--output-file", str(out),
            "--inference_model", "--block_attn", "--dtype", "float32", "--decode-strategy", "sampling",
            "--top_p", "0.8", "--temperature", "0.7", "--max-length", "4", "--seed", "3", "--device", "cpu"]
    assert main(argv) == 0
    assert len(out.read_text().splitlines()) == 1


@pytest.mark.parametrize(("lines", "bad_line", "message"), [
    (['{"src": "ok"}', '{"src": "ok"', '{"src": "x"}'], 2, "not valid JSON"),
    (['{"src": "ok"}', '', '{"tgt": "no src"}'], 3, "'src' must be a non-empty string"),
    (['[{"role": "user"}]'], 1, "'role' and 'content'"),
    (['42'], 1, "expected an object"),
])
def test_bad_data_file_fails_with_the_line_number_and_writes_nothing(
    qwen_dir: Path, tmp_path: Path, capsys, lines, bad_line, message
) -> None:
    data = _write(tmp_path / "bad.jsonl", lines)
    out = tmp_path / "out.jsonl"
    assert _predict(qwen_dir, data, out) == 2
    err = capsys.readouterr().err
    assert f"bad.jsonl line {bad_line}" in err and message in err
    assert not out.exists()
    assert list(tmp_path.glob(".out.jsonl*")) == []


def test_predict_on_the_demo_model(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FLASHLLM_CACHE_DIR", str(tmp_path / "cache"))
    data = _write(tmp_path / "in.jsonl", [json.dumps({"src": "Once upon a time"}), json.dumps({"src": "Hi"})])
    out = tmp_path / "out.jsonl"
    assert _predict(None, data, out) == 0
    assert len(out.read_text().splitlines()) == 2


def test_generate_command(qwen_dir: Path, capsys) -> None:
    assert main(["generate", "Hello", "--model", str(qwen_dir), "--max-tokens", "5", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "prompt: 'Hello'" in out and "tokens" in out


def test_generate_takes_vllm_s_underscore_spellings(qwen_dir: Path, capsys) -> None:
    """--max_tokens and --top_p, as the engine's other flags are spelled both ways."""
    argv = ["generate", "Hello", "--model", str(qwen_dir), "--max_tokens", "3", "--top_p", "0.9", "--device", "cpu"]
    assert main(argv + ["--temperature", "0.7", "--seed", "1"]) == 0
    assert "(3 tokens, length" in capsys.readouterr().out


@pytest.fixture
def built_llms(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every LLM the commands build during the test, in order."""
    import flashllm.llm as llm_module

    built: list[llm_module.LLM] = []

    class Recording(llm_module.LLM):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(llm_module, "LLM", Recording)
    return built


def test_generate_takes_the_context_and_the_cache_in_blocks(qwen_dir: Path, capsys, built_llms: list) -> None:
    """--max-model-len and --num-kv-blocks, which the KV cache's refusal names as the fix."""
    built = built_llms
    argv = ["generate", "Hello", "--model", str(qwen_dir), "--max-tokens", "3", "--device", "cpu"]
    assert main([*argv, "--max-model-len", "64", "--num-kv-blocks", "5"]) == 0
    engine = built[-1].engine
    assert engine.config.model.max_model_len == 64 and len(engine.block_manager.blocks) == 5
    assert "(3 tokens, length" in capsys.readouterr().out
    for flag in ("--max-model-len", "--num-kv-blocks"):
        with pytest.raises(SystemExit) as exc:
            main([*argv, flag, "0"])
        assert exc.value.code == 2 and "positive whole number" in capsys.readouterr().err


def test_generate_takes_a_tokenizer_apart_from_the_model(qwen_dir: Path, tmp_path: Path, capsys,
                                                        built_llms: list) -> None:
    """--tokenizer: a model directory without tokenizer files answers in text with another directory's tokenizer,
    as it does with its own; a --tokenizer that holds none fails in one line before the weights load."""
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(qwen_dir, bare, ignore=shutil.ignore_patterns("tokenizer*", "vocab*", "merges*", "special*"))
    argv = ["generate", "Hello there", "--max-tokens", "4", "--device", "cpu"]
    assert main([*argv, "--model", str(qwen_dir)]) == 0
    own = re.sub(r"[0-9.]+ s\)", "", capsys.readouterr().out)  # the prompt, the reply, the counts; not the time
    assert main([*argv, "--model", str(bare), "--tokenizer", str(qwen_dir)]) == 0
    assert re.sub(r"[0-9.]+ s\)", "", capsys.readouterr().out) == own and "Hello there" in own
    assert built_llms[-1].engine.config.model.tokenizer == str(qwen_dir)
    assert main([*argv, "--model", str(qwen_dir), "--tokenizer", str(tmp_path / "empty")]) != 0
    err = capsys.readouterr().err.strip()
    assert "--tokenizer" in err and "empty: not a GGUF file or a directory holding one of" in err and "\n" not in err


def test_python_dash_m_flashllm_llm_runs_the_predictor(qwen_dir: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    data = _write(tmp_path / "in.jsonl", [json.dumps({"src": "abc"})])
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "flashllm.llm", "--model_name_or_path", str(qwen_dir),
                           "--data_file", str(data), "--output_file", str(out), "--max_length", "3",
                           "--decode_strategy", "greedy_search", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert len(out.read_text().splitlines()) == 1


def test_predict_beam_search(qwen_dir: Path, tmp_path: Path) -> None:
    data = _write(tmp_path / "in.jsonl", [json.dumps({"src": "abc"}), json.dumps({"src": "hello world"})])
    out = tmp_path / "out.jsonl"
    assert _predict(qwen_dir, data, out, "--decode_strategy", "beam_search", "--num_beams", "3") == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(isinstance(r["output"], str) for r in rows)


def test_generate_kv_cache_memory_sizes_the_cache(qwen_dir: Path, capsys, built_llms: list) -> None:
    import torch

    from flashllm.config import CacheConfig

    built = built_llms
    hf = json.loads((qwen_dir / "config.json").read_text())
    # fp32 K and V of one token over all layers, from the model's shape (not the engine's arithmetic)
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    per_token = hf["num_hidden_layers"] * 2 * hf["num_key_value_heads"] * head_dim * 4
    block, context = CacheConfig().block_size, hf["max_position_embeddings"]
    cap = per_token * (context + 2 * block + block // 2)  # one whole context, two blocks more and half a block
    argv = ["generate", "Hello", "--model", str(qwen_dir), "--max-tokens", "3", "--device", "cpu"]
    assert main([*argv, "--kv-cache-memory", str(cap)]) == 0
    engine = built[-1].engine
    assert all(t.dtype == torch.float32 for layer in engine.runner.kv_caches for t in layer)
    assert len(engine.block_manager.blocks) == context // block + 2  # whole blocks within the cap
    assert engine.runner.kv_cache_bytes() <= cap
    assert "prompt: 'Hello'" in capsys.readouterr().out

    # a cap under one context's blocks is refused with the flag named, no traceback
    assert main([*argv, "--kv-cache-memory", str(per_token * (context - block))]) == 2
    assert "--kv-cache-memory" in capsys.readouterr().err
    for bad in ("0", "-4096", "2GB"):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--kv-cache-memory", bad])
        assert exc.value.code == 2 and "positive whole number of bytes" in capsys.readouterr().err
