"""EXAONE MoE (`ExaoneMoeForCausalLM`, LGAI-EXAONE/K-EXAONE-236B-A23B): Llama's pre-norm block with EXAONE 4.0's
attention (per-head q / k RMSNorms before RoPE; sliding-window layers by `layer_types` or `sliding_window_pattern`,
and with a sliding window only those rotate, the global layers being NoPE) over DeepSeek-V3's mixture of experts
(sigmoid scores, `e_score_correction_bias` choosing only, group-limited top-k, weights renormalized where
`norm_topk_prob`, scaled by `routed_scaling_factor`) beside `num_shared_experts` shared experts; `mlp_layer_types`
(else the first `first_k_dense_replace` layers) says which layers keep a dense MLP of `intermediate_size`. The
checkpoints' next-token-prediction weights (`mtp.*`) are skipped, as transformers skips them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from flashllm.models.deepseek_config import GLM4_MOE, grouped_routing
from flashllm.models.deepseek_moe import SharedExpertsMoEConfig, SharedExpertsMoEForCausalLM
from flashllm.models.errors import ModelLoadError
from flashllm.models.exaone4 import hybrid_layers
from flashllm.models.llama_config import parse_llama_config
from flashllm.models.mixtral import moe_config
from flashllm.models.olmo2 import refuse_prequantized
from flashllm.models.smollm3 import NoPositionEmbedding

# transformers' ExaoneMoeConfig defaults, where config.json leaves a field out (Llama's differ)
EXAONE_MOE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 16384, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
    "bos_token_id": 1, "eos_token_id": 53, "pad_token_id": 0, "sliding_window": 4096,
}
# ExaoneMoeConfig's routing defaults, under DeepSeek's names (grouped_routing reads those)
EXAONE_MOE_ROUTING: dict[str, Any] = {"first_k_dense_replace": 1, "moe_intermediate_size": 1024, "num_experts": 64,
                                      "num_experts_per_tok": 8, "num_shared_experts": 1, "norm_topk_prob": True,
                                      "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1}
MLP_LAYER_TYPES = ("dense", "sparse")  # indexed by "is sparse"


@dataclass(frozen=True, slots=True)
class ExaoneMoeModelConfig(SharedExpertsMoEConfig):
    """SharedExpertsMoEConfig plus rope_layers: per layer, whether it applies RoPE."""

    rope_layers: tuple[bool, ...] = ()


def _sparse_layers(view: dict[str, Any], layers: int, first_dense: int, source: str) -> tuple[bool, ...]:
    """Per layer, whether it is MoE: `mlp_layer_types` where written, else from first_k_dense_replace on."""
    kinds = view.get("mlp_layer_types")
    if kinds is None:
        return tuple(i >= first_dense for i in range(layers))
    if not isinstance(kinds, list) or len(kinds) != layers or any(kind not in MLP_LAYER_TYPES for kind in kinds):
        raise ModelLoadError(f"{source}: mlp_layer_types must list {layers} entries, each one of {MLP_LAYER_TYPES}")
    return tuple(kind == "sparse" for kind in kinds)


def parse_exaone_moe_config(raw: dict[str, Any], source: str = "config.json") -> ExaoneMoeModelConfig:
    """config.json -> ExaoneMoeModelConfig (module docstring), with transformers' ExaoneMoeConfig defaults. Raises
    ModelLoadError (one line); a pre-quantized checkpoint is refused (float weights only)."""
    refuse_prequantized(raw, source)
    if "sliding_window" in raw and raw["sliding_window"] is None:
        raise ModelLoadError(f"{source}: sliding_window is null; transformers' ExaoneMoeConfig requires an int (for "
                             "no sliding layers write layer_types with only full_attention entries)")
    view = {**EXAONE_MOE_DEFAULTS, **EXAONE_MOE_ROUTING, **raw}
    view, rope_layers = hybrid_layers(view, source)
    base = dataclasses.replace(parse_llama_config({**view, "attention_bias": False, "mlp_bias": False}, source),
                               qk_norm=True)
    routing = grouped_routing({**view, "n_routed_experts": view["num_experts"], "moe_layer_freq": 1,
                               "n_shared_experts": view["num_shared_experts"], "topk_method": "noaux_tc",
                               "scoring_func": "sigmoid"}, GLM4_MOE, base.num_hidden_layers, source)
    experts, shared = routing["n_routed_experts"], routing["n_shared_experts"]
    return moe_config(
        base, ExaoneMoeModelConfig, num_experts=experts, num_experts_per_tok=routing["num_experts_per_tok"],
        moe_intermediate_size=routing["moe_intermediate_size"],
        shared_expert_intermediate_size=shared * routing["moe_intermediate_size"],
        norm_topk_prob=routing["norm_topk_prob"], qkv_bias=False, rope_layers=rope_layers,
        sparse_layers=_sparse_layers(view, base.num_hidden_layers, routing["first_k_dense_replace"], source),
        **{key: routing[key] for key in ("first_k_dense_replace", "n_routed_experts", "n_shared_experts",
                                         "sigmoid_scoring", "group_limited", "n_group", "topk_group",
                                         "routed_scaling_factor")},
    )


class ExaoneMoeForCausalLM(SharedExpertsMoEForCausalLM):
    """EXAONE MoE: per-head `self_attn.q_norm` / `k_norm`, `mlp.gate` with `mlp.e_score_correction_bias` (transformers
    5: `mlp.gate.e_score_correction_bias`), per-expert `mlp.experts.N.gate_proj|up_proj|down_proj` (or stacked
    tensors), `mlp.shared_experts.*`; dense `mlp.gate_proj|up_proj|down_proj` where mlp_layer_types says."""

    attention_needs: ClassVar[tuple[str, ...]] = ("sliding window",)
    renamed_modules: ClassVar[dict[str, str]] = {".mlp.e_score_correction_bias": ".mlp.gate.e_score_correction_bias"}
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()

    def __init__(self, config: ExaoneMoeModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, ops, dtype, device, tp_rank, tp_size)
        for layer, rotates in zip(self.model.layers, config.rope_layers, strict=True):
            if not rotates:  # a global layer of a hybrid model: NoPE
                layer.self_attn.rotary_emb = NoPositionEmbedding()

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> ExaoneMoeModelConfig:
        """config.json -> ExaoneMoeModelConfig, validated (parse_exaone_moe_config)."""
        return parse_exaone_moe_config(raw, source)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """MixtralForCausalLM.load_weights over the checkpoint less its next-token-prediction (`mtp.*`) tensors."""
        return super().load_weights((name, tensor) for name, tensor in weights if not name.startswith("mtp."))
