"""Prompt lookup ("inference_with_reference"): draft the tokens that followed the latest earlier
occurrence of the sequence's own suffix, in the prompt or the output so far."""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Drafts by n-gram lookup: the longest suffix of n tokens (max_ngram_size down to min_ngram_size)
    that occurred before, at its latest earlier occurrence, proposes the up to k tokens that followed it.

    Matches are found with numpy over the candidate positions of the last token, so one lookup
    costs O(L) for L tokens with a small constant; no state is kept between calls.
    """

    def __init__(self, max_ngram_size: int = 3, min_ngram_size: int = 1) -> None:
        if not 1 <= min_ngram_size <= max_ngram_size:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min ({min_ngram_size}) <= max ({max_ngram_size}); "
                             "fix --speculate_max_ngram_size")
        self.max_ngram_size = max_ngram_size
        self.min_ngram_size = min_ngram_size

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k drafted tokens to follow `token_ids` (prompt + output), or [] when nothing matches."""
        if k <= 0 or len(token_ids) < 2:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        # every earlier position holding the last token, latest first; a match must leave a token after it
        ends = np.flatnonzero(tokens[: length - 1] == tokens[-1])[::-1]
        if ends.size == 0:
            return []
        for n in range(min(self.max_ngram_size, length - 1), self.min_ngram_size - 1, -1):
            candidates = ends[ends >= n - 1]
            matched = np.ones(candidates.size, dtype=bool)
            for back in range(1, n):  # compare the suffix token by token, from the end
                matched &= tokens[candidates - back] == tokens[length - 1 - back]
            hits = candidates[matched]
            if hits.size:
                start = int(hits[0]) + 1
                return tokens[start:start + k].tolist()
        return []
