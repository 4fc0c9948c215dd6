"""`flashllm bench --baseline llama.cpp`: llama.cpp on the exported GGUF agrees with transformers, and the CLI."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from flashllm.bench.llamacpp_baseline import LlamaCppResult
from flashllm.cli import main

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None and importlib.util.find_spec("gguf") is not None
needs_llama_cpp = pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python (and gguf) not installed; "
                                                                  "pip install llama-cpp-python gguf")


def test_missing_llama_cpp_fails_in_one_line_before_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` raise ImportError
    assert main(["bench", "latency", "--model", str(tmp_path / "no-such-model"), "--baseline", "llama.cpp"]) == 2
    message = capsys.readouterr().err.strip()
    assert "pip install llama-cpp-python" in message and "\n" not in message


def test_baselines_can_be_listed_or_repeated() -> None:
    import argparse

    from flashllm.cli.bench import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    listed = parser.parse_args(["bench", "throughput", "--baseline", "transformers", "llama.cpp"])
    repeated = parser.parse_args(["bench", "latency", "--baseline", "transformers", "--baseline", "llama.cpp"])
    assert listed.baseline == repeated.baseline == ["transformers", "llama.cpp"]
    assert parser.parse_args(["bench", "latency"]).baseline is None
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "latency", "--baseline", "vllm-typo"])


def test_gguf_type_choices_match_the_exporter() -> None:
    from flashllm.bench.gguf_export import FILE_TYPES
    from flashllm.cli.bench import GGUF_TYPES

    assert GGUF_TYPES == FILE_TYPES


def test_record_counts_prefill_and_decode_separately() -> None:
    result = LlamaCppResult(elapsed=4.0, prompt_tokens=30, output_tokens=12, ttfts=[0.5, 1.5], decode_s=[1.0, 1.0],
                            token_ids=[[1] * 5, [2] * 7])
    record = result.record()
    assert record["batch_size"] == 1 and record["output_tokens"] == 12
    assert record["output_tokens_per_s"] == pytest.approx(12 / 4.0)
    assert record["total_tokens_per_s"] == pytest.approx((12 + 30) / 4.0)
    assert record["mean_ttft_s"] == pytest.approx(1.0)
    assert record["decode_tokens_per_s"] == pytest.approx((4 + 6) / 2.0)


# ---------------------------------------------------------------- with llama-cpp-python installed


def transformers_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens by full recomputation each step, EOS ignored (no generate() stopping rules)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@needs_llama_cpp
@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2"])
def test_llama_cpp_greedy_tokens_equal_transformers(tmp_path: Path, arch: str) -> None:
    import random

    from flashllm.bench.gguf_export import export_gguf
    from flashllm.bench.llamacpp_baseline import greedy_generate, load
    from flashllm.testing.tiny_models import build_tiny_model

    model_dir = build_tiny_model(tmp_path / arch, arch, seed=5)
    llm = load(export_gguf(model_dir, tmp_path / "m.gguf", "f32"), n_ctx=256, n_batch=64, n_threads=2)
    rng = random.Random(arch)
    try:
        # prompts past 64 tokens reach the llama3 preset's scaled rope bands
        for length in (3, 17, 90):
            prompt = [rng.randrange(3, 512) for _ in range(length)]
            tokens, ttft, total = greedy_generate(llm, prompt, 10)
            assert tokens == transformers_greedy(model_dir, prompt, 10), (arch, length)
            assert 0 < ttft <= total
    finally:
        llm.close()


@needs_llama_cpp
def test_bench_latency_with_llama_cpp_baseline_writes_json(tmp_path: Path) -> None:
    from flashllm.testing.tiny_models import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "qwen2", "qwen2", seed=0, max_position_embeddings=4096)
    out = tmp_path / "latency.json"
    argv = ["bench", "latency", "--model", str(model_dir), "--input-len", "12", "--output-len", "6",
            "--device", "cpu", "--baseline", "llama.cpp", "--repeats", "2", "--roofline", "--probe-every", "2",
            "--json", str(out)]
    env_cache = tmp_path / "cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASHLLM_CACHE_DIR", str(env_cache))
        assert main(argv) == 0
    record = json.loads(out.read_text())
    (baseline,) = record["llama.cpp"]
    assert baseline["batch_size"] == 1 and baseline["output_tokens"] == 6 == record["flashllm"]["output_tokens"]
    assert baseline["gguf_type"] == "f32" and Path(baseline["gguf"]).parent == env_cache / "gguf"
    for key in ("output_tokens_per_s", "decode_tokens_per_s", "mean_ttft_s", "elapsed_s"):
        assert baseline[key] > 0, key
    # two rounds of flashllm then llama.cpp: the mean of the two rounds' ratios
    assert record["speedup_vs_llama_cpp"] == pytest.approx(sum(
        a["output_tokens_per_s"] / b["output_tokens_per_s"]
        for a, b in zip(record["flashllm"]["runs"], baseline["runs"], strict=True)) / 2)
    # repeated like flashllm, each run's 5 decode tokens timed 2 at a time between read probes (after
    # the prefill, then after each chunk); the fraction is the median run's own
    assert len(baseline["runs"]) == 2
    for run in (*baseline["runs"], *record["flashllm"]["runs"]):
        assert [c["tokens"] for c in run["chunks"]] == [2, 2, 1] and len(run["probe_gb_s"]) == 4
        assert run["elapsed_s"] == pytest.approx(run["mean_ttft_s"] + run["decode_s"])
    assert 0 < baseline["gguf_streamed_bytes"] <= baseline["gguf_bytes"]  # tensors only, no header
    fractions = sorted(r["decode_tokens_per_s"] * baseline["gguf_streamed_bytes"] / (r["ceiling_bandwidth_gb_s"] * 1e9)
                       for r in baseline["runs"])
    assert record["fractions_of_bandwidth_ceiling"]["llama.cpp"] == pytest.approx(sum(fractions) / 2)
