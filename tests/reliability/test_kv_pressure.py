"""KV pressure: a cache that holds one max-length sequence forces preemption; outputs equal solo runs."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from flashllm.testing.server import ServerProcess, free_port, running_server

MAX_MODEL_LEN, BLOCK_SIZE = 128, 16
BLOCKS_PER_SEQ = MAX_MODEL_LEN // BLOCK_SIZE  # exactly one max-length sequence fits
FLAGS = ["--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE),
         "--num-kv-blocks", str(BLOCKS_PER_SEQ), "--max-num-seqs", "4"]

# (path, body): greedy completions, streamed and not, chats that fill the whole context (no
# max_tokens: the budget is what the prompt leaves), and one seeded sampled request whose
# per-request generator must survive preemption too.
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/completions", {"prompt": "Once upon a time", "max_tokens": 100}),
    ("/completions", {"prompt": "The sky is", "max_tokens": 110, "stream": True}),
    ("/completions", {"prompt": "Numbers: 1 2 3 4 5", "max_tokens": 96}),
    ("/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}]}),
    ("/chat/completions", {"messages": [{"role": "user", "content": "Count to ten."}], "stream": True}),
    ("/completions", {"prompt": "Hello there", "max_tokens": 100, "temperature": 1.0, "seed": 7}),
]


def _body(body: dict[str, Any]) -> dict[str, Any]:
    return {"temperature": 0, "ignore_eos": True, **body}


async def _run(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]) -> tuple[int, str]:
    async with client.stream("POST", url + path, json=_body(body)) as response:
        return response.status_code, (await response.aread()).decode()


def _answer(path: str, body: dict[str, Any], text: str, serving_checks: SimpleNamespace) -> tuple[str, str | None]:
    """(generated text, finish_reason) of a whole or streamed reply."""
    if body.get("stream"):
        assert serving_checks.problems(text) == []
        finishes = [c["finish_reason"] for p in serving_checks.payloads(text)[:-1]
                    for c in json.loads(p)["choices"] if c["finish_reason"]]
        return serving_checks.texts(text)[0], finishes[0]
    choice = json.loads(text)["choices"][0]
    return (choice["text"] if path == "/completions" else choice["message"]["content"]), choice["finish_reason"]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    with running_server([str(tiny_model_dir), *FLAGS]) as server:
        yield server


@pytest.fixture(scope="module")
def runs(server: ServerProcess, serving_checks: SimpleNamespace) -> SimpleNamespace:
    """Every request alone (one after another), then all at once; the preemption count around the latter."""

    async def solo_then_together() -> tuple[list[tuple[int, str]], list[tuple[int, str]], float, float]:
        async with httpx.AsyncClient(timeout=120) as client:
            solo = [await _run(client, server.url, path, body) for path, body in REQUESTS]
            before = serving_checks.sample((await client.get(f"{server.base_url}/metrics")).text, "num_preemptions")
            together = await asyncio.gather(*(_run(client, server.url, path, body) for path, body in REQUESTS))
            after = serving_checks.sample((await client.get(f"{server.base_url}/metrics")).text, "num_preemptions")
        return solo, list(together), before, after

    solo, together, before, after = asyncio.run(solo_then_together())
    return SimpleNamespace(solo=solo, together=together, preemptions=after - before)


def test_a_tiny_cache_forces_preemption(runs: SimpleNamespace) -> None:
    assert all(status == 200 for status, _ in runs.solo + runs.together), [s for s, _ in runs.together]
    assert runs.preemptions > 0, "the concurrent requests never ran out of KV blocks; the test lost its point"


def test_outputs_under_pressure_equal_solo_runs(runs: SimpleNamespace, serving_checks: SimpleNamespace) -> None:
    for (path, body), (_, alone), (_, crowded) in zip(REQUESTS, runs.solo, runs.together, strict=True):
        expected = _answer(path, body, alone, serving_checks)
        assert expected[0], f"{path} {body} generated nothing alone"
        assert _answer(path, body, crowded, serving_checks) == expected, f"{path} {body}"


def test_whole_context_requests_use_every_position(runs: SimpleNamespace) -> None:
    for (path, body), (_, text) in zip(REQUESTS, runs.together, strict=True):
        if path == "/chat/completions" and not body.get("stream"):
            usage = json.loads(text)["usage"]
            assert usage["total_tokens"] == MAX_MODEL_LEN


def test_all_blocks_are_free_afterwards(server: ServerProcess, runs: SimpleNamespace,
                                        helpers: SimpleNamespace) -> None:
    free, total = helpers.wait_blocks_free(server.base_url, timeout=1.0)
    assert (free, total) == (BLOCKS_PER_SEQ, BLOCKS_PER_SEQ)


def test_refuses_to_start_when_one_sequence_cannot_fit(tiny_model_dir: Path) -> None:
    too_few = BLOCKS_PER_SEQ - 1
    cmd = [sys.executable, "-m", "flashllm", "serve", str(tiny_model_dir), "--max-model-len", str(MAX_MODEL_LEN),
           "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(too_few), "--host", "127.0.0.1",
           "--port", str(free_port())]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert "Traceback" not in output, output[-3000:]
    last = [line for line in output.splitlines() if line.strip()][-1]
    # Both numbers: what the cache holds and what one max_model_len sequence needs.
    assert re.search(rf"\b{too_few} blocks\b", last) and re.search(rf"\b{MAX_MODEL_LEN}\b", last), last
    assert re.search(rf"\b{BLOCKS_PER_SEQ} blocks\b", last), last
