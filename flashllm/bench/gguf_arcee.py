"""GGUF export of Arcee checkpoints (ArceeForCausalLM) as llama.cpp's converter writes `arcee` files: Llama's tensors
(no ffn_gate), Q/K rows reordered for llama.cpp's rope, YaRN's factor and original context where the checkpoint
scales RoPE so. Refused: sliding windows and YaRN variants llama.cpp would run differently."""

from __future__ import annotations

from typing import Any

ARCHITECTURE = "ArceeForCausalLM"


def check(config: Any) -> None:
    """ValueError for what llama.cpp's arcee graph would run differently (module docstring)."""
    if any(window is not None for window in config.sliding_windows):
        raise ValueError("Arcee with a sliding window has no GGUF export: llama.cpp's arcee graph attends to everything")
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") == "yarn" and scaling.get("truncate", True) is not True:
        raise ValueError("Arcee GGUF export needs YaRN with truncate=true: llama.cpp rounds the correction range")


def add_yarn(writer: Any, scaling: dict[str, Any]) -> None:
    """YaRN's type, factor and original context under `<arch>.rope.scaling.*`, as llama.cpp's converters write them."""
    import gguf

    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(scaling["factor"]))
    writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))


def add_hparams(writer: Any, config: Any) -> None:
    """YaRN's settings, where the checkpoint has them (the generic writer handles default and linear RoPE)."""
    if (config.rope_scaling or {}).get("rope_type") == "yarn":
        add_yarn(writer, config.rope_scaling)
