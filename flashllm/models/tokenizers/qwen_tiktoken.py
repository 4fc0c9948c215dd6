"""First-generation Qwen's and GLM-4's tokenizers, built from their tiktoken rank files (tiktoken_bpe.py).

Qwen: `qwen.tiktoken`, NFC-normalized text, single digits, and <|endoftext|>, <|im_start|>,
<|im_end|>, <|extra_0|>..<|extra_204|> after the ranks. GLM-4 (`ChatGLM4Tokenizer`): a rank file
named `tokenizer.model`, no normalization, runs of up to three digits, its 14 special tokens after
the ranks, and `[gMASK]<sop>` before every encoded prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from flashllm.models.tokenizers.tiktoken_bpe import build_tiktoken_tokenizer

VOCAB_FILE = "qwen.tiktoken"
# Qwen's pre-tokenization: contractions, letter runs, single digits, punctuation runs, newlines, spaces
PRETOKENIZE_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                       r"|\s*[\r\n]+|\s+(?!\S)|\s+")
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END, *(f"<|extra_{i}|>" for i in range(205)))

GLM4_VOCAB_FILE = "tokenizer.model"
# GLM-4's pre-tokenization: Qwen's with runs of up to three digits
GLM4_PRETOKENIZE_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GLM4_SPECIAL_TOKENS: tuple[str, ...] = (
    ENDOFTEXT, "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>", "<|assistant|>",
    "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
)
GLM4_PREFIX: tuple[str, ...] = ("[gMASK]", "<sop>")
GLM4_TURN_ENDS: tuple[str, ...] = ("<|user|>", "<|observation|>")  # GLM-4-Chat's generation_config stops


def load_qwen_tokenizer(model_dir: str | Path, tokenizer_config: dict[str, Any] | None = None
                        ) -> PreTrainedTokenizerFast:
    """The tokenizer of a QWen model directory (its `qwen.tiktoken`), as QWenTokenizer encodes:
    NFC-normalized text, special tokens recognised anywhere in it, no BOS added.

    eos_token and pad_token are <|endoftext|> (generation_config.json's eos_token_id). Raises
    ModelLoadError (one line, naming the file and line) on a missing or malformed rank file.
    """
    return build_tiktoken_tokenizer(Path(model_dir) / VOCAB_FILE, pattern=PRETOKENIZE_PATTERN,
                                    special_tokens=SPECIAL_TOKENS, eos_token=ENDOFTEXT, nfc=True,
                                    tokenizer_config=tokenizer_config)


def load_glm4_tokenizer(model_dir: str | Path, tokenizer_config: dict[str, Any] | None = None
                        ) -> PreTrainedTokenizerFast:
    """GLM-4's ChatGLM4Tokenizer from the directory's tiktoken `tokenizer.model`, without its code.

    encode(text) puts [gMASK] <sop> first (add_special_tokens=False leaves them out: chat templates
    write them); special tokens are recognised anywhere in the text; eos and pad are <|endoftext|>;
    <|user|> and <|observation|> end a turn as eos does. Raises ModelLoadError (one line, naming the
    file and line) on a missing or malformed rank file.
    """
    return build_tiktoken_tokenizer(Path(model_dir) / GLM4_VOCAB_FILE, pattern=GLM4_PRETOKENIZE_PATTERN,
                                    special_tokens=GLM4_SPECIAL_TOKENS, eos_token=ENDOFTEXT, prefix=GLM4_PREFIX,
                                    turn_end_tokens=GLM4_TURN_ENDS, tokenizer_config=tokenizer_config)
