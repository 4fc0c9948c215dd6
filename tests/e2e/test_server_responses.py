"""/v1/responses (OpenAI's Responses API) on the real server, driven by the `openai` client: replies against
in-process chat generation and against /v1/chat/completions, streamed events, stored conversations, function
tools, JSON output and refusals."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

import httpx  # noqa: E402

from flashllm import LLM, SamplingParams  # noqa: E402
from flashllm.testing.server import ServerProcess, running_server  # noqa: E402
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

ENGINE_FLAGS = ["--max-model-len", "512", "--block-size", "16", "--num-kv-blocks", "128", "--served-model-name", "tiny"]
WEATHER = {"type": "function", "name": "get_weather", "description": "weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
# sampled with a seed: a tiny random model's greedy reply hardly depends on the conversation, its distribution does
SAMPLED = {"temperature": 1.0, "max_output_tokens": 12, "extra_body": {"seed": 7}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("responses"), "qwen2", seed=3)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    with running_server([str(model_dir), *ENGINE_FLAGS]) as server:
        yield server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), max_model_len=512, block_size=16, num_kv_blocks=128)


def _chat(llm: LLM, messages: list[dict]):
    return llm.chat(messages, SamplingParams(temperature=1.0, seed=7, max_tokens=12))[0]


def test_a_response_is_the_chat_reply_to_its_instructions_and_input(client: openai.OpenAI, llm: LLM) -> None:
    response = client.responses.create(model="tiny", instructions="You are terse.", input="Name a colour.", **SAMPLED)
    expected = _chat(llm, [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}])
    assert response.id.startswith("resp_") and response.object == "response" and response.model == "tiny"
    assert response.output_text == expected.outputs[0].text
    assert [item.type for item in response.output] == ["message"]
    assert response.usage.input_tokens == len(expected.prompt_token_ids)
    assert response.usage.output_tokens == len(expected.outputs[0].token_ids)
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    finished_early = expected.outputs[0].finish_reason == "length"
    assert response.status == ("incomplete" if finished_early else "completed")
    assert (response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens") \
        == finished_early


def test_a_message_list_is_the_same_conversation_as_chat_completions(client: openai.OpenAI) -> None:
    """Message items, text parts and a developer message against the chat route given the same turns."""
    items = [{"role": "developer", "content": "Answer in one word."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a "},
                                                            {"type": "input_text", "text": "fruit."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Apple."}]},
             {"role": "user", "content": "Another one?"}]
    response = client.responses.create(model="tiny", input=items, **SAMPLED)
    chat = client.chat.completions.create(model="tiny", temperature=1.0, seed=7, max_tokens=12, messages=[
        {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "Apple."}, {"role": "user", "content": "Another one?"}])
    assert response.output_text == chat.choices[0].message.content


def test_streamed_events_build_the_same_response(client: openai.OpenAI) -> None:
    whole = client.responses.create(model="tiny", input="Count to three.", **SAMPLED)
    events = list(client.responses.create(model="tiny", input="Count to three.", stream=True, **SAMPLED))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == f"response.{whole.status}"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage == whole.usage


def test_previous_response_id_continues_the_stored_conversation(client: openai.OpenAI, llm: LLM) -> None:
    first = client.responses.create(model="tiny", input="Name a colour.", **SAMPLED)
    second = client.responses.create(model="tiny", previous_response_id=first.id, input="And another?", **SAMPLED)
    expected = _chat(llm, [{"role": "user", "content": "Name a colour."},
                           {"role": "assistant", "content": first.output_text},
                           {"role": "user", "content": "And another?"}])
    assert second.output_text == expected.outputs[0].text and second.previous_response_id == first.id
    stored = client.responses.retrieve(first.id)
    assert stored.id == first.id and stored.output_text == first.output_text and stored.usage == first.usage
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        client.responses.retrieve(first.id)

    unstored = client.responses.create(model="tiny", input="Name a colour.", store=False, **SAMPLED)
    for attempt in (lambda: client.responses.retrieve(unstored.id),
                    lambda: client.responses.create(model="tiny", previous_response_id=unstored.id, input="More?")):
        with pytest.raises(openai.NotFoundError, match="no stored response"):
            attempt()


def test_a_required_function_tool_is_called_and_its_output_continues(client: openai.OpenAI, server: ServerProcess
                                                                      ) -> None:
    response = client.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER],
                                       tool_choice="required", temperature=0, max_output_tokens=64)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(call.name == "get_weather" and call.call_id for call in calls)
    arguments = json.loads(calls[0].arguments)
    assert set(arguments) == {"city"} and len(arguments["city"]) <= 12
    events = list(client.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER], stream=True,
                                          tool_choice="required", temperature=0, max_output_tokens=64))
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [(c.name, c.arguments) for c in done] == [(c.name, c.arguments) for c in calls]

    follow = client.responses.create(model="tiny", previous_response_id=response.id, tools=[WEATHER],
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "sunny"}], **SAMPLED)
    chat_tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    chat = httpx.post(f"{server.url}/chat/completions", timeout=60, json={
        "model": "tiny", "temperature": 1.0, "seed": 7, "max_tokens": 12, "tools": chat_tools, "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls]},
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"}]}).json()
    assert follow.output_text == (chat["choices"][0]["message"]["content"] or "")


def test_json_schema_text_format_constrains_the_reply(client: openai.OpenAI) -> None:
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    response = client.responses.create(model="tiny", input="A number, as JSON.", temperature=0,
                                       max_output_tokens=40, text={"format": {"type": "json_schema", "name": "num",
                                                                              "schema": schema, "strict": True}})
    assert response.status == "completed"
    value = json.loads(response.output_text)
    assert set(value) == {"n"} and 0 <= value["n"] <= 99


@pytest.mark.parametrize("body, fragment", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "text parts"),
    ({"input": [{"type": "web_search_call"}]}, "is not supported"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "function tools only"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, "no stored response"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": [{"type": "function_call_output", "call_id": 3, "output": "x"}]}, "call_id must be a string"),
])
def test_refused_requests_say_why(server: ServerProcess, body: dict, fragment: str) -> None:
    reply = httpx.post(f"{server.url}/responses", json={"model": "tiny", **body}, timeout=60)
    assert reply.status_code in (400, 404), reply.text
    assert fragment in reply.json()["error"]["message"]
