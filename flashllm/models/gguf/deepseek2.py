"""DeepSeek-V2 / V2-Lite / V3 / R1 GGUF files (`deepseek2`): MLA sizes, YaRN and routing as llama.cpp runs them.

What llama.cpp does with a `deepseek2` file (src/llama-model.cpp's deepseek2 hparams and tensors,
src/models/deepseek2.cpp's graph, src/llama-graph.cpp's build_moe_ffn; convert_hf_to_gguf.py's DeepseekV2Model):

- Tensors: `attn_q` (no q_lora_rank, V2-Lite) or `attn_q_a`, `attn_q_a_norm`, `attn_q_b`; `attn_kv_a_mqa`,
  `attn_kv_a_norm`; the latent up-projection either as the checkpoint's `attn_kv_b` (files converted before
  llama.cpp's MLA rework) or split per head into `attn_k_b` (the key half, transposed: numpy (H, L, Dn)) and
  `attn_v_b` (numpy (H, Dv, L)), which join back into kv_b_proj here; routed experts stacked as for the other
  MoE archs, shared experts `ffn_*_shexp` (one MLP n_shared_experts x expert_feed_forward_length wide), V3's
  `exp_probs_b.bias` (the e_score_correction_bias), dense `ffn_*` in the `leading_dense_block_count` layers.
- Sizes: the split form stores MLA as multi-query attention over the latent (head_count_kv 1, key_length
  kv_lora_rank + rope, value_length kv_lora_rank) and the per-head sizes as `attention.key_length_mla` /
  `value_length_mla`; the older form stores the per-head sizes as key_length / value_length. The rotary part of
  a query/key head is `rope.dimension_count` wide, rotated as adjacent pairs (llama.cpp's "normal" rope, which is
  also transformers' DeepSeek rope with rope_interleave); Q/K rows are as in the checkpoint.
- Routing: `expert_gating_func` 2 is sigmoid (V3: choose by score + exp_probs_b, weigh by the score), absent or 1
  softmax (V2); `expert_group_count` > 1 keeps the `expert_group_used_count` groups with the largest sum of their
  two best choice scores (V3's noaux_tc; V2's group_limited_greedy ranks groups by their best score, which
  llama.cpp does not run); `expert_weights_norm` renormalizes the k weights, `expert_weights_scale` multiplies
  them (absent: 1).
- YaRN: `rope.scaling.type` yarn with `factor`, `original_context_length`, `yarn_beta_fast` / `yarn_beta_slow`
  (absent: 32 / 1; config.py reads these for every arch) and `yarn_log_multiplier` (the converter's
  0.1 x mscale_all_dim, absent: 0). The graph scales the
  softmax by (1 + 0.1 x mscale_all_dim x ln factor)^2 and leaves cos / sin unscaled: transformers' DeepSeek YaRN
  with mscale == mscale_all_dim.
- GLM-4.7-Flash is written as a deepseek2 file (the converter's Glm4MoeLiteModel); newer converters append its
  next-token-prediction layer, counted in `block_count` and `nextn_predict_layers`, which the graph never runs: its
  blocks are skipped here and num_hidden_layers is block_count - nextn_predict_layers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.moe import MAX_EXPERTS
from flashllm.models.gguf.reader import GGUFFile

ARCH = "deepseek2"
SIGMOID, SOFTMAX = 2, 1  # llama.cpp's expert_gating_func values
# GGUF layer part -> the checkpoint module (after "model.layers.L."), where deepseek2's differ from Llama's / Qwen's
LAYER_NAMES = {
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# GGUF layer tensor (part.suffix) -> the checkpoint parameter, where the name is not module + suffix
LAYER_PARAMS = {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}
KV_B_PARTS = ("attn_k_b", "attn_v_b")  # joined by join_kv_b into self_attn.kv_b_proj
KV_B_MODULE = "self_attn.kv_b_proj"


def join_kv_b(parts: list[Tensor]) -> Tensor:
    """attn_k_b (H, L, Dn) and attn_v_b (H, Dv, L) -> kv_b_proj's weight (H * (Dn + Dv), L): each head's key rows
    (k_b transposed back), then its value rows, as the checkpoint stores them."""
    k_b, v_b = parts
    if k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
        raise ModelLoadError(f"attn_k_b {tuple(k_b.shape)} and attn_v_b {tuple(v_b.shape)} are not one latent "
                             "up-projection split per head ((H, L, Dn) and (H, Dv, L))")
    joined = torch.cat((k_b.transpose(1, 2), v_b.to(k_b.dtype)), dim=1)
    return joined.reshape(-1, joined.shape[-1]).contiguous()


def deepseek2_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The DeepseekV2ForCausalLM / DeepseekV3ForCausalLM config.json fields of a `deepseek2` file (module docstring)."""
    heads, blocks = raw["num_attention_heads"], raw["num_hidden_layers"]
    nextn = _uint(gf, "nextn_predict_layers", 0, maximum=blocks - 1)  # GLM-4.7-Flash files may append its MTP layer
    layers = blocks - nextn
    fields: dict[str, Any] = {"num_key_value_heads": heads, "num_hidden_layers": layers,
                              "num_nextn_predict_layers": nextn, **_head_sizes(gf), **_routing(gf, layers)}
    fields["q_lora_rank"] = _uint(gf, "attention.q_lora_rank") if "blk.0.attn_q_a.weight" in gf.tensors else None
    fields["architectures"], fields["model_type"] = (["DeepseekV3ForCausalLM"], "deepseek_v3") if fields.pop(
        "sigmoid") else (["DeepseekV2ForCausalLM"], "deepseek_v2")
    if fields["model_type"] == "deepseek_v3":
        fields["rope_interleave"] = True
    scaling = _yarn(gf, raw.get("rope_scaling"))
    if scaling is not None:
        fields["rope_scaling"] = scaling
    fields["intermediate_size"] = raw["intermediate_size"] or fields["moe_intermediate_size"]  # no dense layer reads it
    return fields


