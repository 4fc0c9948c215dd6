"""GGUF export of transformers' GlmForCausalLM checkpoints as llama.cpp's converter writes `chatglm` files (and of
Glm4ForCausalLM ones as `glm4` files, with their post-attention and post-MLP norms): the
checkpoint's q / k / v projections (with their biases) as they are, gate_up_proj as `ffn_up`, RoPE over the
rotary part of each head (adjacent pairs, as GLM turns them), no BOS token. It refuses what llama.cpp's chatglm
graph would run differently (flashllm.models.gguf.chatglm says how the graph runs): rope scaling (the converter
writes none), biases on the output or MLP projections (the graph adds none)."""

from __future__ import annotations

from typing import Any

ARCHITECTURE, GLM4_ARCHITECTURE = "GlmForCausalLM", "Glm4ForCausalLM"
LAYER_NAMES = {"mlp.gate_up_proj": "ffn_up"}
GLM4_LAYER_NAMES = {**LAYER_NAMES, "post_self_attn_layernorm": "post_attention_norm",
                    "post_mlp_layernorm": "post_ffw_norm"}


def check(config: Any) -> None:
    """ValueError for what llama.cpp's chatglm graph would run differently (module docstring)."""
    if config.rope_scaling is not None:
        raise ValueError(f"GLM rope scaling {config.rope_scaling!r} has no GGUF export here: llama.cpp's chatglm "
                         "converter writes plain rope")
    if config.linear_bias or not config.final_norm:
        raise ValueError("GLM without a final norm or with output / MLP biases has no GGUF export here: llama.cpp's "
                         "chatglm graph always normalizes and adds no such biases")

