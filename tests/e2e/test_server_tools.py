"""Tool calling end to end: a tiny model taught to emit `<tool_call>` blocks, served, read by the openai client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from flashllm.models.chat_template import ChatTemplate  # noqa: E402
from flashllm.models.tokenizer import load_tokenizer  # noqa: E402
from flashllm.testing.memorize import memorize  # noqa: E402
from flashllm.testing.server import ServerProcess, running_server  # noqa: E402
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

# A Hermes/Qwen-style template: tool signatures go into the system turn as JSON.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
CALL_ASK = [{"role": "user", "content": "Weather in Paris?"}]
BROKEN_ASK = [{"role": "user", "content": "Weather in Rome?"}]
CALL_TEXT = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
BROKEN_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = build_tiny_model(tmp_path_factory.mktemp("tools"), "qwen2", seed=4)
    (path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    tokenizer = load_tokenizer(path)
    template = ChatTemplate(TOOL_TEMPLATE)
    eos = [tokenizer.convert_tokens_to_ids("<|endoftext|>")]

    def pair(messages: list[dict[str, str]], text: str) -> tuple[list[int], list[int]]:
        prompt = template.render(messages, tools=[WEATHER], add_generation_prompt=True)
        return (tokenizer.encode(prompt, add_special_tokens=False),
                tokenizer.encode(text, add_special_tokens=False) + eos)

    loss = memorize(path, [pair(CALL_ASK, CALL_TEXT), pair(BROKEN_ASK, BROKEN_TEXT)])
    assert loss < 0.05, f"the tiny model did not learn its lines (loss {loss:.3f})"
    return path


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    with running_server([str(model_dir), "--max-model-len", "256", "--block-size", "16",
                         "--num-kv-blocks", "64", "--served-model-name", "tools"]) as server:
        yield server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def _ask(client: openai.OpenAI, messages: list[dict[str, str]], **kwargs: object):
    return client.chat.completions.create(model="tools", messages=messages, tools=[WEATHER], temperature=0,
                                          max_tokens=80, **kwargs)


def test_the_model_says_its_line_without_tools_parsing(client: openai.OpenAI) -> None:
    # tool_choice "none": the same prompt, the raw text back, proving the model learnt CALL_TEXT.
    reply = _ask(client, CALL_ASK, tool_choice="none")
    assert reply.choices[0].message.content == CALL_TEXT
    assert reply.choices[0].message.tool_calls is None


def test_tool_call_is_returned_as_openai_tool_calls(client: openai.OpenAI) -> None:
    reply = _ask(client, CALL_ASK)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")


def test_streamed_tool_call_equals_non_streamed(client: openai.OpenAI) -> None:
    whole = _ask(client, CALL_ASK).choices[0]
    content, calls, finish = "", [], []
    for chunk in _ask(client, CALL_ASK, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    assert content.strip() == whole.message.content
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Paris"})]
    assert finish == ["tool_calls"]


def test_malformed_tool_call_comes_back_as_text(client: openai.OpenAI) -> None:
    reply = _ask(client, BROKEN_ASK)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content == BROKEN_TEXT
    assert reply.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in _ask(client, BROKEN_ASK, stream=True))
    assert streamed == BROKEN_TEXT


def test_tool_choice_must_name_a_known_tool(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        _ask(client, CALL_ASK, tool_choice={"type": "function", "function": {"name": "nope"}})
