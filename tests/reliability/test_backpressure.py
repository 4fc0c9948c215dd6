"""Backpressure: past max_num_seqs + max_queue a burst is refused fast with 503 + Retry-After, never as a stream."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from flashllm.testing.server import ServerProcess, running_server
from flashllm.testing.timing import time_limit

MAX_NUM_SEQS, MAX_QUEUE, BURST = 2, 4, 20
ADMITTED = MAX_NUM_SEQS + MAX_QUEUE
FAST_S = 0.5
# The tiny model makes a token in a few ms on 2 cores, so 200 tokens keep the first admitted
# request running well past the moment the last request of the burst is answered.
MAX_TOKENS = 200
FLAGS = ["--max-model-len", "256", "--block-size", "16", "--num-kv-blocks", "64",
         "--max-num-seqs", str(MAX_NUM_SEQS), "--max-queue", str(MAX_QUEUE)]


@dataclass
class Reply:
    """One request of the burst as the client saw it."""

    stream: bool
    status: int
    headers: httpx.Headers
    body: str
    latency: float  # request sent -> response headers received
    done_at: float  # monotonic time the body was read to the end


def _body(i: int, stream: bool, max_tokens: int) -> tuple[str, dict[str, Any]]:
    common = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream}
    if i % 4 >= 2:
        return "/chat/completions", {"messages": [{"role": "user", "content": f"Story number {i}"}], **common}
    return "/completions", {"prompt": f"Story number {i}", **common}


async def _send(client: httpx.AsyncClient, url: str, i: int, max_tokens: int) -> Reply:
    stream = i % 2 == 1
    path, body = _body(i, stream, max_tokens)
    sent = time.monotonic()
    async with client.stream("POST", url + path, json=body) as response:
        latency = time.monotonic() - sent
        text = (await response.aread()).decode()
    return Reply(stream, response.status_code, response.headers, text, latency, time.monotonic())


async def _poll_health(base_url: str, stop: asyncio.Event) -> list[tuple[int, float]]:
    results = []
    async with httpx.AsyncClient(timeout=10) as client:
        while not stop.is_set():
            sent = time.monotonic()
            status = (await client.get(f"{base_url}/health")).status_code
            results.append((status, time.monotonic() - sent))
            await asyncio.sleep(0.05)
    return results


async def _burst(server: ServerProcess, size: int, max_tokens: int = MAX_TOKENS
                 ) -> tuple[list[Reply], list[tuple[int, float]]]:
    stop = asyncio.Event()
    health = asyncio.create_task(_poll_health(server.base_url, stop))
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=size)) as client:
        replies = await asyncio.gather(*(_send(client, server.url, i, max_tokens) for i in range(size)))
    stop.set()
    return list(replies), await health


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    with running_server([str(tiny_model_dir), *FLAGS]) as server:
        # The first forward passes are slow (lazy init); keep them out of the timed burst.
        httpx.post(f"{server.url}/completions", json={"prompt": "warm up", "max_tokens": 4}, timeout=60)
        yield server


@pytest.fixture(scope="module")
def burst(server: ServerProcess) -> SimpleNamespace:
    """The burst of BURST concurrent requests, run once for the module, and the /metrics scrape after it."""
    before = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    fast_s = time_limit(FAST_S)  # calibrated right before the burst, for the load it meets
    replies, health = asyncio.run(_burst(server, BURST))
    return SimpleNamespace(replies=replies, health=health, metrics_before=before, fast_s=fast_s)


def test_exactly_the_admitted_requests_succeed(burst: SimpleNamespace) -> None:
    statuses = sorted(r.status for r in burst.replies)
    refused = [r for r in burst.replies if r.status == 503]
    served = [r for r in burst.replies if r.status == 200]
    timing = (f"last refusal answered at {max((r.done_at for r in refused), default=0):.3f}, first success "
              f"finished at {min((r.done_at for r in served), default=0):.3f} (a later refusal means the burst "
              "was too slow to be one burst)")
    assert statuses == [200] * ADMITTED + [503] * (BURST - ADMITTED), timing


def test_refusals_are_fast_openai_errors_with_retry_after(burst: SimpleNamespace, helpers: SimpleNamespace) -> None:
    refused = [r for r in burst.replies if r.status == 503]
    assert refused
    for reply in refused:
        assert reply.latency < burst.fast_s, f"a 503 took {reply.latency:.3f} s (limit {burst.fast_s:.2f} s)"
        assert reply.headers.get("retry-after", "").isdigit() and int(reply.headers["retry-after"]) >= 1
        assert reply.headers["content-type"].startswith("application/json")
        body = json.loads(reply.body)
        assert helpers.error_shape_problems(body) == []
        assert body["error"]["code"] == "queue_full"


def test_a_refused_stream_is_a_503_before_any_sse_header(burst: SimpleNamespace) -> None:
    refused_streams = [r for r in burst.replies if r.stream and r.status == 503]
    assert refused_streams, "no streaming request was refused; the burst did not exercise this path"
    for reply in refused_streams:
        assert not reply.headers["content-type"].startswith("text/event-stream")
        assert not reply.body.startswith("data:")


def test_admitted_requests_run_to_the_end(burst: SimpleNamespace, serving_checks: SimpleNamespace) -> None:
    served = [r for r in burst.replies if r.status == 200]
    for reply in served:
        if reply.stream:
            assert reply.headers["content-type"].startswith("text/event-stream")
            assert serving_checks.problems(reply.body) == []
        else:
            body = json.loads(reply.body)
            assert body["usage"]["completion_tokens"] == MAX_TOKENS
            assert body["choices"][0]["finish_reason"] == "length"


def test_health_answers_fast_during_the_burst(burst: SimpleNamespace) -> None:
    assert len(burst.health) >= 3, f"only {len(burst.health)} /health polls ran during the burst"
    assert all(status == 200 for status, _ in burst.health)
    slowest = max(latency for _, latency in burst.health)
    assert slowest < burst.fast_s, f"/health took {slowest:.3f} s under load (limit {burst.fast_s:.2f} s)"


def test_refusals_are_counted_and_capacity_comes_back(server: ServerProcess, burst: SimpleNamespace,
                                                      helpers: SimpleNamespace,
                                                      serving_checks: SimpleNamespace) -> None:
    after = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    rejected = [serving_checks.sample(text, "requests_rejected_total", reason="queue_full")
                for text in (burst.metrics_before, after)]
    assert rejected[1] - rejected[0] == BURST - ADMITTED
    free, total = helpers.wait_blocks_free(server.base_url, timeout=1.0)
    assert free == total
    # Every seat was given back: a second burst of exactly the capacity is admitted whole.
    replies, _ = asyncio.run(_burst(server, ADMITTED, max_tokens=8))
    assert [r.status for r in replies] == [200] * ADMITTED


def test_a_request_larger_than_the_capacity_is_a_400_not_a_retry(server: ServerProcess,
                                                                  helpers: SimpleNamespace) -> None:
    prompts = [f"prompt {i}" for i in range(ADMITTED + 1)]
    response = httpx.post(f"{server.url}/completions", json={"prompt": prompts, "max_tokens": 2}, timeout=30)
    assert response.status_code == 400
    assert helpers.error_shape_problems(response.json()) == []
    assert str(ADMITTED) in response.json()["error"]["message"]
    assert "retry-after" not in response.headers
    fits = httpx.post(f"{server.url}/completions", json={"prompt": prompts[:ADMITTED], "max_tokens": 2}, timeout=30)
    assert fits.status_code == 200
    assert len(fits.json()["choices"]) == ADMITTED
