"""tiktoken rank files made in tests, and a naive tiktoken-style encoder to check tokenizers built from them."""

from __future__ import annotations

import base64
import unicodedata
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import regex
import torch


def train_ranks(corpus: Sequence[str], pattern: str, num_merges: int = 150) -> dict[bytes, int]:
    """A small tiktoken vocabulary: the 256 bytes (ranks 0..255 in a shuffled order), then the most
    frequent adjacent pairs of the corpus's pieces (split by `pattern`), merged one by one."""
    order = torch.randperm(256, generator=torch.Generator().manual_seed(0)).tolist()
    ranks = {bytes([b]): r for r, b in enumerate(order)}
    words = Counter(tuple(bytes([c]) for c in piece.encode()) for text in corpus
                    for piece in regex.findall(pattern, text))
    for _ in range(num_merges):
        pairs: Counter = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += count
        if not pairs:
            break
        (left, right), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[left + right] = len(ranks)
        words = Counter({_merge_word(w, left, right): c for w, c in words.items()})
    return ranks


def _merge_word(word: tuple[bytes, ...], left: bytes, right: bytes) -> tuple[bytes, ...]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == left and word[i + 1] == right:
            out.append(left + right)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def naive_encode(ranks: dict[bytes, int], text: str, pattern: str, specials: Sequence[str],
                 nfc: bool = False) -> list[int]:
    """What tiktoken with every special token allowed gives: (NFC when `nfc`), special tokens cut out
    (ids after the ranks, in `specials` order), the `pattern` pieces, then each piece whole if it is a
    token, else merged pair by lowest rank."""
    special_ids = {t: len(ranks) + i for i, t in enumerate(specials)}
    ids: list[int] = []
    cut = "(" + "|".join(regex.escape(t) for t in specials) + ")"
    for part in regex.split(cut, unicodedata.normalize("NFC", text) if nfc else text):
        if part in special_ids:
            ids.append(special_ids[part])
            continue
        for piece in regex.findall(pattern, part):
            ids += _bpe(ranks, piece.encode())
    return ids


def _bpe(ranks: dict[bytes, int], piece: bytes) -> list[int]:
    if piece in ranks:
        return [ranks[piece]]
    parts = [bytes([b]) for b in piece]
    while True:
        pairs = enumerate(zip(parts, parts[1:], strict=False))
        candidates = [(ranks[a + b], i) for i, (a, b) in pairs if a + b in ranks]
        if not candidates:
            return [ranks[p] for p in parts]
        _, i = min(candidates)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def write_rank_file(path: Path, ranks: dict[bytes, int]) -> None:
    """Write `ranks` as a tiktoken rank file: `base64(token) rank` a line, in rank order."""
    ordered = sorted(ranks.items(), key=lambda kv: kv[1])
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in ordered]
    path.write_text("\n".join(lines) + "\n")
