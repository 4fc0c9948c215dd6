"""Engines and prompts the speculative-decoding tests share: random prompts and a small paged cpu/reference LLM."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

BLOCK = 16


def random_prompts(count: int, seed: int, vocab_size: int = 256, max_len: int = 90) -> list[list[int]]:
    """`count` prompts of 1..max_len - 1 token ids drawn from [0, vocab_size), seeded."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randrange(1, max_len))] for _ in range(count)]


def spec_llm(model_dir: Path, backend: str, spec: Any, **kwargs: Any) -> Any:
    """An fp32 LLM over 16-token blocks (96 of them, 16 sequences, 128-token steps, 256-token context unless
    kwargs say otherwise) with the SpeculativeConfig `spec` (None: plain decoding)."""
    from flashllm.llm import LLM

    options = {"block_size": BLOCK, "num_kv_blocks": 96, "max_num_seqs": 16, "max_num_batched_tokens": 128,
               "max_model_len": 256, **kwargs}
    return LLM(str(model_dir), backend=backend, dtype="float32", speculative_config=spec, **options)
