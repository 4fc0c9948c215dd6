"""Tokenizers over a checkpoint's sentencepiece `tokenizer.model` (ChatGLM2/3, Baichuan), without its remote code.

The `sentencepiece` package encodes and decodes ordinary text exactly as the checkpoint's own
tokenizer does. What the remote code adds on top is small and is data here: extra special tokens
numbered after the model's pieces (ChatGLM's [gMASK], sop, <|user|>, ...), the tokens put around a
prompt (ChatGLM's `[gMASK]sop` prefix, a Llama-style <s>), and which pieces are special. Text is cut at
special tokens and each stretch between them is encoded by sentencepiece on its own, as ChatGLM3's
tokenizer does with encode_special_tokens and transformers' LlamaTokenizer does (legacy mode).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from transformers import BatchEncoding

from flashllm.models.errors import ModelLoadError
from flashllm.models.hf_config import read_json_object

MODEL_FILE = "tokenizer.model"
MAX_MODEL_BYTES = 64 << 20  # ChatGLM's and Baichuan's are 1-2 MB
MAX_GENERATION_CONFIG_BYTES = 1 << 20
# ChatGLM2/3's tokens numbered after the sentencepiece pieces, in id order (ChatGLM2 uses the first five;
# their ids are the same in both, so one list serves both)
CHATGLM_SPECIAL_TOKENS: tuple[str, ...] = (
    "[MASK]", "[gMASK]", "[sMASK]", "sop", "eop", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
)
CHATGLM_PREFIX: tuple[str, ...] = ("[gMASK]", "sop")
# ChatGLM3's chat() stops at eos or at the model starting the next turn: a user turn, or a tool result
CHATGLM_TURN_ENDS: tuple[str, ...] = ("<|user|>", "<|observation|>")
_WORD = re.compile(r"\w+")


def read_sentencepiece_model(path: Path) -> Any:
    """A `sentencepiece.SentencePieceProcessor` of the model file at `path`.

    Raises ModelLoadError (one line, naming the file) when the file is missing, too large, not a
    serialized sentencepiece model, or a model with no pieces.
    """
    if not path.is_file():
        raise ModelLoadError(f"{path} does not exist; this tokenizer is built from the checkpoint's {MODEL_FILE}")
    size = path.stat().st_size
    if size > MAX_MODEL_BYTES:
        raise ModelLoadError(f"{path} is {size} bytes, over the {MAX_MODEL_BYTES}-byte limit for a sentencepiece model")
    try:
        import sentencepiece
    except ImportError:
        raise ModelLoadError(f"{path} needs the sentencepiece package: pip install 'sentencepiece>=0.2'") from None
    try:
        processor = sentencepiece.SentencePieceProcessor(model_proto=path.read_bytes())
    except (RuntimeError, OSError, ValueError):
        processor = None
    if processor is None or processor.get_piece_size() <= 0:
        raise ModelLoadError(f"{path} is not a sentencepiece model (it does not parse as one, or holds no pieces); "
                             f"expected the checkpoint's sentencepiece {MODEL_FILE}")
    return processor


class SentencePieceTokenizer:
    """encode / decode over a sentencepiece model plus special tokens, with the interface flashllm's
    engine, detokenizer, chat and serving code use (the subset of a transformers tokenizer they call).

    Ids: the model's pieces 0..P-1, then `added_tokens` P, P+1, ... Special tokens: the added ones,
    the model's control pieces (<s>, </s>), and the named bos/eos/unk/pad and `extra_special_tokens`
    (pieces of the model). In text, a special token is recognised wherever it is spelt, except one
    spelt as a plain word (ChatGLM's `sop`), which counts only right after another special token,
    so ordinary words containing it stay text. `prefix` / `suffix` tokens go around the ids that
    encode(text, add_special_tokens=True) returns.
    """

    is_fast = False

    def __init__(self, processor: Any, *, added_tokens: Sequence[str] = (), prefix: Sequence[str] = (),
                 suffix: Sequence[str] = (), bos_token: str | None = None, eos_token: str | None = None,
                 unk_token: str | None = None, pad_token: str | None = None,
                 extra_special_tokens: Sequence[str] = (), turn_end_tokens: Sequence[str] = (),
                 name_or_path: str = "") -> None:
        self.sp = processor
        self.name_or_path = name_or_path
        self.turn_end_tokens = tuple(turn_end_tokens)  # besides eos, end generation (models/tokenizer.py)
        self._num_pieces = processor.get_piece_size()
        self._added = {token: self._num_pieces + i for i, token in enumerate(added_tokens)}
        special = {processor.id_to_piece(i): i for i in range(self._num_pieces) if processor.is_control(i)}
        special.update(self._added)
        self.bos_token, self.eos_token, self.unk_token, self.pad_token = bos_token, eos_token, unk_token, pad_token
        for token in (bos_token, eos_token, unk_token, pad_token, *extra_special_tokens):
            if token is not None:
                special[token] = self._require_id(token)
        self._special_ids = special
        self._special_text = {token_id: text for text, token_id in special.items()}
        self._word_specials = {text for text in special if _WORD.fullmatch(text)}
        ordered = sorted(special, key=len, reverse=True)  # longest first: "</s>" before "<s>" can matter
        self._split = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        self._prefix = [self._require_id(t) for t in prefix]
        self._suffix = [self._require_id(t) for t in suffix]

    def _require_id(self, token: str) -> int:
        if token in self._added:
            return self._added[token]
        token_id = self.sp.piece_to_id(token)
        if self.sp.id_to_piece(token_id) != token:
            raise ModelLoadError(f"special token {token!r} is not in {self.name_or_path or 'the'} sentencepiece "
                                 "model's pieces nor among the added tokens; check tokenizer_config.json")
        return token_id

    # ------------------------------------------------------------ vocabulary

    def __len__(self) -> int:
        return self._num_pieces + len(self._added)

    @property
    def vocab_size(self) -> int:
        """Ids this tokenizer assigns: the model's pieces and the added tokens."""
        return len(self)

    def get_vocab(self) -> dict[str, int]:
        """token text -> id for every id."""
        vocab = {self.sp.id_to_piece(i): i for i in range(self._num_pieces)}
        vocab.update(self._added)
        return vocab

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> Any:
        """A token's id (a list for a list); a piece the model lacks maps to the unknown piece's id."""
        if isinstance(tokens, str):
            return self._added[tokens] if tokens in self._added else self.sp.piece_to_id(tokens)
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> Any:
        """An id's token text (a list for a list); "" for an id past the vocabulary (a padded embedding row)."""
        if isinstance(ids, int):
            if ids in self._special_text:
                return self._special_text[ids]
            return self.sp.id_to_piece(ids) if 0 <= ids < self._num_pieces else ""
        return [self.convert_ids_to_tokens(int(i)) for i in ids]

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._special_ids[token]

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._token_id(self.eos_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._token_id(self.unk_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._token_id(self.pad_token)

    @property
    def all_special_tokens(self) -> list[str]:
        return list(self._special_ids)

    @property
    def all_special_ids(self) -> list[int]:
        return list(self._special_ids.values())

    # ------------------------------------------------------------ encode / decode

    def _segments(self, text: str) -> Iterator[tuple[str, int | None]]:
        """(stretch of text, None) and (special token text, its id), in order."""
        start = last_special_end = 0
        for match in self._split.finditer(text) if self._split is not None else ():
            token = match.group()
            if token in self._word_specials and (match.start() != last_special_end or match.start() == 0):
                continue  # a word like "sop" outside a run of special tokens is text
            if match.start() > start:
                yield text[start:match.start()], None
            yield token, self._special_ids[token]
            start = last_special_end = match.end()
        if start < len(text):
            yield text[start:], None

    def tokenize(self, text: str) -> list[str]:
        """The token texts encode(text, add_special_tokens=False) gives ids of."""
        return self.convert_ids_to_tokens(self.encode(text, add_special_tokens=False))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, between the prefix and suffix tokens."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        ids: list[int] = []
        for piece, special_id in self._segments(text):
            if special_id is not None:
                ids.append(special_id)
            else:
                ids.extend(self.sp.encode(piece))
        return [*self._prefix, *ids, *self._suffix] if add_special_tokens else ids

    def decode(self, ids: int | Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids: runs of pieces through sentencepiece, special tokens as their text
        (dropped with skip_special_tokens); ids past the vocabulary give no text."""
        if isinstance(ids, int):
            ids = [ids]
        parts: list[str] = []
        run: list[int] = []
        for token_id in map(int, ids):
            text = self._special_text.get(token_id)
            if text is None and 0 <= token_id < self._num_pieces:
                run.append(token_id)
                continue
            if run:
                parts.append(self.sp.decode(run))
                run = []
            if text is not None and not skip_special_tokens:
                parts.append(text)
        if run:
            parts.append(self.sp.decode(run))
        return "".join(parts)

    def batch_decode(self, sequences: Iterable[Iterable[int]], skip_special_tokens: bool = False) -> list[str]:
        """decode() of each sequence."""
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True, **_: Any) -> BatchEncoding:
        """{"input_ids", "attention_mask"} of a text (lists of ids) or of a list of texts (a list of each)."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return BatchEncoding({"input_ids": ids, "attention_mask": [1] * len(ids)})
        batch = [self.encode(t, add_special_tokens) for t in text]
        return BatchEncoding({"input_ids": batch, "attention_mask": [[1] * len(ids) for ids in batch]})

    def __repr__(self) -> str:
        return (f"SentencePieceTokenizer({self.name_or_path!r}, pieces={self._num_pieces}, "
                f"added={list(self._added)}, prefix={self.convert_ids_to_tokens(self._prefix)})")


def load_chatglm_tokenizer(model_dir: str | Path, tokenizer_config: dict[str, Any] | None = None
                           ) -> SentencePieceTokenizer:
    """ChatGLM2/3's ChatGLMTokenizer from the directory's tokenizer.model, without tokenization_chatglm.py.

    Ids: the sentencepiece pieces, then CHATGLM_SPECIAL_TOKENS. encode(text) puts `[gMASK]sop` first
    (add_special_tokens=False leaves it out: the chat templates write it); eos is the model's `</s>`,
    unk and pad its `<unk>`; there is no bos. <|user|> and <|observation|> end a turn as eos does
    (turn_end_tokens: ChatGLM2 never writes them). Raises ModelLoadError (one line) on a missing or
    invalid tokenizer.model.
    """
    root = Path(model_dir)
    processor = read_sentencepiece_model(root / MODEL_FILE)
    unk = processor.id_to_piece(processor.unk_id())
    eos = processor.id_to_piece(processor.eos_id()) if processor.eos_id() >= 0 else None
    return SentencePieceTokenizer(processor, added_tokens=CHATGLM_SPECIAL_TOKENS, prefix=CHATGLM_PREFIX,
                                  eos_token=eos, unk_token=unk, pad_token=unk, turn_end_tokens=CHATGLM_TURN_ENDS,
                                  name_or_path=str(root))


def load_sentencepiece_tokenizer(model_dir: str | Path, tokenizer_config: dict[str, Any] | None = None
                                 ) -> SentencePieceTokenizer:
    """A LlamaTokenizer-style sentencepiece tokenizer (Baichuan's) from tokenizer.model and tokenizer_config.json.

    Special tokens are pieces of the model: bos/eos/unk/pad_token from the config (the model's own
    <s>, </s>, <unk> when absent), additional_special_tokens, and the pieces generation_config.json's
    `user_token_id` / `assistant_token_id` name (Baichuan chat models' turn markers, <reserved_106> /
    <reserved_107>, so their text in a rendered chat prompt is always that one id). encode(text) adds
    bos when add_bos_token (default true) and eos when add_eos_token (default false). Raises
    ModelLoadError (one line) on an invalid tokenizer.model or a special token the model does not have.
    """
    config = tokenizer_config or {}
    root = Path(model_dir)
    processor = read_sentencepiece_model(root / MODEL_FILE)

    def own(piece_id: int) -> str | None:
        return processor.id_to_piece(piece_id) if piece_id >= 0 else None

    tokens = {"bos_token": own(processor.bos_id()), "eos_token": own(processor.eos_id()),
              "unk_token": own(processor.unk_id()), "pad_token": None}
    tokens.update({key: _token_text(config[key]) for key in tokens if config.get(key) is not None})
    extra = [t for t in map(_token_text, config.get("additional_special_tokens") or []) if t]
    extra += _turn_markers(root, processor)
    add_bos = config.get("add_bos_token", True) is not False
    add_eos = config.get("add_eos_token", False) is True
    prefix = [tokens["bos_token"]] if add_bos and tokens["bos_token"] else []
    suffix = [tokens["eos_token"]] if add_eos and tokens["eos_token"] else []
    return SentencePieceTokenizer(processor, prefix=prefix, suffix=suffix, extra_special_tokens=extra,
                                  name_or_path=str(root), **tokens)


# Ernie4_5Tokenizer's special tokens beyond bos / eos / unk, with its defaults
ERNIE_SPECIAL_DEFAULTS = {"pad_token": "<pad>", "cls_token": "<cls>", "sep_token": "<sep>", "mask_token": "<mask:0>"}
ERNIE_ADDITIONAL_DEFAULTS = ("<mask:1>", "<mask:7>")


def load_ernie4_5_tokenizer(model_dir: str | Path, tokenizer_config: dict[str, Any] | None = None
                            ) -> SentencePieceTokenizer:
    """ERNIE 4.5's remote-code Ernie4_5Tokenizer, built from its tokenizer.model: sentencepiece pieces of the text
    between special tokens, nothing added around a prompt (its prepare_for_model drops add_special_tokens). The
    special tokens are the config's bos / eos / unk / pad / cls / sep / mask tokens and additional_special_tokens,
    the class's defaults where the config is silent (<s>, </s>, <unk>, <pad>, <cls>, <sep>, <mask:0>; <mask:1>,
    <mask:7>), each a piece of the model. Raises ModelLoadError (one line) as load_sentencepiece_tokenizer."""
    config = dict(tokenizer_config or {})
    named = {key: _token_text(config.get(key)) or default for key, default in ERNIE_SPECIAL_DEFAULTS.items()}
    extra = [t for t in map(_token_text, config.get("additional_special_tokens") or ERNIE_ADDITIONAL_DEFAULTS) if t]
    config.update(pad_token=named.pop("pad_token"), additional_special_tokens=[*extra, *named.values()],
                  add_bos_token=False, add_eos_token=False)
    return load_sentencepiece_tokenizer(model_dir, config)


def _turn_markers(root: Path, processor: Any) -> list[str]:
    """The pieces at generation_config.json's user_token_id / assistant_token_id (none when absent);
    an id outside the model's pieces is refused in one line."""
    path = root / "generation_config.json"
    if not path.is_file():
        return []
    generation = read_json_object(path, MAX_GENERATION_CONFIG_BYTES)
    markers = []
    for key in ("user_token_id", "assistant_token_id"):
        value = generation.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < processor.get_piece_size():
            raise ModelLoadError(f"{path}: {key}={value!r} is not a piece of {root / MODEL_FILE} "
                                 f"(0..{processor.get_piece_size() - 1}); expected the id of the turn marker")
        markers.append(processor.id_to_piece(value))
    return markers


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None
