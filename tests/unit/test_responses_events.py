"""The Responses API's streamed events for replies the e2e tests' tiny models do not write: a think block before
the text, a function call after it, nothing at all (flashllm/serving/responses_api.py's _Events)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from flashllm.serving.responses_api import _Events  # noqa: E402

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def _decoded(chunks: list[bytes]) -> list[dict]:
    events = []
    for chunk in chunks:
        head, data, blank = chunk.decode().split("\n", 2)
        assert head.startswith("event: ") and data.startswith("data: ") and blank == "\n"
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == head[len("event: "):]
        events.append(payload)
    return events


def test_reasoning_then_text_then_a_call_stream_as_three_items_in_order() -> None:
    stream = _Events()
    chunks = [chunk for delta in ({"reasoning_content": "let me "}, {"reasoning_content": "see"}, {"content": "Sure."},
                                  {"tool_calls": [CALL]}) for chunk in stream.delta(delta)]
    events = _decoded(chunks + stream.close())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [(e["type"], e.get("output_index")) for e in events] == [
        ("response.output_item.added", 0), ("response.reasoning_text.delta", 0), ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.content_part.added", 1), ("response.output_text.delta", 1),
        ("response.output_item.added", 2), ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2), ("response.output_item.done", 2),
        ("response.output_text.done", 1), ("response.content_part.done", 1), ("response.output_item.done", 1)]
    assert events[3]["text"] == "let me see" and events[4]["item"]["content"][0]["text"] == "let me see"
    assert events[10]["arguments"] == CALL["function"]["arguments"]
    assert events[11]["item"]["call_id"] == "call_1" and events[11]["item"]["name"] == "get_weather"
    items = stream.reply.items()
    assert [item["type"] for item in items] == ["reasoning", "message", "function_call"]
    assert items[1]["content"][0]["text"] == "Sure." == events[-3]["text"]
    assert [item["id"] for item in items] == [events[4]["item"]["id"], events[-1]["item"]["id"], events[11]["item"]["id"]]
    assert stream.reply.assistant_message() == {"role": "assistant", "content": "Sure.", "tool_calls": [CALL]}


def test_a_reply_of_nothing_is_one_empty_message() -> None:
    stream = _Events()
    events = _decoded(stream.close())
    assert [e["type"] for e in events] == ["response.output_item.added", "response.content_part.added",
                                           "response.output_text.done", "response.content_part.done",
                                           "response.output_item.done"]
    assert stream.reply.items() == [events[-1]["item"]] and events[-1]["item"]["content"][0]["text"] == ""


def test_a_call_alone_has_no_message() -> None:
    stream = _Events()
    events = _decoded(stream.delta({"tool_calls": [CALL]}) + stream.close())
    assert [e["type"] for e in events][-1] == "response.output_item.done"
    assert [item["type"] for item in stream.reply.items()] == ["function_call"]
