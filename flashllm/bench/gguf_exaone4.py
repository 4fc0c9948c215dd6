"""GGUF export of EXAONE 4.0 checkpoints (Exaone4ForCausalLM) as llama.cpp's converter writes `exaone4` files:
Llama's names with OLMo 2's post-norms, Q/K rows as they are, the sliding window where the model slides. Refused:
a layer layout llama.cpp's rule would run otherwise (flashllm.models.gguf.exaone4 says how it runs)."""

from __future__ import annotations

from typing import Any

from flashllm.models.gguf import exaone4 as rules

ARCHITECTURE = "Exaone4ForCausalLM"
LAYER_NAMES = {module: part for part, module in rules.LAYER_NAMES.items()}


def check(config: Any) -> None:
    """ValueError where llama.cpp's exaone4 rule places sliding layers otherwise than the checkpoint."""
    expected = [t == "sliding_attention" for t in rules.layer_types(config.num_hidden_layers)]
    if [w is not None for w in config.sliding_windows] != expected:
        raise ValueError(f"EXAONE 4 with sliding layers {[i for i, w in enumerate(config.sliding_windows) if w]}: "
                         f"llama.cpp slides only {rules.HYBRID_LAYERS}-layer files, layer i when i % "
                         f"{rules.SLIDING_PATTERN} < {rules.SLIDING_PATTERN - 1}; this model has no GGUF export")
    if len({w for w in config.sliding_windows if w is not None}) > 1:
        raise ValueError("EXAONE 4 sliding layers of different windows have no GGUF export (one sliding_window key)")


def add_hparams(writer: Any, config: Any) -> None:
    """The sliding window, where the model has one."""
    window = next((w for w in config.sliding_windows if w is not None), None)
    if window is not None:
        writer.add_sliding_window(window)
