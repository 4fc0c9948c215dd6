"""`flashllm run-batch`: an OpenAI batch file answered by the server's routes in process, checked against
in-process LLM generation, with refused lines, the engine's queue full and the command line."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")

from flashllm import LLM, SamplingParams  # noqa: E402
from flashllm.cli import build_parser  # noqa: E402
from flashllm.cli import serve as serve_cli  # noqa: E402
from flashllm.serving.batch import run_batch  # noqa: E402
from flashllm.serving.server import build_server  # noqa: E402
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

ENGINE_FLAGS = ["--device", "cpu", "--max-model-len", "256", "--block-size", "16", "--num-kv-blocks", "96"]
QUESTIONS = ["Name a colour.", "Count to three.", "Say hello.", "What is two plus two?", "Name a fruit.",
             "Spell cat.", "Name a dog.", "Pick a number.", "Say yes.", "Say no.", "Name a city.", "Name a sea."]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("batch"), "qwen2", seed=3)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), device="cpu", max_model_len=256, block_size=16, num_kv_blocks=96)


def _request(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _chat(custom_id: str, question: str, **extra) -> str:
    return _request(custom_id, "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": question}], "max_tokens": 10, "temperature": 0, **extra})


def _run(model_dir: Path, lines: list[str], flags: list[str] = (), concurrency: int = 8) -> list[dict]:
    """The output lines of `lines` run through a server built as run-batch builds it."""
    args = build_parser().parse_args(["run-batch", "-i", "-", "-o", "-", str(model_dir), *ENGINE_FLAGS, *flags])
    options = serve_cli.resolve_options(args, {})
    built = build_server(options)
    built.engine.start()
    written: list[str] = []
    try:
        asyncio.run(run_batch(built.app, lines, written.append, concurrency, options["max_body_bytes"]))
    finally:
        built.engine.stop()
    return [json.loads(line) for line in written]


def test_answers_are_the_server_s_in_input_order_and_bad_lines_say_why(model_dir: Path, llm: LLM) -> None:
    lines = [
        _chat("chat", QUESTIONS[0]),
        "not json",
        _request("complete", "/v1/completions", {"prompt": ["The sky is", "Once upon"], "max_tokens": 8,
                                                 "temperature": 0}),
        "",  # blank lines are skipped
        _request("embed", "/v1/embeddings", {"input": ["red green blue"]}),
        _request("elsewhere", "/v1/models", {}),
        _chat("streamed", QUESTIONS[1], stream=True),
        _chat("chat", QUESTIONS[2]),  # a custom_id already used
        _request("no-body", "/v1/chat/completions", []),
        _chat("refused", QUESTIONS[3], max_tokens=100_000_000),  # answered by the route: 400
        json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}}),
        _request("respond", "/v1/responses", {"input": QUESTIONS[0], "max_output_tokens": 10, "temperature": 0}),
    ]
    out = _run(model_dir, lines)
    assert [o["custom_id"] for o in out] == ["chat", None, "complete", "embed", "elsewhere", "streamed", "chat",
                                             "no-body", "refused", "get", "respond"]
    assert all(o["id"].startswith("batch_req_") for o in out)
    errors = {i: o["error"]["code"] for i, o in enumerate(out) if o["error"] is not None}
    assert errors == {1: "invalid_json", 4: "invalid_url", 5: "stream_unsupported", 6: "duplicate_custom_id",
                      7: "invalid_body", 9: "invalid_method"}
    assert all(out[i]["response"] is None for i in errors)

    chat = out[0]["response"]
    assert chat["status_code"] == 200 and chat["request_id"].startswith("req_")
    expected = llm.chat([{"role": "user", "content": QUESTIONS[0]}], SamplingParams(temperature=0, max_tokens=10))[0]
    assert chat["body"]["choices"][0]["message"]["content"] == expected.outputs[0].text
    assert chat["body"]["usage"]["completion_tokens"] == len(expected.outputs[0].token_ids)

    completions = out[2]["response"]["body"]["choices"]
    generated = llm.generate(["The sky is", "Once upon"], SamplingParams(temperature=0, max_tokens=8))
    assert [c["text"] for c in completions] == [g.outputs[0].text for g in generated]

    embedding = out[3]["response"]["body"]["data"][0]["embedding"]
    assert np.allclose(embedding, llm.embed(["red green blue"])[0].outputs.embedding, atol=1e-6)

    response = out[10]["response"]["body"]
    assert response["object"] == "response" and response["output"][0]["content"][0]["text"] == expected.outputs[0].text

    refused = out[8]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "max_tokens"


def test_requests_past_the_engine_s_seats_wait_for_them(model_dir: Path, llm: LLM) -> None:
    """Twelve requests at once on an engine of 2 sequences and no queue: each one the engine turns away (503
    queue_full) goes again until it has a seat, and every answer is its own greedy reply."""
    lines = [_chat(f"q{i}", question) for i, question in enumerate(QUESTIONS)]
    out = _run(model_dir, lines, ["--max-num-seqs", "2", "--max-queue", "0"], concurrency=len(lines))
    assert [o["custom_id"] for o in out] == [f"q{i}" for i in range(len(QUESTIONS))]
    assert [o["response"]["status_code"] for o in out] == [200] * len(QUESTIONS)
    params = SamplingParams(temperature=0, max_tokens=10)
    for o, question in zip(out, QUESTIONS, strict=True):
        expected = llm.chat([{"role": "user", "content": question}], params)[0].outputs[0].text
        assert o["response"]["body"]["choices"][0]["message"]["content"] == expected


def test_the_command_writes_the_output_file_whole(model_dir: Path, tmp_path: Path) -> None:
    batch = tmp_path / "batch.jsonl"
    batch.write_text("\n".join([_chat("a", QUESTIONS[0]), "[]", _chat("b", QUESTIONS[1])]) + "\n")
    results = tmp_path / "results.jsonl"
    command = [sys.executable, "-m", "flashllm", "run-batch", "-i", str(batch), "-o", str(results), str(model_dir),
               *ENGINE_FLAGS]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "3 line(s): 2 succeeded, 1 failed (2 x 200; 1 without an answer)" in proc.stderr
    out = [json.loads(line) for line in results.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["a", None, "b"]
    assert not list(tmp_path.glob("*.partial"))

    missing = subprocess.run([*command[:4], "-i", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "x.jsonl"),
                              str(model_dir)], capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1] == f"flashllm run-batch: the input file {tmp_path / 'none.jsonl'} " \
                                                      "does not exist"
    assert not (tmp_path / "x.jsonl").exists()
