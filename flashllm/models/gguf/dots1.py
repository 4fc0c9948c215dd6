"""dots.llm1 GGUF files (`dots1`: dots.llm1.base / .inst): run as flashllm's Dots1ForCausalLM.

What llama.cpp does with them (src/models/dots1.cpp, its hparams and tensors in src/llama-model.cpp, the converter's
Dots1Model over Qwen2MoeModel):

- Attention: Qwen3's: `attn_q` / `attn_k` / `attn_v` without biases (the graph adds none; only `attn_output`'s
  bias is read), per-head `attn_q_norm` / `attn_k_norm` before RoPE over half-split pairs (Q/K rows as in the
  checkpoint), no rope factors, full attention in every layer (no sliding window). Its loader sizes the key and
  value projections by the query heads, so a file with fewer key / value heads is not one it loads.
- MoE: dense `ffn_gate` / `ffn_up` / `ffn_down` in the `leading_dense_block_count` first layers; then the router
  `ffn_gate_inp` with its choice bias `exp_probs_b`, stacked experts `expert_feed_forward_length` wide and
  `expert_shared_count` shared experts (`ffn_*_shexp`, added unweighted). Routing by `expert_gating_func` (the
  converter writes sigmoid): experts chosen by score + exp_probs_b, weighed by the score, renormalized where
  `expert_weights_norm`, scaled by `expert_weights_scale`; no expert groups (the converter writes none).

Refused: a gating function other than sigmoid (or none: the graph has no routing without one), an
expert_weights_scale that is not positive, attention biases (flashllm's dots1 biases q, k, v and o together, the
graph only o) and fewer key / value heads than query heads.
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf import deepseek2
from flashllm.models.gguf.graph_checks import check_tensors
from flashllm.models.gguf.moe import MAX_EXPERTS
from flashllm.models.gguf.reader import GGUFFile

ARCH = "dots1"
LAYER_NAMES = {part: module for part, module in deepseek2.LAYER_NAMES.items() if part.endswith("_shexp")}
LAYER_PARAMS = deepseek2.LAYER_PARAMS  # exp_probs_b.bias -> mlp.gate.e_score_correction_bias
_UNREAD = ("blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias", "blk.0.attn_output.bias")


def dots1_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The Dots1ForCausalLM config.json fields of a `dots1` file (module docstring)."""
    check_tensors(gf, ARCH, ("blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"), _UNREAD)
    heads, layers = raw["num_attention_heads"], raw["num_hidden_layers"]
    if raw["num_key_value_heads"] != heads:
        raise ModelLoadError(f"{gf.name}: {ARCH}.attention.head_count_kv={raw['num_key_value_heads']} differs from "
                             f"head_count={heads}; llama.cpp's dots1 loader sizes attn_k / attn_v by the query heads")
    gating = _uint(gf, "expert_gating_func", 0, maximum=deepseek2.SIGMOID)
    if gating != deepseek2.SIGMOID:
        raise ModelLoadError(f"{gf.name}: {ARCH}.expert_gating_func is {gating}; dots.llm1 routes by sigmoid scores "
                             f"({deepseek2.SIGMOID}), which flashllm runs and llama.cpp's converter writes")
    scale = deepseek2.float_meta(gf, ARCH, "expert_weights_scale", 0.0)
    if scale <= 0:
        raise ModelLoadError(f"{gf.name}: {ARCH}.expert_weights_scale is {scale}; llama.cpp's dots1 graph multiplies "
                             "the routing weights by it (a required positive number)")
    experts = _uint(gf, "expert_count", maximum=MAX_EXPERTS)
    moe_inter = _uint(gf, "expert_feed_forward_length")
    return {
        "n_routed_experts": experts, "num_experts_per_tok": _uint(gf, "expert_used_count", maximum=experts),
        "n_shared_experts": _uint(gf, "expert_shared_count", maximum=MAX_EXPERTS),
        "first_k_dense_replace": _uint(gf, "leading_dense_block_count", maximum=layers),
        "moe_intermediate_size": moe_inter, "norm_topk_prob": gf.get(f"{ARCH}.expert_weights_norm", False) is True,
        "routed_scaling_factor": scale, "n_group": 1, "topk_group": 1, "attention_bias": False,
        "sliding_window": None, "max_window_layers": layers, "intermediate_size": raw["intermediate_size"] or moe_inter,
    }


def _uint(gf: GGUFFile, key: str, default: int | None = None, maximum: int = 1 << 20) -> int:
    return deepseek2.uint_meta(gf, ARCH, key, default, maximum)
