"""dots.llm1 (`Dots1ForCausalLM`: rednote-hilab/dots.llm1.base / .inst): Qwen3's attention (per-head q / k RMSNorms
before RoPE, q, k, v and o biased together where `attention_bias` says, sliding windows by `layer_types` or from
`max_window_layers` on) over DeepSeek-V3's mixture of experts (sigmoid scores, `e_score_correction_bias` choosing
only, group-limited top-k, weights renormalized where `norm_topk_prob`, scaled by `routed_scaling_factor`, shared
experts beside them); the first `first_k_dense_replace` layers keep a dense MLP. As transformers' Dots1 computes it,
the routing is always that: `topk_method` and `scoring_func` in config.json are not read, nor is
`use_sliding_window`."""

from __future__ import annotations

import dataclasses
from typing import Any

from flashllm.models.deepseek_config import GLM4_MOE, grouped_routing
from flashllm.models.deepseek_moe import SharedExpertsMoEConfig, SharedExpertsMoEForCausalLM
from flashllm.models.errors import ModelLoadError
from flashllm.models.hf_config import flag
from flashllm.models.llama_config import parse_llama_config
from flashllm.models.mixtral import check_prequantized_experts, moe_config
from flashllm.models.qwen3 import Qwen3MoeForCausalLM

# transformers' Dots1Config defaults, where config.json leaves a field out or null (the routing fields) ...
DOTS1_ROUTING_DEFAULTS: dict[str, Any] = {"first_k_dense_replace": 0, "norm_topk_prob": False, "n_group": 1,
                                          "topk_group": 1, "routed_scaling_factor": 1.0, "moe_intermediate_size": 1408,
                                          "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
# ... or out (the rest, where Llama's differ); Dots1Config has no default for these
DOTS1_DEFAULTS: dict[str, Any] = {"num_key_value_heads": 32, "sliding_window": 4096, "max_window_layers": 62}
DOTS1_REQUIRED = ("n_routed_experts", "num_experts_per_tok", "n_shared_experts")
_NOT_READ = ("topk_method", "scoring_func", "use_sliding_window")


def parse_dots1_config(raw: dict[str, Any], source: str = "config.json") -> SharedExpertsMoEConfig:
    """Validate a Dots1ForCausalLM config.json (module docstring) with transformers' Dots1Config defaults; the
    expert counts and top-k, which Dots1Config leaves unset, are required. Raises ModelLoadError (one line)."""
    for key in DOTS1_REQUIRED:
        if raw.get(key) is None:
            raise ModelLoadError(f"{source} is missing {key!r}; transformers' Dots1Config has no default for it, "
                                 "every dots.llm1 config.json sets it")
    view = {**DOTS1_DEFAULTS, **{k: v for k, v in raw.items() if k not in _NOT_READ}}
    view.update({k: v for k, v in DOTS1_ROUTING_DEFAULTS.items() if view.get(k) is None})
    base = dataclasses.replace(parse_llama_config(view, source), qk_norm=True)
    routing = grouped_routing(view, GLM4_MOE, base.num_hidden_layers, source)  # GLM-4.5's: V3's routing
    first_dense, experts = routing["first_k_dense_replace"], routing["n_routed_experts"]
    config = moe_config(
        base, SharedExpertsMoEConfig, num_experts=experts, num_experts_per_tok=routing["num_experts_per_tok"],
        moe_intermediate_size=routing["moe_intermediate_size"],
        shared_expert_intermediate_size=routing["n_shared_experts"] * routing["moe_intermediate_size"],
        norm_topk_prob=routing["norm_topk_prob"], sparse_layers=tuple(i >= first_dense for i in range(
            base.num_hidden_layers)), qkv_bias=flag(raw, "attention_bias", source),
        **{key: routing[key] for key in ("first_k_dense_replace", "n_routed_experts", "n_shared_experts",
                                         "sigmoid_scoring", "group_limited", "n_group", "topk_group",
                                         "routed_scaling_factor")},
    )
    check_prequantized_experts(config, source)
    return config


class Dots1ForCausalLM(SharedExpertsMoEForCausalLM):
    """dots.llm1: Qwen3's `self_attn.q_norm` / `k_norm`, `mlp.gate` (weight and e_score_correction_bias), per-expert
    `mlp.experts.N.gate_proj|up_proj|down_proj` (or transformers 5's stacked tensors), `mlp.shared_experts.*`; dense
    `mlp.gate_proj|up_proj|down_proj` before first_k_dense_replace."""

    attention_biases = staticmethod(Qwen3MoeForCausalLM.attention_biases)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> SharedExpertsMoEConfig:
        """config.json -> SharedExpertsMoEConfig, validated (see parse_dots1_config)."""
        return parse_dots1_config(raw, source)
