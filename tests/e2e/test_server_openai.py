"""The real server on 127.0.0.1 driven by the `openai` client; answers checked against in-process LLM."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

import httpx  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import flashllm  # noqa: E402
from flashllm import LLM, SamplingParams  # noqa: E402
from flashllm.testing.server import ServerProcess, running_server  # noqa: E402
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
ENGINE_FLAGS = ["--max-model-len", "256", "--block-size", "16", "--num-kv-blocks", "96", "--max-num-seqs", "8"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("served"), "qwen2", seed=3)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    with running_server([str(model_dir), *ENGINE_FLAGS]) as server:
        yield server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), max_model_len=256, block_size=16, num_kv_blocks=96)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_served_model(client: openai.OpenAI, model_dir: Path) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [model_dir.name]


def test_chat_matches_in_process_generation(client: openai.OpenAI, llm: LLM) -> None:
    reply = client.chat.completions.create(model=_model(client), messages=MESSAGES, temperature=0, max_tokens=12)
    expected = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12))[0]
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert reply.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kwargs = dict(model=_model(client), messages=MESSAGES, temperature=0.8, seed=11, max_tokens=20)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.choices[0].message.content
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_equals_non_stream_with_several_prompts(client: openai.OpenAI) -> None:
    kwargs = dict(model=_model(client), prompt=["The sky is", "Once upon"], temperature=0.9, seed=5,
                  max_tokens=10, n=2)
    whole = client.completions.create(**kwargs)
    assert sorted(c.index for c in whole.choices) == [0, 1, 2, 3]
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {c.index: c.text for c in whole.choices}


def test_completion_matches_in_process_generation(client: openai.OpenAI, llm: LLM) -> None:
    whole = client.completions.create(model=_model(client), prompt="Hello there", temperature=0, max_tokens=8)
    expected = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=8))[0]
    assert whole.choices[0].text == expected.text
    echoed = client.completions.create(model=_model(client), prompt="Hello there", temperature=0, max_tokens=8,
                                       echo=True)
    assert echoed.choices[0].text == "Hello there" + expected.text


def test_token_id_prompt_equals_text_prompt(client: openai.OpenAI, llm: LLM) -> None:
    ids = llm.tokenizer.encode("Hello there")
    by_ids = client.completions.create(model=_model(client), prompt=ids, temperature=0, max_tokens=8)
    by_text = client.completions.create(model=_model(client), prompt="Hello there", temperature=0, max_tokens=8)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_seeds_reproduce_and_differ(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        reply = client.chat.completions.create(model=_model(client), messages=MESSAGES, temperature=1.0,
                                               seed=seed, max_tokens=16)
        return reply.choices[0].message.content

    first = sample(7)
    assert all(sample(7) == first for _ in range(4))
    assert any(sample(seed) != first for seed in (8, 9, 10))


def test_n_gives_distinct_choices(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=_model(client), messages=MESSAGES, temperature=1.0, seed=3,
                                           max_tokens=16, n=2, logprobs=True)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].message.content != reply.choices[1].message.content
    assert reply.usage.completion_tokens == sum(len(c.logprobs.content) for c in reply.choices)


def test_logprobs_match_in_process_values(client: openai.OpenAI, llm: LLM) -> None:
    reply = client.chat.completions.create(model=_model(client), messages=MESSAGES, temperature=0, max_tokens=6,
                                           logprobs=True, top_logprobs=3)
    expected = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=6, logprobs=3))[0].outputs[0]
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == len(expected.token_ids)
    for entry, lp, tops in zip(content, expected.logprobs, expected.top_logprobs, strict=True):
        assert entry.logprob == pytest.approx(lp, abs=1e-4)
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([v for _, v in tops], abs=1e-4)
        assert entry.logprob <= 0 and entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
    legacy = client.completions.create(model=_model(client), prompt="Hello", temperature=0, max_tokens=5, logprobs=2)
    assert len(legacy.choices[0].logprobs.token_logprobs) == 5
    assert "".join(legacy.choices[0].logprobs.tokens) == legacy.choices[0].text


def test_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    base = client.completions.create(model=_model(client), prompt="Once upon", temperature=0, max_tokens=24,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), f"the sample text {text!r} is too short to pick a stop string from"
    cut = client.completions.create(model=_model(client), prompt="Once upon", temperature=0, max_tokens=24,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_extra_sampling_fields_are_honoured(client: openai.OpenAI) -> None:
    greedy = client.chat.completions.create(model=_model(client), messages=MESSAGES, temperature=0, max_tokens=10)
    top1 = client.chat.completions.create(model=_model(client), messages=MESSAGES, temperature=1.5, seed=1,
                                          max_tokens=10, extra_body={"top_k": 1})
    assert top1.choices[0].message.content == greedy.choices[0].message.content


def test_validation_errors_are_openai_shaped(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=_model(client), messages=MESSAGES, temperature=7)
    assert err.value.status_code == 400
    assert "temperature" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="not-this-one", messages=MESSAGES)


def _post(server: ServerProcess, path: str, body: dict) -> tuple[int, dict]:
    reply = httpx.post(f"{server.base_url}{path}", json=body, timeout=30)
    return reply.status_code, reply.json()


def test_tokenize_counts_a_prompt_as_the_completion_route_does(server: ServerProcess, client: openai.OpenAI,
                                                               model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = "The quick brown fox jumps over the lazy dog"
    status, reply = _post(server, "/tokenize", {"prompt": prompt})
    assert status == 200, reply
    assert reply["tokens"] == tokenizer.encode(prompt) and reply["count"] == len(reply["tokens"])
    assert reply["max_model_len"] == 256
    done = client.completions.create(model=_model(client), prompt=prompt, max_tokens=1, temperature=0)
    assert done.usage.prompt_tokens == reply["count"]
    status, plain = _post(server, "/tokenize", {"prompt": prompt, "add_special_tokens": False,
                                                "return_token_strs": True})
    assert plain["tokens"] == tokenizer.encode(prompt, add_special_tokens=False)
    assert plain["token_strs"] == tokenizer.convert_ids_to_tokens(plain["tokens"])
    # past the context it is still counted, not refused: that is what a client asks this route for
    status, long = _post(server, "/tokenize", {"prompt": "hello world " * 200})
    assert status == 200 and long["count"] > 256


def test_tokenize_renders_messages_as_the_chat_route_does(server: ServerProcess, client: openai.OpenAI,
                                                          llm: LLM) -> None:
    status, reply = _post(server, "/tokenize", {"messages": MESSAGES})
    assert status == 200, reply
    expected = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=1))[0]
    assert reply["tokens"] == list(expected.prompt_token_ids)
    chat = client.chat.completions.create(model=_model(client), messages=MESSAGES, max_tokens=1, temperature=0)
    assert chat.usage.prompt_tokens == reply["count"]
    _, bare = _post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert bare["count"] < reply["count"] and reply["tokens"][:bare["count"]] == bare["tokens"]


def test_detokenize_inverts_tokenize(server: ServerProcess, model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = "Once upon a time, a small model counted its tokens."
    _, tokenized = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})
    status, reply = _post(server, "/detokenize", {"tokens": tokenized["tokens"]})
    assert status == 200, reply
    assert reply["prompt"] == tokenizer.decode(tokenized["tokens"]) == text
    status, error = _post(server, "/detokenize", {"tokens": [1, len(tokenizer) + 10_000_000]})
    assert status == 400 and error["error"]["param"] == "tokens"


def test_version_names_the_package(server: ServerProcess) -> None:
    assert httpx.get(f"{server.base_url}/version", timeout=30).json() == {"version": flashllm.__version__}


def test_embeddings_are_the_model_s_pooled_states(client: openai.OpenAI, server: ServerProcess, llm: LLM,
                                                  model_dir: Path) -> None:
    """/v1/embeddings as the openai client calls it (base64, which it decodes) and as floats, against
    LLM.embed; `dimensions` cuts before normalizing; usage counts the prompt tokens."""
    import base64

    import numpy as np

    texts = ["Name a colour.", "red green blue"]
    expected = [o.outputs.embedding for o in llm.embed(texts)]
    reply = client.embeddings.create(model=_model(client), input=texts)
    assert [d.index for d in reply.data] == [0, 1]
    for got, want in zip(reply.data, expected, strict=True):
        assert np.allclose(got.embedding, want, atol=1e-6)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    assert reply.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in texts)
    plain = httpx.post(f"{server.url}/embeddings", json={"input": texts[0], "encoding_format": "float",
                                                          "dimensions": 8}, timeout=60).json()
    cut = np.asarray(expected[0])  # normalized full vector: its first 8 features, normalized again
    assert np.allclose(plain["data"][0]["embedding"], cut[:8] / np.linalg.norm(cut[:8]), atol=1e-6)
    raw = httpx.post(f"{server.url}/embeddings", json={"input": [[5, 6, 7]], "encoding_format": "base64"},
                     timeout=60).json()["data"][0]["embedding"]
    from_ids = llm.embed([[5, 6, 7]])[0].outputs.embedding
    assert np.allclose(np.frombuffer(base64.b64decode(raw), dtype="<f4"), from_ids, atol=1e-6)
    long = "red green blue " * 200  # past the 256-token context: refused whole, embedded by its last 5 tokens
    assert httpx.post(f"{server.url}/embeddings", json={"input": long}, timeout=60).status_code == 400
    cut = httpx.post(f"{server.url}/embeddings", json={"input": long, "truncate_prompt_tokens": 5}, timeout=60).json()
    assert cut["usage"]["prompt_tokens"] == 5
    tail = llm.embed([tokenizer.encode(long)[-5:]])[0].outputs.embedding
    assert np.allclose(cut["data"][0]["embedding"], tail, atol=1e-6)


def _held_word(llm: LLM, output: object) -> str:
    """A word of a greedy output (split at spaces, or one token's text) whose bad-word token sequences (as the
    engine bans them) the output holds."""
    from flashllm.core.bad_words import tokenize_bad_words

    ids, text = output.outputs[0].token_ids, output.outputs[0].text
    for word in [*text.split(), *(llm.engine.tokenizer.decode([t]).strip() for t in ids)]:
        for seq in tokenize_bad_words([word], llm.engine.tokenizer):
            if any(tuple(ids[i:i + len(seq)]) == seq for i in range(len(ids))):
                return word
    raise AssertionError(f"the greedy output {text!r} holds no whole word to ban")


def test_bad_words_leave_both_routes_as_in_process(client: openai.OpenAI, llm: LLM) -> None:
    # a prompt whose greedy reply holds a word the tokenizer spells as the reply does (this tiny tokenizer splits
    # digits, so the "50" tokens other prompts repeat cannot be named as words)
    prompt, messages = "Hello, my name is", [{"role": "user", "content": "Hello, my name is"}]
    free = SamplingParams(temperature=0, max_tokens=16)
    plain = llm.generate([prompt], free, use_tqdm=False)[0]
    word = _held_word(llm, plain)
    expected = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, bad_words=[word]), use_tqdm=False)[0]
    assert expected.outputs[0].text != plain.outputs[0].text
    reply = client.completions.create(model=_model(client), prompt=prompt, temperature=0, max_tokens=16,
                                      extra_body={"bad_words": [word]})
    assert reply.choices[0].text == expected.outputs[0].text
    chat_plain = llm.chat(messages, free)[0]
    chat_word = _held_word(llm, chat_plain)
    chat_expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=16, bad_words=[chat_word]))[0]
    assert chat_expected.outputs[0].text != chat_plain.outputs[0].text
    chat = client.chat.completions.create(model=_model(client), messages=messages, temperature=0, max_tokens=16,
                                          extra_body={"bad_words": [chat_word]})
    assert chat.choices[0].message.content == chat_expected.outputs[0].text


def test_truncate_prompt_tokens_keeps_the_last_tokens_of_a_prompt_past_the_context(
        server: ServerProcess, client: openai.OpenAI, llm: LLM) -> None:
    long = "the sky is blue and " * 100
    ids = llm.engine.tokenizer.encode(long)
    assert len(ids) > 256
    status, refused = _post(server, "/v1/completions", {"prompt": long, "max_tokens": 4})
    assert status == 400 and refused["error"]["code"] == "context_length_exceeded"
    expected = llm.generate([ids[-8:]], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    reply = client.completions.create(model=_model(client), prompt=long, temperature=0, max_tokens=6, echo=True,
                                      extra_body={"truncate_prompt_tokens": 8})
    assert reply.usage.prompt_tokens == 8
    assert reply.choices[0].text == llm.engine.tokenizer.decode(ids[-8:]) + expected.outputs[0].text
    messages = [{"role": "user", "content": long}]
    chat_ids = llm.render_chat(messages)
    chat_expected = llm.generate([chat_ids[-8:]], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    chat = client.chat.completions.create(model=_model(client), messages=messages, temperature=0, max_tokens=6,
                                          extra_body={"truncate_prompt_tokens": 8})
    assert chat.usage.prompt_tokens == 8
    assert chat.choices[0].message.content == chat_expected.outputs[0].text


@pytest.mark.parametrize("route", ["/completions", "/chat/completions"])
def test_continuous_usage_stats_count_every_chunk(server: ServerProcess, route: str) -> None:
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage counts the tokens streamed so far, and the
    final usage chunk the whole reply."""
    import json

    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            **({"prompt": "Hello"} if route == "/completions" else {"messages": MESSAGES})}
    with httpx.stream("POST", f"{server.url}{route}", json=body, timeout=60) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all("usage" in c for c in chunks) and counts == sorted(counts) and counts[-1] == 8
    prompt = {c["usage"]["prompt_tokens"] for c in chunks}
    assert len(prompt) == 1 and all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] +
                                    c["usage"]["completion_tokens"] for c in chunks)
    streamed = [c for c in chunks if c["choices"]]
    assert len({c["usage"]["completion_tokens"] for c in streamed}) > 2  # it grows while the reply streams
