"""The tokenizer a GGUF file's vocabulary describes ("gpt2" byte-level BPE, "llama" SentencePiece), built in `tokenizers`."""

from __future__ import annotations

import logging
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.reader import GGUFFile

logger = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
TOKENIZER_MODELS = ("gpt2", "llama")

# How llama.cpp splits text before byte-level BPE, by the `tokenizer.ggml.pre` name it records.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# o200k's split (gpt-oss, GPT-4o): llama.cpp's "gpt-4o" runs the pattern its tokenizer.json carries
_O200K_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# DeepSeek-V3's splits, applied in turn (each piece of one split is split by the next): llama.cpp's list for
# "deepseek-v3" in src/llama-vocab.cpp (digits in runs of up to three, CJK ideographs and kana, then words).
_DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
)

# Mistral's tekken split (Mistral NeMo, Small 3): o200k's case-aware words without contractions, single digits
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# the cased letters of DeepSeek-LLM's word split (its tokenizer.json's class, as llama.cpp's "deepseek-llm" lists it)
_DEEPSEEK_LLM_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-"
    "\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# DeepSeek LLM 7B / 67B and DeepSeek-Coder (v1) split in turn: newlines, words, punctuation runs, trailing space, CJK
# and Hangul, then digits (LLM: runs; Coder: one by one)
_DEEPSEEK_LLM_SPLITS = ("[\r\n]", r"\s?[" + _DEEPSEEK_LLM_LETTERS + "]+",
                        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$", _CJK_HANGUL,
                        r"\p{N}+")
_DEEPSEEK_CODER_SPLITS = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")


def _byte_level() -> Any:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_byte_level() -> Any:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])


def _split_then_bytes(*patterns: str) -> Any:
    return lambda: pre_tokenizers.Sequence([
        *(pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False) for pattern in patterns),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


BPE_PRE_TOKENIZERS: dict[str, Any] = {
    "gpt-2": _byte_level,
    "smollm": _digits_then_byte_level, "starcoder": _digits_then_byte_level, "refact": _digits_then_byte_level,
    "qwen2": _split_then_bytes(_QWEN2_SPLIT), "deepseek-r1-qwen": _split_then_bytes(_QWEN2_SPLIT),
    "llama-bpe": _split_then_bytes(_LLAMA3_SPLIT), "llama3": _split_then_bytes(_LLAMA3_SPLIT),
    "chatglm-bpe": _split_then_bytes(_LLAMA3_SPLIT),  # GLM-4's tiktoken split is cl100k's, Llama 3's
    "glm4": _split_then_bytes(_LLAMA3_SPLIT),  # GLM-4.5's files: llama.cpp runs it as chatglm-bpe
    "deepseek-v3": _split_then_bytes(*_DEEPSEEK_V3_SPLITS),
    "gpt-4o": _split_then_bytes(_O200K_SPLIT),
    "tekken": _split_then_bytes(_TEKKEN_SPLIT),
    "deepseek-llm": _split_then_bytes(*_DEEPSEEK_LLM_SPLITS),
    "deepseek-coder": _split_then_bytes(*_DEEPSEEK_CODER_SPLITS),
}
# names llama.cpp gives the same split as one above
for _alias, _same in {"command-r": "starcoder", "exaone": "starcoder", "codeshell": "starcoder", "mpt": "gpt-2",
                      "olmo": "gpt-2", "dbrx": "llama-bpe", "smaug-bpe": "llama-bpe", "stablelm2": "qwen2",
                      "hunyuan": "qwen2", "hunyuan-dense": "deepseek-v3"}.items():
    BPE_PRE_TOKENIZERS[_alias] = BPE_PRE_TOKENIZERS[_same]


def build_gguf_tokenizer(gf: GGUFFile) -> PreTrainedTokenizerFast:
    """A fast tokenizer from the file's `tokenizer.ggml.*` metadata: ids are the GGUF token indices.

    CONTROL tokens become special added tokens, USER_DEFINED ones plain added tokens (both are
    matched whole before the model splits text); bos/eos/unk/pad come from their `*_token_id`
    keys; `add_bos_token` / `add_eos_token` (default: true for "llama", false for "gpt2") become a
    post-processor. Raises ModelLoadError (one line) for a missing or inconsistent vocabulary or a
    tokenizer kind or pre-tokenizer flashllm does not know (listing those it does).
    """
    kind = gf.get("tokenizer.ggml.model")
    tokens = gf.get("tokenizer.ggml.tokens")
    if kind not in TOKENIZER_MODELS:
        raise ModelLoadError(f"{gf.name}: tokenizer model {kind!r} is not supported; supported: "
                             f"{', '.join(TOKENIZER_MODELS)}")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ModelLoadError(f"{gf.name} has no tokenizer.ggml.tokens list of strings")
    types = gf.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelLoadError(f"{gf.name}: {len(types)} token types for {len(tokens)} tokens")
    specials = _special_ids(gf, len(tokens))
    backend = _bpe(gf, tokens) if kind == "gpt2" else _sentencepiece(gf, tokens, types, specials.get("unk"))
    added = [AddedToken(t, special=ty == CONTROL, normalized=False)
             for t, ty in zip(tokens, types, strict=True) if ty in (CONTROL, USER_DEFINED)]
    backend.add_tokens(added)
    _post_processor(gf, backend, kind, tokens, specials)
    named = {f"{key}_token": tokens[i] for key, i in specials.items()}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False,
                                        model_input_names=["input_ids", "attention_mask"], **named)
    tokenizer.turn_end_tokens = turn_end_tokens(gf, tokens, types)  # models/tokenizer.py eos_token_ids reads them
    return tokenizer


