"""ERNIE 4.5 GGUF files (`ernie4_5`: ERNIE-4.5-0.3B; `ernie4_5-moe`: ERNIE-4.5-21B-A3B, 300B-A47B): run as
transformers' Ernie4_5ForCausalLM / Ernie4_5_MoeForCausalLM.

What llama.cpp does with them (src/models/ernie4-5.cpp, ernie4-5-moe.cpp, convert_hf_to_gguf.py's Ernie4_5Model and
Ernie4_5MoeModel):

- Attention: `attn_q` / `attn_k` / `attn_v` (the converter splits a fused qkv_proj), RoPE over the whole head in
  adjacent pairs (llama.cpp's "normal" rope; Q/K rows as in the checkpoint, which ERNIE rotates so). The graph adds
  q / k / v biases where the file has them but never an output or MLP bias, so a file with biases (use_bias, which
  no published ERNIE 4.5 has) is refused rather than run half-biased.
- MoE: layer i is MoE when i >= `leading_dense_block_count` (the checkpoint's moe_layer_start_index) and
  (i + 1) % `interleave_moe_layer_step` == 0, up to the last layer; the router `ffn_gate_inp` scores by softmax,
  the k experts are chosen by score + `exp_probs_b` (the checkpoint's moe_statics), weighted by their scores
  renormalized; the shared experts (`ffn_*_shexp`, as wide as their count times `expert_feed_forward_length`) are
  added unweighted.
- Vocabulary: ERNIE's SentencePiece model, `tokenizer.ggml.add_space_prefix` from its tokenizer_config.
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf import deepseek2
from flashllm.models.gguf.moe import MAX_EXPERTS
from flashllm.models.gguf.reader import GGUFFile

MOE_ARCH = "ernie4_5-moe"
MOE_LAYER_NAMES = {part: module for part, module in deepseek2.LAYER_NAMES.items() if part.endswith("_shexp")}
MOE_LAYER_PARAMS = deepseek2.LAYER_PARAMS  # exp_probs_b.bias -> mlp.gate.e_score_correction_bias
_BIASES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def ernie_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The Ernie4_5ForCausalLM config.json fields of an `ernie4_5` file (module docstring)."""
    return _dense_fields(gf, raw, "ernie4_5")


def ernie_moe_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The Ernie4_5_MoeForCausalLM config.json fields of an `ernie4_5-moe` file (module docstring)."""
    layers = raw["num_hidden_layers"]
    experts = deepseek2.uint_meta(gf, MOE_ARCH, "expert_count", maximum=MAX_EXPERTS)
    inter = deepseek2.uint_meta(gf, MOE_ARCH, "expert_feed_forward_length")
    start = deepseek2.uint_meta(gf, MOE_ARCH, "leading_dense_block_count", 0, maximum=layers - 1)
    step = deepseek2.uint_meta(gf, MOE_ARCH, "interleave_moe_layer_step", 1, maximum=layers) or 1
    first = next((i for i in range(start, layers) if (i + 1) % step == 0), start)
    shared = gf.tensors.get(f"blk.{first}.ffn_gate_shexp.weight")
    width = int(shared.shape[1]) if shared is not None and len(shared.shape) == 2 else 0
    if inter == 0 or width % inter:
        raise ModelLoadError(f"{gf.name}: the shared experts' {width} features are not a whole number of "
                             f"{MOE_ARCH}.expert_feed_forward_length {inter}; the file is inconsistent")
    return {
        **_dense_fields(gf, raw, MOE_ARCH), "moe_num_experts": experts,
        "moe_k": deepseek2.uint_meta(gf, MOE_ARCH, "expert_used_count", maximum=experts),
        "moe_intermediate_size": inter, "moe_num_shared_experts": width // inter, "moe_layer_start_index": start,
        "moe_layer_interval": step, "moe_layer_end_index": -1, "intermediate_size": raw["intermediate_size"] or inter,
    }


def _dense_fields(gf: GGUFFile, raw: dict[str, Any], arch: str) -> dict[str, Any]:
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]  # rope over all of it
    biased = [f"blk.0.{part}.bias" for part in _BIASES if f"blk.0.{part}.bias" in gf.tensors]
    if biased:
        raise ModelLoadError(f"{gf.name} holds {biased[0]}: llama.cpp's {arch} graph adds q / k / v biases but no "
                             "output or MLP ones, which ERNIE's use_bias would; flashllm runs ERNIE files without "
                             "biases (as every published one is)")
    return {"head_dim": head_dim, "use_bias": False}
