"""The n-gram lookup proposer: longest suffix first, latest earlier occurrence, bounded drafts."""

from __future__ import annotations

import pytest

from flashllm.core.spec.ngram import NgramProposer


def _brute_force(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Oracle: try every n from max_n down, every earlier start from the latest, compare slices."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_copies_what_followed_the_longest_matching_suffix() -> None:
    proposer = NgramProposer(max_ngram_size=3, min_ngram_size=1)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # [1, 2, 3] occurred at 0 (followed by 4, 5); the 2-gram [2, 3] also at 6 (followed by 7) loses to it
    assert proposer.propose(tokens, 2) == [4, 5]
    assert proposer.propose(tokens, 0) == []
    assert proposer.propose([5], 4) == []
    assert proposer.propose([1, 2, 3, 4], 3) == []  # the last token never occurred before


def test_matches_a_brute_force_oracle_on_random_sequences() -> None:
    import random

    rng = random.Random(7)
    proposer = NgramProposer(max_ngram_size=4, min_ngram_size=2)
    for _ in range(500):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 60))]
        k = rng.randrange(1, 6)
        assert proposer.propose(tokens, k) == _brute_force(tokens, k, 4, 2), tokens


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="n-gram sizes"):
        NgramProposer(max_ngram_size=1, min_ngram_size=2)
    with pytest.raises(ValueError, match="n-gram sizes"):
        NgramProposer(max_ngram_size=0, min_ngram_size=0)