def turn_end_tokens(gf: GGUFFile, tokens: list[str], types: list[int]) -> tuple[str, ...]:
    """The tokens that end a reply besides EOS, as llama.cpp finds them: `tokenizer.ggml.eot_token_id` and
    `eom_token_id`, and the added tokens spelt like a known end of turn (a chat model's GGUF often names only
    its base model's EOS: gemma-3-it's <eos> while replies end with <end_of_turn>)."""
    found = []
    for meta in ("eot_token_id", "eom_token_id"):
        index = gf.get(f"tokenizer.ggml.{meta}")
        if isinstance(index, int) and not isinstance(index, bool) and 0 <= index < len(tokens):
            found.append(tokens[index])
    found += [t for t, kind in zip(tokens, types, strict=True) if kind in (CONTROL, USER_DEFINED) and t in TURN_ENDS]
    return tuple(dict.fromkeys(found))


# texts llama.cpp takes as the end of a generation wherever they are added tokens (llama-vocab.cpp's end-of-
# generation set): Llama 3's, ChatML's, Phi-3's, Gemma's, GPT-2's and CodeLlama's turn ends
TURN_ENDS = frozenset({"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                       "<EOT>", "_<EOT>"})


def _special_ids(gf: GGUFFile, count: int) -> dict[str, int]:
    found = {}
    for key, meta in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                      ("pad", "padding_token_id")):
        value = gf.get(f"tokenizer.ggml.{meta}")
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < count:
            raise ModelLoadError(f"{gf.name}: tokenizer.ggml.{meta}={value!r} is not a token id below {count}")
        found[key] = value
    return found


def _vocab(gf: GGUFFile, tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)  # a repeated text keeps its first id, as llama.cpp's lookup does
    if len(vocab) != len(tokens):
        logger.warning("%s: %d token texts repeat; text maps to the first id of each", gf.name,
                       len(tokens) - len(vocab))
    return vocab


def _bpe(gf: GGUFFile, tokens: list[str]) -> Tokenizer:
    merges = gf.get("tokenizer.ggml.merges")
    if not isinstance(merges, list) or not all(isinstance(m, str) and " " in m for m in merges):
        raise ModelLoadError(f"{gf.name}: a gpt2 (BPE) vocabulary needs tokenizer.ggml.merges, a list of 'a b' strings")
    pre = gf.get("tokenizer.ggml.pre", "default")
    if pre not in BPE_PRE_TOKENIZERS:
        if pre != "default":
            raise ModelLoadError(f"{gf.name}: pre-tokenizer {pre!r} is not supported; supported: "
                                 f"{', '.join(sorted(BPE_PRE_TOKENIZERS))}")
        logger.warning("%s names no pre-tokenizer ('default'): splitting text as GPT-2 does", gf.name)
        pre = "gpt-2"
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = Tokenizer(models.BPE(vocab=_vocab(gf, tokens), merges=pairs, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = BPE_PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(gf: GGUFFile, tokens: list[str], types: list[int], unk: int | None) -> Tokenizer:
    """SentencePiece BPE: pieces merge by the score of the piece they form (higher first), bytes fall back to <0xXX>."""
    scores = gf.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise ModelLoadError(f"{gf.name}: a llama (SentencePiece) vocabulary needs one tokenizer.ggml.scores value "
                             "per token")
    vocab = _vocab(gf, tokens)
    ranked = []
    for index, (piece, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind not in (NORMAL, USER_DEFINED) or len(piece) < 2 or vocab[piece] != index:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[index]), index, vocab[left], left, right))
    ranked.sort()
    merges = [(left, right) for *_, left, right in ranked]
    unk_token = tokens[unk] if unk is not None else None
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True))
    prefix = gf.get("tokenizer.ggml.add_space_prefix", True)
    # llama.cpp puts the space prefix before every text fragment that follows a special token (or starts the
    # text); added tokens are split off before normalizing, so a normalizer prepends it to exactly those
    escape = normalizers.Replace(" ", "\u2581")
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), escape]) if prefix else escape
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    return backend


def _post_processor(gf: GGUFFile, backend: Tokenizer, kind: str, tokens: list[str], specials: dict[str, int]) -> None:
    add_bos = bool(gf.get("tokenizer.ggml.add_bos_token", kind == "llama")) and "bos" in specials
    add_eos = bool(gf.get("tokenizer.ggml.add_eos_token", False)) and "eos" in specials
    if not (add_bos or add_eos):
        if kind == "gpt2":
            backend.post_processor = processors.ByteLevel(trim_offsets=False)
        return
    bos = [tokens[specials["bos"]]] if add_bos else []
    eos = [tokens[specials["eos"]]] if add_eos else []
    used = {(t, specials[k]) for k, t in (("bos", bos[0] if bos else None), ("eos", eos[0] if eos else None)) if t}
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join([*bos, "$A", *eos]), pair=" ".join([*bos, "$A", *eos, *bos, "$B:1", *eos]),
        special_tokens=sorted(used, key=lambda p: p[1]))


def gguf_chat_template(gf: GGUFFile, name: str | None) -> tuple[str | None, dict[str, str]]:
    """(the template source under `tokenizer.chat_template[.<name>]` or None, {bos_token, eos_token} texts)."""
    key = "tokenizer.chat_template" if name in (None, "default") else f"tokenizer.chat_template.{name}"
    source = gf.get(key)
    tokens = gf.get("tokenizer.ggml.tokens") or []
    special = {}
    for which in ("bos", "eos"):
        index = gf.get(f"tokenizer.ggml.{which}_token_id")
        ok = isinstance(index, int) and not isinstance(index, bool) and 0 <= index < len(tokens)
        special[f"{which}_token"] = tokens[index] if ok else ""
    return (source if isinstance(source, str) else None), special
