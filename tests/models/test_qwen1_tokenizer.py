"""First-generation Qwen's tokenizer from a `qwen.tiktoken` rank file made here: encodings equal a
naive tiktoken-style BPE written in this test, round trips, special tokens, ChatML, stop words,
and malformed rank files refused in one line."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
import torch

from flashllm.models.errors import ModelLoadError
from flashllm.models.tokenizer import eos_token_ids, load_chat_template, load_tokenizer
from flashllm.testing.tiktoken_files import naive_encode as naive_tiktoken_encode
from flashllm.testing.tiktoken_files import train_ranks, write_rank_file

# Qwen's pre-tokenization regex, as published in tokenization_qwen.py
PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
       r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *(f"<|extra_{i}|>" for i in range(205))]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. I'll say it's what they've done; we'd agree.",
    "def tokenize(text):\n    return [t for t in text.split()]\n\n\nprint(tokenize('hello world'))",
    "通义千问是阿里云研发的大语言模型。你好，世界！今天天气很好。",
    "Numbers 12345 and 2024-11-29, prices $3.50 or €4,20; emoji 😀🎉 and accents café naïve.",
]
TEXTS = [
    "hello world", "  leading spaces and trailing   ", "I'll be there, won't you? THEY'RE here.",
    "line one\nline two\r\n\n\n   indented\tand tabbed", "1234567890 3.14159", "你好，世界！通义千问",
    "emoji 😀🎉 mixed with café and naïve", "e\u0301 decomposed (NFC turns it into é)", "",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n", "text<|endoftext|>more<|extra_204|>",
    "def f(x):\n    return x ** 2  # square\n", "!!!??? ... --- ***", "\u00a0non-breaking\u2003spaces",
]


def naive_encode(ranks: dict[bytes, int], text: str) -> list[int]:
    """What QWenTokenizer (tiktoken, allowed_special="all") gives: NFC, special tokens cut out, the
    regex pieces, then each piece whole if it is a token, else merged pair by lowest rank."""
    return naive_tiktoken_encode(ranks, text, PAT, SPECIALS, nfc=True)


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    return train_ranks(CORPUS, PAT)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, ranks) -> Path:
    root = tmp_path_factory.mktemp("qwen_tok")
    write_rank_file(root / "qwen.tiktoken", ranks)
    (root / "tokenizer_config.json").write_text(json.dumps({
        "model_max_length": 8192, "tokenizer_class": "QWenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_qwen.QWenTokenizer", None]}}))
    (root / "generation_config.json").write_text(json.dumps({
        "chat_format": "chatml", "eos_token_id": len(ranks), "pad_token_id": len(ranks), "max_window_size": 6144}))
    return root


@pytest.fixture(scope="module")
def tokenizer(qwen_dir):
    return load_tokenizer(qwen_dir)


def test_the_trained_vocabulary_has_merges_to_test(ranks):
    assert len(ranks) > 256 + 100 and max(len(t) for t in ranks) >= 4


@pytest.mark.parametrize("text", TEXTS)
def test_encoding_equals_the_naive_tiktoken_bpe(text, tokenizer, ranks):
    expected = naive_encode(ranks, text)
    assert tokenizer.encode(text) == expected  # no BOS is added, as QWenTokenizer adds none
    assert tokenizer.encode(text, add_special_tokens=False) == expected


def test_random_unicode_strings_encode_like_the_naive_bpe(tokenizer, ranks):
    gen = torch.Generator().manual_seed(3)
    alphabet = list("abcdeABC xyz'\n\t.,!?0123 ") + ["é", "中", "文", "😀", "\u0301", "\u3000"]
    for _ in range(200):
        picks = torch.randint(0, len(alphabet), (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen)
        text = "".join(alphabet[i] for i in picks.tolist())
        assert tokenizer.encode(text) == naive_encode(ranks, text), repr(text)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips_nfc_text(text, tokenizer):
    assert tokenizer.decode(tokenizer.encode(text)) == unicodedata.normalize("NFC", text)


def test_special_tokens_take_the_ids_after_the_ranks(tokenizer, ranks):
    n = len(ranks)
    assert tokenizer.convert_tokens_to_ids(SPECIALS) == list(range(n, n + 208))
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == n
    assert tokenizer.bos_token_id is None
    assert len(tokenizer) == n + 208
    ids = tokenizer.encode("<|im_start|>user\nhello<|im_end|>")
    assert ids[0] == n + 1 and ids[-1] == n + 2
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhello"
    assert tokenizer.convert_ids_to_tokens([n + 207]) == ["<|extra_204|>"]


def test_a_split_multibyte_character_decodes_as_replacement_then_whole(tokenizer):
    ids = tokenizer.encode("🚀")
    assert len(ids) > 1  # four bytes, the last two never adjacent in CORPUS, so never merged
    assert tokenizer.decode(ids[:1]) == "\ufffd" and tokenizer.decode(ids) == "🚀"


def test_chatml_template_renders_qwens_make_context(qwen_dir, tokenizer, ranks):
    template = load_chat_template(qwen_dir)
    assert template is not None
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"},
               {"role": "user", "content": "2+2?"}]
    # qwen_generation_utils.make_context, chat_format "chatml", default system prompt
    expected = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>"
                "\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello!<|im_end|>"
                "\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert template.render(history) == expected
    own_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert template.render(own_system) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>"
                                           "\n<|im_start|>assistant\n")
    assert tokenizer.encode(expected, add_special_tokens=False) == naive_encode(ranks, expected)


def test_generation_config_stop_words_join_the_eos_ids(qwen_dir, tokenizer, ranks):
    n = len(ranks)
    generation = json.loads((qwen_dir / "generation_config.json").read_text())
    assert sorted(eos_token_ids(tokenizer, generation)) == [n, n + 1, n + 2]  # endoftext, im_start, im_end
    assert eos_token_ids(tokenizer, {**generation, "chat_format": "raw"}) == [n]


# ---------------------------------------------------------------- hostile rank files


def _load_with_lines(tmp_path: Path, ranks: dict[bytes, int], edit) -> ModelLoadError:
    write_rank_file(tmp_path / "qwen.tiktoken", ranks)
    lines = (tmp_path / "qwen.tiktoken").read_text().splitlines()
    (tmp_path / "qwen.tiktoken").write_text("\n".join(edit(lines)) + "\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "QWenTokenizer"}))
    with pytest.raises(ModelLoadError) as info:
        load_tokenizer(tmp_path)
    assert "\n" not in str(info.value) and str(tmp_path / "qwen.tiktoken") in str(info.value)
    return info.value


@pytest.mark.parametrize("bad", ["not-base64!! 300", "QUJD", "QUJD 12 13", "QUJD -1", "QUJD x", " 12"])
def test_a_malformed_line_is_refused_naming_the_file_and_line(tmp_path, ranks, bad):
    error = _load_with_lines(tmp_path, ranks, lambda lines: [*lines[:2], bad, *lines[2:]])
    assert "line 3: expected '<base64 token bytes> <rank>'" in str(error)


def test_a_duplicate_token_or_rank_is_refused(tmp_path, ranks):
    error = _load_with_lines(tmp_path, ranks, lambda lines: [*lines, lines[5].split()[0] + f" {len(lines)}"])
    assert f"line {len(ranks) + 1}" in str(error) and "already given on line 6" in str(error)
    error = _load_with_lines(tmp_path, ranks, lambda lines: [*lines, "QUJDREVGRw== 7"])
    assert "rank 7 was already given on line 8" in str(error)


def test_gaps_in_the_ranks_or_a_missing_byte_are_refused(tmp_path, ranks):
    assert "ranks are not 0.." in str(_load_with_lines(tmp_path, ranks, lambda lines: lines[:-2] + lines[-1:]))
    no_byte = {t: r for t, r in ranks.items() if t != b"\x00"}
    renumbered = {t: i for i, t in enumerate(sorted(no_byte, key=no_byte.get))}
    assert "single-byte tokens are missing" in str(_load_with_lines(tmp_path, renumbered, lambda lines: lines))


def test_a_missing_rank_file_is_refused(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "QWenTokenizer"}))
    with pytest.raises(ModelLoadError, match="qwen.tiktoken does not exist"):
        load_tokenizer(tmp_path)
