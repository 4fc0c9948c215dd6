"""Tokenizers that Hugging Face ships only as remote code, built by flashllm from the checkpoint's own files."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

# the files a model directory's tokenizer is read from (any one of them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

# tokenizer_config.json's exact `tokenizer_class` -> "module:function" building it as
# function(model_dir: Path, tokenizer_config: dict) -> a transformers PreTrainedTokenizerFast (or, for
# sentencepiece models, a SentencePieceTokenizer with the interface flashllm calls)
NATIVE_TOKENIZERS: dict[str, str] = {
    "QWenTokenizer": "flashllm.models.tokenizers.qwen_tiktoken:load_qwen_tokenizer",
    # GLM-4's remote-code tokenizer: a tiktoken rank file under the name tokenizer.model
    "ChatGLM4Tokenizer": "flashllm.models.tokenizers.qwen_tiktoken:load_glm4_tokenizer",
    "ChatGLMTokenizer": "flashllm.models.tokenizers.sentencepiece_tokenizer:load_chatglm_tokenizer",
    # Baichuan-13B / Baichuan2 and Baichuan-7B (its class is spelt BaiChuanTokenizer)
    "BaichuanTokenizer": "flashllm.models.tokenizers.sentencepiece_tokenizer:load_sentencepiece_tokenizer",
    "BaiChuanTokenizer": "flashllm.models.tokenizers.sentencepiece_tokenizer:load_sentencepiece_tokenizer",
    # ERNIE 4.5's checkpoints name a remote-code sentencepiece class (transformers reads them with its own backend)
    "Ernie4_5Tokenizer": "flashllm.models.tokenizers.sentencepiece_tokenizer:load_ernie4_5_tokenizer",
}


def native_tokenizer_loader(tokenizer_class: Any) -> Callable[[Path, dict[str, Any]], Any] | None:
    """The function that builds `tokenizer_class` natively, or None when flashllm has none for it."""
    target = NATIVE_TOKENIZERS.get(tokenizer_class) if isinstance(tokenizer_class, str) else None
    if target is None:
        return None
    module_name, _, function = target.partition(":")
    return getattr(importlib.import_module(module_name), function)
