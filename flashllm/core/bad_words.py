"""bad_words (vLLM's): words a request's output must not contain, tokenized once per request, masked each step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

BadWordIds = tuple[tuple[int, ...], ...]


def tokenize_bad_words(words: Sequence[str] | None, tokenizer: Any) -> BadWordIds:
    """The token id sequences a request's bad_words ban: each word (leading whitespace stripped, as vLLM does)
    encoded as written and after a space, since a BPE tokenizer encodes a word after a space as other tokens;
    both forms are kept when they differ, duplicates once. ValueError without a tokenizer.

    (vLLM keeps the spaced form only when it has as many tokens as the plain one; a longer spaced form still
    spells the word, so flashllm bans it too.)"""
    if not words:
        return ()
    if tokenizer is None:
        raise ValueError("bad_words needs the model's tokenizer and this model has none; "
                         "ban token ids with logit_bias (-100) instead")
    found: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                found.setdefault(ids, None)
    return tuple(found)


def banned_next_tokens(bad_word_ids: BadWordIds, output_token_ids: Sequence[int]) -> list[int]:
    """The last token of every bad-word sequence whose other tokens are the last tokens generated (a one-token
    word: always): vLLM's rule. Only generated tokens count, never the prompt's."""
    banned = []
    for ids in bad_word_ids:
        prefix = len(ids) - 1
        if prefix > len(output_token_ids):
            continue
        if prefix == 0 or tuple(output_token_ids[len(output_token_ids) - prefix:]) == ids[:-1]:
            banned.append(ids[-1])
    return banned


def apply_bad_words(logits: Tensor, bad_word_ids: Sequence[BadWordIds], output_token_ids: Sequence[Sequence[int]]
                    ) -> None:
    """In place: row i's banned_next_tokens get -inf. logits (B, V) fp32; ids past V are ignored (such a
    token cannot be generated)."""
    rows: list[int] = []
    ids: list[int] = []
    vocab_size = logits.shape[1]
    for row, (words, output) in enumerate(zip(bad_word_ids, output_token_ids, strict=True)):
        if words:
            banned = [t for t in banned_next_tokens(words, output) if t < vocab_size]
            rows.extend([row] * len(banned))
            ids.extend(banned)
    if ids:
        logits[torch.tensor(rows, device=logits.device), torch.tensor(ids, device=logits.device)] = float("-inf")
