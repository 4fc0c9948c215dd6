"""ROUGE scoring: CJK-aware tokenization, limits (identical 100, disjoint 0), and hand/naive computations."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("rouge_score", reason="ROUGE needs rouge-score (the bench extra)")

from flashllm.eval.rouge import ROUGE_TYPES, rouge_scores, score_pair, tokenize  # noqa: E402

CJK_CHARS = "我你他猫狗爱喜欢天气很好今日は世界한국어"
WORDS = ["cat", "dog", "train", "left", "late", "the", "station", "42", "café"]


def _f1(overlap: int, num_pred: int, num_ref: int) -> float:
    if overlap == 0:
        return 0.0
    precision, recall = Fraction(overlap, num_pred), Fraction(overlap, num_ref)
    return float(100 * 2 * precision * recall / (precision + recall))


def _lcs(a: list[str], b: list[str]) -> int:
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            table[i + 1][j + 1] = table[i][j] + 1 if x == y else max(table[i][j + 1], table[i + 1][j])
    return table[-1][-1]


def test_tokenize_splits_cjk_into_characters_and_keeps_words() -> None:
    assert tokenize("Hello, 世界! ＡＢＣ１２ abc中文def こんにちは") == [
        "hello", "世", "界", "abc12", "abc", "中", "文", "def", "こ", "ん", "に", "ち", "は"]
    assert tokenize("Café naïve_test 한국") == ["café", "naïve", "test", "한", "국"]
    assert tokenize("  ,.!?。，") == []


# two tokens at least: a single token has no bigram, so its ROUGE-2 is 0 even against itself
texts = st.lists(st.sampled_from([*WORDS, *CJK_CHARS]), min_size=2, max_size=12).map(" ".join)


@settings(deadline=None)  # the machine is shared; timing says nothing here
@given(texts)
def test_identical_texts_score_100(text: str) -> None:
    assert score_pair(text, text) == pytest.approx(dict.fromkeys(ROUGE_TYPES, 100.0))


@settings(deadline=None)
@given(st.lists(st.sampled_from("我你他猫狗"), min_size=1, max_size=10),
       st.lists(st.sampled_from("天气很好今"), min_size=1, max_size=10))
def test_disjoint_texts_score_0(pred: list[str], ref: list[str]) -> None:
    assert score_pair("".join(pred), "".join(ref)) == dict.fromkeys(ROUGE_TYPES, 0.0)


def test_cjk_example_matches_hand_computed_f1() -> None:
    # pred 我爱猫 (3 chars) vs ref 我喜欢猫 (4 chars): unigram overlap {我, 猫} = 2, LCS 我猫 = 2,
    # no shared bigram; F1 = 2PR/(P+R) with P = 2/3, R = 2/4 -> 4/7
    scores = score_pair("我爱猫", "我喜欢猫")
    assert scores["rouge1"] == pytest.approx(400 / 7)
    assert scores["rougeL"] == pytest.approx(400 / 7)
    assert scores["rougeLsum"] == pytest.approx(400 / 7)
    assert scores["rouge2"] == 0.0


def test_rouge_lsum_matches_sentences_rouge_l_does_not() -> None:
    # flat: [猫, 狗] vs [狗, 猫] has LCS 1 -> 50; per sentence each line finds its match -> 100
    scores = score_pair("狗\n猫", "猫\n狗")
    assert scores["rougeL"] == pytest.approx(50.0)
    assert scores["rougeLsum"] == pytest.approx(100.0)


@settings(deadline=None)
@given(st.lists(st.sampled_from(CJK_CHARS), min_size=1, max_size=15),
       st.lists(st.sampled_from(CJK_CHARS), min_size=1, max_size=15))
def test_cjk_scores_equal_naive_ngram_and_lcs_f1(pred: list[str], ref: list[str]) -> None:
    scores = score_pair("".join(pred), "".join(ref))
    unigrams = sum((Counter(pred) & Counter(ref)).values())
    assert scores["rouge1"] == pytest.approx(_f1(unigrams, len(pred), len(ref)))
    pred_bi, ref_bi = list(zip(pred, pred[1:], strict=False)), list(zip(ref, ref[1:], strict=False))
    bigrams = sum((Counter(pred_bi) & Counter(ref_bi)).values())
    assert scores["rouge2"] == pytest.approx(_f1(bigrams, len(pred_bi), len(ref_bi)))
    assert scores["rougeL"] == pytest.approx(_f1(_lcs(pred, ref), len(pred), len(ref)))
    if set(pred) & set(ref):
        assert scores["rouge1"] > 0


def test_corpus_scores_are_the_mean_of_example_scores() -> None:
    preds, refs = ["我爱猫", "the cat", "狗"], ["我喜欢猫", "the cat", "猫"]
    result = rouge_scores(preds, refs)
    assert result.mean["rouge1"] == pytest.approx((400 / 7 + 100 + 0) / 3)
    assert len(result.per_example) == 3


def test_mismatched_counts_are_rejected() -> None:
    with pytest.raises(ValueError, match="2 predictions for 1 references"):
        rouge_scores(["a", "b"], ["a"])
