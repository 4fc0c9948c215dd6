"""ROUGE-1/2/L/Lsum with rouge-score, tokenized so that CJK text scores character by character."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")

# Scripts written without spaces between words: each character is one token. Hangul is included
# so that all of CJK is handled alike (Korean ROUGE on syllables rather than eojeol).
_CJK_RANGES = (
    "\u2e80-\u2fdf"          # CJK radicals, Kangxi radicals
    "\u3040-\u30ff"          # hiragana, katakana
    "\u3100-\u312f\u31a0-\u31bf"  # bopomofo
    "\u3130-\u318f\uac00-\ud7af"  # hangul jamo and syllables
    "\u31f0-\u31ff"          # katakana extensions
    "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"  # CJK ideographs, extension A, compatibility
    "\U00020000-\U0003134f"  # CJK ideograph extensions B-G
)
_TOKEN = re.compile(f"[{_CJK_RANGES}]|(?:(?![{_CJK_RANGES}])[^\\W_])+")


def tokenize(text: str) -> list[str]:
    """Lower-cased tokens of `text`: one per CJK character, one per run of other letters/digits.

    Text is NFKC-normalised first (full-width Ｌａｔｉｎ and digits become ASCII); punctuation,
    symbols and whitespace separate tokens and are dropped, as rouge-score's own tokenizer does
    for ASCII (which, unlike this one, drops every non-ASCII character).
    """
    return _TOKEN.findall(unicodedata.normalize("NFKC", text).lower())


class CJKTokenizer:
    """The `tokenize(text) -> list[str]` object rouge-score's RougeScorer accepts as `tokenizer=`."""

    def tokenize(self, text: str) -> list[str]:
        return tokenize(text)


def make_scorer(rouge_types: tuple[str, ...] = ROUGE_TYPES) -> Any:
    """A rouge_score RougeScorer using CJKTokenizer; rougeLsum splits summaries on newlines."""
    try:
        from rouge_score.rouge_scorer import RougeScorer
    except ImportError:
        raise ImportError("ROUGE needs the rouge-score package: pip install rouge-score "
                          "(or pip install 'flashllm[bench]')") from None
    return RougeScorer(list(rouge_types), tokenizer=CJKTokenizer())


@dataclass
class RougeScores:
    """F-measures x 100: `mean` over the examples per ROUGE type, and each example's."""

    mean: dict[str, float]
    per_example: list[dict[str, float]] = field(default_factory=list)


def score_pair(prediction: str, reference: str, scorer: Any = None) -> dict[str, float]:
    """ROUGE F-measures x 100 of one prediction against one reference."""
    scorer = scorer or make_scorer()
    scores = scorer.score(reference, prediction)  # rouge-score takes (target, prediction)
    return {name: 100.0 * score.fmeasure for name, score in scores.items()}


def rouge_scores(predictions: list[str], references: list[str]) -> RougeScores:
    """Mean ROUGE-1/2/L/Lsum F-measures x 100 of predictions against references, paired in order."""
    if len(predictions) != len(references):
        raise ValueError(f"got {len(predictions)} predictions for {len(references)} references; "
                         "they are paired line by line, so the counts must match")
    if not references:
        raise ValueError("no examples to score: give at least one prediction/reference pair")
    scorer = make_scorer()
    per_example = [score_pair(p, r, scorer) for p, r in zip(predictions, references, strict=True)]
    mean = {name: sum(s[name] for s in per_example) / len(per_example) for name in ROUGE_TYPES}
    return RougeScores(mean, per_example)
