"""GGUF export of Seed-OSS checkpoints (SeedOssForCausalLM) as llama.cpp's converter writes `seed_oss` files:
Llama's tensors, the norm before the MLP as `post_attention_norm`. Refused: a bias on the output projection and
sliding windows, which llama.cpp's graph has no place for (flashllm.models.gguf.seed_oss says how it runs a file)."""

from __future__ import annotations

from typing import Any

ARCHITECTURE = "SeedOssForCausalLM"
LAYER_NAMES = {"post_attention_layernorm": "post_attention_norm"}


def check(config: Any) -> None:
    """ValueError for what llama.cpp's seed_oss graph would run differently (module docstring)."""
    if config.raw.get("attention_out_bias"):
        raise ValueError("Seed-OSS with attention_out_bias=true has no GGUF export: llama.cpp's seed_oss graph reads "
                         "no output-projection bias")
    if any(window is not None for window in config.sliding_windows):
        raise ValueError("Seed-OSS with sliding-window layers has no GGUF export: llama.cpp's seed_oss graph attends "
                         "to everything")
