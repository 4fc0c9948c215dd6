"""Shared fixtures and helpers for the reliability suites: the tiny served model, metrics, error shape."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

import httpx  # noqa: E402

from flashllm.testing.server import ServerProcess, running_server  # noqa: E402
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

# Small enough that a prompt or max_tokens past the context is cheap to write; 64 blocks of 16
# tokens hold eight 128-token sequences, so a batch of 8 runs without preemption.
MAX_MODEL_LEN = 128
ENGINE_FLAGS = ["--max-model-len", str(MAX_MODEL_LEN), "--block-size", "16", "--num-kv-blocks", "64",
                "--max-num-seqs", "8"]
# Mixed case and digits so that a case-folded or truncated comparison would be noticed.
API_KEYS = ("key-One-1f9c", "second-KEY-2b7d")
# A traceback, a Python file or an absolute path inside an error message leaks server internals.
LEAK_PATTERN = re.compile(r"Traceback|File \"|\.py\b|/(?:home|usr|tmp|work|root|site-packages)/")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random qwen2 model with a tokenizer and a chatml template (built once per session)."""
    return build_tiny_model(tmp_path_factory.mktemp("reliability-model"), "qwen2", seed=3)


@pytest.fixture(scope="session")
def keyed_server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    """One server for the session, started with `--api-key` for both API_KEYS (a start costs ~15 s)."""
    keys = [arg for key in API_KEYS for arg in ("--api-key", key)]
    with running_server([str(tiny_model_dir), *ENGINE_FLAGS, *keys]) as server:
        yield server


@pytest.fixture(scope="session")
def auth_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEYS[0]}"}


def metric_value(metrics_text: str, name: str) -> float:
    """The value of the single sample `flashllm:<name>{...}` in a Prometheus text scrape."""
    pattern = re.compile(rf"^flashllm:{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
    values = pattern.findall(metrics_text)
    assert len(values) == 1, f"expected one flashllm:{name} sample, found {values!r}"
    return float(values[0])


def kv_blocks(base_url: str, headers: dict[str, str] | None = None) -> tuple[int, int]:
    """(free, total) KV blocks from /metrics."""
    text = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10).text
    return int(metric_value(text, "kv_blocks_free")), int(metric_value(text, "kv_blocks_total"))


def wait_blocks_free(base_url: str, headers: dict[str, str] | None = None, timeout: float = 5.0
                     ) -> tuple[int, int]:
    """Poll /metrics until every KV block is free (or `timeout`); returns the last (free, total)."""
    deadline = time.monotonic() + timeout
    free, total = kv_blocks(base_url, headers)
    while free != total and time.monotonic() < deadline:
        time.sleep(0.1)
        free, total = kv_blocks(base_url, headers)
    return free, total


def error_shape_problems(body: Any) -> list[str]:
    """What is wrong with an OpenAI error body `{"error": {"message", "type", "param", "code"}}` (empty: fine)."""
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return [f"not {{'error': {{...}}}}: {body!r:.300}"]
    err = body["error"]
    problems = []
    if set(err) != {"message", "type", "param", "code"}:
        problems.append(f"error keys are {sorted(err)}, expected code, message, param, type")
    if not isinstance(err.get("message"), str) or not err.get("message"):
        problems.append("error.message is not a non-empty string")
    elif LEAK_PATTERN.search(err["message"]):
        problems.append(f"error.message leaks internals: {err['message']!r:.300}")
    elif not err["message"].isprintable():
        problems.append(f"error.message holds control characters: {err['message']!r:.300}")
    if not isinstance(err.get("type"), str) or not err.get("type"):
        problems.append("error.type is not a non-empty string")
    if err.get("param") is not None and not isinstance(err["param"], str):
        problems.append("error.param is neither null nor a string")
    if err.get("code") is not None and not isinstance(err["code"], str):
        problems.append("error.code is neither null nor a string")
    return problems


