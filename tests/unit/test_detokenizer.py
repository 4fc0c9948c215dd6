"""Incremental detokenizer and stop strings: streamed text equals the one-shot decode."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from flashllm.core.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, StopChecker
from flashllm.testing.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def byte_bpe(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    return train_tokenizer(tmp_path_factory.mktemp("tok"))


def _byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style (Llama-2-like) BPE: metaspace words, <0xNN> byte fallback."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["▁", ",", ".", "!"]
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("i", "n"), ("▁", "w")]
    for token in letters + ["".join(m) for m in merges]:
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)


BYTE_FALLBACK = _byte_fallback_tokenizer()

# Text mixing ASCII words with characters of 2, 3 and 4 UTF-8 bytes and multi-codepoint emoji.
pieces = st.sampled_from(["the", " the", " in", " a", "w", "hello", ",", ".", "!", " ", "\n",
                          "é", "ñ", "中", "文", "你好", "😀", "🎉", "👍🏽", "👨‍👩‍👧", "∑", "→"])
texts = st.lists(pieces, min_size=1, max_size=60).map("".join)
special = st.sampled_from(["", "<|im_start|>", "<|im_end|>", "<|endoftext|>"])


def _stream(detok: IncrementalDetokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    deltas = [detok.add(ids[a:b]) for a, b in pairwise(bounds)]
    deltas.append(detok.flush())
    return deltas


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts, sep=special, tail=texts, cuts=st.lists(st.integers(0, 500), max_size=40),
       skip=st.booleans())
def test_stream_equals_decode_byte_level(byte_bpe: PreTrainedTokenizerFast, text: str, sep: str,
                                         tail: str, cuts: list[int], skip: bool) -> None:
    ids = byte_bpe.encode(text + sep + tail)
    deltas = _stream(IncrementalDetokenizer(byte_bpe, [5, 6], skip_special_tokens=skip), ids, cuts)
    assert "".join(deltas) == byte_bpe.decode(ids, skip_special_tokens=skip)
    assert not any(REPLACEMENT_CHAR in d for d in deltas), "emitted a broken UTF-8 sequence"


@settings(max_examples=150, deadline=None)
@given(text=texts, cuts=st.lists(st.integers(0, 500), max_size=40))
def test_stream_equals_decode_byte_fallback(text: str, cuts: list[int]) -> None:
    ids = BYTE_FALLBACK.encode(text, add_special_tokens=False)
    deltas = _stream(IncrementalDetokenizer(BYTE_FALLBACK, []), ids, cuts)
    assert "".join(deltas) == BYTE_FALLBACK.decode(ids, skip_special_tokens=True)
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 511), max_size=80), cuts=st.lists(st.integers(0, 500), max_size=40))
def test_arbitrary_ids_including_invalid_bytes(byte_bpe: PreTrainedTokenizerFast, ids: list[int],
                                               cuts: list[int]) -> None:
    deltas = _stream(IncrementalDetokenizer(byte_bpe, []), ids, cuts)
    assert "".join(deltas) == byte_bpe.decode(ids, skip_special_tokens=True)


def test_multibyte_character_is_held_until_complete(byte_bpe: PreTrainedTokenizerFast) -> None:
    emoji = "🎉"
    # The byte-level stand-ins of the emoji's four UTF-8 bytes, one token each.
    [(mapped, _)] = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(emoji)
    byte_tokens = byte_bpe.convert_tokens_to_ids(list(mapped))
    assert len(byte_tokens) == len(emoji.encode()) == 4
    assert byte_bpe.decode(byte_tokens) == emoji
    detok = IncrementalDetokenizer(byte_bpe, [])
    assert [detok.add([t]) for t in byte_tokens] == ["", "", "", emoji]


def test_long_output_keeps_the_window_small(byte_bpe: PreTrainedTokenizerFast) -> None:
    text = "The 学习 model 🙂 writes a long answer. " * 40
    ids = byte_bpe.encode(text)
    detok = IncrementalDetokenizer(byte_bpe, [])
    calls: list[int] = []
    original = byte_bpe.decode

    class Spy:
        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            calls.append(len(token_ids))
            return original(token_ids, skip_special_tokens=skip_special_tokens)

    detok.tokenizer = Spy()
    out = "".join(detok.add([t]) for t in ids) + detok.flush()
    assert out == text
    assert max(calls) <= 40, "decode window grew with the output length"


def test_invalid_bytes_are_released_and_stay_consistent(byte_bpe: PreTrainedTokenizerFast) -> None:
    # A model stuck emitting lone continuation bytes: they never form characters.
    [(mapped, _)] = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str("é")
    continuation = byte_bpe.convert_tokens_to_ids(mapped[1])
    # Then "é" as two byte tokens: its lead byte arrives while the garbage is being released.
    e_acute = byte_bpe.convert_tokens_to_ids(list(mapped))
    ids = [continuation] * 150 + e_acute + byte_bpe.encode(" then 中文 text")
    detok = IncrementalDetokenizer(byte_bpe, [])
    deltas = [detok.add([t]) for t in ids]
    assert "".join(deltas) + detok.flush() == byte_bpe.decode(ids)


@pytest.mark.parametrize("first", [1, 3])
def test_long_byte_fallback_runs_stream_cleanly(first: int) -> None:
    # One run of 3-byte characters, all byte-fallback tokens: window restarts must land on
    # character boundaries, and adds that always end mid-character (first=1: chunks of 3
    # offset by one byte) must keep holding the tail however long the run.
    text = "the " + "中文你好" * 30
    ids = BYTE_FALLBACK.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(BYTE_FALLBACK, [])
    bounds = [0, *range(first, len(ids), 3), len(ids)]
    deltas = [detok.add(ids[a:b]) for a, b in pairwise(bounds)] + [detok.flush()]
    assert "".join(deltas) == BYTE_FALLBACK.decode(ids, skip_special_tokens=True) == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    single = IncrementalDetokenizer(BYTE_FALLBACK, [])
    assert "".join(single.add([t]) for t in ids) + single.flush() == text


# ---------------------------------------------------------------- stop strings


def _naive_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Final text: cut at the stop occurrence that ends first (longest on ties), by brute force."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return (text[:end] if include else text[:end - len(stop)]), stop
    return text, None


alphabet = st.text(alphabet="abcxy中😀", max_size=40)
stop_lists = st.lists(st.text(alphabet="abcxy中😀", min_size=1, max_size=4), max_size=4)


@settings(max_examples=300, deadline=None)
@given(text=alphabet, stops=stop_lists, include=st.booleans(),
       cuts=st.lists(st.integers(0, 40), max_size=12))
def test_stop_strings_streamed_equals_final(text: str, stops: list[str], include: bool,
                                            cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    checker = StopChecker(stops, include_stop_str_in_output=include)
    shown, matched = [], None
    for a, b in pairwise(bounds):
        result = checker.feed(text[a:b])
        shown.append(result.text)
        if result.finished:
            matched = result.stop
            break
    else:
        shown.append(checker.flush())
    expected, expected_stop = _naive_stop(text, stops, include)
    assert "".join(shown) == expected
    assert matched == expected_stop
    if not include:
        # A stream never shows a stop string, even in part before it is cut.
        partial = ""
        for piece in shown:
            partial += piece
            assert not any(s in partial for s in stops)


@pytest.mark.parametrize(("text", "stops", "expected"), [
    ("abcde", ["abcde", "bcd"], "a"),      # "bcd" completes first although "abcde" starts earlier
    ("xabc", ["bc", "abc"], "x"),          # same end: the longer (earlier-starting) one wins
    ("aab", ["ab"], "a"),
])
def test_stop_string_that_completes_first_wins(text: str, stops: list[str], expected: str) -> None:
    assert _naive_stop(text, stops, False)[0] == expected
    for step in (1, len(text)):
        checker = StopChecker(stops)
        shown = "".join(checker.feed(text[i:i + step]).text for i in range(0, len(text), step)
                        if not checker.finished)
        assert shown == expected


def test_partial_stop_string_is_held_then_released() -> None:
    checker = StopChecker(["</answer>"])
    assert checker.feed("42 </ans").text == "42 "
    assert checker.feed("wer? no").text == "</answer? no"
    assert checker.feed("</").text == ""
    assert checker.flush() == "</"


def test_stop_checker_rejects_empty_and_reuse() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopChecker([""])
    checker = StopChecker(["x"])
    assert checker.feed("abx").finished
    with pytest.raises(RuntimeError, match="already finished"):
        checker.feed("more")


def test_detokenizer_accepts_a_raw_tokenizers_object(byte_bpe: PreTrainedTokenizerFast) -> None:
    raw = byte_bpe.backend_tokenizer
    ids = raw.encode("混合 text 😀").ids
    detok = IncrementalDetokenizer(raw, [])
    assert "".join(detok.add([t]) for t in ids) + detok.flush() == raw.decode(ids)
