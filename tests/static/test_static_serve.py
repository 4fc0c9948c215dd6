"""`flashllm serve --mode static` on 127.0.0.1: the same answers as the dynamic server, streaming, 400s, aborts."""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from flashllm.testing.server import ServerProcess, running_server  # noqa: E402

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
COMMON = ["--max-model-len", "256", "--max-num-seqs", "4", "--dtype", "float32"]
PAGED = ["--backend", "reference", "--block-size", "16", "--num-kv-blocks", "96"]


@pytest.fixture(scope="module")
def static_server(exported: dict[str, Path]) -> Iterator[ServerProcess]:
    with running_server([str(exported["qwen2"]), "--mode", "static", *COMMON]) as server:
        yield server


@pytest.fixture(scope="module")
def dynamic_server(model_dirs: dict[str, Path], onnx_ready: None) -> Iterator[ServerProcess]:
    with running_server([str(model_dirs["qwen2"]), *COMMON, *PAGED]) as server:
        yield server


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def clients(static_server: ServerProcess, dynamic_server: ServerProcess) -> tuple[openai.OpenAI, openai.OpenAI]:
    return _client(static_server), _client(dynamic_server)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_say_static_mode_its_provider_and_batching(static_server: ServerProcess) -> None:
    import onnxruntime

    (entry,) = httpx.get(f"{static_server.url}/models").json()["data"]
    cuda = "CUDAExecutionProvider" in onnxruntime.get_available_providers()
    assert entry["mode"] == "static" and entry["max_model_len"] == 256
    assert entry["execution_provider"] == ("CUDAExecutionProvider" if cuda else "CPUExecutionProvider")
    assert "one batch" in entry["batching"] and "no continuous batching" in entry["batching"]
    assert f"onnxruntime's {entry['execution_provider']}" in static_server.log()


def test_greedy_chat_with_logprobs_and_n_equals_the_dynamic_server(clients) -> None:
    replies = [c.chat.completions.create(model=_model(c), messages=MESSAGES, temperature=0, max_tokens=12, n=2,
                                         logprobs=True, top_logprobs=2) for c in clients]
    ours, theirs = replies
    assert [(c.message.content, c.finish_reason) for c in ours.choices] == \
        [(c.message.content, c.finish_reason) for c in theirs.choices]
    assert ours.usage == theirs.usage
    for a, b in zip(ours.choices[0].logprobs.content, theirs.choices[0].logprobs.content, strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]


def test_seeded_completions_with_stops_equal_the_dynamic_server(clients) -> None:
    kwargs = dict(prompt=["The sky is", "Once upon", "a b c"], temperature=0.9, seed=5, max_tokens=10, n=2,
                  stop=["e"], presence_penalty=0.5, extra_body={"top_k": 40})
    ours, theirs = [c.completions.create(model=_model(c), **kwargs) for c in clients]
    assert sorted((c.index, c.text, c.finish_reason) for c in ours.choices) == \
        sorted((c.index, c.text, c.finish_reason) for c in theirs.choices)
    assert ours.usage == theirs.usage


def test_streams_equal_whole_answers(clients) -> None:
    client = clients[0]
    kwargs = dict(model=_model(client), messages=MESSAGES, temperature=0.8, seed=11, max_tokens=20)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    kwargs = dict(model=_model(client), prompt=["a b", "c d e"], temperature=0, max_tokens=8, n=2)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {c.index: c.text for c in client.completions.create(**kwargs).choices}


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"prompt": [1, 512]}, "prompt", None),  # the export's vocabulary has 512 tokens
    ({"prompt": "hi", "max_tokens": 300}, "max_tokens", "context_length_exceeded"),
    ({"prompt": list(range(1, 257))}, "prompt", "context_length_exceeded"),
    ({"prompt": "hi", "logit_bias": {"512": 1.0}}, "logit_bias", None),
    ({"prompt": "hi", "echo": True, "logprobs": 1}, "echo", None),
])
def test_requests_that_cannot_run_get_a_400(static_server: ServerProcess, body: dict, param: str,
                                            code: str | None) -> None:
    response = httpx.post(f"{static_server.url}/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == code and error["message"]
    assert httpx.get(f"{static_server.base_url}/health").status_code == 200


def _running(server: ServerProcess) -> float:
    metrics = httpx.get(f"{server.base_url}/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("flashllm:num_requests_running{"))
    return float(line.rsplit(" ", 1)[1])


def test_a_disconnected_stream_leaves_the_batch_and_later_requests_run(static_server: ServerProcess) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{static_server.url}/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it is decoding
    deadline = time.monotonic() + 20
    while _running(static_server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running(static_server) == 0
    reply = httpx.post(f"{static_server.url}/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 3


def test_a_request_sent_mid_batch_gets_the_answer_it_gets_alone(static_server: ServerProcess) -> None:
    """The second request arrives while the first decodes: it waits for that batch, then runs; neither changes."""
    bodies = [{"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "temperature": 0},
              {"prompt": "The sky", "max_tokens": 5, "temperature": 0}]
    alone = [httpx.post(f"{static_server.url}/completions", json=b, timeout=60).json()["choices"][0]["text"]
             for b in bodies]
    second: dict[str, str] = {}

    def send_second() -> None:
        reply = httpx.post(f"{static_server.url}/completions", json=bodies[1], timeout=60)
        second["text"] = reply.json()["choices"][0]["text"]

    thread = threading.Thread(target=send_second)
    first = ""
    with httpx.stream("POST", f"{static_server.url}/completions", json={**bodies[0], "stream": True},
                      timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            if thread.ident is None:
                thread.start()  # the first batch is decoding now
            first += json.loads(line.removeprefix("data: "))["choices"][0]["text"]
    thread.join(60)
    assert [first, second["text"]] == alone


def _serve_args(argv: list[str]) -> argparse.Namespace:
    from flashllm.cli import serve

    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


@pytest.mark.parametrize(("argv", "needle"), [
    (["export-dir", "--mode", "static", "--block-size", "16"], "--block-size"),
    (["export-dir", "--mode", "static", "--backend", "cpu", "--no-prefix-caching"], "--backend, --no-prefix-caching"),
    (["export-dir", "--mode", "graph"], "--mode 'graph' is not one of: dynamic, static"),
])
def test_serve_refuses_options_static_mode_cannot_use(argv: list[str], needle: str) -> None:
    from flashllm.cli import serve

    with pytest.raises(SystemExit) as refused:
        serve.resolve_options(_serve_args(argv), environ={})
    assert needle in str(refused.value)
    assert serve.resolve_options(_serve_args(["export-dir", "--mode", "static", "--max-num-seqs", "2"]),
                                 environ={})["mode"] == "static"


def test_serve_without_onnxruntime_exits_with_the_install_hint(exported: dict[str, Path], monkeypatch) -> None:
    import sys

    from flashllm.cli import serve
    from flashllm.serving.server import build_server

    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    options = serve.resolve_options(_serve_args([str(exported["qwen2"]), "--mode", "static"]), environ={})
    with pytest.raises(SystemExit) as refused:
        build_server(options)
    assert "pip install 'flashllm[onnx]'" in str(refused.value) and len(str(refused.value).splitlines()) == 1
