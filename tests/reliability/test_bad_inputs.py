"""The bad-input corpus against a live server: clear 4xx in OpenAI's shape, fast, and the server unharmed."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from flashllm.testing.server import ServerProcess
from flashllm.testing.timing import time_limit

# One JSON object per line: name, method, path, optional headers; a body as "json" (any JSON value),
# "raw" (text sent as is: NaN, broken JSON) or "raw_b64" (bytes); "repeat" {"MARKER": [unit, count]}
# expands MARKER in body, headers and path (big inputs stay small on disk); "chunked" sends the body
# without a Content-Length; "expect" the allowed statuses; "param" the allowed error.param (a value
# or a list); "type" and "code" the exact error.type and error.code (null: no finer code than the
# field); "shape": false for refusals by the HTTP parser, which never reach the app; "note".
CORPUS_PATH = Path(__file__).with_name("bad_inputs.jsonl")
LATENCY_LIMIT_S = 0.5  # on the idle team VM; scaled by the slowdown measured when a case is slower
CHUNK_BYTES = 64 << 10
CASE_KEYS = {"name", "method", "path", "headers", "json", "raw", "raw_b64", "repeat", "chunked", "shape", "expect",
             "param", "type", "code", "note"}
CANARY = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@dataclass
class Case:
    """One corpus line, with its `repeat` markers expanded into the bytes that go on the wire."""

    name: str
    method: str
    path: str
    expect: set[int]
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    chunked: bool = False
    check_shape: bool = True
    params: set[str | None] = field(default_factory=set)  # acceptable error.param values
    error_type: str | None = None
    code: str | None = None


def _expand(text: str, repeat: dict[str, list[Any]]) -> str:
    for marker, (unit, count) in repeat.items():
        text = text.replace(marker, unit * count)
    return text


def _parse_case(line: str) -> Case:
    raw = json.loads(line)
    unknown = set(raw) - CASE_KEYS
    assert not unknown, f"corpus case {raw.get('name')!r} has unknown keys {sorted(unknown)}"
    assert sum(k in raw for k in ("json", "raw", "raw_b64")) <= 1, f"{raw['name']}: give one body kind"
    repeat = raw.get("repeat", {})
    body: bytes | None = None
    if "json" in raw:
        body = _expand(json.dumps(raw["json"]), repeat).encode()
    elif "raw" in raw:
        body = _expand(raw["raw"], repeat).encode("utf-8", "surrogatepass")
    elif "raw_b64" in raw:
        body = base64.b64decode(raw["raw_b64"])
    headers = {k: _expand(v, repeat) for k, v in raw.get("headers", {}).items()}
    if body is not None:
        headers = {"Content-Type": "application/json", **headers}
    shape = raw.get("shape", True)
    assert not shape or {"param", "type", "code"} <= set(raw), \
        f"{raw['name']}: give the expected error.param, error.type and error.code (null if none)"
    param = raw.get("param")
    params = set(param) if isinstance(param, list) else {param}
    return Case(raw["name"], raw["method"], _expand(raw["path"], repeat), set(raw["expect"]), body, headers,
                bool(raw.get("chunked")), shape, params, raw.get("type"), raw.get("code"))


def load_corpus() -> list[Case]:
    lines = [line for line in CORPUS_PATH.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [_parse_case(line) for line in lines]


CORPUS = load_corpus()


def _chunks(body: bytes) -> Iterator[bytes]:
    for start in range(0, len(body), CHUNK_BYTES):
        yield body[start:start + CHUNK_BYTES]


@pytest.fixture(scope="module")
def client(keyed_server: ServerProcess, auth_headers: dict[str, str]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=keyed_server.base_url, headers=auth_headers, timeout=30) as client:
        yield client


def _canary_text(client: httpx.Client) -> str:
    reply = client.post("/v1/completions", json=CANARY)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def canary_before(client: httpx.Client) -> str:
    """The greedy canary's text before any corpus case was sent (also warms the server up)."""
    return _canary_text(client)