@pytest.fixture(scope="session")
def helpers() -> SimpleNamespace:
    """This module's helpers and constants for test modules (conftest is not importable by name)."""
    return SimpleNamespace(
        metric_value=metric_value, kv_blocks=kv_blocks, wait_blocks_free=wait_blocks_free,
        error_shape_problems=error_shape_problems, api_keys=API_KEYS, engine_flags=list(ENGINE_FLAGS),
        max_model_len=MAX_MODEL_LEN,
    )


# ---- streams (backpressure, disconnect soak, KV pressure, shutdown suites) ----------------------

import json  # noqa: E402 - appended section


def sse_payloads(body: str) -> list[str]:
    """The `data:` payloads of a text/event-stream body, in order; raises ValueError on any other line."""
    payloads = []
    for event in body.split("\n\n"):
        for line in filter(None, event.split("\n")):
            if not line.startswith("data: "):
                raise ValueError(f"not an SSE data line: {line!r:.200}")
            payloads.append(line[len("data: "):])
    return payloads


def stream_problems(body: str) -> list[str]:
    """What is wrong with a finished OpenAI SSE stream (empty: fine).

    Fine: only `data:` events ending in a blank line; every payload but the last is a JSON chunk
    with `choices` and no `error`; each choice index gets exactly one finish_reason and nothing
    after it; the last payload is `[DONE]`.
    """
    if not body.endswith("\n\n"):
        return [f"the stream does not end with a blank line: {body[-200:]!r}"]
    try:
        payloads = sse_payloads(body)
    except ValueError as exc:
        return [str(exc)]
    if not payloads or payloads[-1] != "[DONE]" or payloads.count("[DONE]") != 1:
        return [f"expected exactly one final 'data: [DONE]', the stream ends with {payloads[-2:]!r:.300}"]
    problems: list[str] = []
    finished: set[int] = set()
    seen: set[int] = set()
    for payload in payloads[:-1]:
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            problems.append(f"a chunk is not JSON: {payload!r:.200}")
            continue
        if not isinstance(chunk, dict) or "error" in chunk or not isinstance(chunk.get("choices"), list):
            problems.append(f"not a completion chunk: {payload!r:.200}")
            continue
        for choice in chunk["choices"]:
            index = choice["index"]
            seen.add(index)
            if index in finished:
                problems.append(f"choice {index} got a chunk after its finish_reason: {payload!r:.200}")
            if choice.get("finish_reason") is not None:
                finished.add(index)
    if not seen:
        problems.append("the stream has no choices")
    problems += [f"choice {i} has no finish_reason" for i in sorted(seen - finished)]
    return problems


def stream_texts(body: str) -> dict[int, str]:
    """Choice index -> the text a stream delivered (completions `text` or chat `delta.content`)."""
    texts: dict[int, str] = {}
    for payload in sse_payloads(body):
        if payload == "[DONE]":
            continue
        for choice in json.loads(payload).get("choices", []):
            piece = choice["text"] if "text" in choice else (choice.get("delta") or {}).get("content") or ""
            texts[choice["index"]] = texts.get(choice["index"], "") + piece
    return texts


def stream_error(body: str) -> dict[str, Any] | None:
    """The error event that ended a stream (`{"error": {...}}`), or None if it did not end with one."""
    payloads = sse_payloads(body)
    if not payloads or not payloads[-1].startswith("{"):
        return None
    last = json.loads(payloads[-1])
    return last if isinstance(last, dict) and "error" in last else None


def metric_sample(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of the `flashllm:<name>` samples whose labels include `labels` (0.0 when none yet)."""
    total = 0.0
    for line in metrics_text.splitlines():
        match = re.fullmatch(rf"flashllm:{re.escape(name)}(?:\{{(.*)\}})? (\S+)", line)
        if match is None:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


@pytest.fixture(scope="session")
def serving_checks() -> SimpleNamespace:
    """The helpers above for test modules: SSE payloads / problems / texts / error, metric sample."""
    return SimpleNamespace(payloads=sse_payloads, problems=stream_problems, texts=stream_texts, error=stream_error,
                           sample=metric_sample)
