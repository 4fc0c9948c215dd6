"""`--tool-call-parser llama3_json | mistral | glm45`: replies read into calls and content, any stream split reads as
the whole reply, and the forced-call grammars produce exactly what the parsers read (glm45 has none: refused)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm.serving.protocol import APIError
from flashllm.serving.tool_parsers import MISTRAL_TOOL_CALLS, PYTHON_TAG, parse_reply, stream_parser

NAMES = ["look", "add"]


def calls(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def test_llama3_json_replies() -> None:
    parsed = parse_reply("llama3_json", '{"name": "look", "parameters": {"q": "sky"}}', NAMES)
    assert (parsed.content, calls(parsed)) == (None, [("look", {"q": "sky"})])
    two = parse_reply("llama3_json", f'{PYTHON_TAG}{{"name": "look", "parameters": {{}}}}; '
                                     '{"name": "add", "arguments": {"a": 1}}', NAMES)
    assert calls(two) == [("look", {}), ("add", {"a": 1})]
    # an answer that is JSON but not a call, a call of an unknown tool, and text: all content
    for text in ('{"answer": 4}', '{"name": "rm", "parameters": {}}', "It is 4. {\"name\": \"look\"}"):
        parsed = parse_reply("llama3_json", text, NAMES)
        assert (parsed.content, parsed.tool_calls) == (text, [])


def test_mistral_replies() -> None:
    text = f'Checking. {MISTRAL_TOOL_CALLS} [{{"name": "look", "arguments": {{"q": "x"}}}}, {{"name": "add", "arguments": "{{}}"}}]'
    parsed = parse_reply("mistral", text, NAMES)
    assert (parsed.content, calls(parsed)) == ("Checking.", [("look", {"q": "x"}), ("add", {})])
    broken = f"{MISTRAL_TOOL_CALLS} [{{\"name\": \"look\""
    assert parse_reply("mistral", broken, NAMES).content == broken
    assert parse_reply("mistral", "no calls here", NAMES).content == "no calls here"


# GLM-4.5's tools as the server hands them to the parser: name -> parameters schema
GLM_TOOLS = {"look": {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"},
                                                       "tags": {"type": "array"}, "opt": {"type": ["string", "null"]}}},
             "add": {}}


def _glm(name: str, **arguments: str) -> str:
    pairs = "".join(f"<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n" for key, value in arguments.items())
    return f"<tool_call>{name}\n{pairs}</tool_call>"


def test_glm45_replies() -> None:
    """Values typed by the tool's schema: strings as written (digits and JSON-looking text included), other types
    parsed as JSON; text before the first block is content; a block of an unknown tool, an unterminated one or text
    between blocks leaves the reply all content."""
    text = "Let me look.\n" + _glm("look", q="123", n="7", tags='["a", 2]', opt='{"x": 1}') + "\n" + _glm("add")
    parsed = parse_reply("glm45", text, GLM_TOOLS)
    assert parsed.content == "Let me look."
    assert calls(parsed) == [("look", {"q": "123", "n": 7, "tags": ["a", 2], "opt": '{"x": 1}'}), ("add", {})]
    # a value the schema types but that holds no JSON stays text; a key the schema lacks is a string
    assert calls(parse_reply("glm45", _glm("look", n="seven", extra="[1]"), GLM_TOOLS)) == [
        ("look", {"n": "seven", "extra": "[1]"})]
    assert calls(parse_reply("glm45", _glm("look", n="NaN"), GLM_TOOLS)) == [("look", {"n": "NaN"})]
    for bad in (_glm("rm", q="x"), "<tool_call>look\n<arg_key>q</arg_key><arg_value>x", _glm("add") + " and " + _glm("add"),
                "<tool_call>look\n<arg_key>q</arg_key>junk<arg_value>x</arg_value></tool_call>"):
        assert (parse_reply("glm45", bad, GLM_TOOLS).content, parse_reply("glm45", bad, GLM_TOOLS).tool_calls) == (bad, [])
    assert parse_reply("glm45", "no calls", GLM_TOOLS).content == "no calls"
    # names alone (no schemas): every value is text
    assert calls(parse_reply("glm45", _glm("look", n="7"), list(GLM_TOOLS))) == [("look", {"n": "7"})]


def test_glm45_has_no_forced_call_grammar() -> None:
    from flashllm.serving.structured import tool_call_constraint

    with pytest.raises(APIError, match="not supported with --tool-call-parser glm45"):
        tool_call_constraint(TOOLS, "required", True, "glm45")
    assert tool_call_constraint(TOOLS, "auto", True, "glm45") is None


def test_at_most_max_calls_else_all_content() -> None:
    text = '{"name": "look", "parameters": {}}; {"name": "look", "parameters": {}}'
    assert len(parse_reply("llama3_json", text, NAMES, max_tool_calls=2).tool_calls) == 2
    assert parse_reply("llama3_json", text, NAMES, max_tool_calls=1).content == text


PIECES = {
    "llama3_json": [PYTHON_TAG, "<|python", "{", "}", '"', ";", " ", "\n", "x", '{"name": "look", "parameters": {}}',
                    '{"name": "add", "arguments": {"a": [1, "}"]}}', '{"name": "rm", "parameters": {}}'],
    "mistral": [MISTRAL_TOOL_CALLS, "[TOOL", "[", "]", "{", '"', " ", "\n", "x", "é",
                '[{"name": "look", "arguments": {}}]', '[{"name": "add", "arguments": {"s": "]["}}]'],
    "glm45": ["<tool_call>", "<tool_", "</tool_call>", "<arg_key>", "</arg_value>", " ", "\n", "x", "é",
              "<tool_call>look\n<arg_key>n</arg_key><arg_value>7</arg_value></tool_call>",
              "<tool_call>add</tool_call>", "<tool_call>rm</tool_call>"],
}


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(PIECES)), st.data())
def test_any_split_streams_like_the_whole_reply(parser: str, data: st.DataObject) -> None:
    text = "".join(data.draw(st.lists(st.sampled_from(PIECES[parser]), max_size=10)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    tools = GLM_TOOLS if parser == "glm45" else NAMES
    whole = parse_reply(parser, text, tools)
    reader = stream_parser(parser, tools)
    events = []
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        events += reader.feed(text[start:end])
    events += reader.flush()
    assert "".join(e.content for e in events if e.content is not None) == (whole.content or "")
    assert [(e.tool_call.name, e.tool_call.arguments) for e in events if e.tool_call] == \
        [(c.name, c.arguments) for c in whole.tool_calls]


def test_text_before_a_llama_call_makes_the_reply_content() -> None:
    """Llama 3 calls are the whole reply: JSON after words is an answer, not a call (as vLLM's parser reads it)."""
    text = 'Sure: {"name": "look", "parameters": {}}'
    assert parse_reply("llama3_json", text, NAMES).content == text


TOOLS = [{"type": "function", "function": {"name": "look", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add"}}]
# a reply each forced-call grammar must allow (two calls), in the layout the grammars write JSON
REPLIES = {
    "hermes": '<tool_call>\n{"name": "look", "arguments": {"q": "a b"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>',
    "llama3_json": '{"name": "look", "parameters": {"q": "a b"}}; {"name": "add", "parameters": {}}',
    "mistral": f'{MISTRAL_TOOL_CALLS} [{{"name": "look", "arguments": {{"q": "a b"}}}}, {{"name": "add", "arguments": {{}}}}]',
}


@pytest.fixture(scope="module", params=["text marker", "marker token"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from tokenizers import AddedToken

    from flashllm.testing.tokenizer import train_tokenizer

    tok = train_tokenizer(tmp_path_factory.mktemp("tok"), 512)
    if request.param == "marker token":  # Mistral's tokenizers hold [TOOL_CALLS] as a control token
        tok.add_tokens([AddedToken(MISTRAL_TOOL_CALLS, special=True, normalized=False)], special_tokens=True)
    return tok


@pytest.mark.parametrize("parser", sorted(REPLIES))
def test_forced_call_grammars_allow_what_the_parsers_read(parser: str, tokenizer) -> None:
    pytest.importorskip("llguidance")
    import torch

    from flashllm.serving.structured import tool_call_constraint
    from flashllm.structured.compiler import GrammarCompiler
    from flashllm.structured.mask import unpack_bitmask

    compiler = GrammarCompiler(tokenizer, [0], len(tokenizer))
    spec = tool_call_constraint(TOOLS, "required", True, parser, tokenizer)
    reply = REPLIES[parser]
    tokens = tokenizer.encode(reply)
    state = compiler.compile(spec).new_state()
    row = torch.empty((len(tokenizer) + 31) // 32, dtype=torch.int32)
    for i, token in enumerate(tokens):
        state.compute_bitmask(row)
        assert unpack_bitmask(row[None], len(tokenizer))[0, token], f"token {i} ({tokenizer.decode([token])!r})"
        assert state.accept(token)
    state.compute_bitmask(row)
    assert unpack_bitmask(row[None], len(tokenizer))[0, 0]  # complete: end of sequence (id 0) is allowed
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    assert calls(parse_reply(parser, text, NAMES)) == [("look", {"q": "a b"}), ("add", {})]
    single = compiler.compile(tool_call_constraint(TOOLS, "required", False, parser, tokenizer)).new_state()
    assert 0 < single.valid_prefix(tokens) < len(tokens)  # without parallel calls the second is refused
