"""Train a tiny byte-level BPE tokenizer locally, so tests never download one."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from flashllm.testing.corpus import CORPUS

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]  # ids 0, 1, 2


def train_tokenizer(out_dir: str | Path, vocab_size: int = 512, *, corpus: list[str] | None = None,
                    chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `corpus` (default: CORPUS), save it to out_dir, return it.

    Special tokens: `<|endoftext|>` (eos and pad, id 0), `<|im_start|>` (1), `<|im_end|>` (2).
    Every byte is in the base alphabet, so any text (CJK, emoji) round-trips. The same inputs
    give the same vocabulary and files. out_dir receives tokenizer.json and
    tokenizer_config.json (and chat_template.jinja when a template is given).
    """
    min_size = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < min_size:
        raise ValueError(f"vocab_size={vocab_size} is below the byte alphabet plus special tokens "
                         f"({min_size}); use at least {min_size}")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS if corpus is None else corpus, trainer)
    extra = {} if chat_template is None else {"chat_template": chat_template}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        **extra,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer
