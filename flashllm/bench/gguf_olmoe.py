"""GGUF export of OLMoE checkpoints (OlmoeForCausalLM) as llama.cpp's converter writes `olmoe` files: Llama's tensor
names with the whole-projection q / k norms as attn_q_norm / attn_k_norm, Q/K rows as in the checkpoint (the graph
rotates halves), the experts stacked (gguf_moe), `expert_count` / `expert_used_count` (the experts are
`feed_forward_length` wide). It refuses what llama.cpp would run differently from the checkpoint, or not load
(flashllm.models.gguf.olmoe says how a file runs): norm_topk_prob (the olmoe graph never renormalizes), attention
biases (it adds none), an rms_norm_eps other than the 1e-5 the converter always writes, fewer key heads than query
heads (its k norm is embedding_length wide), tied embeddings (its loader requires output.weight) and rope scaling
other than linear (the converter writes no llama3 factors the graph would read)."""

from __future__ import annotations

from typing import Any

ARCHITECTURE = "OlmoeForCausalLM"
CONVERTER_EPS = 1e-5  # convert_hf_to_gguf's OlmoeModel writes this epsilon whatever config.json says


def check(config: Any) -> None:
    """ValueError for what llama.cpp's olmoe converter and graph would run differently (module docstring)."""
    from flashllm.ops.rope_cache import rope_type_of

    refusals = {
        "norm_topk_prob=true": (config.norm_topk_prob, "its olmoe graph never renormalizes the top-k routing weights"),
        "attention_bias=true": (config.qkv_bias, "its olmoe graph adds no attention biases"),
        f"rms_norm_eps={config.rms_norm_eps}": (config.rms_norm_eps != CONVERTER_EPS,
                                                f"its converter writes the epsilon as {CONVERTER_EPS}"),
        f"{config.num_key_value_heads} key heads of {config.num_attention_heads}": (
            config.num_key_value_heads != config.num_attention_heads,
            "its olmoe loader takes attn_k_norm of embedding_length features"),
        "tie_word_embeddings=true": (config.tie_word_embeddings, "its olmoe loader requires output.weight"),
        f"rope scaling {config.rope_scaling!r}": (rope_type_of(config.rope_scaling) not in ("default", "linear"),
                                                  "its olmoe converter writes plain or linear rope only"),
    }
    for what, (refused, why) in refusals.items():
        if refused:
            raise ValueError(f"OLMoE with {what} has no GGUF export here: llama.cpp would not run it as the "
                             f"checkpoint does ({why})")


def add_hparams(writer: Any, config: Any) -> None:
    """The expert counts llama.cpp's loader reads (each expert feed_forward_length wide)."""
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
