"""GGUF export of StarCoder 2 checkpoints (Starcoder2ForCausalLM) as llama.cpp's converter writes `starcoder2` files:
Llama's tensor names with the MLP's c_fc / c_proj as ffn_up / ffn_down, the LayerNorms' biases beside their weights,
and the norms' eps as `attention.layer_norm_epsilon`. Refused: checkpoints without biases (use_bias=false, which
llama.cpp's loader does not accept) and sliding windows (flashllm.models.gguf.starcoder2 says how a file runs)."""

from __future__ import annotations

from typing import Any

ARCHITECTURE = "Starcoder2ForCausalLM"
LAYER_NAMES = {"mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}


def check(config: Any) -> None:
    """ValueError for what llama.cpp's starcoder2 graph would run differently (module docstring)."""
    if not config.attention_bias:
        raise ValueError("StarCoder 2 with use_bias=false has no GGUF export: llama.cpp's starcoder2 loader requires "
                         "the projections' biases")
    if any(window is not None for window in config.sliding_windows):
        raise ValueError("StarCoder 2 with a sliding window has no GGUF export here: llama.cpp's converter drops the "
                         "window and its graph attends to everything; set sliding_window to null to export")


def add_hparams(writer: Any, config: Any) -> None:
    """The LayerNorms' eps under the key llama.cpp's starcoder2 loader reads."""
    writer.add_layer_norm_eps(config.rms_norm_eps)
