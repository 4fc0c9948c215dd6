"""IBM Granite 3.x mixture of experts (`GraniteMoeForCausalLM`: granite-3.0 / 3.1 1b-a400m and 3b-a800m): Granite's
multipliers around Mixtral's sparse MLP in every layer (the top-k router logits softmaxed, which is the top-k of
the softmax renormalized)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.granite import MULTIPLIERS, GraniteForCausalLM, GraniteModel, parse_granite_config
from flashllm.models.hf_config import ModelLoadError
from flashllm.models.layers.moe import SparseMoeBlock, expert_param_target, with_fused_experts
from flashllm.models.mixtral import MoEModelConfig, every_layer_sparse

# the published checkpoints' expert and router names (transformers 5 writes experts.gate_up_proj / down_proj and
# router.weight), after block_sparse_moe -> mlp
_RENAMES = ((".mlp.input_linear.weight", ".mlp.experts.gate_up_proj"),
            (".mlp.output_linear.weight", ".mlp.experts.down_proj"),
            (".mlp.router.layer.weight", ".mlp.gate.weight"), (".mlp.router.weight", ".mlp.gate.weight"))


@dataclass(frozen=True, slots=True)
class GraniteMoeModelConfig(MoEModelConfig):
    """MoEModelConfig (every layer sparse, experts intermediate_size wide, the top-k weights renormalized) plus
    Granite's four multipliers (granite.GraniteModelConfig says what each does)."""

    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0


def parse_granitemoe_config(raw: dict[str, Any], source: str = "config.json") -> GraniteMoeModelConfig:
    """Validate a GraniteMoeForCausalLM config.json: Granite's fields and multipliers (parse_granite_config),
    num_local_experts and num_experts_per_tok (transformers' defaults 8 and 2). Raises ModelLoadError (one line)."""
    if raw.get("quantization_config") is not None:
        raise ModelLoadError(f"{source}: pre-quantized GraniteMoeForCausalLM checkpoints are not supported; load the "
                             "float checkpoint and pass --quant_type")
    granite = parse_granite_config(raw, source)
    return every_layer_sparse(granite, raw, 8, 2, source, GraniteMoeModelConfig, qkv_bias=granite.attention_bias,
                              **{name: getattr(granite, name) for name in MULTIPLIERS})


class GraniteMoeForCausalLM(GraniteForCausalLM):
    """Granite-MoE: `block_sparse_moe.input_linear` (E, 2I, H, gate rows first), `output_linear` (E, H, I) and
    `router.layer` (E, H) (or transformers 5's `experts.gate_up_proj` / `down_proj` / `router.weight`) load into
    each layer's SparseMoeBlock; the rest as Granite's. Float checkpoints only; no fused decoder step (Granite's
    multipliers)."""

    required_ops: ClassVar[tuple[str, ...]] = ("fused_moe",)
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> GraniteMoeModelConfig:
        """config.json -> GraniteMoeModelConfig, validated (see parse_granitemoe_config)."""
        return parse_granitemoe_config(raw, source)

    @classmethod
    def with_expert_parallel(cls, config: GraniteMoeModelConfig) -> GraniteMoeModelConfig:
        """--enable-expert-parallel: the experts split whole over the ranks (models/layers/moe.py FusedMoE)."""
        return dataclasses.replace(config, expert_parallel=True)

    def build_stack(self, config: GraniteMoeModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> GraniteModel:
        """Granite's stack with a SparseMoeBlock as every layer's MLP."""
        def sparse(layer_idx: int) -> nn.Module:
            return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                                  config.moe_intermediate_size, True, 0, ops, dtype, device, tp_rank, tp_size,
                                  expert_parallel=config.expert_parallel)

        return GraniteModel(config, ops, dtype, device, tp_rank, tp_size, make_mlp=sparse)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """GraniteForCausalLM.load_weights, each FusedMoE's stacked parameters counted loaded once complete."""
        return with_fused_experts(self, super().load_weights(weights))

    def _param_target(self, name: str) -> tuple[str, Any]:
        """Checkpoint name -> (parameter, shard): the MoE names renamed, then expert tensors, then the rest."""
        name = name.replace(".block_sparse_moe.", ".mlp.")
        for old, new in _RENAMES:
            if name.endswith(old):
                name = name[: -len(old)] + new
        target = expert_param_target(name)
        return target if target is not None else super()._param_target(name)
