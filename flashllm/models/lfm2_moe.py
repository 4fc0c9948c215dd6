"""LFM2-MoE (`Lfm2MoeForCausalLM`: LiquidAI/LFM2-8B-A1B), as transformers' Lfm2MoeConfig / Lfm2MoeForCausalLM read
and run it: LFM2's hybrid stack of short-convolution and attention layers (models/lfm2.py) whose first
`num_dense_layers` feed-forwards are SwiGLU MLPs of intermediate_size (taken as given: no width derivation, unlike
LFM2's) and the others sparse: a router `feed_forward.gate` scoring every expert by a sigmoid, the top
`num_experts_per_tok` chosen by score + `feed_forward.expert_bias` (where `use_expert_bias`; the bias only chooses) and
weighted by their unbiased scores, renormalized where `norm_topk_prob`, times `routed_scaling_factor`; experts
`feed_forward.experts.N.w1|w3|w2` (or transformers 5's stacked gate_up_proj / down_proj), moe_intermediate_size wide,
no shared expert. The routing is DeepSeek-V3's without groups (deepseek_moe.DeepseekMoE). Tensor parallelism splits
the heads, the convolution channels and every expert's features; expert parallelism the experts whole."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.deepseek_moe import DeepseekMoE, SharedExpertsMoEConfig
from flashllm.models.hf_config import MAX_NUM_LAYERS, ModelLoadError, flag, positive_float, positive_int
from flashllm.models.layers.moe import expert_param_target, with_fused_experts
from flashllm.models.lfm2 import Lfm2DecoderLayer, Lfm2ForCausalLM, Lfm2Model, mixer_parameters, parse_hybrid_fields
from flashllm.models.mixtral import experts_and_top_k, moe_config

# transformers' Lfm2MoeConfig defaults (LFM2-8B-A1B's shape) where config.json leaves a field out or null
LFM2_MOE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 65536, "hidden_size": 2048, "intermediate_size": 7168, "moe_intermediate_size": 1792,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 128000,
    "norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True, "rope_theta": 1e6,
    "conv_bias": False, "conv_L_cache": 3, "num_dense_layers": 2, "num_experts_per_tok": 4, "num_experts": 32,
    "use_expert_bias": True, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
}


@dataclasses.dataclass(frozen=True, slots=True)
class Lfm2MoeModelConfig(SharedExpertsMoEConfig):
    """SharedExpertsMoEConfig (sigmoid routing without groups, choice_bias = use_expert_bias, no shared experts,
    sparse_layers from num_dense_layers on) plus LFM2's hybrid layers (Lfm2ModelConfig's attention_layers, conv_bias,
    conv_kernel)."""

    attention_layers: tuple[bool, ...] = ()
    conv_bias: bool = False
    conv_kernel: int = 3

    @property
    def num_parameters(self) -> int:
        """SharedExpertsMoEConfig's count with LFM2's mixers (attention or convolution per layer) in place of
        attention in every layer."""
        attention = self.hidden_size * self.head_dim * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        every_layer = SharedExpertsMoEConfig.num_parameters.fget(self)
        return every_layer - self.num_hidden_layers * attention + mixer_parameters(self)


def parse_lfm2_moe_config(raw: dict[str, Any], source: str = "config.json") -> Lfm2MoeModelConfig:
    """config.json -> Lfm2MoeModelConfig over LFM2_MOE_DEFAULTS (module docstring), the hybrid layers read as LFM2's
    (lfm2.parse_hybrid_fields). A pre-quantized checkpoint is refused (quantize at load with --quant_type). Raises
    ModelLoadError (one line)."""
    base, fields, hybrid = parse_hybrid_fields(raw, source, LFM2_MOE_DEFAULTS, derived_ff_dim=False)
    experts, top_k = experts_and_top_k(fields, "num_experts", 32, 4, source)
    dense = fields["num_dense_layers"]
    if isinstance(dense, bool) or not isinstance(dense, int) or not 0 <= dense <= MAX_NUM_LAYERS:
        raise ModelLoadError(f"{source}: num_dense_layers={dense!r} must be a non-negative int (the leading layers "
                             "with a dense feed-forward)")
    return moe_config(
        base, Lfm2MoeModelConfig, num_experts=experts, n_routed_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=positive_int(fields, "moe_intermediate_size", None, 1 << 20, source),
        norm_topk_prob=flag(fields, "norm_topk_prob", source),
        sparse_layers=tuple(i >= dense for i in range(base.num_hidden_layers)), first_k_dense_replace=dense,
        sigmoid_scoring=True, group_limited=False, choice_bias=flag(fields, "use_expert_bias", source),
        routed_scaling_factor=positive_float(fields, "routed_scaling_factor", None, source), **hybrid)


class Lfm2MoeModel(Lfm2Model):
    """LFM2's hybrid stack with DeepseekMoE feed-forwards in the sparse layers."""

    def build_layer(self, config: Lfm2MoeModelConfig, layer_idx: int, ops: Any, dtype: torch.dtype,
                    device: torch.device, tp_rank: int, tp_size: int) -> nn.Module:
        """LFM2's layer with a sparse feed-forward where config.sparse_layers says (else its dense SwiGLU MLP)."""
        moe = DeepseekMoE(config, ops, dtype, device, tp_rank, tp_size) if config.sparse_layers[layer_idx] else None
        return Lfm2DecoderLayer(config, layer_idx, self.rotary_emb, ops, dtype, device, tp_rank, tp_size, mlp=moe)


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """LFM2-MoE (module docstring): LFM2's checkpoint names, plus `feed_forward.gate` as the router,
    `feed_forward.expert_bias` as its choice bias and the experts stacked at load into each layer's FusedMoE."""

    renamed_modules: ClassVar[dict[str, str]] = {
        ".feed_forward.expert_bias": ".mlp.gate.e_score_correction_bias", **Lfm2ForCausalLM.renamed_modules,
    }
    required_ops: ClassVar[tuple[str, ...]] = ("fused_moe",)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> Lfm2MoeModelConfig:
        """config.json -> Lfm2MoeModelConfig (parse_lfm2_moe_config)."""
        return parse_lfm2_moe_config(raw, source)

    @classmethod
    def with_expert_parallel(cls, config: Lfm2MoeModelConfig) -> Lfm2MoeModelConfig:
        """--enable-expert-parallel: the experts split whole over the ranks, the rest tensor parallel."""
        return dataclasses.replace(config, expert_parallel=True)

    def build_stack(self, config: Lfm2MoeModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> Lfm2MoeModel:
        """LFM2-MoE's hybrid stack."""
        return Lfm2MoeModel(config, ops, dtype, device, tp_rank, tp_size)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """CausalLM.load_weights, each FusedMoE counted loaded once every expert's projections arrived."""
        return with_fused_experts(self, super().load_weights(weights))

    def _param_target(self, name: str) -> tuple[str, Any]:
        """Expert tensors to their FusedMoE (before `w1` / `w3` would fuse into a dense gate_up_proj)."""
        target = expert_param_target(self.renamed(name))
        return target if target is not None else super()._param_target(name)
