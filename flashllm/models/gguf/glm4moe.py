"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 GGUF files (`glm4moe`): run as transformers' Glm4MoeForCausalLM.

What llama.cpp does with a `glm4moe` file (src/models/glm4-moe.cpp, convert_hf_to_gguf.py's Glm4MoeModel):

- Blocks: `block_count` counts the decoder layers and, after them, `nextn_predict_layers` next-token-prediction
  layers (the checkpoint's MTP layer; `blk.N.nextn.*` beside a full layer's tensors) that the graph loads but never
  runs; they are skipped here, and num_hidden_layers is block_count - nextn_predict_layers.
- Attention: `attn_q` / `attn_k` / `attn_v` with optional biases, optional per-head `attn_q_norm` / `attn_k_norm`
  (GLM-4.5, 4.6), `attn_output` without a bias; the FFN's input norm is `post_attention_norm`. RoPE over the first
  `rope.dimension_count` features of each head (the converter writes head_dim x partial_rotary_factor), rotated as
  halves (neox: the converter leaves Q/K rows as in the checkpoint). `rope.dimension_sections` (GLM-4.5V's M-RoPE)
  is refused.
- MoE: dense `ffn_gate` / `ffn_up` / `ffn_down` in the `leading_dense_block_count` first layers; then the router
  `ffn_gate_inp`, its choice bias `exp_probs_b`, stacked experts and `expert_shared_count` shared experts
  (`ffn_*_shexp`, added unweighted). The graph's routing: sigmoid scores (`expert_gating_func` absent or 2; softmax
  is refused, no GLM routes so) chosen by score + exp_probs_b, weighed by the score, renormalized where
  `expert_weights_norm`, scaled by `expert_weights_scale` (absent or 0: 1); no expert groups (the graph reads
  none, and every published GLM-4.5 / 4.6 has one group).
- Vocabulary: GLM's byte-level BPE with the `glm4` pre-tokenizer (llama.cpp's chatglm-bpe split).
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf import deepseek2
from flashllm.models.gguf.moe import MAX_EXPERTS
from flashllm.models.gguf.reader import GGUFFile

ARCH = "glm4moe"
SIGMOID, SOFTMAX = deepseek2.SIGMOID, deepseek2.SOFTMAX
LAYER_NAMES = {"post_attention_norm": "post_attention_layernorm",
               **{part: module for part, module in deepseek2.LAYER_NAMES.items() if part.endswith("_shexp")}}
LAYER_PARAMS = deepseek2.LAYER_PARAMS  # exp_probs_b.bias -> mlp.gate.e_score_correction_bias


def glm4moe_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The Glm4MoeForCausalLM config.json fields of a `glm4moe` file (module docstring)."""
    blocks = raw["num_hidden_layers"]
    nextn = _uint(gf, "nextn_predict_layers", 0, maximum=blocks - 1)
    layers = blocks - nextn
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    rope = _uint(gf, "rope.dimension_count", head_dim // 2, maximum=head_dim)
    if rope == 0 or rope % 2:
        raise ModelLoadError(f"{gf.name}: {ARCH}.rope.dimension_count is {rope}; expected an even number of features "
                             f"in 2..{head_dim} (the head size)")
    if gf.get(f"{ARCH}.rope.dimension_sections") is not None:
        raise ModelLoadError(f"{gf.name}: {ARCH}.rope.dimension_sections is set (GLM-4.5V's M-RoPE); flashllm runs "
                             "the text models' plain rope")
    gating = _uint(gf, "expert_gating_func", 0, maximum=SIGMOID)
    if gating not in (0, SIGMOID):
        raise ModelLoadError(f"{gf.name}: {ARCH}.expert_gating_func is {gating}; GLM-4.5 routes by sigmoid scores "
                             f"({SIGMOID}), which flashllm runs")
    experts = _uint(gf, "expert_count", maximum=MAX_EXPERTS)
    first_moe = _uint(gf, "leading_dense_block_count", 0, maximum=layers)
    moe_inter = _uint(gf, "expert_feed_forward_length")
    return {
        "num_hidden_layers": layers, "num_nextn_predict_layers": nextn, "head_dim": head_dim,
        "partial_rotary_factor": rope / head_dim, "attention_bias": "blk.0.attn_q.bias" in gf.tensors,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in gf.tensors,
        "n_routed_experts": experts, "num_experts_per_tok": _uint(gf, "expert_used_count", maximum=experts),
        "n_shared_experts": _uint(gf, "expert_shared_count", 0, maximum=MAX_EXPERTS),
        "first_k_dense_replace": first_moe, "moe_intermediate_size": moe_inter,
        "norm_topk_prob": gf.get(f"{ARCH}.expert_weights_norm", False) is True,
        "routed_scaling_factor": deepseek2.float_meta(gf, ARCH, "expert_weights_scale", 0.0) or 1.0,
        "n_group": 1, "topk_group": 1, "intermediate_size": raw["intermediate_size"] or moe_inter,
    }


def _uint(gf: GGUFFile, key: str, default: int | None = None, maximum: int = 1 << 20) -> int:
    return deepseek2.uint_meta(gf, ARCH, key, default, maximum)
