"""GGUF export of transformers' Glm4MoeForCausalLM checkpoints (GLM-4.5 / 4.6) as llama.cpp's converter writes
`glm4moe` files: the checkpoint's tensors under glm4moe's names (the FFN input norm as `post_attention_norm`), Q/K
rows as they are (the graph rotates halves, as the checkpoint does), RoPE over `rotary_dim` features, the experts
stacked, the router's correction bias as `exp_probs_b`, sigmoid gating. No next-token-prediction layer is written
(as the converter's --no-mtp). It refuses what llama.cpp's glm4moe graph would run differently
(flashllm.models.gguf.glm4moe says how the graph runs): expert groups (the graph routes without them) and rope
scaling (the converter writes none for GLM-4.5)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from flashllm.bench import gguf_deepseek, gguf_moe

ARCHITECTURE = "Glm4MoeForCausalLM"
# HF module (after "model.layers.L.") -> GGUF layer part, over Llama's and gguf_moe's
LAYER_NAMES = {"post_attention_layernorm": "post_attention_norm",
               **{module: part for module, part in gguf_deepseek.LAYER_NAMES.items() if module.startswith("mlp.")}}


def check(config: Any) -> None:
    """ValueError for what llama.cpp's glm4moe graph would run differently (module docstring)."""
    if config.n_group > 1:
        raise ValueError(f"GLM-4.5 routing within n_group={config.n_group} expert groups has no GGUF export here: "
                         "llama.cpp's glm4moe graph routes without groups")
    if config.rope_scaling is not None:
        raise ValueError(f"GLM-4.5 rope scaling {config.rope_scaling!r} has no GGUF export here: llama.cpp's "
                         "glm4moe converter writes plain rope")


def transform(entries: list[gguf_deepseek.Entry], config: Any) -> Iterator[gguf_deepseek.Entry]:
    """The checkpoint's entries as the converter writes them: experts stacked, the correction bias renamed."""
    for name, shape, load in gguf_moe.group_experts(entries, config.n_routed_experts):
        yield gguf_deepseek.renamed_bias(name), shape, load


def add_hparams(writer: Any, config: Any) -> None:
    """glm4moe's MoE keys (gguf_export writes the generic ones, rope.dimension_count the rotary part)."""
    import gguf

    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    writer.add_expert_weights_norm(config.norm_topk_prob)
