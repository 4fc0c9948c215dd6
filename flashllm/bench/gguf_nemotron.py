"""GGUF export of Nemotron checkpoints (NemotronForCausalLM) as llama.cpp's converter writes `nemotron` files: Llama's
tensor names (no ffn_gate), 1 added to every LayerNorm weight, the norms' eps as `attention.layer_norm_epsilon`, RoPE
over `rope.dimension_count` features of each head (flashllm.models.gguf.nemotron says how a file runs)."""

from __future__ import annotations

from typing import Any

ARCHITECTURE = "NemotronForCausalLM"
NORM_SHIFT = 1.0


def add_hparams(writer: Any, config: Any) -> None:
    """The LayerNorms' eps under the key llama.cpp's nemotron loader reads."""
    writer.add_layer_norm_eps(config.rms_norm_eps)
