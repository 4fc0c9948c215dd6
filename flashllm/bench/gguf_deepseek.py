"""GGUF export of DeepSeek-V2 / V3 checkpoints as llama.cpp's converter writes `deepseek2` files (its MLA layout).

The converter keeps the checkpoint's tensors under deepseek2's names, except the latent up-projection, which it
splits per head into `attn_k_b` (each head's key rows, transposed: (H, L, Dn)) and `attn_v_b` ((H, Dv, L)), and
the experts, stacked as for the other MoE archs (gguf_moe.group_experts). It records MLA as one latent head
(head_count_kv 1, key_length L + R, value_length L) with the per-head sizes as key_length_mla / value_length_mla.
It refuses what llama.cpp's deepseek2 graph would run differently (flashllm.models.gguf.deepseek2 says how the
graph runs): V2's group-limited routing (llama.cpp ranks groups by their two best scores, V2 by the best one),
neox RoPE (the graph rotates adjacent pairs), YaRN with mscale != mscale_all_dim (the graph leaves cos and sin
unscaled), attention biases (the graph has none).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from flashllm.bench import gguf_moe

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM")  # the last: GLM-4.7-Flash
# HF module (after "model.layers.L.") -> GGUF layer part, over Llama's and gguf_moe's
LAYER_NAMES = {
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.k_b_proj": "attn_k_b", "self_attn.v_b_proj": "attn_v_b",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp", "mlp.gate.e_score_correction": "exp_probs_b",
}
_KV_B = re.compile(r"^(model\.layers\.\d+\.self_attn)\.kv_b_proj\.weight$")
_BIAS = re.compile(r"^(model\.layers\.\d+\.mlp\.gate)\.e_score_correction_bias$")

Entry = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]


def check(config: Any) -> None:
    """ValueError for what llama.cpp's deepseek2 graph would run differently (module docstring)."""
    if not config.sigmoid_scoring and config.group_limited and config.n_group > 1:
        raise ValueError("DeepSeek-V2 group-limited routing (topk_method group_limited_greedy) has no GGUF export "
                         "here: llama.cpp ranks expert groups by the sum of their two best scores, V2 by the best")
    if not config.rope_interleaved:
        raise ValueError("DeepSeek with rope_interleave=false has no GGUF export here: llama.cpp's deepseek2 graph "
                         "rotates adjacent feature pairs")
    if config.attention_bias:
        raise ValueError("DeepSeek with attention_bias=true has no GGUF export here: llama.cpp's deepseek2 graph "
                         "adds no attention biases")
    scaling = config.rope_scaling or {}
    if scaling and (scaling.get("rope_type") or scaling.get("type")) != "yarn":
        raise ValueError(f"DeepSeek rope scaling {scaling!r} has no GGUF export here; llama.cpp's deepseek2 runs yarn")
    if scaling and float(scaling.get("mscale") or 1.0) != float(scaling.get("mscale_all_dim") or 0.0):
        raise ValueError("DeepSeek YaRN with mscale != mscale_all_dim has no GGUF export here: llama.cpp's deepseek2 "
                         "graph assumes they are equal (it scales only the softmax, by mscale_all_dim)")


def transform(entries: list[Entry], config: Any) -> Iterator[Entry]:
    """The checkpoint's (HF name, shape, loader) entries as the converter writes them: experts stacked, kv_b_proj
    split into per-head k_b (transposed) and v_b, the correction bias under a name gguf_export maps to
    `exp_probs_b.bias`."""
    heads, nope, value = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
    for name, shape, load in gguf_moe.group_experts(entries, config.n_routed_experts):
        kv_b = _KV_B.match(name)
        if kv_b:
            rank = shape[1]
            yield f"{kv_b[1]}.k_b_proj.weight", (heads, rank, nope), _k_b(load, heads, nope)
            yield f"{kv_b[1]}.v_b_proj.weight", (heads, value, rank), _v_b(load, heads, nope)
        else:
            yield renamed_bias(name), shape, load


def renamed_bias(name: str) -> str:
    """The correction bias's HF name as one gguf_export maps to `exp_probs_b.bias` (LAYER_NAMES); others as they are."""
    bias = _BIAS.match(name)
    return f"{bias[1]}.e_score_correction.bias" if bias else name


def _k_b(load: Callable[[], np.ndarray], heads: int, nope: int) -> Callable[[], np.ndarray]:
    def k_b() -> np.ndarray:
        weight = load()
        return np.ascontiguousarray(weight.reshape(heads, -1, weight.shape[-1])[:, :nope].transpose(0, 2, 1))
    return k_b


def _v_b(load: Callable[[], np.ndarray], heads: int, nope: int) -> Callable[[], np.ndarray]:
    def v_b() -> np.ndarray:
        weight = load()
        return np.ascontiguousarray(weight.reshape(heads, -1, weight.shape[-1])[:, nope:])
    return v_b


def add_hparams(writer: Any, config: Any) -> None:
    """deepseek2's MLA sizes, MoE routing and YaRN keys (gguf_export writes the generic ones, not the head sizes)."""
    import gguf

    rank, rope = config.kv_lora_rank, config.qk_rope_head_dim
    writer.add_head_count_kv(1)
    writer.add_key_length(rank + rope)
    writer.add_value_length(rank)
    writer.add_key_length_mla(config.qk_nope_head_dim + rope)
    writer.add_value_length_mla(config.v_head_dim)
    writer.add_rope_dimension_count(rope)
    writer.add_kv_lora_rank(rank)
    if config.q_lora_rank is not None:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    if config.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    gating = gguf.ExpertGatingFuncType
    writer.add_expert_gating_func(gating.SIGMOID if config.sigmoid_scoring else gating.SOFTMAX)
    if config.sigmoid_scoring and config.n_group > 1:
        writer.add_expert_group_count(config.n_group)
        writer.add_expert_group_used_count(config.topk_group)
    scaling = config.rope_scaling
    if scaling:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
        writer.add_rope_scaling_yarn_log_mul(0.1 * float(scaling.get("mscale_all_dim") or 0.0))
        for key, add in (("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
            if scaling.get(key) is not None:
                add(float(scaling[key]))

