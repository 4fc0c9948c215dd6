"""`serve --tool-call-parser llama3_json | mistral | glm45`: tiny models taught to answer in Llama 3's JSON, Mistral's
`[TOOL_CALLS]` (its marker a special token, as in its tokenizer) and GLM-4.5's `<arg_key>` / `<arg_value>` formats,
served and read back as OpenAI tool calls, whole and streamed."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from flashllm.models.chat_template import ChatTemplate  # noqa: E402
from flashllm.models.tokenizer import load_tokenizer  # noqa: E402
from flashllm.testing.memorize import memorize  # noqa: E402
from flashllm.testing.server import ServerProcess, running_server  # noqa: E402
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
LINES = {
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": 'Looking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "glm45": "Looking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
}
CONTENT = {"llama3_json": None, "mistral": "Looking.", "glm45": "Looking."}


@pytest.fixture(scope="module", params=sorted(LINES))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ServerProcess]]:
    parser = request.param
    path = build_tiny_model(tmp_path_factory.mktemp(parser), "qwen2", seed=4, vocab_size=513)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    tokenizer = load_tokenizer(path)
    if parser == "mistral":  # the marker is one control token, which a plain reply's text would drop
        from tokenizers import AddedToken

        tokenizer.add_tokens([AddedToken("[TOOL_CALLS]", special=True, normalized=False)], special_tokens=True)
        tokenizer.save_pretrained(str(path))
        assert tokenizer.convert_tokens_to_ids("[TOOL_CALLS]") == 512
    prompt = tokenizer.encode(ChatTemplate(TEMPLATE).render(ASK, add_generation_prompt=True), add_special_tokens=False)
    reply = tokenizer.encode(LINES[parser], add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    loss = memorize(path, [(prompt, reply)])
    assert loss < 0.05, f"the tiny model did not learn its line (loss {loss:.3f})"
    with running_server([str(path), "--max-model-len", "256", "--block-size", "16", "--num-kv-blocks", "64",
                         "--served-model-name", "m", "--tool-call-parser", parser]) as server:
        yield parser, server


def _ask(server: ServerProcess, **kwargs: object):
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    return client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], temperature=0, max_tokens=100,
                                          **kwargs)


def test_the_reply_is_read_as_a_tool_call_whole_and_streamed(served: tuple[str, ServerProcess]) -> None:
    parser, server = served
    choice = _ask(server).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == CONTENT[parser]
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    content, calls = "", []
    for chunk in _ask(server, stream=True):
        content += chunk.choices[0].delta.content or ""
        calls += chunk.choices[0].delta.tool_calls or []
    assert content == (CONTENT[parser] or "")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_without_tools_the_line_is_plain_text(served: tuple[str, ServerProcess]) -> None:
    parser, server = served
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=100)
    text = reply.choices[0].message.content
    assert reply.choices[0].message.tool_calls is None
    if parser == "mistral":  # its marker is a special token: a reply read without tools drops it, as any reply does
        assert text.startswith("Looking.") and "[TOOL_CALLS]" not in text and '"get_weather"' in text
    else:
        assert text == LINES[parser]


def test_a_forced_call_takes_the_parser_s_format(served: tuple[str, ServerProcess]) -> None:
    parser, server = served
    if parser == "glm45":  # its XML arguments have no grammar: a forced call is refused, not run unconstrained
        with pytest.raises(openai.BadRequestError, match="not supported with --tool-call-parser glm45"):
            _ask(server, tool_choice="required")
        return
    choice = _ask(server, tool_choice="required").choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
