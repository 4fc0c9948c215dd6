"""Structured output through the OpenAI API on the demo model: response_format, guided_*, forced tool calls, 400s."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
jsonschema = pytest.importorskip("jsonschema")
regex = pytest.importorskip("regex")
pytest.importorskip("llguidance")

from flashllm.testing.server import ServerProcess, running_server  # noqa: E402
from flashllm.testing.structured import JSON_SCHEMAS, is_json_prefix  # noqa: E402

MODEL = "demo"
ASK = [{"role": "user", "content": "Give me data."}]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather of a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                         "b": {"type": "integer", "minimum": -99, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "noop"}},  # no parameters: takes {}
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server(["--dtype", "float32", "--max-model-len", "512", "--block-size", "16", "--num-kv-blocks", "256",
                         "--served-model-name", MODEL]) as server:
        yield server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _check_json(schema: dict, text: str, finish: str) -> None:
    if finish == "length":
        assert is_json_prefix(text), text
        return
    assert finish == "stop", (finish, text)
    jsonschema.validate(json.loads(text), schema)


def test_response_format_json_schema(client: openai.OpenAI) -> None:
    for i, schema in enumerate(JSON_SCHEMAS[:10]):
        reply = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=64, temperature=1.0, seed=i, n=2,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                   "strict": True}})
        for choice in reply.choices:
            _check_json(schema, choice.message.content, choice.finish_reason)


def test_response_format_json_object_streamed(client: openai.OpenAI) -> None:
    text, finish = "", None
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=0.8, seed=3,
                                                response_format={"type": "json_object"}, stream=True):
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{") and is_json_prefix(text)


def test_guided_fields_on_completions(client: openai.OpenAI) -> None:
    cases = [({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: regex.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
             ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
             ({"guided_grammar": 'start: "<" /[a-z]{1,4}/ ">"'}, lambda t: regex.fullmatch("<[a-z]{1,4}>", t)),
             ({"guided_json": JSON_SCHEMAS[0]}, lambda t: jsonschema.validate(json.loads(t), JSON_SCHEMAS[0]) is None)]
    for extra, ok in cases:
        reply = client.completions.create(model=MODEL, prompt="Say:", max_tokens=40, temperature=1.0, seed=1, n=3,
                                          extra_body=extra)
        for choice in reply.choices:
            assert choice.finish_reason == "stop" and ok(choice.text), (extra, choice.text)


@pytest.mark.parametrize("extra, words", [
    ({"guided_json": {"type": "strng"}}, "cannot be"),
    ({"guided_regex": "a(?=b)"}, "look-around"),
    ({"guided_grammar": "start: missing"}, "cannot be"),
    ({"guided_grammar": "start: ((("}, "Expected token"),  # llguidance's first line begins with its position
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "send only one"),
    ({"guided_choice": ["x" * 2000]}, "characters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
])
def test_bad_constraints_are_400_and_the_server_keeps_serving(client: openai.OpenAI, extra: dict, words: str) -> None:
    with pytest.raises(openai.BadRequestError, match=words) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)
    assert info.value.body["code"] in ("invalid_structured_output", "invalid_value")
    message = info.value.body["message"]
    assert "\n" not in message, message  # one line: no grammar listing echoed back
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text is not None


def test_hostile_schemas_are_refused_or_bounded(client: openai.OpenAI) -> None:
    deep: dict = {"type": "string"}
    for _ in range(150):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    many = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)}}
    for schema in (deep, many):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "h", "schema": schema}})
    reply = client.completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body={
        "guided_regex": "(a|aa)*c{1,1000}"})
    assert regex.fullmatch("(a|aa)*c{1,1000}", reply.choices[0].text, partial=True)


def _tool_schema(name: str) -> dict:
    params = next(t["function"].get("parameters") for t in TOOLS if t["function"]["name"] == name)
    return params or {"type": "object", "maxProperties": 0}


def test_required_tool_choice_always_calls_a_tool(client: openai.OpenAI) -> None:
    calls = 0
    for seed in range(12):
        parallel = seed % 2 == 1  # several calls in one message: the budget may end the last one
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                               max_tokens=160, temperature=1.0, seed=seed, n=2,
                                               parallel_tool_calls=parallel)
        for choice in reply.choices:
            assert choice.finish_reason == "tool_calls" or parallel and choice.finish_reason == "length", choice
            assert choice.message.tool_calls, choice
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), _tool_schema(call.function.name))
                calls += 1
    assert calls >= 24


def test_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    for seed in range(4):
        reply = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "add"}}, parallel_tool_calls=False)
        (call,) = reply.choices[0].message.tool_calls
        assert call.function.name == "add"
        jsonschema.validate(json.loads(call.function.arguments), _tool_schema("add"))
    streamed = list(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=1.0, seed=9, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False))
    calls = [c for chunk in streamed for c in chunk.choices[0].delta.tool_calls or []] if streamed else []
    assert [c.function.name for c in calls] == ["get_weather"]
    assert streamed[-1].choices[0].finish_reason == "tool_calls"


def test_auto_tool_choice_stays_free(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto",
                                           max_tokens=16, temperature=0)
    assert reply.choices[0].message.tool_calls is None  # the random model writes no <tool_call> by itself


def _strict_json(text: str) -> dict:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON: {text[:300]}")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_of_tokens_the_grammar_rules_out_are_valid_json(server: ServerProcess, stream: bool) -> None:
    # one choice allows few tokens a step, so the top 5 hold tokens the mask set to -inf: they come at
    # the floor vLLM uses (-9999.0), never as -Infinity (not JSON: a 500, or a stream clients cannot parse)
    import httpx

    from flashllm.serving.generation import LOGPROB_FLOOR

    bodies = [("completions", {"prompt": "Say:", "logprobs": 5}),
              ("chat/completions", {"messages": ASK, "logprobs": True, "top_logprobs": 5})]
    for path, body in bodies:
        body = {**body, "model": MODEL, "max_tokens": 8, "guided_choice": ["alpha"], "stream": stream}
        reply = httpx.post(f"{server.url}/{path}", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        events = ([_strict_json(line[6:]) for line in reply.text.splitlines()
                   if line.startswith("data: ") and line != "data: [DONE]"] if stream else [_strict_json(reply.text)])
        text = "".join(c.get("text") or (c.get("message") or c.get("delta") or {}).get("content") or ""
                       for e in events for c in e["choices"])
        assert text == "alpha", (path, text)
        logprobs = [c["logprobs"] for e in events for c in e["choices"] if c.get("logprobs")]
        if path == "completions":
            chosen = [lp for entry in logprobs for lp in entry["token_logprobs"]]
            tops = [lp for entry in logprobs for top in entry["top_logprobs"] for lp in top.values()]
        else:
            content = [item for entry in logprobs for item in entry["content"]]
            chosen = [item["logprob"] for item in content]
            tops = [t["logprob"] for item in content for t in item["top_logprobs"]]
        assert chosen and all(LOGPROB_FLOOR < lp <= 0 for lp in chosen), (path, chosen)
        assert LOGPROB_FLOOR in tops and all(LOGPROB_FLOOR <= lp <= 0 for lp in tops), (path, tops)


def test_echo_with_logprobs_gives_the_prompts_logprobs(client: openai.OpenAI) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from flashllm.models.demo import demo_model_dir
    from flashllm.models.tokenizer import load_tokenizer

    prompt = "Hello there, this is a prompt"
    ids = load_tokenizer(demo_model_dir()).encode(prompt)
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(demo_model_dir(), dtype=torch.float32).eval()
        expected = hf(torch.tensor([ids])).logits[0].log_softmax(dim=-1)
    for stream in (False, True):
        reply = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=3,
                                          temperature=0, stream=stream)
        choices = [reply.choices[0]] if not stream else [c.choices[0] for c in reply if c.choices]
        text = "".join(c.text for c in choices)
        logprobs = choices[0].logprobs
        assert text.startswith(prompt)
        assert len(logprobs.tokens) >= len(ids) and logprobs.token_logprobs[0] is None
        got = torch.tensor(logprobs.token_logprobs[1:len(ids)])
        torch.testing.assert_close(got, expected[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], atol=1e-4, rtol=0)
        assert len(logprobs.top_logprobs[1]) == 2 and logprobs.top_logprobs[0] is None
