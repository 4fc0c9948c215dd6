"""Tool-call parsing: hand-written messages, malformed blocks, bounds, streaming splits, tools validation."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm.serving.tool_calls import (
    MAX_TOOL_CALL_CHARS,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    ToolCallStreamParser,
    check_tool_choice,
    parse_tool_calls,
    validate_tools,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def block(name: object, arguments: object = None, *, raw: str | None = None) -> str:
    """A block as Qwen/Hermes templates make models write it, built with json.dumps independently."""
    body = raw if raw is not None else json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def calls_of(parsed) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def stream(text: str, cuts: list[int], tool_names=None, **limits) -> tuple[str, list]:
    parser = ToolCallStreamParser(tool_names, **limits)
    bounds = [0, *sorted(set(cuts)), len(text)]
    events = [e for a, b in zip(bounds[:-1], bounds[1:], strict=True) for e in parser.feed(text[a:b])] + parser.flush()
    for e in events:
        assert (e.content is None) != (e.tool_call is None)
    content = "".join(e.content for e in events if e.content is not None)
    return content, [e for e in events if e.tool_call is not None]


def test_single_call_matches_openai_shape() -> None:
    parsed = parse_tool_calls(block("get_weather", {"city": "Paris"}))
    assert parsed.content is None
    (call,) = parsed.tool_calls
    assert calls_of(parsed) == [("get_weather", {"city": "Paris"})]
    out = call.to_openai()
    assert set(out) == {"id", "type", "function"} and out["type"] == "function"
    assert out["function"] == {"name": "get_weather", "arguments": call.arguments}
    assert re.fullmatch(r"call_[0-9a-f]{8,}", out["id"])


def test_several_calls_with_text_around() -> None:
    before, between, after = "  Let me check both.\n", "\nand also\n", "\nDone. "
    text = before + block("a", {"x": 1}) + between + block("b", {"y": [1, {"z": None}]}) + after
    parsed = parse_tool_calls(text)
    assert calls_of(parsed) == [("a", {"x": 1}), ("b", {"y": [1, {"z": None}]})]
    assert parsed.content == (before + between + after).strip()
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_close_tag_and_braces_inside_json_strings() -> None:
    args = {"code": 'if x: print("}</tool_call>{")', "nested": {"a": {"b": "{{"}}, "quote": '\\"<tool_call>'}
    parsed = parse_tool_calls("pre " + block("run", args) + " post")
    assert calls_of(parsed) == [("run", args)]
    assert parsed.content == "pre  post"


def test_unicode_kept_unescaped() -> None:
    args = {"city": "Zürich 東京", "emoji": "🌧"}
    parsed = parse_tool_calls("天気は？" + block("météo", args))
    assert calls_of(parsed) == [("météo", args)]
    assert "東京" in parsed.tool_calls[0].arguments and "\\u" not in parsed.tool_calls[0].arguments
    assert parsed.content == "天気は？"


def test_arguments_as_json_string_are_kept_verbatim() -> None:
    arguments = '{"city":  "Paris"}'
    parsed = parse_tool_calls(block("w", arguments))
    assert [c.arguments for c in parsed.tool_calls] == [arguments]


def test_missing_arguments_mean_no_arguments() -> None:
    parsed = parse_tool_calls(block("now", raw='{"name": "now"}'))
    assert calls_of(parsed) == [("now", {})]


def test_plain_text_without_tags() -> None:
    assert parse_tool_calls("  hello <b>world</b> 1 < 2  ").content == "hello <b>world</b> 1 < 2"
    assert parse_tool_calls(" \n ").content is None


MALFORMED = [
    block("f", raw='{"name": "f", "arguments": {"x": 1}'),  # bad JSON
    block("f", raw='{"arguments": {"x": 1}}'),  # no name
    block(3, {"x": 1}),  # name not a string
    block("", {"x": 1}),  # empty name
    block("f", [1, 2]),  # arguments a list
    block("f", 7),  # arguments a number
    block("f", None),  # arguments null
    block("f", "{not json"),  # arguments a string that is not JSON
    block("f", '"just a string"'),  # arguments a string that is JSON but not an object
    block("f", raw='["f", {}]'),  # body not an object
    block("f", raw='{"name": "f", "arguments": {"x": NaN}}'),  # not JSON
    block("f", raw=""),  # empty block
    block("f", raw='{"name": "f", "arguments": {}} trailing'),  # junk after the object
    OPEN + '\n{"name": "f", "arguments": {"x": 1}}',  # unterminated at end of generation
    OPEN + '\n{"name": "f", "arguments": {"x": "</tool_call>',  # cut inside a string
    OPEN,
]


@pytest.mark.parametrize("bad", MALFORMED)
def test_malformed_block_is_text(bad: str) -> None:
    text = "Hi. " + bad + " Bye."
    parsed = parse_tool_calls(text)
    assert parsed.tool_calls == []
    assert parsed.content == text.strip()


def test_malformed_block_does_not_hide_a_later_valid_one() -> None:
    bad = block("f", raw="{oops}")
    parsed = parse_tool_calls(bad + "x" + block("g", {"k": "v"}))
    assert calls_of(parsed) == [("g", {"k": "v"})]
    assert parsed.content == bad + "x"


def test_unknown_tool_name_is_text_when_names_given() -> None:
    text = block("known", {}) + block("rm_rf", {"path": "/"})
    parsed = parse_tool_calls(text, tool_names=["known"])
    assert calls_of(parsed) == [("known", {})]
    assert parsed.content == block("rm_rf", {"path": "/"})
    assert len(parse_tool_calls(text).tool_calls) == 2


def test_block_over_the_size_bound_is_text() -> None:
    overhead = len(block("f", {"s": ""}))
    fits = block("f", {"s": "a" * (MAX_TOOL_CALL_CHARS - overhead)})
    assert len(fits) == MAX_TOOL_CALL_CHARS
    assert calls_of(parse_tool_calls(fits)) == [("f", {"s": "a" * (MAX_TOOL_CALL_CHARS - overhead)})]
    too_long = block("f", {"s": "a" * (MAX_TOOL_CALL_CHARS - overhead + 1)})
    parsed = parse_tool_calls(too_long + block("g", {}))
    assert calls_of(parsed) == [("g", {})]
    assert parsed.content == too_long


def test_at_most_max_tool_calls() -> None:
    blocks = [block(f"f{i}", {"i": i}) for i in range(MAX_TOOL_CALLS + 2)]
    parsed = parse_tool_calls("".join(blocks))
    assert calls_of(parsed) == [(f"f{i}", {"i": i}) for i in range(MAX_TOOL_CALLS)]
    assert parsed.content == "".join(blocks[MAX_TOOL_CALLS:])


def test_stream_holds_partial_open_tag_then_releases_it() -> None:
    parser = ToolCallStreamParser()
    first = parser.feed("Hello <tool")
    assert "".join(e.content for e in first) == "Hello"
    second = parser.feed("box> ok")
    assert "".join(e.content for e in first + second) == "Hello <toolbox> ok"


def test_stream_emits_call_when_close_tag_completes() -> None:
    text = "Sure." + block("w", {"city": "Paris"})
    parser = ToolCallStreamParser()
    early = parser.feed(text[:-1])
    assert [e.content for e in early] == ["Sure."]
    (late,) = parser.feed(text[-1])
    assert late.index == 0 and late.tool_call.name == "w"
    assert json.loads(late.tool_call.arguments) == {"city": "Paris"}
    assert parser.flush() == []
    with pytest.raises(RuntimeError, match="after flush"):
        parser.feed("more")


HAND_WRITTEN = [
    "Sure." + block("f", {"s": 'a\\"</tool_call>\\'}) + " then " + block("g", {}),
    block("f", raw="[1, 2]") + block("g", {"k": "v"}),  # a body that is not an object ends at the first tag
    block("f", raw="plain </tool_call") + "x" + block("g", {}),
    *MALFORMED,
    *(m + block("g", {"n": 1}) for m in MALFORMED),
]


@pytest.mark.parametrize("text", HAND_WRITTEN)
def test_char_by_char_stream_matches_whole_parse(text: str) -> None:
    whole = parse_tool_calls(text)
    content, events = stream(text, list(range(len(text))))
    assert content == (whole.content or "")
    assert [(e.tool_call.name, e.tool_call.arguments) for e in events] == \
        [(c.name, c.arguments) for c in whole.tool_calls]


def test_plain_body_then_valid_call() -> None:
    bad = block("f", raw="[1, 2]")
    parsed = parse_tool_calls(bad + block("g", {"k": "v"}))
    assert calls_of(parsed) == [("g", {"k": "v"})]
    assert parsed.content == bad


# Pieces that combine into valid, malformed, nested, cut and near-miss blocks.
PIECES = [OPEN, CLOSE, "<", "<tool", "_call>", "</tool", "{", "}", '"', "\\", " ", "\n", "a", "é 東",
          '{"name": "f", "arguments": {}}', '{"name": "g", "arguments": "{\\"x\\": 1}"}',
          '{"name": "h", "arguments": {"s": "</tool_call>"}}', '{"name": "zz", "arguments": {"q": "}{"}}',
          block("f", {"k": "<tool_call>"})]


@st.composite
def text_and_cuts(draw: st.DrawFn) -> tuple[str, list[int]]:
    text = "".join(draw(st.lists(st.sampled_from(PIECES), max_size=24)))
    cuts = draw(st.lists(st.integers(0, len(text)), max_size=12))
    return text, cuts


@settings(max_examples=300, deadline=None)
@given(text_and_cuts(), st.sampled_from([None, ["f", "g", "h"]]), st.sampled_from([MAX_TOOL_CALL_CHARS, 60]),
       st.sampled_from([MAX_TOOL_CALLS, 1]))
def test_any_split_streams_like_one_parse(case, tool_names, max_block_chars, max_tool_calls) -> None:
    text, cuts = case
    limits = {"max_block_chars": max_block_chars, "max_tool_calls": max_tool_calls}
    whole = parse_tool_calls(text, tool_names, **limits)
    content, events = stream(text, cuts, tool_names, **limits)
    assert content == (whole.content or "")
    assert [e.index for e in events] == list(range(len(events)))
    assert [(e.tool_call.name, e.tool_call.arguments) for e in events] == \
        [(c.name, c.arguments) for c in whole.tool_calls]


json_leaf = st.none() | st.booleans() | st.integers() | st.text(st.sampled_from('ab{}<>/"\\\n é_tool_call'))
json_args = st.dictionaries(st.text(max_size=5), st.recursive(json_leaf, lambda c: st.lists(c, max_size=3)
                                                                | st.dictionaries(st.text(max_size=3), c, max_size=3),
                                                                max_leaves=6), max_size=4)
plain_text = st.text(st.characters(blacklist_characters="<"), max_size=20)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(plain_text, st.sampled_from(["a", "b_2", "c-3"]), json_args), max_size=5), plain_text,
       st.data())
def test_built_messages_parse_back(segments, tail, data) -> None:
    text = "".join(pre + block(name, args) for pre, name, args in segments) + tail
    expected_content = ("".join(pre for pre, _, _ in segments) + tail).strip() or None
    parsed = parse_tool_calls(text)
    assert parsed.content == expected_content
    assert calls_of(parsed) == [(name, args) for _, name, args in segments]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    content, events = stream(text, cuts)
    assert content == (expected_content or "")
    assert [(e.tool_call.name, json.loads(e.tool_call.arguments)) for e in events] == calls_of(parsed)


def tool(name: object, **function: object) -> dict:
    return {"type": "function", "function": {"name": name, **function}}


def test_validate_tools_accepts_openai_shapes() -> None:
    tools = [tool("get_weather", description="d", parameters={"type": "object"}), tool("a-B_9"), tool("x" * 64)]
    assert validate_tools(tools) == ["get_weather", "a-B_9", "x" * 64]
    assert validate_tools(None) == []


@pytest.mark.parametrize("tools, field", [
    ("nope", "tools must be a list"),
    ([tool("ok"), "x"], "tools[1] must be an object"),
    ([{"type": "retrieval", "function": {"name": "a"}}], "tools[0].type"),
    ([{"type": "function"}], "tools[0].function must"),
    ([tool("ok"), tool("")], "tools[1].function.name"),
    ([tool("has space")], "tools[0].function.name"),
    ([tool("x" * 65)], "tools[0].function.name"),
    ([tool(5)], "tools[0].function.name"),
    ([tool("a", description=3)], "tools[0].function.description"),
    ([tool("a", parameters="{}")], "tools[0].function.parameters"),
    ([tool("a"), tool("a")], "tools[1].function.name 'a' repeats tools[0]"),
    ([tool(f"t{i}") for i in range(MAX_TOOLS + 1)], f"at most {MAX_TOOLS}"),
])
def test_validate_tools_names_the_bad_field(tools, field) -> None:
    with pytest.raises(ValueError) as info:
        validate_tools(tools)
    assert field in str(info.value)


def test_check_tool_choice_modes_and_forced_name() -> None:
    tools = [tool("a"), tool("b")]
    for mode in ("none", "auto", "required"):
        assert check_tool_choice(tools, mode) == mode
    assert check_tool_choice(tools, None) == "auto"
    assert check_tool_choice(None, None) is None
    assert check_tool_choice(tools, {"type": "function", "function": {"name": "b"}}) == "b"


@pytest.mark.parametrize("tools, choice, field", [
    ([tool("a")], "any", "tool_choice must be"),
    ([tool("a")], 1, "tool_choice must be"),
    ([tool("a")], {"type": "tool", "function": {"name": "a"}}, "tool_choice.type"),
    ([tool("a")], {"type": "function"}, "tool_choice.function.name"),
    ([tool("a")], {"type": "function", "function": {"name": 3}}, "tool_choice.function.name"),
    ([tool("a")], {"type": "function", "function": {"name": "zz"}}, "tool_choice.function.name 'zz'"),
    (None, "required", "tool_choice 'required'"),
    ([tool("")], "auto", "tools[0].function.name"),
])
def test_check_tool_choice_names_the_bad_field(tools, choice, field) -> None:
    with pytest.raises(ValueError) as info:
        check_tool_choice(tools, choice)
    assert field in str(info.value)
