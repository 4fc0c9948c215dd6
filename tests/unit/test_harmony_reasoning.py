"""`--reasoning-parser openai_gptoss`: gpt-oss's harmony replies split into reasoning (the analysis channel) and
content (final, commentary), whole and in any streamed pieces, markers taken out, messages to function tools read
as tool calls; requests under it keep special tokens in their text and refuse structured output."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("fastapi")

from flashllm.serving.generation import ServerContext  # noqa: E402
from flashllm.serving.harmony import HarmonySplitter, split_harmony  # noqa: E402
from flashllm.serving.openai_api import APIError, chat_constraint, chat_sampling_params  # noqa: E402
from flashllm.serving.protocol import ChatCompletionRequest  # noqa: E402
from flashllm.serving.reasoning import REASONING_PARSERS, reasoning_splitter, split_reasoning  # noqa: E402
from flashllm.serving.tool_calls import ToolCallStreamParser, parse_tool_calls  # noqa: E402

REPLY = ("<|channel|>analysis<|message|>User asks 2+2. a < b holds.<|end|><|start|>assistant<|channel|>analysis"
         "<|message|> Check again.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>")


def test_a_whole_reply_splits_by_channel() -> None:
    assert split_harmony(REPLY) == ("User asks 2+2. a < b holds. Check again.", "It is 4.", True)
    assert split_reasoning("openai_gptoss", REPLY) == ("User asks 2+2. a < b holds. Check again.", "It is 4.")
    assert "openai_gptoss" in REASONING_PARSERS


CALL = ('<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary<|message|>'
        'Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
        '<|message|>{"city": "Paris"}<|call|>')


def test_a_message_to_a_function_is_a_tool_call_and_commentary_is_content() -> None:
    reasoning, content, thought = split_harmony(CALL)
    assert (reasoning, thought) == ("Need weather.", True)
    parsed = parse_tool_calls(content, ["get_weather"])
    assert parsed.content == "Checking."
    (call,) = parsed.tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    # the template's own form puts the recipient in the role header
    role_form = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"a": 1}<|call|>'
    (call,) = parse_tool_calls(split_harmony(role_form)[1], ["get_weather"]).tool_calls
    assert json.loads(call.arguments) == {"a": 1}


@pytest.mark.parametrize("seed", range(10))
def test_a_streamed_tool_call_is_read_by_the_hermes_stream_parser(seed: int) -> None:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(CALL)), rng.randrange(1, 30)))
    pieces = [CALL[a:b] for a, b in zip([0, *cuts], [*cuts, len(CALL)], strict=True)]
    splitter, tools = HarmonySplitter(), ToolCallStreamParser(["get_weather"])
    events = []
    for i, piece in enumerate(pieces):
        events += tools.feed(splitter.take(piece, finished=i == len(pieces) - 1)[1])
    events += tools.flush()
    (call,) = [e.tool_call for e in events if e.tool_call is not None]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert "".join(e.content for e in events if e.content is not None).strip() == "Checking."


def test_a_reply_without_markers_is_all_content() -> None:
    assert split_reasoning("openai_gptoss", "Just text, no channels.") == (None, "Just text, no channels.")
    assert split_reasoning("openai_gptoss", "<|channel|>final<|message|>Only an answer.") == (None, "Only an answer.")


@pytest.mark.parametrize("seed", range(20))
def test_streamed_pieces_join_to_the_whole_reply_s_fields(seed: int) -> None:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(REPLY)), rng.randrange(1, 40)))
    pieces = [REPLY[a:b] for a, b in zip([0, *cuts], [*cuts, len(REPLY)], strict=True)]
    splitter = reasoning_splitter("openai_gptoss")
    assert isinstance(splitter, HarmonySplitter)
    fields = [splitter.take(piece, finished=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    reasoning, content = "".join(r for r, _ in fields), "".join(c for _, c in fields)
    assert (reasoning, content) == split_harmony(REPLY)[:2]
    assert all("<|" not in r + c for r, c in fields)


def test_a_split_marker_is_held_until_it_is_known() -> None:
    splitter = HarmonySplitter()
    assert splitter.take("<|channel|>final<|message|>Hi <|", finished=False) == ("", "Hi ")
    assert splitter.take("ret", finished=False) == ("", "")
    assert splitter.take("urn|>", finished=True) == ("", "")
    held = HarmonySplitter()
    assert held.take("<|channel|>final<|message|>x <", finished=False) == ("", "x ")
    assert held.take("", finished=True) == ("", "<")  # the reply ended: an unfinished marker is text


def _ctx(parser: str | None) -> ServerContext:
    return ServerContext(engine=None, tokenizer=None, model_name="m", max_model_len=64, defaults={},
                         request_timeout=10.0, metrics=None, reasoning_parser=parser)


def test_requests_keep_special_tokens_and_refuse_constraints_under_the_parser() -> None:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    for parser, skip in (("openai_gptoss", False), ("qwen3", True), (None, True)):
        params = chat_sampling_params(_ctx(parser), req, 16, None, None, None)
        assert params.skip_special_tokens is skip, parser
    constrained = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                        response_format={"type": "json_object"})
    assert chat_constraint(_ctx("qwen3"), constrained)[0] is not None
    with pytest.raises(APIError, match="not supported under --reasoning-parser openai_gptoss"):
        chat_constraint(_ctx("openai_gptoss"), constrained)
