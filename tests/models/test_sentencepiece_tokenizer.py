"""The sentencepiece tokenizer (ChatGLM2/3's, Baichuan-style) and the ChatGLM2 / ChatGLM3 chat formats.

The sentencepiece model is trained in the test; expected ids come from the `sentencepiece` package
itself and from ChatGLM's published layout (its special tokens numbered after the model's pieces:
[MASK] [gMASK] [sMASK] sop eop <|system|> <|user|> <|assistant|> <|observation|>), expected prompts
from the published formats.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sentencepiece

from flashllm.core.detokenizer import IncrementalDetokenizer
from flashllm.models.chat_template import ChatTemplate, ChatTemplateError
from flashllm.models.errors import ModelLoadError
from flashllm.models.tokenizer import eos_token_ids, load_chat_template, load_tokenizer
from flashllm.models.tokenizers.sentencepiece_tokenizer import (
    SentencePieceTokenizer,
    load_chatglm_tokenizer,
    load_sentencepiece_tokenizer,
)
from flashllm.testing.sentencepiece_model import train_sentencepiece_model

CHATGLM_ORDER = ("[MASK]", "[gMASK]", "[sMASK]", "sop", "eop", "<|system|>", "<|user|>", "<|assistant|>",
                 "<|observation|>")
TEXTS = [
    "The morning train left the station four minutes late.",
    "def add(a, b):\n    return a + b\n",
    "  two leading spaces,   three inside, a tab\tand a trailing space ",
    "你好，世界！今天天气很好。",
    "emoji 🚀🌧️ and accents: café, naïve, Ångström",
    "line one\n\nline three\r\n",
]


@pytest.fixture(scope="module")
def chatglm_dir(tmp_path_factory) -> Path:
    """A directory shaped like ChatGLM3's tokenizer files: tokenizer.model, a tokenizer_config.json naming
    ChatGLMTokenizer, and a tokenization_chatglm.py that would leave a mark if anything ran it."""
    root = tmp_path_factory.mktemp("chatglm_tokenizer")
    train_sentencepiece_model(root / "tokenizer.model")
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "ChatGLMTokenizer", "remove_space": False, "do_lower_case": False,
        "auto_map": {"AutoTokenizer": ["tokenization_chatglm.ChatGLMTokenizer", None]},
    }))
    (root / "tokenization_chatglm.py").write_text(
        f"open({str(root / 'EXECUTED')!r}, 'w').close()\nraise SystemExit('remote code ran')\n")
    return root


@pytest.fixture(scope="module")
def sp(chatglm_dir):
    return sentencepiece.SentencePieceProcessor(model_file=str(chatglm_dir / "tokenizer.model"))


@pytest.fixture(scope="module")
def tok(chatglm_dir) -> SentencePieceTokenizer:
    return load_tokenizer(chatglm_dir)


def special_id(sp, token: str) -> int:
    return sp.get_piece_size() + CHATGLM_ORDER.index(token)


def test_load_tokenizer_builds_chatglm_natively_without_running_its_code(chatglm_dir, tok):
    assert isinstance(tok, SentencePieceTokenizer)
    assert not (chatglm_dir / "EXECUTED").exists()


def test_special_tokens_follow_the_pieces_in_chatglm_order(tok, sp):
    for token in CHATGLM_ORDER:
        assert tok.convert_tokens_to_ids(token) == special_id(sp, token)
        assert tok.convert_ids_to_tokens(special_id(sp, token)) == token
    assert len(tok) == sp.get_piece_size() + len(CHATGLM_ORDER)
    assert (tok.eos_token, tok.eos_token_id) == ("</s>", sp.eos_id())
    assert (tok.pad_token_id, tok.unk_token_id, tok.bos_token_id) == (sp.unk_id(), sp.unk_id(), None)


@pytest.mark.parametrize("text", TEXTS)
def test_plain_text_encodes_as_sentencepiece_does_and_round_trips(tok, sp, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == sp.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode(text) == [special_id(sp, "[gMASK]"), special_id(sp, "sop"), *ids]
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text


def test_special_tokens_in_text_are_cut_out_and_the_rest_encoded_between_them(tok, sp):
    text = "[gMASK]sop<|system|>\n Be brief.<|user|>\n 你好<|assistant|>"
    expected = [special_id(sp, "[gMASK]"), special_id(sp, "sop"), special_id(sp, "<|system|>"),
                *sp.encode("\n Be brief."), special_id(sp, "<|user|>"), *sp.encode("\n 你好"),
                special_id(sp, "<|assistant|>")]
    assert tok.encode(text, add_special_tokens=False) == expected
    assert tok.decode(expected) == text
    assert tok.decode(expected, skip_special_tokens=True) == "\n Be brief.\n 你好"


@pytest.mark.parametrize("text", ["sop", "isopropyl sop eop", "a sop<|user|>", "sop[gMASK]"])
def test_sop_spelt_in_ordinary_text_stays_text(tok, sp, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert special_id(sp, "sop") not in ids and special_id(sp, "eop") not in ids
    assert tok.decode(ids) == text


def test_padded_vocabulary_ids_decode_to_nothing(tok, sp):
    past = len(tok) + 5  # ChatGLM's embedding has rows past the tokenizer (padded_vocab_size)
    assert tok.decode([*sp.encode("hello"), past]) == "hello"
    assert tok.convert_ids_to_tokens(past) == ""


def test_streamed_text_equals_the_whole_decode(tok):
    ids = tok.encode(" ".join(TEXTS) + "<|user|>", add_special_tokens=False)
    stream = IncrementalDetokenizer(tok, skip_special_tokens=True)
    text = "".join(stream.add([i]) for i in ids) + stream.flush()
    assert text == tok.decode(ids, skip_special_tokens=True)


def test_call_returns_input_ids_like_a_transformers_tokenizer(tok):
    batch = tok(["hello", "a b"], add_special_tokens=False)
    assert batch["input_ids"] == [tok.encode("hello", False), tok.encode("a b", False)]
    assert batch.attention_mask == [[1] * len(ids) for ids in batch["input_ids"]]


@pytest.mark.parametrize("content", [b"not a sentencepiece model\n", b"", b"\x0a\x05hello"])
def test_a_file_that_is_not_a_sentencepiece_model_is_refused_in_one_line(tmp_path, content):
    (tmp_path / "tokenizer.model").write_bytes(content)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ChatGLMTokenizer"}))
    with pytest.raises(ModelLoadError) as info:
        load_tokenizer(tmp_path)
    message = str(info.value)
    assert "\n" not in message and "tokenizer.model" in message and "not a sentencepiece model" in message


def test_a_missing_model_file_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match=r"tokenizer\.model does not exist"):
        load_chatglm_tokenizer(tmp_path)


def test_llama_style_loader_adds_bos_and_checks_its_special_tokens(tmp_path):
    model = train_sentencepiece_model(tmp_path / "tokenizer.model", user_defined_symbols=["<reserved_106>"])
    own = sentencepiece.SentencePieceProcessor(model_file=str(model))
    tok = load_sentencepiece_tokenizer(tmp_path, {"add_bos_token": True, "add_eos_token": True,
                                                  "additional_special_tokens": ["<reserved_106>"]})
    reserved = own.piece_to_id("<reserved_106>")
    assert tok.encode("hi<reserved_106>") == [own.bos_id(), *own.encode("hi"), reserved, own.eos_id()]
    assert tok.decode(tok.encode("hi<reserved_106>"), skip_special_tokens=True) == "hi"
    with pytest.raises(ModelLoadError, match="'<nope>' is not in"):
        load_sentencepiece_tokenizer(tmp_path, {"eos_token": "<nope>"})


ERNIE_PIECES = ["<pad>", "<cls>", "<sep>", "<mask:0>", "<mask:1>", "<mask:7>", "<|begin_of_sentence|>",
                "<|end_of_sentence|>"]


def test_ernie_4_5_s_remote_code_tokenizer_is_built_natively_adding_nothing(tmp_path):
    """ERNIE 4.5 checkpoints name Ernie4_5Tokenizer (remote code over tokenizer.model): built from the file, its
    code never run; the text between special tokens is sentencepiece's, with no <s> / </s> added (the class drops
    add_special_tokens); its default special tokens are the model's pieces, the config's additional ones too."""
    model = train_sentencepiece_model(tmp_path / "tokenizer.model", user_defined_symbols=ERNIE_PIECES)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Ernie4_5Tokenizer", "bos_token": "<s>", "eos_token": "</s>",
        "additional_special_tokens": ["<|begin_of_sentence|>", "<|end_of_sentence|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_ernie4_5.Ernie4_5Tokenizer", None]}}))
    (tmp_path / "tokenization_ernie4_5.py").write_text(
        f"open({str(tmp_path / 'EXECUTED')!r}, 'w').close()\nraise SystemExit('remote code ran')\n")
    own = sentencepiece.SentencePieceProcessor(model_file=str(model))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, SentencePieceTokenizer) and not (tmp_path / "EXECUTED").exists()
    for text in TEXTS:
        assert tok.encode(text) == own.encode(text)
        assert tok.decode(tok.encode(text)) == text
    start, end, mask = (own.piece_to_id(p) for p in ("<|begin_of_sentence|>", "<|end_of_sentence|>", "<mask:1>"))
    assert tok.encode("<|begin_of_sentence|>User: hi<mask:1><|end_of_sentence|>") == [
        start, *own.encode("User: hi"), mask, end]
    assert (tok.eos_token_id, tok.pad_token_id) == (own.eos_id(), own.piece_to_id("<pad>"))
    train_sentencepiece_model(tmp_path / "bare" / "tokenizer.model")  # no <pad> / <cls> / <mask:*> pieces
    (tmp_path / "bare" / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Ernie4_5Tokenizer"}))
    with pytest.raises(ModelLoadError, match="is not in"):
        load_tokenizer(tmp_path / "bare")


# ---------------------------------------------------------------- chat formats


def test_chatglm2_renders_its_numbered_rounds():
    messages = [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "你好！有什么可以帮你？"},
                {"role": "user", "content": "讲个笑话"}]
    expected = "[gMASK]sop[Round 1]\n\n问：你好\n\n答：你好！有什么可以帮你？\n\n[Round 2]\n\n问：讲个笑话\n\n答："
    assert ChatTemplate.builtin("chatglm2").render(messages) == expected


@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
])
def test_chatglm2_refuses_what_its_format_cannot_say(messages):
    with pytest.raises(ChatTemplateError, match="chatglm2 conversations alternate user and assistant"):
        ChatTemplate.builtin("chatglm2").render(messages)


def test_chatglm3_renders_role_tokens_after_the_prefix():
    messages = [{"role": "system", "content": "You are a helpful assistant"}, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi there"}, {"role": "user", "content": "Who are you"}]
    expected = ("[gMASK]sop<|system|>\n You are a helpful assistant<|user|>\n Hello<|assistant|>\n Hi there"
                "<|user|>\n Who are you<|assistant|>")
    template = ChatTemplate.builtin("chatglm3")
    assert template.render(messages) == expected
    assert template.render(messages, add_generation_prompt=False) == expected.removesuffix("<|assistant|>")


def test_chatglm3_puts_tools_after_the_system_text_and_tool_results_under_observation():
    tools = [{"name": "get_weather", "description": "天气", "parameters": {"type": "object"}}]
    tools_json = json.dumps(tools, indent=4, ensure_ascii=False)
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "get_weather()"}, {"role": "tool", "content": "{\"sun\": true}"}]
    expected = (f"[gMASK]sop<|system|>\n Use tools.\n{tools_json}<|user|>\n Weather?<|assistant|>\n get_weather()"
                "<|observation|>\n {\"sun\": true}<|assistant|>")
    template = ChatTemplate.builtin("chatglm3")
    assert template.render(messages, tools=tools) == expected
    without_system = template.render(messages[1:2], tools=tools)
    assert without_system == ("[gMASK]sop<|system|>\n Answer the following questions as best as you can. You have "
                              f"access to the following tools:\n{tools_json}<|user|>\n Weather?<|assistant|>")


def test_a_rendered_chatglm3_prompt_encodes_to_chatglm3_special_ids(tok, sp):
    text = ChatTemplate.builtin("chatglm3").render([{"role": "user", "content": "Hello"}])
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[:3] == [special_id(sp, "[gMASK]"), special_id(sp, "sop"), special_id(sp, "<|user|>")]
    assert ids[3:-1] == sp.encode("\n Hello") and ids[-1] == special_id(sp, "<|assistant|>")


def test_chatglm3s_turn_starts_end_generation_beside_eos(tok, sp):
    """ChatGLM3's chat() passes eos_token_id=[eos, <|user|>, <|observation|>]: the model writes one of
    them when its turn is over."""
    assert eos_token_ids(tok, None) == [sp.eos_id(), special_id(sp, "<|user|>"), special_id(sp, "<|observation|>")]
    assert eos_token_ids(tok, {"eos_token_id": [2]}) == [sp.eos_id(), special_id(sp, "<|user|>"),
                                                          special_id(sp, "<|observation|>")]


@pytest.mark.parametrize(("names", "expected"), [
    ({"config": "THUDM/chatglm3-6b"}, "chatglm3"),
    ({"config": "THUDM/ChatGLM2-6B-int4"}, "chatglm2"),
    ({"tokenizer": "/models/chatglm3-6b-32k"}, "chatglm3"),
    ({"config": "THUDM/chatglm2-6b", "template": "{{ 'own' }}"}, "own"),  # a shipped template wins
    ({}, None),  # a fine-tune naming neither generation: no guess
])
def test_a_chatglm_checkpoint_without_a_template_gets_the_one_of_its_generation(chatglm_dir, tmp_path, names,
                                                                                 expected):
    (tmp_path / "tokenizer.model").write_bytes((chatglm_dir / "tokenizer.model").read_bytes())
    config = json.loads((chatglm_dir / "tokenizer_config.json").read_text())
    if "tokenizer" in names:
        config["name_or_path"] = names["tokenizer"]
    if "template" in names:
        config["chat_template"] = names["template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if "config" in names:
        (tmp_path / "config.json").write_text(json.dumps({"architectures": ["ChatGLMModel"],
                                                          "_name_or_path": names["config"]}))
    template = load_chat_template(tmp_path)
    if expected is None:
        assert template is None
        return
    messages = [{"role": "user", "content": "hi"}]
    expected_text = {"chatglm3": "[gMASK]sop<|user|>\n hi<|assistant|>", "chatglm2": "[gMASK]sop[Round 1]\n\n问：hi\n\n答：",
                     "own": "own"}[expected]
    assert template.render(messages) == expected_text
