"""The built-in demo model: a small random-weight Llama with a trained tokenizer, built on first use."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from flashllm.config import cache_root

logger = logging.getLogger(__name__)

DEMO_NAME = "demo-v1"
DEMO_SEED = 0
DEMO_TOKENIZER_VOCAB = 2048
# Files whose presence marks a finished build (the directory only appears by an atomic rename,
# so a partial one means someone edited it by hand).
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "README.md")

DEMO_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "dtype": "float32",
}

README = """\
# flashllm demo model ({name})

A tiny Llama-shaped model with RANDOM weights (hidden 256, 4 layers, GQA 4/2 heads) and a small
byte-level BPE tokenizer trained locally with a chatml chat template. flashllm builds it
deterministically the first time it is needed, so the engine, CLI and server can run with no
download. Its text is meaningless: it exists to exercise the machinery, not to answer anything.
Delete this directory to rebuild it.
"""


def demo_model_dir(cache_dir: Path | None = None) -> Path:
    """The demo model's directory (`<cache root>/demo-v1`), building it first if it is absent.

    The build happens in a temporary sibling directory renamed into place, so concurrent first
    uses and interrupted builds never leave a half-written model where the engine would read it.
    """
    final = cache_root(cache_dir) / DEMO_NAME
    if final.is_dir():
        _check_complete(final)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-", dir=final.parent))
    try:
        logger.info("building the demo model in %s (first use only)", final)
        _build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            # another process finished first; its copy is identical (same seed)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _check_complete(final)
    return final


def _check_complete(path: Path) -> None:
    missing = [name for name in _REQUIRED if not (path / name).is_file()]
    if missing:
        raise RuntimeError(
            f"demo model directory {path} is incomplete (missing {', '.join(missing)}); delete it "
            "and flashllm will rebuild it"
        )


def _build(out_dir: Path) -> None:
    from flashllm.testing.tiny_models import CHATML_TEMPLATE, build_random_model_from_config
    from flashllm.testing.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(out_dir, vocab_size=DEMO_TOKENIZER_VOCAB, chat_template=CHATML_TEMPLATE)
    config = {**DEMO_CONFIG, "vocab_size": len(tokenizer)}
    for key in ("bos_token_id", "eos_token_id"):
        if getattr(tokenizer, key, None) is not None:
            config[key] = getattr(tokenizer, key)
    build_random_model_from_config(out_dir, config, seed=DEMO_SEED)
    (out_dir / "README.md").write_text(README.format(name=DEMO_NAME))
