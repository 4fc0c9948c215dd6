"""tiktoken rank files (Qwen's `qwen.tiktoken`, GLM-4's `tokenizer.model`) as Rust-backed fast tokenizers.

A rank file holds one token a line, `base64(token bytes) rank`, the ranks numbering the tokens
0..n-1. tiktoken encodes a pre-tokenized piece by repeatedly merging the adjacent pair whose
concatenation has the lowest rank (a piece that is itself a token is taken whole). A byte-level
BPE whose merges are every (left, right) split of every token, ordered by the rank of their
concatenation, does the same, so the `tokenizers` library runs it, and flashllm hands the engine
the same PreTrainedTokenizerFast interface as for any other model. Special tokens take the ids
after the ranks, in the order the model's own tokenizer lists them.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from flashllm.models.errors import ModelLoadError

MAX_RANK_FILE_BYTES = 64 << 20  # Qwen's is ~2.5 MB, GLM-4's ~2.6 MB


def build_tiktoken_tokenizer(path: Path, *, pattern: str, special_tokens: Sequence[str], eos_token: str,
                             nfc: bool = False, prefix: Sequence[str] = (), turn_end_tokens: Sequence[str] = (),
                             tokenizer_config: dict[str, Any] | None = None) -> PreTrainedTokenizerFast:
    """The fast tokenizer of rank file `path`: text (NFC-normalized when `nfc`) cut at special tokens,
    the rest split by the `pattern` regex and byte-pair merged by rank.

    special_tokens take ids n, n+1, ... after the n ranks; eos_token (and pad) is one of them;
    `prefix` tokens go before the ids of encode(text, add_special_tokens=True); `turn_end_tokens`
    end generation beside eos (models/tokenizer.py). model_max_length comes from
    tokenizer_config. Raises ModelLoadError (one line, naming the file and line) on a missing or
    malformed rank file.
    """
    ranks = read_ranks(path)
    backend = Tokenizer(models.BPE(vocab=_vocab(ranks), merges=_merges(ranks), ignore_merges=True))
    if nfc:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    if backend.token_to_id(special_tokens[0]) != len(ranks):  # a rank file holding a special token's text
        raise ModelLoadError(f"{path}: {special_tokens[0]} did not get id {len(ranks)} (right after the ranks); "
                             "the file must not contain the model's special tokens")
    if prefix:
        ids = [(t, backend.token_to_id(t)) for t in prefix]
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join([*prefix, "$A"]), pair=" ".join([*prefix, "$A", "$B"]), special_tokens=ids)
    max_length = (tokenizer_config or {}).get("model_max_length")
    extra = {"model_max_length": max_length} if isinstance(max_length, int) and not isinstance(max_length, bool) else {}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos_token, pad_token=eos_token,
                                        clean_up_tokenization_spaces=False, **extra)
    tokenizer.turn_end_tokens = tuple(turn_end_tokens)
    return tokenizer


def read_ranks(path: Path) -> dict[bytes, int]:
    """token bytes -> rank, from a tiktoken rank file; the ranks must be exactly 0..n-1 and the
    single bytes all present (each byte of any text must have a token). Empty lines are skipped.

    Raises ModelLoadError naming the file (and the line) on anything else.
    """
    if not path.is_file():
        raise ModelLoadError(f"{path} does not exist; this tokenizer is built from the checkpoint's tiktoken rank "
                             f"file {path.name}")
    size = path.stat().st_size
    if size > MAX_RANK_FILE_BYTES:
        raise ModelLoadError(f"{path} is {size} bytes, over the {MAX_RANK_FILE_BYTES}-byte limit for a rank file")
    ranks: dict[bytes, int] = {}
    lines_of_rank: dict[int, int] = {}
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        token, rank = _parse_line(path, number, line)
        if token in ranks or rank in lines_of_rank:
            what = f"token {token!r}" if token in ranks else f"rank {rank}"
            first = lines_of_rank[ranks[token]] if token in ranks else lines_of_rank[rank]
            raise ModelLoadError(f"{path} line {number}: {what} was already given on line {first}")
        ranks[token] = rank
        lines_of_rank[rank] = number
    if not ranks or max(lines_of_rank) != len(ranks) - 1:
        raise ModelLoadError(f"{path}: {len(ranks)} tokens whose ranks are not 0..{len(ranks) - 1}; "
                             "a tiktoken rank file numbers its tokens without gaps")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ModelLoadError(f"{path}: {len(missing)} of the 256 single-byte tokens are missing (first: "
                             f"{bytes([missing[0]])!r}); every byte needs one so that any text can be encoded")
    return ranks


def _parse_line(path: Path, number: int, line: bytes) -> tuple[bytes, int]:
    fields = line.split()
    if len(fields) == 2 and fields[1].isdigit():
        try:
            token = base64.b64decode(fields[0], validate=True)
        except (binascii.Error, ValueError):
            token = b""
        if token:
            return token, int(fields[1])
    raise ModelLoadError(f"{path} line {number}: expected '<base64 token bytes> <rank>', got {line[:60]!r}")


def byte_alphabet() -> dict[int, str]:
    """The reversible byte -> character map byte-level BPE vocabularies are written in (GPT-2's):
    printable Latin-1 bytes stand for themselves, the others for U+0100 onwards, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in kept}
    for offset, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + offset)
    return table


def _vocab(ranks: dict[bytes, int]) -> dict[str, int]:
    alphabet = byte_alphabet()
    return {"".join(alphabet[b] for b in token): rank for token, rank in ranks.items()}


def _merges(ranks: dict[bytes, int]) -> list[tuple[str, str]]:
    """Every split of every token into two tokens, ordered by the rank of the token they make:
    BPE then merges the pair tiktoken would (the lowest-ranked concatenation; leftmost on ties)."""
    alphabet = byte_alphabet()
    found: list[tuple[int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                found.append((rank, ranks[left], left, right))
    found.sort()
    return [("".join(alphabet[b] for b in left), "".join(alphabet[b] for b in right)) for _, _, left, right in found]
