"""Qwen3 decoder: Llama's layers with every query and key head RMS-normed before the rotary embedding;
Qwen3-MoE: the same attention over Qwen2-MoE's sparse MLP without its shared expert."""

from __future__ import annotations

import dataclasses
from typing import Any

from flashllm.models.hf_config import flag
from flashllm.models.llama import LlamaForCausalLM
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
from flashllm.models.mixtral import MoEModelConfig
from flashllm.models.qwen2_moe import Qwen2MoeForCausalLM, parse_qwen2_moe_config

QWEN3_DEFAULT_HEAD_DIM = 128  # transformers' Qwen3Config default (Qwen3-MoE's falls back to hidden / heads)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 is Llama's decoder with `self_attn.q_norm` / `self_attn.k_norm` ((head_dim,) RMSNorms of each
    query and key head, before RoPE) and an explicit `head_dim` (128 in every published size, whatever
    hidden_size / num_attention_heads gives). `attention_bias` (false in the published models) puts a bias
    on q, k, v and o alike, as for Llama; sliding windows follow `use_sliding_window` / `layer_types`."""

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig with qk_norm set (see parse_llama_config for the rest); a config
        without `head_dim` gets transformers' Qwen3 default, 128 (not hidden_size / num_attention_heads)."""
        fields = raw if "head_dim" in raw else {**raw, "head_dim": QWEN3_DEFAULT_HEAD_DIM}
        return dataclasses.replace(parse_llama_config(fields, source), qk_norm=True)


def parse_qwen3_moe_config(raw: dict[str, Any], source: str = "config.json") -> MoEModelConfig:
    """Validate a Qwen3-MoE config.json: Qwen2-MoE's fields with transformers' Qwen3-MoE defaults (128
    experts, 8 a token, moe_intermediate_size 768, norm_topk_prob false), no shared expert, q, k, v and o
    biased only with `attention_bias`, and the per-head q / k norms. Raises ModelLoadError (one line)."""
    defaults = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False}
    # Qwen3-MoE has no shared expert and no qkv_bias field: its attention_bias says what Llama's does
    fields = {**defaults, **raw, "shared_expert_intermediate_size": 0,
              "qkv_bias": flag(raw, "attention_bias", source)}
    if "num_experts" not in raw and "num_local_experts" in raw:  # transformers 5 writes the count under this name
        fields["num_experts"] = raw["num_local_experts"]
    return dataclasses.replace(parse_qwen2_moe_config(fields, source), qk_norm=True, raw=raw)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    """Qwen3-MoE: per-expert `mlp.experts.N.gate_proj|up_proj|down_proj` (or transformers 5's stacked
    tensors), router `mlp.gate`, top-k renormalized when norm_topk_prob; dense `mlp.*` layers where
    decoder_sparse_step and mlp_only_layers say; attention as Qwen3's."""

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> MoEModelConfig:
        """config.json -> MoEModelConfig, validated (see parse_qwen3_moe_config)."""
        return parse_qwen3_moe_config(raw, source)

    @staticmethod
    def attention_biases(config: MoEModelConfig) -> tuple[bool, bool]:
        """(qkv_proj has a bias, o_proj has a bias): both `attention_bias`, as in transformers' Qwen3-MoE."""
        return config.qkv_bias, config.qkv_bias
