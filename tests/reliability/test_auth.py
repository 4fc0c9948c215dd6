"""API keys against live servers: every non-public route needs one, near-misses and path tricks get 401."""

from __future__ import annotations

import argparse
import base64
import itertools
import logging
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import yaml
from starlette.routing import Route

from flashllm.cli import serve as serve_cli
from flashllm.serving.app import PUBLIC_PATHS, create_app
from flashllm.testing.server import ServerProcess, running_server

ENV_KEY = "env-Key-3c5e"
COMPLETION = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
# What the routes answer with a key; a trick that reaches a protected route would show one of these.
PROTECTED_MARKERS = (b'"object":"list"', b"flashllm:kv_blocks_total", b'"text_completion"')


def route_table() -> list[tuple[str, str]]:
    """(method, path) of every route the app defines, read from the app itself so a new route is covered."""
    app = create_app(SimpleNamespace(), api_keys=["unused"])  # handlers read the context only when called
    routes = [(method, route.path) for route in app.routes if isinstance(route, Route)
              for method in sorted(route.methods or ()) if method != "HEAD"]
    assert routes, "the app defines no routes"
    return routes


ROUTES = route_table()
PROTECTED = [(method, path) for method, path in ROUTES if path not in PUBLIC_PATHS]


BODIES = {"/v1/completions": COMPLETION, "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}],
                                                                    "max_tokens": 2},
          "/tokenize": {"prompt": "Hi"}, "/detokenize": {"tokens": [1, 2]}, "/v1/embeddings": {"input": "Hi"},
          "/v1/responses": {"input": "Hi", "max_output_tokens": 2}}


