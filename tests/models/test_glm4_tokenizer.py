"""GLM-4's tokenizer (ChatGLM4Tokenizer) from a tiktoken rank file made here under GLM-4's name, tokenizer.model:
encodings equal a naive tiktoken-style BPE with GLM-4's pre-tokenization, the [gMASK]<sop> prefix, special
tokens after the ranks in the published order, stop ids, the glm-4 chat format as build_chat_input builds it,
and rank files that are not ones refused in one line. Nothing in the directory is executed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashllm.models.errors import ModelLoadError
from flashllm.models.tokenizer import eos_token_ids, load_chat_template, load_tokenizer
from flashllm.testing.sentencepiece_model import train_sentencepiece_model
from flashllm.testing.tiktoken_files import naive_encode, train_ranks, write_rank_file

# GLM-4's pre-tokenization regex as its tokenization_chatglm.py publishes it (digits in runs of up to three)
PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
       r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN_PAT = PAT.replace(r"\p{N}{1,3}", r"\p{N}")
SPECIALS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
            "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
            "<|end_of_video|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. I'll say it's what they've done; we'd agree.",
    "def tokenize(text):\n    return [t for t in text.split()]\n\n\nprint(tokenize('hello world'))",
    "智谱清言是一个语言模型。你好，世界！今天天气很好。",
    "Years 2024 1999 2023 and 123 456 789, 100 200 300 prices $3.50; emoji 😀🎉 and café.",
]
TEXTS = [
    "hello world", "  leading spaces and trailing   ", "I'll be there, won't you? THEY'RE here.",
    "line one\nline two\r\n\n\n   indented\tand tabbed", "1234567890 3.14159 2024", "你好，世界！智谱",
    "emoji 😀🎉 mixed with café", "e\u0301 decomposed stays decomposed", "",
    "[gMASK]<sop><|user|>\nhi there<|assistant|>", "text<|endoftext|>more<|end_of_video|>",
]


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    return train_ranks(CORPUS, PAT)


@pytest.fixture(scope="module")
def glm4_dir(tmp_path_factory, ranks) -> Path:
    """A directory shaped like glm-4-9b-chat's tokenizer files (its template left out), with a
    tokenization_chatglm.py that would leave a mark if anything ran it."""
    root = tmp_path_factory.mktemp("glm4_tok")
    write_rank_file(root / "tokenizer.model", ranks)
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "ChatGLM4Tokenizer", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "model_max_length": 128000, "auto_map": {"AutoTokenizer": ["tokenization_chatglm.ChatGLM4Tokenizer", None]}}))
    (root / "tokenization_chatglm.py").write_text(f"open({str(root / 'EXECUTED')!r}, 'w').close()\n")
    return root


@pytest.fixture(scope="module")
def tok(glm4_dir):
    return load_tokenizer(glm4_dir)


def special(ranks, token: str) -> int:
    return len(ranks) + SPECIALS.index(token)


def test_the_vocabulary_merges_digit_runs_so_the_pattern_is_tested(ranks):
    assert naive_encode(ranks, "2024 123", PAT, SPECIALS) != naive_encode(ranks, "2024 123", QWEN_PAT, SPECIALS)


@pytest.mark.parametrize("text", TEXTS)
def test_encoding_equals_the_naive_tiktoken_bpe_and_decodes_back(text, tok, ranks, glm4_dir):
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == naive_encode(ranks, text, PAT, SPECIALS)
    assert tok.encode(text) == [special(ranks, "[gMASK]"), special(ranks, "<sop>"), *ids]
    assert tok.decode(ids) == text  # no normalization: what went in comes out
    assert not (glm4_dir / "EXECUTED").exists()


def test_special_tokens_follow_the_ranks_in_the_published_order(tok, ranks):
    assert tok.convert_ids_to_tokens(list(range(len(ranks), len(ranks) + len(SPECIALS)))) == SPECIALS
    assert (tok.eos_token_id, tok.pad_token_id, tok.model_max_length) == (len(ranks), len(ranks), 128000)
    assert tok.decode(tok.encode("a<|user|>b"), skip_special_tokens=True) == "ab"


def test_a_turn_ends_at_eos_user_or_observation(tok, ranks):
    """GLM-4-Chat's generation_config lists these three; a checkpoint without one still stops at them."""
    expected = [len(ranks), special(ranks, "<|user|>"), special(ranks, "<|observation|>")]
    assert eos_token_ids(tok, None) == expected
    assert eos_token_ids(tok, {"eos_token_id": expected}) == expected


def test_the_glm4_chat_format_encodes_as_build_chat_input_builds_it(glm4_dir, tok, ranks):
    """build_chat_input: per message its role token, encode(metadata + "\\n"), encode(content); then
    <|assistant|>; encode(text) adds [gMASK]<sop> before it all."""
    template = load_chat_template(glm4_dir)
    assert template is not None and template.name == "glm-4"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2024 + 1?"},
                {"role": "assistant", "content": "2025."}, {"role": "user", "content": "And times 3?"}]
    expected = [special(ranks, "[gMASK]"), special(ranks, "<sop>")]
    for message in messages:
        expected += [special(ranks, f"<|{message['role']}|>"), *naive_encode(ranks, "\n", PAT, SPECIALS),
                     *naive_encode(ranks, message["content"], PAT, SPECIALS)]
    expected.append(special(ranks, "<|assistant|>"))
    assert tok.encode(template.render(messages), add_special_tokens=False) == expected


@pytest.mark.parametrize("bad", ["not-base64!! 300", "QUJD", "QUJD 12 13", "QUJD -1"])
def test_a_malformed_line_is_refused_naming_the_file_and_line(tmp_path, glm4_dir, bad):
    lines = (glm4_dir / "tokenizer.model").read_text().splitlines()
    lines.insert(3, bad)
    (tmp_path / "tokenizer.model").write_text("\n".join(lines) + "\n")
    (tmp_path / "tokenizer_config.json").write_text((glm4_dir / "tokenizer_config.json").read_text())
    with pytest.raises(ModelLoadError) as info:
        load_tokenizer(tmp_path)
    message = str(info.value)
    assert f"{tmp_path / 'tokenizer.model'} line 4" in message and "\n" not in message


def test_a_sentencepiece_model_under_the_glm4_class_is_refused_in_one_line(tmp_path, glm4_dir):
    train_sentencepiece_model(tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer_config.json").write_text((glm4_dir / "tokenizer_config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"tokenizer\.model line \d+: expected '<base64 token bytes> <rank>'") as info:
        load_tokenizer(tmp_path)
    assert "\n" not in str(info.value)
