"""GLM-4.5 / GLM-4.6 (transformers' Glm4MoeForCausalLM): grouped-query attention with biased q, k, v, optional
per-head q / k norms and RoPE over the first half of each head, over DeepSeek-V3's mixture of experts (sigmoid
scores, a correction bias that only chooses, group-limited top-k, shared experts); the first
first_k_dense_replace layers keep a dense MLP."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from flashllm.models.deepseek_config import GLM4_MOE, grouped_routing
from flashllm.models.deepseek_moe import SharedExpertsMoEConfig, SharedExpertsMoEForCausalLM, without_mtp_layers
from flashllm.models.hf_config import flag
from flashllm.models.llama_config import parse_llama_config
from flashllm.models.mixtral import check_prequantized_experts, moe_config

GLM4_MOE_ROTARY_FACTOR = 0.5  # transformers' Glm4MoeConfig default, and every published GLM-4.5 / 4.6 config's


@dataclass(frozen=True, slots=True)
class Glm4MoeModelConfig(SharedExpertsMoEConfig):
    """A GLM-4.5 config.json: layers from first_k_dense_replace on are sparse, routed as DeepSeek-V3 routes
    (sigmoid scores, the choice bias, groups)."""


def parse_glm4_moe_config(raw: dict[str, Any], source: str = "config.json") -> Glm4MoeModelConfig:
    """Validate a Glm4MoeForCausalLM config.json: Llama's fields (partial_rotary_factor 0.5 unless given, q / k
    norms where use_qk_norm, q, k and v biased where attention_bias) and DeepSeek-V3's routing fields with
    transformers' Glm4MoeConfig defaults. Raises ModelLoadError (one line naming the field)."""
    base = dataclasses.replace(parse_llama_config(raw, source, rotary_default=GLM4_MOE_ROTARY_FACTOR),
                               qk_norm=flag(raw, "use_qk_norm", source))
    routing = grouped_routing(raw, GLM4_MOE, base.num_hidden_layers, source)
    first_dense, experts = routing["first_k_dense_replace"], routing["n_routed_experts"]
    config = moe_config(
        base, Glm4MoeModelConfig, num_experts=experts, num_experts_per_tok=routing["num_experts_per_tok"],
        moe_intermediate_size=routing["moe_intermediate_size"],
        shared_expert_intermediate_size=routing["n_shared_experts"] * routing["moe_intermediate_size"],
        norm_topk_prob=routing["norm_topk_prob"],
        sparse_layers=tuple(i >= first_dense for i in range(base.num_hidden_layers)),
        qkv_bias=flag(raw, "attention_bias", source),
        **{key: routing[key] for key in ("first_k_dense_replace", "n_routed_experts", "n_shared_experts",
                                         "sigmoid_scoring", "group_limited", "n_group", "topk_group",
                                         "routed_scaling_factor")},
    )
    check_prequantized_experts(config, source)
    return config


class Glm4MoeForCausalLM(SharedExpertsMoEForCausalLM):
    """GLM-4.5 / 4.6 / 4.5-Air: `mlp.gate` (weight and e_score_correction_bias), per-expert
    `mlp.experts.N.gate_proj|up_proj|down_proj` (or transformers 5's stacked tensors), `mlp.shared_experts.*`;
    dense `mlp.gate_proj|up_proj|down_proj` before first_k_dense_replace. The next-token-prediction layer the
    checkpoints append (model.layers.{num_hidden_layers}) is skipped here; --speculate_method mtp loads it
    (glm4_moe_mtp.py)."""


    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> Glm4MoeModelConfig:
        """config.json -> Glm4MoeModelConfig, validated (see parse_glm4_moe_config)."""
        return parse_glm4_moe_config(raw, source)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """MixtralForCausalLM.load_weights over the checkpoint less its next-token-prediction layers."""
        return super().load_weights(without_mtp_layers(weights, self.config.num_hidden_layers))
