"""Qwen1.5-MoE / Qwen2-MoE decoder: Mixtral's MoE stack with a sigmoid-gated shared expert, qkv bias,
and dense MLP layers where decoder_sparse_step and mlp_only_layers say."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from flashllm.models.hf_config import MAX_INTERMEDIATE_SIZE, MAX_NUM_LAYERS, ModelLoadError, flag, positive_int
from flashllm.models.layers.mlp import GatedMLP
from flashllm.models.llama_config import parse_llama_config
from flashllm.models.mixtral import (
    MixtralForCausalLM,
    MoEModelConfig,
    check_prequantized_experts,
    experts_and_top_k,
    moe_config,
)


def parse_qwen2_moe_config(raw: dict[str, Any], source: str = "config.json") -> MoEModelConfig:
    """Validate a Qwen2-MoE config.json: Llama's fields plus num_experts, num_experts_per_tok,
    moe_intermediate_size, shared_expert_intermediate_size (0: no shared expert), decoder_sparse_step,
    mlp_only_layers, norm_topk_prob and qkv_bias, with transformers' defaults where absent.

    Layer i is MoE when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0, else a
    dense gated MLP of intermediate_size. Raises ModelLoadError (one line naming the field).
    """
    base = parse_llama_config(raw, source)
    num_experts, top_k = experts_and_top_k(raw, "num_experts", 60, 4, source)
    step = positive_int(raw, "decoder_sparse_step", 1, MAX_NUM_LAYERS, source)
    dense = _mlp_only_layers(raw, base.num_hidden_layers, source)
    if flag(raw, "use_sliding_window", source) and not isinstance(raw.get("layer_types"), list):
        # transformers 4 and 5 disagree on which Qwen2-MoE layers a window applies to without layer_types
        raise ModelLoadError(f"{source}: use_sliding_window=true without a layer_types list is ambiguous; "
                             "add layer_types (one 'sliding_attention' / 'full_attention' per layer)")
    config = moe_config(
        base,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=positive_int(raw, "moe_intermediate_size", 1408, MAX_INTERMEDIATE_SIZE, source),
        shared_expert_intermediate_size=non_negative_size(raw, "shared_expert_intermediate_size", 5632, source),
        norm_topk_prob=flag(raw, "norm_topk_prob", source),
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(base.num_hidden_layers)),
        qkv_bias=flag(raw, "qkv_bias", source) if "qkv_bias" in raw else True,
    )
    check_prequantized_experts(config, source)
    return config


def _mlp_only_layers(raw: dict[str, Any], num_layers: int, source: str) -> frozenset[int]:
    value = raw.get("mlp_only_layers") or []
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in value
    ):
        raise ModelLoadError(f"{source}: mlp_only_layers={value!r} must be a list of layer indices in "
                             f"0..{num_layers - 1}")
    return frozenset(value)


def non_negative_size(raw: dict[str, Any], key: str, default: int, source: str) -> int:
    """`raw[key]` as a feature count, 0 (none) or positive up to MAX_INTERMEDIATE_SIZE; `default` when absent."""
    value = raw.get(key, default)
    if value == 0 and not isinstance(value, bool):
        return 0
    return positive_int({key: value}, key, default, MAX_INTERMEDIATE_SIZE, source)


class Qwen2MoeForCausalLM(MixtralForCausalLM):
    """Qwen2-MoE: per-expert `mlp.experts.N.gate_proj|up_proj|down_proj`, router `mlp.gate`, shared expert
    `mlp.shared_expert.*` scaled by sigmoid(`mlp.shared_expert_gate`); dense `mlp.gate_proj|up_proj|
    down_proj` in the layers that are not sparse. Routing weights renormalized when norm_topk_prob."""

    renamed_modules: ClassVar[dict[str, str]] = {}

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> MoEModelConfig:
        """config.json -> MoEModelConfig, validated (see parse_qwen2_moe_config)."""
        return parse_qwen2_moe_config(raw, source)

    @staticmethod
    def make_mlp(config: MoEModelConfig, layer_idx: int, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int, tp_size: int) -> nn.Module:
        """The sparse MoE block (with its shared expert) where config.sparse_layers says, else a dense gated MLP."""
        if config.sparse_layers[layer_idx]:
            return MixtralForCausalLM.make_mlp(config, layer_idx, ops, dtype, device, tp_rank, tp_size)
        return GatedMLP(config.hidden_size, config.intermediate_size, False, ops, dtype, device, tp_rank, tp_size)