def test_corpus_is_big_and_well_formed() -> None:
    names = [case.name for case in CORPUS]
    assert len(names) >= 100
    assert len(set(names)) == len(names), "corpus case names must be unique"
    assert all(case.expect and all(400 <= s < 500 for s in case.expect) for case in CORPUS)


@pytest.mark.parametrize("case", CORPUS, ids=[case.name for case in CORPUS])
def test_bad_input_gets_a_clear_4xx(client: httpx.Client, canary_before: str, helpers: SimpleNamespace,
                                    case: Case) -> None:
    content: bytes | Iterator[bytes] | None = _chunks(case.body) if case.chunked and case.body else case.body
    started = time.perf_counter()
    reply = client.request(case.method, case.path, content=content, headers=case.headers)
    elapsed = time.perf_counter() - started
    assert reply.status_code < 500, f"server error {reply.status_code}: {reply.text[:500]}"
    assert reply.status_code in case.expect, f"got {reply.status_code}, expected {sorted(case.expect)}: " \
                                             f"{reply.text[:500]}"
    if elapsed >= LATENCY_LIMIT_S:  # calibrate only then: 7 x 9 ms per case would add seconds to the run
        limit = time_limit(LATENCY_LIMIT_S)
        assert elapsed < limit, f"answered in {elapsed:.3f} s (limit {limit:.2f} s at the current load)"
    if case.check_shape:
        assert reply.headers.get("content-type", "").startswith("application/json")
        error = reply.json()
        assert helpers.error_shape_problems(error) == []
        assert error["error"]["param"] in case.params, f"error names {error['error']['param']!r}, expected one " \
                                                       f"of {sorted(case.params, key=str)}: {error['error']['message']}"
        got = (error["error"]["type"], error["error"]["code"])
        assert got == (case.error_type, case.code), f"error (type, code) is {got}, expected " \
                                                    f"{(case.error_type, case.code)}: {error['error']['message']}"
        named = {p.split(".")[0] for p in case.params if p}
        assert not named or any(name in error["error"]["message"] for name in named), "the message must name the field"


def test_server_is_unharmed_after_the_corpus(keyed_server: ServerProcess, client: httpx.Client,
                                             auth_headers: dict[str, str], canary_before: str,
                                             helpers: SimpleNamespace) -> None:
    for case in CORPUS:  # resend everything so this test holds on its own (e.g. under -k)
        client.request(case.method, case.path, content=case.body, headers=case.headers)
    assert httpx.get(f"{keyed_server.base_url}/health", timeout=5).status_code == 200
    assert _canary_text(client) == canary_before
    free, total = helpers.wait_blocks_free(keyed_server.base_url, auth_headers)
    assert total > 0 and free == total, f"{total - free} of {total} KV blocks are still held"
    assert "Traceback" not in keyed_server.log()


def test_media_type_is_matched_without_case_or_parameters(client: httpx.Client) -> None:
    body = json.dumps({"prompt": "Hi", "max_tokens": 1, "temperature": 0}).encode()
    for content_type in ("Application/JSON", "application/json; charset=utf-8", "application/json;charset=UTF-8"):
        reply = client.post("/v1/completions", content=body, headers={"Content-Type": content_type})
        assert reply.status_code == 200, f"{content_type!r}: {reply.status_code} {reply.text[:300]}"


def test_a_refused_request_holds_no_kv_blocks(keyed_server: ServerProcess, client: httpx.Client,
                                              auth_headers: dict[str, str], helpers: SimpleNamespace) -> None:
    # Validation must run before any allocation: a stream of refusals leaves the pool untouched.
    free_before, total = helpers.kv_blocks(keyed_server.base_url, auth_headers)
    for _ in range(20):
        assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 10_000}).status_code == 400
    assert helpers.kv_blocks(keyed_server.base_url, auth_headers) == (free_before, total)
