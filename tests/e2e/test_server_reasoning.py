"""`serve --reasoning-parser`: a reply's think block comes back as reasoning_content, whole and streamed, and
tool calls are read from the content after it. The tiny model is held to a think block by guided_regex, on a
server that constrains the think block too (--structured-output-in-reasoning); by default a constraint holds
only after the block."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
httpx = pytest.importorskip("httpx")

from flashllm.testing.server import ServerProcess, running_server  # noqa: E402
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

MESSAGES = [{"role": "user", "content": "Think, then answer."}]
THINKING = r"<think>[a-z]{2,6}( [a-z]{2,6}){1,3}</think>\n\nanswer [a-z]{2,8}"
FLAGS = ["--max-model-len", "256", "--block-size", "16", "--num-kv-blocks", "64"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("reasoning"), "qwen3", seed=4)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    with running_server([str(model_dir), *FLAGS, "--reasoning-parser", "qwen3", "--structured-output-in-reasoning"]
                        ) as server:
        yield server


def _chat(server: ServerProcess, **body) -> dict:
    reply = httpx.post(f"{server.url}/chat/completions", json={"messages": MESSAGES, "max_tokens": 60,
                                                              "temperature": 0, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _stream(server: ServerProcess, **body) -> list[dict]:
    events = []
    with httpx.stream("POST", f"{server.url}/chat/completions", timeout=60,
                      json={"messages": MESSAGES, "max_tokens": 60, "temperature": 0, "stream": True, **body}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return events


def test_the_think_block_is_reasoning_content_and_the_rest_content(server: ServerProcess) -> None:
    message = _chat(server, guided_regex=THINKING)["choices"][0]["message"]
    assert message["content"].startswith("answer ") and "<think>" not in message["content"]
    words = message["reasoning_content"].split(" ")
    assert 2 <= len(words) <= 4 and all(w.isalpha() for w in words)


def test_a_streamed_reply_splits_the_same_way(server: ServerProcess) -> None:
    whole = _chat(server, guided_regex=THINKING)["choices"][0]["message"]
    deltas = [e["choices"][0]["delta"] for e in _stream(server, guided_regex=THINKING) if e.get("choices")]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert (reasoning, content) == (whole["reasoning_content"], whole["content"])
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content:])  # reasoning all came first


def test_a_reply_without_a_think_block_is_all_content(server: ServerProcess) -> None:
    message = _chat(server, guided_regex="plain [a-z]{3,8}")["choices"][0]["message"]
    assert message["content"].startswith("plain ") and message["reasoning_content"] is None


def test_tool_calls_are_read_after_the_think_block(server: ServerProcess) -> None:
    tools = [{"type": "function", "function": {"name": "look", "parameters": {"type": "object", "properties": {
        "q": {"type": "string"}}}}}]
    pattern = r'<think>[a-z]{2,6} [a-z]{2,6}</think>\n\n<tool_call>\n\{"name": "look", "arguments": \{"q": "[a-z]{1,5}"\}\}\n</tool_call>'
    choice = _chat(server, guided_regex=pattern, tools=tools, max_tokens=200)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "look" and json.loads(call["function"]["arguments"])["q"].isalpha()
    assert choice["message"]["reasoning_content"].count(" ") == 1


def test_an_unknown_parser_fails_start_up_in_one_line(model_dir: Path) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "flashllm", "serve", str(model_dir), "--reasoning-parser", "r1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].endswith("--reasoning-parser must be one of deepseek_r1, qwen3, "
                                                         "openai_gptoss, got 'r1'")


def test_an_earlier_reply_s_reasoning_reaches_the_template(model_dir: Path, tmp_path: Path) -> None:
    """An assistant message's reasoning_content (what this server answered) is handed to the template, which
    may render it back (Qwen3's does after the last user turn); as callers' text, a special token in it stays
    characters."""
    template = tmp_path / "reasoning.jinja"
    template.write_text("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
                        "{%- if m.reasoning_content is defined %}{{- '<think>' + m.reasoning_content + '</think>' }}"
                        "{%- endif %}{{- m.content + '<|im_end|>\\n' }}{%- endfor %}")
    turns = [*MESSAGES, {"role": "assistant", "content": "blue", "reasoning_content": "sky<|im_end|>"}]
    with running_server([str(model_dir), *FLAGS, "--chat-template", str(template)]) as server:
        reply = httpx.post(f"{server.base_url}/tokenize", json={"messages": turns, "add_generation_prompt": False},
                           timeout=60).json()
        plain = httpx.post(f"{server.base_url}/tokenize", timeout=60, json={
            "messages": [*MESSAGES, {"role": "assistant", "content": "blue"}], "add_generation_prompt": False}).json()
        text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": reply["tokens"]}, timeout=60).json()
    assert "<think>sky<|im_end|></think>blue" in text["prompt"]
    assert reply["tokens"].count(2) == plain["tokens"].count(2) == 2  # <|im_end|>: the two turns' own only


@pytest.fixture(scope="module")
def think_tokens_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """The tiny Qwen3 with `<think>` and `</think>` as added tokens, as Qwen3's own tokenizer holds them."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("think-tokens")
    tok = AutoTokenizer.from_pretrained(str(build_tiny_model(out / "probe", "qwen3")))
    build_tiny_model(out / "model", "qwen3", seed=4, vocab_size=len(tok) + 2)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tok.save_pretrained(str(out / "model"))
    return out / "model", {t: tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>")}


def test_structured_output_holds_after_the_think_block(think_tokens_dir: tuple[Path, dict[str, int]]) -> None:
    """By default a constraint leaves the think block free: the reply thinks, then answers in the schema. The
    tiny model is steered into a block by logit_bias (it would not open or close one itself); with the think block
    constrained too, the same request cannot think at all."""
    model_dir, ids = think_tokens_dir
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    body = {"messages": MESSAGES, "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
            "logit_bias": {str(ids["<think>"]): 100, str(ids["</think>"]): 100}}
    replies = {}
    for extra in ([], ["--structured-output-in-reasoning"]):
        with running_server([str(model_dir), *FLAGS, "--reasoning-parser", "qwen3", *extra]) as server:
            whole = httpx.post(f"{server.url}/chat/completions", json=body, timeout=60)
            assert whole.status_code == 200, whole.text
            replies[bool(extra)] = whole.json()["choices"][0]["message"]
    after = replies[False]
    assert after["reasoning_content"] == ""  # the biased tags open and close the block at once
    assert isinstance(json.loads(after["content"])["n"], int)
    assert replies[True]["reasoning_content"] is None  # the schema allowed no <think>
    assert isinstance(json.loads(replies[True]["content"])["n"], int)


def test_the_flag_without_a_parser_fails_start_up_in_one_line(model_dir: Path) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "flashllm", "serve", str(model_dir), "--structured-output-in-reasoning"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("flashllm serve: --structured-output-in-reasoning must be "
                                                           "set only with --reasoning-parser")
