"""GGUF export of dots.llm1 checkpoints (Dots1ForCausalLM) as llama.cpp's converter writes `dots1` files: Qwen3's
attention names (per-head q / k norms as attn_q_norm / attn_k_norm, Q/K rows as in the checkpoint), the experts
stacked, the router's correction bias as `exp_probs_b`, the shared experts as `ffn_*_shexp`, and the routing keys
(sigmoid gating, leading dense layers, shared count, weights scale and norm). It refuses what llama.cpp would run
differently from the checkpoint, or not load (flashllm.models.gguf.dots1 says how a file runs): expert groups (its
graph routes without them), sliding-window layers (it attends fully), attention biases (it adds only o's), fewer key /
value heads than query heads (its loader sizes them by the query heads) and rope scaling (it reads no rope factors)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from flashllm.bench import gguf_deepseek, gguf_glm4moe

ARCHITECTURE = "Dots1ForCausalLM"
# HF module (after "model.layers.L.") -> GGUF layer part, over Llama's and gguf_moe's: the shared experts, the bias
LAYER_NAMES = {module: part for module, part in gguf_deepseek.LAYER_NAMES.items() if module.startswith("mlp.")}


def check(config: Any) -> None:
    """ValueError for what llama.cpp's dots1 graph or loader would run differently (module docstring)."""
    refusals = {
        f"n_group={config.n_group}": (config.n_group > 1, "its dots1 graph routes without expert groups"),
        "sliding-window layers": (any(w is not None for w in config.sliding_windows),
                                  "its dots1 graph attends fully in every layer"),
        "attention_bias=true": (config.qkv_bias, "its dots1 graph adds no q / k / v biases"),
        f"{config.num_key_value_heads} key heads of {config.num_attention_heads}": (
            config.num_key_value_heads != config.num_attention_heads,
            "its dots1 loader sizes attn_k / attn_v by the query heads"),
        f"rope scaling {config.rope_scaling!r}": (config.rope_scaling is not None, "its dots1 graph reads no rope factors"),
    }
    for what, (refused, why) in refusals.items():
        if refused:
            raise ValueError(f"dots.llm1 with {what} has no GGUF export here: llama.cpp would not run it as the "
                             f"checkpoint does ({why})")


def transform(entries: list[gguf_deepseek.Entry], config: Any) -> Iterator[gguf_deepseek.Entry]:
    """The checkpoint's entries as the converter writes them: experts stacked, the correction bias renamed."""
    return gguf_glm4moe.transform(entries, config)


def add_hparams(writer: Any, config: Any) -> None:
    """dots1's MoE keys, the converter's glm4moe ones (leading dense layers, expert counts and sizes, sigmoid gating,
    weights scale and norm); gguf_export writes the generic ones."""
    gguf_glm4moe.add_hparams(writer, config)
