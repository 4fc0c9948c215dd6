"""The tokenizer built from a GGUF vocabulary encodes and decodes exactly as the tokenizer it was written from."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from flashllm.models.gguf import open_gguf  # noqa: E402
from flashllm.models.gguf.tokenizer import build_gguf_tokenizer  # noqa: E402
from flashllm.models.tokenizer import load_chat_template, load_tokenizer  # noqa: E402
from flashllm.testing.corpus import CORPUS  # noqa: E402
from flashllm.testing.gguf_files import add_bpe_vocab  # noqa: E402
from flashllm.testing.tiny_models import CHATML_TEMPLATE  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The split patterns Qwen2's and Llama 3's tokenizer.json files carry, written out here as the oracle's own.
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                 r"|\s+(?!\S)|\s+")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# gpt-oss's (o200k) tokenizer.json split: case-aware words with their contractions, digit runs of up to three
O200K_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek-V3's tokenizer.json splits in turn: digit runs of up to three, CJK ideographs and kana, then words
DEEPSEEK_V3_PATTERNS = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Mistral's tekken split: o200k's case-aware words without contractions, digits one by one
TEKKEN_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                  r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                  r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek-Coder's tokenizer.json splits in turn (newlines, words, punctuation, CJK and Hangul), then single digits
DEEPSEEK_CODER_PATTERNS = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+")
# names llama.cpp gives one of the splits above -> the oracle it is checked against
ALIASES = {"command-r": "smollm", "exaone": "smollm", "olmo": "gpt-2", "mpt": "gpt-2", "dbrx": "llama-bpe",
           "stablelm2": "qwen2", "hunyuan": "qwen2", "hunyuan-dense": "deepseek-v3"}


def _texts(count: int = 300) -> list[str]:
    """Corpus lines, their pieces glued oddly, digits, whitespace runs, CJK, emoji, special tokens inside text."""
    rng = random.Random(7)
    lines = [line for text in CORPUS for line in text.splitlines() if line.strip()]
    alphabet = "abc XYZ 0123456789 \n\t  ,.;:'\"!?-_()[]{}é中文字ひらカタ🙂🚀\u00a0"
    texts = ["", " ", "  leading", "trailing  ", "a\n\nb", "1234567", "it's they'll we've", "x" * 50]
    texts += [f"{SPECIALS[1]}user\n{lines[0]}{SPECIALS[2]}\n", f"{lines[1]}{SPECIALS[0]}{lines[2]}"]
    while len(texts) < count:
        kind = rng.randrange(3)
        if kind == 0:
            texts.append(rng.choice(lines))
        elif kind == 1:
            texts.append(" ".join(rng.sample(lines, 2))[: rng.randrange(1, 120)])
        else:
            texts.append("".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40))))
    return texts


def _train_bpe(pre: str) -> PreTrainedTokenizerFast:
    pre = ALIASES.get(pre, pre)
    backend = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre in ("gpt-2", "smollm"))
    if pre == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("qwen2", "llama-bpe", "chatglm-bpe", "glm4"):  # GLM-4's tiktoken split is Llama 3's
        split = pre_tokenizers.Split(Regex(QWEN2_PATTERN if pre == "qwen2" else LLAMA3_PATTERN), behavior="isolated")
        backend.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif pre == "gpt-4o":
        split = pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated")
        backend.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif pre == "deepseek-v3":
        splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in DEEPSEEK_V3_PATTERNS]
        backend.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    elif pre == "tekken":
        split = pre_tokenizers.Split(Regex(TEKKEN_PATTERN), behavior="isolated")
        backend.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif pre == "deepseek-coder":
        splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in DEEPSEEK_CODER_PATTERNS]
        digits = pre_tokenizers.Digits(individual_digits=True)
        backend.pre_tokenizer = pre_tokenizers.Sequence([*splits, digits, byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=SPECIALS[0], pad_token=SPECIALS[0],
                                   additional_special_tokens=SPECIALS[1:], clean_up_tokenization_spaces=False,
                                   chat_template=CHATML_TEMPLATE)


def _vocab_only_gguf(path: Path, fill) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    fill(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "qwen2", "llama-bpe", "deepseek-v3", "chatglm-bpe", "glm4",
                                 "gpt-4o", "tekken", "deepseek-coder", *ALIASES])
def test_bpe_vocabulary_encodes_and_decodes_as_its_tokenizer_json(pre, tmp_path):
    source = _train_bpe(pre)
    source.save_pretrained(str(tmp_path / "src"))
    path = _vocab_only_gguf(tmp_path / "vocab.gguf", lambda w: add_bpe_vocab(w, tmp_path / "src", len(source), pre))
    ours = load_tokenizer(path)
    assert ours.eos_token == source.eos_token and ours.eos_token_id == source.eos_token_id
    split, expected_split = ours.backend_tokenizer.pre_tokenizer, source.backend_tokenizer.pre_tokenizer
    for text in [*_texts(), "HelloWorld ABCdef it's IT'S 12345 x/\n/"]:  # case-aware and contraction splits
        assert split.pre_tokenize_str(text) == expected_split.pre_tokenize_str(text), text
        expected = source(text)["input_ids"]
        assert ours(text)["input_ids"] == expected, text
        assert ours.decode(expected) == source.decode(expected), text
        assert ours.decode(expected, skip_special_tokens=True) == source.decode(expected, skip_special_tokens=True)
    template = load_chat_template(path)
    messages = [{"role": "user", "content": "Hi"}]
    assert template.render(messages) == source.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _sentencepiece_gguf(tmp_path: Path) -> tuple[object, Path]:
    import sentencepiece

    from flashllm.testing.sentencepiece_model import train_sentencepiece_model

    model = train_sentencepiece_model(tmp_path / "tokenizer.model", vocab_size=700)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model))
    kinds = gguf.TokenType
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(int(kinds.UNKNOWN if sp.is_unknown(i) else kinds.CONTROL if sp.is_control(i)
                         else kinds.BYTE if sp.is_byte(i) else kinds.NORMAL))

    def fill(writer):
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(sp.bos_id())
        writer.add_eos_token_id(sp.eos_id())
        writer.add_unk_token_id(sp.unk_id())
        writer.add_add_bos_token(True)

    return sp, _vocab_only_gguf(tmp_path / "spm.gguf", fill)


def test_sentencepiece_vocabulary_encodes_and_decodes_as_sentencepiece(tmp_path):
    sp, path = _sentencepiece_gguf(tmp_path)
    ours = build_gguf_tokenizer(open_gguf(path))
    assert (ours.bos_token_id, ours.eos_token_id, ours.unk_token_id) == (sp.bos_id(), sp.eos_id(), sp.unk_id())
    for text in _texts():
        if any(s in text for s in SPECIALS):
            continue  # sentencepiece reads special-token text as plain text; llama.cpp and flashllm match it whole
        expected = sp.encode(text)
        assert ours(text, add_special_tokens=False)["input_ids"] == expected, text
        assert ours(text)["input_ids"] == [sp.bos_id(), *expected], text
        assert ours.decode(expected) == sp.decode(expected), text


def test_unknown_tokenizer_kinds_and_pre_tokenizers_are_refused(tmp_path):
    from flashllm.models.errors import ModelLoadError

    def fill(kind: str, pre: str):
        def write(writer):
            writer.add_tokenizer_model(kind)
            writer.add_tokenizer_pre(pre)
            writer.add_token_list(["a", "b", "ab"])
            writer.add_token_merges(["a b"])
        return write

    with pytest.raises(ModelLoadError, match="tokenizer model 'rwkv' is not supported; supported: gpt2, llama"):
        build_gguf_tokenizer(open_gguf(_vocab_only_gguf(tmp_path / "a.gguf", fill("rwkv", "gpt-2"))))
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'kimi-k2' is not supported; supported: .*qwen2"):
        build_gguf_tokenizer(open_gguf(_vocab_only_gguf(tmp_path / "b.gguf", fill("gpt2", "kimi-k2"))))


@pytest.mark.parametrize(("pre", "text", "pieces"), [
    # newlines alone, words with one leading space, punctuation runs, CJK runs, digit runs (LLM) or single digits
    # (Coder); LLM's punctuation class spans ASCII ':'..'~', letters included, so it cuts a Latin tail off a Greek word
    ("deepseek-llm", "Hello, world 123\n中文Ωx!!", ["Hello", ",", " world", " ", "123", "\n", "中文", "Ω", "x", "!!"]),
    ("deepseek-coder", "Hello, world 123\n中文Ωx!!",
     ["Hello", ",", " world", " ", "1", "2", "3", "\n", "中文", "Ωx", "!!"]),
    ("deepseek-llm", "a  \t", ["a", "  \t"]),  # trailing whitespace kept whole
    ("tekken", "HelloWorld it's 42", ["Hello", "World", " it", "'s", " ", "4", "2"]),
])
def test_split_pieces_are_llama_cpp_s(pre, text, pieces, tmp_path):
    """The pieces each split makes, read off llama.cpp's regex lists (offsets into the text, before byte mapping)."""
    from flashllm.models.gguf.tokenizer import BPE_PRE_TOKENIZERS

    spans = BPE_PRE_TOKENIZERS[pre]().pre_tokenize_str(text)
    assert [text[start:end] for _, (start, end) in spans] == pieces