def uint_meta(gf: GGUFFile, arch: str, key: str, default: int | None = None, maximum: int = 1 << 20) -> int:
    """`<arch>.<key>` as a whole number in 0..maximum (`default` when absent); ModelLoadError naming it otherwise."""
    value = gf.get(f"{arch}.{key}", default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise ModelLoadError(f"{gf.name}: {arch}.{key} is {value!r}; expected a whole number in 0..{maximum}")
    return value


def float_meta(gf: GGUFFile, arch: str, key: str, default: float) -> float:
    """`<arch>.<key>` as a finite number >= 0 (`default` when absent); ModelLoadError naming it otherwise."""
    value = gf.get(f"{arch}.{key}", default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
        raise ModelLoadError(f"{gf.name}: {arch}.{key} is {value!r}; expected a finite number >= 0")
    return float(value)


def _uint(gf: GGUFFile, key: str, default: int | None = None, maximum: int = 1 << 20) -> int:
    return uint_meta(gf, ARCH, key, default, maximum)


def _float(gf: GGUFFile, key: str, default: float) -> float:
    return float_meta(gf, ARCH, key, default)


def _head_sizes(gf: GGUFFile) -> dict[str, int]:
    """qk_nope / qk_rope / v head sizes and kv_lora_rank from either layout's metadata (module docstring)."""
    rank, rope = _uint(gf, "attention.kv_lora_rank"), _uint(gf, "rope.dimension_count")
    key, value = _uint(gf, "attention.key_length"), _uint(gf, "attention.value_length")
    split = "blk.0.attn_k_b.weight" in gf.tensors
    if split:
        kv_heads = _uint(gf, "attention.head_count_kv", 1)
        if (key, value, kv_heads) != (rank + rope, rank, 1):
            raise ModelLoadError(f"{gf.name}: a file with attn_k_b / attn_v_b stores MLA as one latent head "
                                 f"(head_count_kv 1, key_length kv_lora_rank + rope = {rank + rope}, value_length "
                                 f"{rank}); it has {kv_heads}, {key}, {value}: the file is inconsistent")
        key, value = _uint(gf, "attention.key_length_mla"), _uint(gf, "attention.value_length_mla")
    elif "blk.0.attn_kv_b.weight" not in gf.tensors:
        raise ModelLoadError(f"{gf.name} has neither blk.0.attn_kv_b nor blk.0.attn_k_b / attn_v_b; a deepseek2 "
                             "file holds the latent up-projection in one of those forms")
    if not 0 < rope < key or rope % 2 or value <= 0:
        raise ModelLoadError(f"{gf.name}: {ARCH}.rope.dimension_count {rope} must be even and below the query / key "
                             f"head size {key} (value head size {value})")
    return {"kv_lora_rank": rank, "qk_rope_head_dim": rope, "qk_nope_head_dim": key - rope, "v_head_dim": value}


def _routing(gf: GGUFFile, layers: int) -> dict[str, Any]:
    """The MoE fields; `sigmoid` (popped by the caller) picks V3's scoring over V2's."""
    experts = _uint(gf, "expert_count", maximum=MAX_EXPERTS)
    used = _uint(gf, "expert_used_count", maximum=experts)
    gating = _uint(gf, "expert_gating_func", SOFTMAX, maximum=SIGMOID)
    if gating not in (SOFTMAX, SIGMOID) or experts == 0 or used == 0:
        raise ModelLoadError(f"{gf.name}: {ARCH} with expert_gating_func {gating}, {experts} experts, {used} used is "
                             "not a DeepSeek MoE flashllm runs (softmax or sigmoid gating over >= 1 expert)")
    sigmoid = gating == SIGMOID
    groups, used_groups = _uint(gf, "expert_group_count", 1), _uint(gf, "expert_group_used_count", 1)
    norm = gf.get(f"{ARCH}.expert_weights_norm", False) is True
    if not sigmoid and (groups > 1 or norm):
        raise ModelLoadError(f"{gf.name}: softmax gating with expert_group_count {groups} / expert_weights_norm "
                             f"{norm}: llama.cpp ranks groups by their two best scores and renormalizes, which "
                             "neither DeepSeek-V2 routing does; flashllm runs V2 files without groups or "
                             "renormalization")
    first_moe = _uint(gf, "leading_dense_block_count", 0, maximum=layers)
    if sigmoid and first_moe < layers and f"blk.{first_moe}.exp_probs_b.bias" not in gf.tensors:
        raise ModelLoadError(f"{gf.name}: sigmoid gating without exp_probs_b (the expert choice bias DeepSeek-V3 "
                             "layers carry); the file is not a DeepSeek-V3 model flashllm runs")
    fields: dict[str, Any] = {
        "n_routed_experts": experts, "num_experts_per_tok": used, "norm_topk_prob": norm,
        "first_k_dense_replace": first_moe,
        "moe_intermediate_size": _uint(gf, "expert_feed_forward_length"),
        "n_shared_experts": _uint(gf, "expert_shared_count", 0, maximum=MAX_EXPERTS),
        "routed_scaling_factor": _float(gf, "expert_weights_scale", 0.0) or 1.0, "sigmoid": sigmoid,
    }
    if sigmoid:
        fields.update(topk_method="noaux_tc", scoring_func="sigmoid", n_group=groups, topk_group=used_groups)
    else:
        fields.update(topk_method="greedy", scoring_func="softmax")
    return fields


def _yarn(gf: GGUFFile, generic: dict[str, Any] | None) -> dict[str, Any] | None:
    """The file's yarn rope_scaling (config.py's, from the rope.scaling.* keys) as transformers' DeepSeek YaRN runs
    what llama.cpp's graph does: mscale == mscale_all_dim from yarn_log_multiplier, cos / sin unscaled."""
    if generic is None:
        return None
    if generic.get("rope_type") != "yarn":
        raise ModelLoadError(f"{gf.name}: {ARCH}.rope.scaling.type {generic.get('rope_type')!r} is not supported; "
                             "DeepSeek files use yarn or none")
    mscale = _float(gf, "rope.scaling.yarn_log_multiplier", 0.0) / 0.1  # the converter wrote 0.1 x mscale_all_dim
    return {**generic, "mscale": mscale, "mscale_all_dim": mscale, "attention_factor": 1.0}