def _send(client: httpx.Client, method: str, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    if "{response_id}" in path and headers is not None:  # a stored response's id, made with the same key
        stored = client.post("/v1/responses", json=BODIES["/v1/responses"], headers=headers).json()
        path = path.replace("{response_id}", stored["id"])
    return client.request(method, path, json=BODIES.get(path), headers=headers)


def _assert_401(reply: httpx.Response, helpers: SimpleNamespace) -> None:
    assert reply.status_code == 401, f"{reply.status_code}: {reply.text[:300]}"
    assert reply.headers.get("www-authenticate", "").lower().startswith("bearer")
    assert helpers.error_shape_problems(reply.json()) == []
    assert reply.json()["error"]["code"] == "invalid_api_key"


@pytest.fixture(scope="module")
def client(keyed_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=keyed_server.base_url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def env_key_server(tiny_model_dir: Path, helpers: SimpleNamespace) -> Iterator[ServerProcess]:
    with running_server([str(tiny_model_dir), *helpers.engine_flags], env={"FLASHLLM_API_KEY": ENV_KEY}) as server:
        yield server


def test_route_table_has_the_known_routes_and_only_health_and_ready_are_public() -> None:
    paths = {path for _, path in ROUTES}
    assert {"/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize",
            "/version", "/metrics", "/health", "/ready"} <= paths
    assert PUBLIC_PATHS == {"/health", "/ready"}


@pytest.mark.parametrize(("method", "path"), PROTECTED, ids=[f"{m} {p}" for m, p in PROTECTED])
def test_every_protected_route_needs_a_key(client: httpx.Client, helpers: SimpleNamespace, method: str,
                                           path: str) -> None:
    _assert_401(_send(client, method, path), helpers)
    with_key = _send(client, method, path, {"Authorization": f"Bearer {helpers.api_keys[0]}"})
    assert with_key.status_code == 200, f"{with_key.status_code}: {with_key.text[:300]}"


@pytest.mark.parametrize("path", sorted(PUBLIC_PATHS))
def test_health_and_ready_are_public(client: httpx.Client, path: str) -> None:
    assert client.get(path).status_code == 200


@pytest.mark.parametrize("path", ["/", "/v1/rerank", "/v2/models", "/admin", "/v1/models/x", "/health/x"])
def test_unknown_paths_need_a_key_before_they_say_404(client: httpx.Client, helpers: SimpleNamespace,
                                                      path: str) -> None:
    # Without a key the server must not reveal which paths exist.
    _assert_401(client.get(path), helpers)
    assert client.get(path, headers={"Authorization": f"Bearer {helpers.api_keys[1]}"}).status_code == 404


def _near_misses(key: str) -> dict[str, str | None]:
    """Authorization header values that are almost right (None: no header at all)."""
    basic = base64.b64encode(f"user:{key}".encode()).decode()
    return {
        "missing": None, "empty": "", "scheme only": "Bearer",
        "upper case": f"Bearer {key.upper()}", "lower case": f"Bearer {key.lower()}",
        "swapped case": f"Bearer {key.swapcase()}", "prefix": f"Bearer {key[:-1]}", "suffix": f"Bearer {key}x",
        "leading extra": f"Bearer x{key}", "first character": f"Bearer {key[0]}", "no scheme": key,
        "basic scheme": f"Basic {basic}", "token scheme": f"Token {key}", "scheme glued": f"Bearer{key}",
        "two spaces": f"Bearer  {key}", "two keys glued": f"Bearer {key}{key}", "comma list": f"Bearer {key},{key}",
    }


@pytest.mark.parametrize("kind", list(_near_misses("k")))
@pytest.mark.parametrize("route", [("GET", "/v1/models"), ("POST", "/v1/completions")], ids=["models", "completions"])
def test_near_miss_keys_get_401(client: httpx.Client, helpers: SimpleNamespace, kind: str,
                                route: tuple[str, str]) -> None:
    for key in helpers.api_keys:
        value = _near_misses(key)[kind]
        _assert_401(_send(client, *route, headers=None if value is None else {"Authorization": value}), helpers)


def test_keys_sent_elsewhere_than_the_authorization_header_get_401(client: httpx.Client,
                                                                     helpers: SimpleNamespace) -> None:
    key = helpers.api_keys[0]
    _assert_401(client.get("/v1/models", headers={"X-API-Key": key, "Api-Key": key}), helpers)
    _assert_401(client.get("/v1/models", params={"api_key": key, "key": key}), helpers)
    _assert_401(client.get("/v1/models", headers={"Cookie": f"api_key={key}; session={key}"}), helpers)


def test_both_keys_work_and_the_scheme_is_case_insensitive(client: httpx.Client, helpers: SimpleNamespace) -> None:
    for key in helpers.api_keys:
        for scheme in ("Bearer", "bearer", "BEARER"):
            headers = {"Authorization": f"{scheme} {key}"}
            assert client.get("/v1/models", headers=headers).status_code == 200
            reply = client.post("/v1/completions", json=COMPLETION, headers=headers)
            assert reply.status_code == 200, reply.text[:300]
            assert reply.json()["usage"]["completion_tokens"] == COMPLETION["max_tokens"]


def test_flashllm_api_key_environment_variable(env_key_server: ServerProcess, helpers: SimpleNamespace) -> None:
    with httpx.Client(base_url=env_key_server.base_url, timeout=30) as client:
        assert client.get("/health").status_code == 200
        _assert_401(client.get("/v1/models"), helpers)
        _assert_401(client.get("/v1/models", headers={"Authorization": f"Bearer {helpers.api_keys[0]}"}), helpers)
        _assert_401(client.get("/v1/models", headers={"Authorization": f"Bearer {ENV_KEY.upper()}"}), helpers)
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {ENV_KEY}"}).status_code == 200
        assert client.get("/metrics", headers={"Authorization": f"Bearer {ENV_KEY}"}).status_code == 200


def raw_exchange(port: int, request: bytes, timeout: float = 5.0) -> bytes:
    """Send `request` bytes as they are (httpx would normalize the target) and read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _statuses(response: bytes) -> list[int]:
    # pipelined responses follow each other's bodies directly, so status lines are not always line-initial
    return [int(code) for code in re.findall(rb"HTTP/1\.[01] (\d{3}) ", response)]


def _tricks(port: int) -> dict[str, bytes]:
    """Raw requests that try to reach a protected route without a key by confusing host or path handling."""
    body = b'{"prompt": "Hi", "max_tokens": 1}'

    def get(target: str, host: str = "127.0.0.1", extra: str = "") -> bytes:
        return f"GET {target} HTTP/1.1\r\nHost: {host}\r\n{extra}Connection: close\r\n\r\n".encode()

    return {
        "host with a public path": get("/v1/models", host="localhost/health"),
        "host with path and query": get("/metrics", host="127.0.0.1/health?x="),
        "absolute-form target": get("http://127.0.0.1/v1/models"),
        "absolute-form through health": get(f"http://127.0.0.1:{port}/health/../v1/models"),
        "absolute-form with public host path": get("http://localhost/health/v1/models"),
        "double slash": get("//v1/models"),
        "dot-dot after health": get("/health/../v1/models"),
        "encoded dot-dot after health": get("/health/%2e%2e/v1/models"),
        "encoded slashes after health": get("/health%2F..%2Fv1%2Fmodels"),
        "dot segment": get("/./v1/models"),
        "trailing slash": get("/v1/models/"),
        "percent-encoded v1": get("/%76%31/models"),
        "encoded slash": get("/v1%2Fmodels"),
        "semicolon parameter": get("/health;/../v1/models"),
        "upper-case health": get("/HEALTH/../v1/models"),
        "NUL after health": get("/health%00/../v1/models"),
        "rewrite headers": get("/v1/models", extra="X-Original-URL: /health\r\nX-Rewrite-URL: /health\r\n"
                                                   "X-Forwarded-Prefix: /health\r\nX-Forwarded-Host: localhost\r\n"),
        "forwarded-for loopback": get("/metrics", extra="X-Forwarded-For: 127.0.0.1\r\nX-Real-IP: 127.0.0.1\r\n"),
        "no host, HTTP/1.0": b"GET /v1/models HTTP/1.0\r\n\r\n",
        "post through health": (b"POST /health/../v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                                % (len(body), body)),
    }


@pytest.mark.parametrize("trick", list(_tricks(0)))
def test_host_and_path_tricks_never_reach_a_protected_route(keyed_server: ServerProcess, trick: str) -> None:
    response = raw_exchange(keyed_server.port, _tricks(keyed_server.port)[trick])
    statuses = _statuses(response)
    assert len(statuses) == 1 and statuses[0] in (400, 401), f"answered {statuses}: {response[:400]!r}"
    assert not any(marker in response for marker in PROTECTED_MARKERS), response[:400]


def test_a_public_request_does_not_unlock_the_next_one_on_the_same_connection(keyed_server: ServerProcess) -> None:
    pipelined = (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
                 b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
                 b"GET /health?next=/v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    response = raw_exchange(keyed_server.port, pipelined)
    assert _statuses(response) == [200, 401, 200]
    assert not any(marker in response for marker in PROTECTED_MARKERS)


def test_keys_never_appear_in_the_server_log(keyed_server: ServerProcess, env_key_server: ServerProcess,
                                             client: httpx.Client, helpers: SimpleNamespace) -> None:
    # Make sure both servers saw right and wrong keys in this test, whatever ran before it.
    for key in helpers.api_keys:
        client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        client.get("/v1/models", headers={"Authorization": f"Bearer {key}x"})
    httpx.get(f"{env_key_server.url}/models", headers={"Authorization": f"Bearer {ENV_KEY}"}, timeout=10)
    logs = keyed_server.log() + env_key_server.log()
    assert logs.strip(), "the server logs are empty; the check below would prove nothing"
    for key in (*helpers.api_keys, ENV_KEY):
        assert key not in logs
        assert key[: len(key) // 2 + 1] not in logs, "a key prefix is logged"


# --- command-line side: the bind warning and option precedence (no server needed) ---


def _serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("FLASHLLM_")]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize(("host", "keys", "warns"), [
    ("0.0.0.0", [], True), ("::", [], True), ("192.0.2.7", [], True), ("example.com", [], True),
    ("0.0.0.0", ["--api-key", "bind-Key-7"], False), ("127.0.0.1", [], False), ("127.0.0.2", [], False),
    ("::1", [], False), ("localhost", [], False),
])
def test_binding_beyond_loopback_without_a_key_warns(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                                     clean_env: None, host: str, keys: list[str], warns: bool) -> None:
    import flashllm.serving.server as server_module

    started: list[dict[str, Any]] = []
    monkeypatch.setattr(server_module, "build_server", lambda options: started.append(options) or "built")
    monkeypatch.setattr(server_module, "serve", lambda built, options: 0)
    with caplog.at_level(logging.WARNING, logger="flashllm.serve"):
        assert serve_cli.run(_serve_args(["--host", host, *keys])) == 0
    assert started and started[0]["host"] == host
    warnings = [r.getMessage() for r in caplog.records if "without --api-key" in r.getMessage()]
    assert bool(warnings) == warns, warnings
    assert all(host in w and "bind-Key-7" not in w for w in warnings)


# Each option gets values from disjoint ranges per source, so the winner is identifiable.
PRECEDENCE_CASES = {
    "port": (lambda i: str(1000 + i), lambda i: str(2000 + i), lambda i: 3000 + i, int),
    "request_timeout": (lambda i: f"{i}.5", lambda i: f"{i}.25", lambda i: i + 0.75, float),
    # repeatable (aliases): a list from every source
    "served_model_name": (lambda i: f"cli{i}", lambda i: f"env{i}", lambda i: [f"yaml{i}"], lambda v: [v]),
    "max_queue": (lambda i: str(10 + i), lambda i: str(20 + i), lambda i: 30 + i, int),
}


# cli/serve.py only pops a --config key when it is the value used, so a key that the command line
# or the environment overrides is then refused as "unknown" (also `model`, skipped by `or`).


def _resolve(option: str, i: int, where: tuple[bool, bool, bool], tmp_path: Path) -> dict[str, Any]:
    cli_value, env_value, yaml_value, _ = PRECEDENCE_CASES[option]
    in_cli, in_env, in_yaml = where
    argv = [f"--{option.replace('_', '-')}", cli_value(i)] if in_cli else []
    environ = {f"FLASHLLM_{option.upper()}": env_value(i)} if in_env else {}
    if in_yaml:
        config = tmp_path / f"serve-{option}-{i}-{''.join('01'[w] for w in where)}.yaml"
        config.write_text(yaml.safe_dump({option.replace("_", "-"): yaml_value(i)}))
        argv += ["--config", str(config)]
    return serve_cli.resolve_options(_serve_args(argv), environ)


def _expected(option: str, i: int, where: tuple[bool, bool, bool]) -> Any:
    cli_value, env_value, yaml_value, kind = PRECEDENCE_CASES[option]
    in_cli, in_env, in_yaml = where
    return kind(cli_value(i)) if in_cli else kind(env_value(i)) if in_env else \
        yaml_value(i) if in_yaml else serve_cli.OPTIONS[option][1]


def _precedence_params() -> list[Any]:
    """Every option x every subset of (command line, environment, config file), all 32 of them."""
    params = []
    for option in sorted(PRECEDENCE_CASES):
        for where in itertools.product((False, True), repeat=3):
            sources = "+".join(n for n, w in zip(("cli", "env", "yaml"), where, strict=True) if w) or "default"
            params.append(pytest.param(option, where, id=f"{option}-{sources}"))
    return params


@pytest.mark.parametrize(("option", "where"), _precedence_params())
def test_resolve_options_precedence(tmp_path: Path, option: str, where: tuple[bool, bool, bool]) -> None:
    resolved = _resolve(option, 7, where, tmp_path)[option]
    expected = _expected(option, 7, where)
    assert resolved == expected and type(resolved) is type(expected)


def test_api_keys_and_model_follow_the_same_precedence(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"api-key": ["yaml-a", "yaml-b"], "model": "yaml-model", "ui": True}))
    file_only = serve_cli.resolve_options(_serve_args(["--config", str(config)]), {})
    assert (file_only["api_key"], file_only["model"], file_only["ui"]) == (["yaml-a", "yaml-b"], "yaml-model", True)
    assert serve_cli.resolve_options(_serve_args([]), {})["api_key"] is None
    env = serve_cli.resolve_options(_serve_args(["--config", str(config)]),
                                    {"FLASHLLM_API_KEY": "env", "FLASHLLM_MODEL": "env-model", "FLASHLLM_UI": "0"})
    assert (env["api_key"], env["model"], env["ui"]) == (["env"], "env-model", False)
    both = serve_cli.resolve_options(_serve_args(["cli-model", "--api-key", "a", "--api-key", "b", "--config",
                                                  str(config)]), {"FLASHLLM_API_KEY": "env"})
    assert (both["api_key"], both["model"]) == (["a", "b"], "cli-model")


@pytest.mark.parametrize(("content", "environ", "needle"), [
    ({"port": 1, "api_keys": ["typo"]}, {}, "api_keys"),
    ({"max-num-seq": 4}, {}, "max_num_seq"),
    ({"port": "eighty"}, {}, "port"),
    ({"port": True}, {}, "port"),
    ([1, 2], {}, "mapping"),
    ({}, {"FLASHLLM_PORT": "eighty"}, "FLASHLLM_PORT"),
    ({}, {"FLASHLLM_UI": "maybe"}, "FLASHLLM_UI"),
])
def test_bad_configuration_is_refused_by_name(tmp_path: Path, content: Any, environ: dict[str, str],
                                              needle: str) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(content))
    with pytest.raises(SystemExit) as refused:
        serve_cli.resolve_options(_serve_args(["--config", str(config)]), environ)
    assert needle in str(refused.value)
