"""Solar Open (`SolarOpenForCausalLM`, model_type solar_open: upstage/Solar-Open-100B), as transformers' SolarOpen
computes it: Llama's attention (q, k and v biased where `attention_bias`, o never; RoPE over every feature of each
head, no q / k norms) over GLM-4.5's mixture of experts (sigmoid scores, `e_score_correction_bias` choosing only,
group-limited top-k, weights renormalized where `norm_topk_prob`, times `routed_scaling_factor`, shared experts
beside them) in every layer: there is no dense layer. transformers' SolarOpenConfig does not read
`intermediate_size`, `first_k_dense_replace`, `use_qk_norm`, `topk_method` or `scoring_func`; neither does this.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from flashllm.models.afmoe import without_empty_shared_experts
from flashllm.models.deepseek_config import GLM4_MOE, grouped_routing
from flashllm.models.deepseek_moe import SharedExpertsMoEConfig, SharedExpertsMoEForCausalLM
from flashllm.models.errors import ModelLoadError
from flashllm.models.hf_config import MAX_NUM_LAYERS, flag, positive_int
from flashllm.models.llama_config import parse_llama_config
from flashllm.models.mixtral import check_prequantized_experts, moe_config

# transformers' SolarOpenConfig defaults, where config.json leaves a field out (the routing ones: or null)
SOLAR_OPEN_DEFAULTS: dict[str, Any] = {"vocab_size": 196608, "hidden_size": 4096, "num_hidden_layers": 48,
                                       "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                                       "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                                       "tie_word_embeddings": False}
SOLAR_OPEN_ROUTING_DEFAULTS: dict[str, Any] = {"n_routed_experts": 128, "num_experts_per_tok": 8,
                                               "n_shared_experts": 1, "moe_intermediate_size": 1280,
                                               "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
                                               "norm_topk_prob": True}
SOLAR_OPEN_ROPE_THETA = 1_000_000.0  # SolarOpenConfig.default_theta
_NOT_READ = ("intermediate_size", "first_k_dense_replace", "use_qk_norm", "topk_method", "scoring_func",
             "sliding_window", "use_sliding_window", "layer_types", "partial_rotary_factor")


def parse_solar_open_config(raw: dict[str, Any], source: str = "config.json") -> SharedExpertsMoEConfig:
    """Validate a SolarOpenForCausalLM config.json (module docstring) with transformers' SolarOpenConfig defaults.
    Raises ModelLoadError (one line naming the field)."""
    _refuse_partial_rotary(raw, source)
    if "head_dim" in raw and raw["head_dim"] is None:
        raise ModelLoadError(f"{source}: head_dim is null; transformers' SolarOpenConfig requires an int (128 where "
                             "left out)")
    view = {**SOLAR_OPEN_DEFAULTS, **{k: v for k, v in raw.items() if k not in _NOT_READ}}
    if view.get("n_routed_experts") is None:  # SolarOpenConfig's alias for it
        view["n_routed_experts"] = view.pop("num_local_experts", None)
    view.update({k: v for k, v in SOLAR_OPEN_ROUTING_DEFAULTS.items() if view.get(k) is None})
    view.update(first_k_dense_replace=0, rope_theta=view.get("rope_theta") or SOLAR_OPEN_ROPE_THETA)
    layers = positive_int(view, "num_hidden_layers", None, MAX_NUM_LAYERS, source)
    routing = grouped_routing(view, GLM4_MOE, layers, source)  # GLM-4.5's: V3's routing
    # no dense MLP: intermediate_size (which SolarOpenConfig does not have) sized as an expert's, never built
    base = parse_llama_config({**view, "intermediate_size": routing["moe_intermediate_size"]}, source)
    config = moe_config(
        base, SharedExpertsMoEConfig, num_experts=routing["n_routed_experts"],
        num_experts_per_tok=routing["num_experts_per_tok"], moe_intermediate_size=routing["moe_intermediate_size"],
        shared_expert_intermediate_size=routing["n_shared_experts"] * routing["moe_intermediate_size"],
        norm_topk_prob=routing["norm_topk_prob"], sparse_layers=(True,) * layers,
        qkv_bias=flag(raw, "attention_bias", source),
        **{key: routing[key] for key in ("first_k_dense_replace", "n_routed_experts", "n_shared_experts",
                                         "sigmoid_scoring", "group_limited", "n_group", "topk_group",
                                         "routed_scaling_factor")},
    )
    check_prequantized_experts(config, source)
    return config


def _refuse_partial_rotary(raw: dict[str, Any], source: str) -> None:
    """transformers' SolarOpen sizes its rotary table by a partial_rotary_factor in rope_parameters but rotates every
    feature with it (a shape error below 1); config.json must leave it at 1."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    for factor in (raw.get("partial_rotary_factor"), rope.get("partial_rotary_factor") if isinstance(rope, dict)
                   else None):
        if factor is not None and factor != 1:
            raise ModelLoadError(f"{source}: partial_rotary_factor={factor!r}; transformers' SolarOpen rotates every "
                                 "feature of each head, so expected 1 (or none)")


class SolarOpenForCausalLM(SharedExpertsMoEForCausalLM):
    """Solar Open (module docstring): `mlp.gate` (weight and e_score_correction_bias), per-expert
    `mlp.experts.N.gate_proj|up_proj|down_proj` (or transformers 5's stacked tensors) and `mlp.shared_experts.*` in
    every layer; Llama's attention and norm names."""

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> SharedExpertsMoEConfig:
        """config.json -> SharedExpertsMoEConfig, validated (see parse_solar_open_config)."""
        return parse_solar_open_config(raw, source)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """MixtralForCausalLM.load_weights over the checkpoint less the empty shared-expert tensors transformers
        writes where n_shared_experts is 0."""
        return super().load_weights(without_empty_shared_experts(weights))
