"""GGUF export of SmolLM3 checkpoints (SmolLM3ForCausalLM) as llama.cpp's converter writes `smollm3` files: Llama's
tensors and metadata. Refused: NoPE layers other than llama.cpp's hard-coded every-fourth ones, and sliding windows
(flashllm.models.gguf.smollm3 says how llama.cpp runs the file)."""

from __future__ import annotations

from typing import Any

from flashllm.models.gguf.smollm3 import NO_ROPE_LAYER_STEP

ARCHITECTURE = "SmolLM3ForCausalLM"


def check(config: Any) -> None:
    """ValueError for what llama.cpp's smollm3 graph would run differently (module docstring)."""
    expected = tuple((i + 1) % NO_ROPE_LAYER_STEP != 0 for i in range(config.num_hidden_layers))
    if config.rope_layers != expected:
        raise ValueError(f"SmolLM3 NoPE layers {[i for i, r in enumerate(config.rope_layers) if not r]}: llama.cpp's "
                         f"smollm3 leaves RoPE out of every {NO_ROPE_LAYER_STEP}th layer only; no GGUF export")
    if any(window is not None for window in config.sliding_windows):
        raise ValueError("SmolLM3 with sliding-window layers has no GGUF export: llama.cpp's smollm3 graph attends "
                         "to everything")
