"""GGUF export of first-generation OLMo checkpoints (OlmoForCausalLM) as llama.cpp's converter writes `olmo` files:
Llama's tensor names (no norm tensors: OLMo's LayerNorms have no parameters), Q/K rows reordered for its adjacent-pair
RoPE, the LayerNorms' eps as `attention.layer_norm_epsilon` (always 1e-5) and clip_qkv as `attention.clamp_kqv`. It
refuses what llama.cpp would run differently from the checkpoint (flashllm.models.gguf.olmo says how a file runs):
attention biases (its olmo graph adds none) and rope scaling other than linear (it reads no llama3 factors)."""

from __future__ import annotations

from typing import Any

ARCHITECTURE = "OlmoForCausalLM"
CONVERTER_EPS = 1e-5  # convert_hf_to_gguf's OlmoModel writes this eps, OlmoLayerNorm's fixed one


def check(config: Any) -> None:
    """ValueError for what llama.cpp's olmo graph would run differently (module docstring)."""
    from flashllm.ops.rope_cache import rope_type_of

    if config.attention_bias:
        raise ValueError("OLMo with attention_bias=true has no GGUF export: llama.cpp's olmo graph adds no "
                         "attention biases")
    if rope_type_of(config.rope_scaling) not in ("default", "linear"):
        raise ValueError(f"OLMo with rope scaling {config.rope_scaling!r} has no GGUF export: llama.cpp's olmo graph "
                         "runs plain or linear rope only")


def add_hparams(writer: Any, config: Any) -> None:
    """The LayerNorms' eps and the q / k / v clamp under the keys llama.cpp's olmo loader reads."""
    writer.add_layer_norm_eps(CONVERTER_EPS)
    if config.clip_qkv is not None:
        writer.add_clamp_kqv(config.clip_qkv)
