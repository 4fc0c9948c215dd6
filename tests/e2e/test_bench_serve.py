"""`flashllm bench serve`: Poisson schedule, metric math, SSE timing, and runs against a real server."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm.bench.serve_client import (
    RequestResult,
    ServeRequest,
    ServeTarget,
    poisson_arrivals,
    run_benchmark,
    send_request,
)
from flashllm.bench.serve_metrics import percentile, summarize

# ---------------------------------------------------------------- arrival schedule


def test_poisson_gaps_have_mean_and_spread_of_an_exponential() -> None:
    rate, num = 5.0, 20001
    offsets = poisson_arrivals(num, rate, seed=7)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and (gaps >= 0).all()
    # the mean of 20000 exponential gaps has a standard error of 0.2 / sqrt(20000) ~ 0.0014
    assert gaps.mean() == pytest.approx(1 / rate, abs=0.01)
    # exponential: standard deviation equals the mean (a fixed spacing would give 0)
    assert gaps.std() == pytest.approx(1 / rate, abs=0.01)
    # memoryless: about e^-1 of the gaps exceed the mean
    assert (gaps > 1 / rate).mean() == pytest.approx(math.exp(-1), abs=0.02)


def test_poisson_schedule_is_reproducible_from_the_seed() -> None:
    assert poisson_arrivals(50, 2.0, seed=3) == poisson_arrivals(50, 2.0, seed=3)
    assert poisson_arrivals(50, 2.0, seed=3) != poisson_arrivals(50, 2.0, seed=4)


def test_infinite_rate_sends_everything_at_once_and_bad_rates_are_refused() -> None:
    assert poisson_arrivals(6, math.inf) == [0.0] * 6
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="request-rate"):
            poisson_arrivals(3, bad)


# ---------------------------------------------------------------- metric math


def test_percentile_matches_hand_computed_ranks() -> None:
    values = [10.0, 1.0, 9.0, 2.0, 8.0, 3.0, 7.0, 4.0, 6.0, 5.0]  # 1..10 shuffled
    # rank = q/100 * 9: p50 -> 4.5 (between 5 and 6), p90 -> 8.1, p99 -> 8.91
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 10.0
    assert percentile([4.0], 99) == 4.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=40), st.floats(0, 100))
def test_percentile_agrees_with_numpy(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-6)


def test_tpot_and_summary_against_hand_computed_values() -> None:
    # token arrival stamps: a's gaps 100 200 300 200 ms, b's 100 300 ms; e2e includes a tail after the last token
    a = RequestResult(success=True, prompt_len=10, output_tokens=5, e2e=1.1, token_times=[0.2, 0.3, 0.5, 0.8, 1.0])
    b = RequestResult(success=True, prompt_len=20, output_tokens=3, e2e=0.8, token_times=[0.4, 0.5, 0.8])
    one = RequestResult(success=True, prompt_len=6, output_tokens=1, e2e=0.5, token_times=[0.5])
    failed = RequestResult(success=False, prompt_len=99, output_tokens=0, error="HTTP 500")
    # TPOT from the first and last token's arrival, not from e2e
    assert a.tpot == pytest.approx((1.0 - 0.2) / 4) and b.tpot == pytest.approx((0.8 - 0.4) / 2)
    assert one.tpot is None and failed.tpot is None  # no decode interval / no answer
    assert a.itl == pytest.approx([0.1, 0.2, 0.3, 0.2]) and a.ttft == 0.2 and failed.ttft == 0.0

    s = summarize([a, b, one, failed], duration=4.0)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (36, 9)
    assert s["request_throughput"] == pytest.approx(3 / 4)
    assert s["output_throughput"] == pytest.approx(9 / 4)
    assert s["total_token_throughput"] == pytest.approx(45 / 4)
    # TTFT over the three successes: 200, 400, 500 ms
    assert s["mean_ttft_ms"] == pytest.approx(1100 / 3)
    assert s["p50_ttft_ms"] == pytest.approx(400) and s["p90_ttft_ms"] == pytest.approx(480)
    # TPOT: 200 and 200 ms (the one-token request has none)
    assert s["mean_tpot_ms"] == pytest.approx(200) and s["p99_tpot_ms"] == pytest.approx(200)
    # ITL pools every gap: 100 100 200 200 300 300 ms; rank 0.5*5 = 2.5 -> 200, rank 0.9*5 = 4.5 -> 300
    assert s["mean_itl_ms"] == pytest.approx(200) and s["p50_itl_ms"] == pytest.approx(200)
    assert s["p90_itl_ms"] == pytest.approx(300)
    # E2E: 500, 800, 1100 ms
    assert s["mean_e2e_ms"] == pytest.approx(2400 / 3) and s["p50_e2e_ms"] == pytest.approx(800)
    assert s["per_token_stamps"]


def test_summary_of_no_samples_is_none_not_nan() -> None:
    s = summarize([RequestResult(success=False, error="x")], duration=1.0)
    assert s["completed"] == 0 and s["mean_ttft_ms"] is None and s["p99_itl_ms"] is None


# ---------------------------------------------------------------- SSE client against a scripted stream


def _sse(chunks: list[dict[str, Any]], delays: list[float]) -> AsyncIterator[bytes]:
    async def stream() -> AsyncIterator[bytes]:
        for chunk, delay in zip(chunks, delays, strict=True):
            await asyncio.sleep(delay)
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"
    return stream()


def _chat_chunk(content: str | None, role: str | None = None) -> dict[str, Any]:
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def test_send_request_times_text_chunks_and_reads_usage() -> None:
    seen: list[dict[str, Any]] = []
    chunks = [_chat_chunk("", role="assistant"), _chat_chunk("a"), _chat_chunk("bc"), _chat_chunk("d"),
              {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}}]
    delays = [0.0, 0.15, 0.05, 0.1, 0.0]

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        assert request.headers["authorization"] == "Bearer k"
        return httpx.Response(200, content=_sse(chunks, delays))

    target = ServeTarget("http://test/v1", "m", "chat", api_key="k")

    async def go() -> RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send_request(client, target, ServeRequest("hi", 3, 5))

    r = asyncio.run(go())
    assert r.success, r.error
    body = seen[0]
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
    assert body["max_tokens"] == 5 and body["messages"] == [{"role": "user", "content": "hi"}]
    # the role-only chunk carries no text: the first token is the one after 0.15 s
    assert r.ttft >= 0.15 and len(r.itl) == 2
    assert r.itl[0] >= 0.05 and r.itl[1] >= 0.1 and r.e2e >= r.ttft + sum(r.itl) - 1e-6
    assert (r.output_tokens, r.prompt_len) == (5, 11)  # the server's usage, not the 3 text chunks
    assert not r.per_token  # 5 tokens in 3 chunks that do not say how many each carried: stamps per chunk


def test_tokens_a_chunk_lists_share_its_arrival_stamp() -> None:
    # a server that streams decode bursts: 1, then 3, then 2 tokens a chunk, each listing its tokens
    def chunk(tokens: list[str], finish: str | None = None) -> dict[str, Any]:
        logprobs = {"tokens": tokens, "token_logprobs": [-1.0] * len(tokens)} if tokens else None
        return {"choices": [{"index": 0, "text": "".join(tokens), "logprobs": logprobs, "finish_reason": finish}]}

    chunks = [chunk(["a"]), chunk(["b", "c", "d"]), chunk(["e", "f"]), chunk([], "length"),
              {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 6}}]
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=_sse(chunks, [0.0, 0.2, 0.3, 0.1, 0.0])))

    async def go() -> RequestResult:
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_request(client, ServeTarget("http://test/v1", "m"), ServeRequest([5, 6], 2, 6))

    r = asyncio.run(go())
    assert r.success and r.per_token and r.output_tokens == len(r.token_times) == 6
    gaps = r.itl  # the burst's later tokens arrived with its first: gaps of 0
    assert gaps[1] == gaps[2] == gaps[4] == 0.0 and gaps[0] >= 0.2 and gaps[3] >= 0.3
    assert r.tpot == pytest.approx((r.token_times[-1] - r.token_times[0]) / 5)
    assert r.e2e >= r.token_times[-1] + 0.1  # the closing chunk's delay is no token's


def test_send_request_without_usage_counts_output_chunks_and_reports_http_errors() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content)["prompt"] == "bad":
            return httpx.Response(400, json={"error": {"message": "too long", "type": "invalid_request_error"}})
        # A mid-stream chunk with empty text is a token that decoded to nothing (it counts);
        # the closing chunk that only carries finish_reason is not a token.
        chunks = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in ("x", "", "y", "z")]
        chunks.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        return httpx.Response(200, content=_sse(chunks, [0.0] * 5))

    async def go(prompt: str) -> RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send_request(client, ServeTarget("http://test/v1", "m"), ServeRequest(prompt, 2, 4))

    ok, bad = asyncio.run(go("fine")), asyncio.run(go("bad"))
    assert ok.success and ok.output_tokens == 4 and ok.prompt_len == 2 and len(ok.itl) == 3
    assert not bad.success and "HTTP 400" in bad.error and "too long" in bad.error


def test_run_benchmark_keeps_at_most_max_concurrency_in_flight() -> None:
    in_flight, peak = 0, 0

    async def stream() -> AsyncIterator[bytes]:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.05)
        yield b'data: {"choices": [{"index": 0, "text": "t"}]}\n\n'
        in_flight -= 1
        yield b"data: [DONE]\n\n"

    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=stream()))
    requests = [ServeRequest("p", 1, 1)] * 10
    results, duration = asyncio.run(run_benchmark(ServeTarget("http://test/v1", "m"), requests, math.inf, 3,
                                                  progress=False, transport=transport))
    assert all(r.success for r in results) and peak == 3
    assert duration >= 4 * 0.05  # ceil(10 / 3) waves of 50 ms


# ---------------------------------------------------------------- against a real `flashllm serve`

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, SEED = 8, (8, 32), (2, 12), 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flashllm.testing.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2", seed=0)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[Any]:
    from flashllm.testing.server import running_server

    with running_server([str(model_dir), "--max-model-len", "256", "--device", "cpu", "--dtype", "float32"]) as s:
        yield s


def _asked_tokens(model_dir: Path) -> tuple[int, int]:
    """(input, output) tokens the seeded random workload asks for: with ignore_eos every request
    must return exactly its output length."""
    from flashllm.bench.workload import random_requests
    from flashllm.models.tokenizer import load_tokenizer

    requests = random_requests(NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, len(load_tokenizer(model_dir)), SEED)
    return sum(len(r.prompt_token_ids) for r in requests), sum(r.output_len for r in requests)


def _bench(tmp_path: Path, *extra: str) -> dict[str, Any]:
    from flashllm.cli import main

    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--dataset", "random", "--input-len", "{}:{}".format(*INPUT_LEN),
            "--output-len", "{}:{}".format(*OUTPUT_LEN), "--num-prompts", str(NUM_PROMPTS), "--seed", str(SEED),
            "--no-progress", "--json", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())


def _check_record(record: dict[str, Any], asked_output_tokens: int) -> None:
    assert record["completed"] == NUM_PROMPTS and record["failed"] == 0 and len(record["requests"]) == NUM_PROMPTS
    for key in ("duration_s", "request_throughput", "output_throughput", "total_token_throughput"):
        assert math.isfinite(record[key]) and record[key] > 0, key
    for name in ("ttft", "tpot", "itl", "e2e"):
        stats = [record[f"{s}_{name}_ms"] for s in ("mean", "p50", "p90", "p99")]
        assert all(isinstance(v, float) and math.isfinite(v) and v >= 0 for v in stats), (name, stats)
        assert stats[1] <= stats[2] <= stats[3], (name, stats)
    rows = record["requests"]
    assert record["total_output_tokens"] == sum(r["output_tokens"] for r in rows) == asked_output_tokens
    assert record["total_input_tokens"] == sum(r["prompt_tokens"] for r in rows) and all(
        r["prompt_tokens"] > 0 for r in rows)
    assert all(r["success"] and 0 < r["ttft_ms"] <= r["e2e_ms"] for r in rows)
    duration = record["duration_s"]
    assert record["request_throughput"] == pytest.approx(NUM_PROMPTS / duration)
    assert record["output_throughput"] == pytest.approx(asked_output_tokens / duration)
    total = record["total_input_tokens"] + asked_output_tokens
    assert record["total_token_throughput"] == pytest.approx(total / duration)
    assert max(r["e2e_ms"] for r in rows) <= duration * 1000 + 1
    assert statistics.mean(r["e2e_ms"] for r in rows) == pytest.approx(record["mean_e2e_ms"])


def test_bench_serve_completions_all_at_once(server: Any, model_dir: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    record = _bench(tmp_path, "--url", server.url, "--tokenizer", str(model_dir), "--request-rate", "inf")
    asked_input, asked_output = _asked_tokens(model_dir)
    _check_record(record, asked_output)
    assert record["total_input_tokens"] == asked_input  # random prompts travel as token ids
    assert record["model"] == model_dir.name and record["endpoint"] == "completions"
    assert "Output token throughput" in capsys.readouterr().out


def test_bench_serve_chat_with_poisson_arrivals_and_a_concurrency_cap(server: Any, model_dir: Path,
                                                                      tmp_path: Path) -> None:
    rate = 20.0
    record = _bench(tmp_path, "--url", server.url, "--model", str(model_dir), "--endpoint", "chat",
                    "--request-rate", str(rate), "--max-concurrency", "2")
    _check_record(record, _asked_tokens(model_dir)[1])
    # the last request cannot start before its scheduled arrival
    assert record["duration_s"] >= poisson_arrivals(NUM_PROMPTS, rate, SEED)[-1]
    assert record["request_rate"] == rate and record["max_concurrency"] == 2


def test_bench_serve_starts_and_stops_its_own_server(model_dir: Path, tmp_path: Path) -> None:
    record = _bench(tmp_path, "--model", str(model_dir), "--max-model-len", "256", "--device", "cpu",
                    "--dtype", "float32")
    _check_record(record, _asked_tokens(model_dir)[1])
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{record['url']}/models", timeout=2.0)  # the server it started is gone


def _workload_args(**overrides: Any) -> Any:
    import argparse

    fields = {"num_prompts": 6, "input_len": "10:40", "output_len": "3:5", "seed": 1, "endpoint": "chat"}
    return argparse.Namespace(**{**fields, **overrides})


def test_chat_prompts_re_tokenize_to_about_the_asked_length(model_dir: Path) -> None:
    from flashllm.bench.serve_run import serve_requests
    from flashllm.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    requests = serve_requests("random", None, tokenizer, _workload_args())
    assert len(requests) == 6
    for r in requests:
        assert isinstance(r.prompt, str) and 10 <= r.prompt_len <= 40
        n = len(tokenizer.encode(r.prompt, add_special_tokens=False))
        assert abs(n - r.prompt_len) <= max(2, r.prompt_len // 10), (n, r.prompt_len)


def test_sharegpt_prompts_are_text_with_the_reply_length_as_output(model_dir: Path, tmp_path: Path) -> None:
    from flashllm.bench.serve_run import _dataset, serve_requests
    from flashllm.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    turns = [("hello there, how are you today?", "I am fine, thank you very much."),
             ("what is the capital of France?", "Paris is the capital of France.")]
    data = [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]} for q, a in turns]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    kind, found = _dataset(_workload_args(dataset=["sharegpt", str(path)], dataset_path=None))
    assert (kind, found) == ("sharegpt", path)
    requests = serve_requests(kind, found, tokenizer, _workload_args(endpoint="completions"))
    expected = {(q, len(tokenizer.encode(a))) for q, a in turns}
    assert {(r.prompt, r.output_len) for r in requests} == expected
    with pytest.raises(SystemExit, match="needs a file"):
        _dataset(_workload_args(dataset=["sharegpt"], dataset_path=None))
