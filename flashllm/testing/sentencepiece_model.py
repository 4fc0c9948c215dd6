"""Train a tiny sentencepiece `tokenizer.model` locally (ChatGLM- and Baichuan-style), so tests never download one."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

from flashllm.testing.corpus import CORPUS


def train_sentencepiece_model(path: str | Path, vocab_size: int = 800, *, corpus: Sequence[str] | None = None,
                              user_defined_symbols: Sequence[str] = ()) -> Path:
    """Train a BPE sentencepiece model on `corpus` (default: CORPUS) and write it to `path`.

    Pieces 0, 1, 2 are <unk>, <s>, </s> (as in ChatGLM's and Baichuan's models); byte fallback
    makes any text encodable (characters outside the 99.95% coverage become byte pieces), and the
    identity normalization with whitespace kept makes decode(encode(text)) == text. `user_defined_symbols` become whole pieces
    (Baichuan's <reserved_*> tokens are such). The same inputs give the same file. Returns path.
    """
    import sentencepiece

    lines = [line for text in (CORPUS if corpus is None else corpus) for line in text.splitlines() if line.strip()]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=0.9995, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        user_defined_symbols=list(user_defined_symbols), num_threads=1, minloglevel=2,
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.getvalue())
    return path
