"""`flashllm bench latency --speculate_method ngram` on a tiny model: both engines decode the same tokens, the
copy prompts hold their texts, and the record's ratios are the rounds' own numbers."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from flashllm.cli import main
from flashllm.testing.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("spec-bench") / "llama", "llama", seed=1,
                            max_position_embeddings=4096)


def _bench(tmp_path: Path, model_dir: Path, dataset: str) -> dict:
    out = tmp_path / f"{dataset}.json"
    argv = ["bench", "latency", "--model", str(model_dir), "--device", "cpu", "--dataset", dataset,
            "--num-prompts", "4", "--output-len", "24", "--input-len", "40", "--repeats", "2",
            "--speculate_method", "ngram", "--json", str(out)]
    assert main(argv) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("dataset", ["copy", "chat", "random"])
def test_latency_bench_compares_the_same_tokens_with_and_without_drafts(model_dir: Path, tmp_path: Path,
                                                                        dataset: str) -> None:
    record = _bench(tmp_path, model_dir, dataset)
    assert record["num_requests"] == 4 and len(record["rounds"]) == 2
    for entry in record["rounds"]:
        plain, spec = entry["plain"], entry["speculative"]
        assert plain["decode_tokens"] == spec["decode_tokens"] > 0  # greedy: the same answers, so as many tokens
        if dataset == "random":  # ignore_eos: every request decodes its whole output length after the first token
            assert plain["decode_tokens"] == 4 * 23
        assert 0 <= spec["accepted"] <= spec["drafted"]
        assert spec["verify_step_cost"] > 0
        assert len(spec["request_tokens_per_s"]) == len(plain["request_tokens_per_s"]) == 4
    ratios = [r["speculative"]["decode_tokens_per_s"] / r["plain"]["decode_tokens_per_s"] for r in record["rounds"]]
    assert record["speedup_vs_plain"] == pytest.approx(statistics.median(ratios))
    first = [r["speculative"]["request_tokens_per_s"][0] / r["plain"]["request_tokens_per_s"][0]
             for r in record["rounds"]]
    assert record["request_speedups"][0] == pytest.approx(statistics.median(first))


def test_copy_prompts_hold_the_text_they_ask_to_copy(model_dir: Path) -> None:
    import argparse

    from flashllm.bench import speculative
    from flashllm.llm import LLM
    from flashllm.testing.corpus import CORPUS

    llm = LLM(str(model_dir), device="cpu", max_model_len=4096)
    args = argparse.Namespace(dataset="copy", num_prompts=4, output_len="64", input_len="8", seed=0)
    requests = speculative._requests(args, llm)
    texts = [llm.tokenizer.decode(prompt) for prompt, _ in requests]
    for text, task in zip(texts, speculative.COPY_TASKS, strict=True):
        assert task.split("{")[0].strip() in text
    prose = [line for line in CORPUS if line.endswith(".") and len(line) > 40]
    assert sum(line in texts[0] for line in prose) >= 8  # eight sentences to copy, not a fragment


def test_sharegpt_prompts_are_the_files_first_turns(model_dir: Path, tmp_path: Path) -> None:
    """--dataset sharegpt with --speculate_method decodes the file's prompts for their replies' lengths (it
    fell back to random tokens before)."""
    import argparse

    from flashllm.bench import speculative
    from flashllm.llm import LLM

    llm = LLM(str(model_dir), device="cpu", max_model_len=4096)
    texts = ["the quick brown fox jumps over the lazy dog", "tell me a story about a small boat at sea"]
    replies = ["once upon a time there was a fox", "a boat sailed on and on, far from home"]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": t}, {"from": "gpt", "value": r}]}
                                for t, r in zip(texts, replies, strict=True)]))
    args = argparse.Namespace(dataset="sharegpt", dataset_path=str(path), num_prompts=2, output_len="64",
                              input_len="8", seed=0)
    requests = speculative._requests(args, llm)
    assert sorted(llm.tokenizer.decode(p).strip() for p, _ in requests) == sorted(texts)
    lengths = {llm.tokenizer.decode(p).strip(): n for p, n in requests}
    assert [lengths[t] for t in texts] == [len(llm.tokenizer.encode(r)) for r in replies]
