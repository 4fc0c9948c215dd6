"""IBM Granite 3.x mixture of experts (`GraniteMoeForCausalLM`: granite-3.0 / 3.1 1b-a400m and 3b-a800m;
`GraniteMoeSharedForCausalLM`: the same with a shared MLP beside the experts): Granite's multipliers around Mixtral's
sparse MLP in every layer (the top-k router logits softmaxed, which is the top-k of the softmax renormalized)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.granite import MULTIPLIERS, GraniteForCausalLM, GraniteModel, parse_granite_config
from flashllm.models.hf_config import ModelLoadError
from flashllm.models.layers.moe import SparseMoeBlock, expert_param_target, with_fused_experts
from flashllm.models.mixtral import MoEModelConfig, every_layer_sparse
from flashllm.models.qwen2_moe import non_negative_size

# the published checkpoints' expert and router names (transformers 5 writes experts.gate_up_proj / down_proj and
# router.weight), after block_sparse_moe -> mlp
_RENAMES = ((".mlp.input_linear.weight", ".mlp.experts.gate_up_proj"),
            (".mlp.output_linear.weight", ".mlp.experts.down_proj"),
            (".mlp.router.layer.weight", ".mlp.gate.weight"), (".mlp.router.weight", ".mlp.gate.weight"))
# Granite-MoE-Shared's ungated shared MLP: input_linear (2S, H), gate rows first, cut in two as it loads
_SHARED_IN, _SHARED_RENAMES = ".shared_mlp.input_linear.weight", ((".shared_mlp.", ".mlp.shared_expert."),
                                                                   (".output_linear.", ".down_proj."))


@dataclass(frozen=True, slots=True)
class GraniteMoeModelConfig(MoEModelConfig):
    """MoEModelConfig (every layer sparse, experts intermediate_size wide, the top-k weights renormalized) plus
    Granite's four multipliers (granite.GraniteModelConfig says what each does)."""

    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0


def parse_granitemoe_config(raw: dict[str, Any], source: str = "config.json",
                            shared_mlp: bool = False) -> GraniteMoeModelConfig:
    """Validate a GraniteMoeForCausalLM config.json: Granite's fields and multipliers (parse_granite_config),
    num_local_experts and num_experts_per_tok (transformers' defaults 8 and 2); with shared_mlp
    (GraniteMoeSharedForCausalLM) shared_intermediate_size too (default 0: no shared MLP), read into
    shared_expert_intermediate_size. Raises ModelLoadError (one line)."""
    if raw.get("quantization_config") is not None:
        arch = "GraniteMoeSharedForCausalLM" if shared_mlp else "GraniteMoeForCausalLM"
        raise ModelLoadError(f"{source}: pre-quantized {arch} checkpoints are not supported; load the "
                             "float checkpoint and pass --quant_type")
    raw = {"bos_token_id": 1, "eos_token_id": 2, **raw}  # GraniteMoeConfig's defaults where absent (null stays null)
    granite = parse_granite_config(raw, source)
    shared = non_negative_size(raw, "shared_intermediate_size", 0, source) if shared_mlp else 0
    return every_layer_sparse(granite, raw, 8, 2, source, GraniteMoeModelConfig, qkv_bias=granite.attention_bias,
                              shared_expert_intermediate_size=shared,
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
        """Granite's stack with a SparseMoeBlock as every layer's MLP (an ungated shared MLP in it where
        shared_expert_intermediate_size)."""
        def sparse(layer_idx: int) -> nn.Module:
            return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                                  config.moe_intermediate_size, True, config.shared_expert_intermediate_size, ops,
                                  dtype, device, tp_rank, tp_size, expert_parallel=config.expert_parallel,
                                  shared_expert_gated=False)

        return GraniteModel(config, ops, dtype, device, tp_rank, tp_size, make_mlp=sparse)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """GraniteForCausalLM.load_weights, each FusedMoE's stacked parameters counted loaded once complete."""
        return with_fused_experts(self, super().load_weights(self._split_shared(weights)))

    @staticmethod
    def _split_shared(weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """A shared MLP's fused input_linear (2S, H) as its gate_proj and up_proj halves (views)."""
        for name, tensor in weights:
            if name.endswith(_SHARED_IN):
                gate, up = tensor.chunk(2, dim=0)
                stem = name[: -len(_SHARED_IN)] + ".shared_mlp."
                yield stem + "gate_proj.weight", gate
                yield stem + "up_proj.weight", up
            else:
                yield name, tensor

    def _param_target(self, name: str) -> tuple[str, Any]:
        """Checkpoint name -> (parameter, shard): the MoE names renamed, then expert tensors, then the rest."""
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if ".shared_mlp." in name:
            for old, new in _SHARED_RENAMES:
                name = name.replace(old, new)
        for old, new in _RENAMES:
            if name.endswith(old):
                name = name[: -len(old)] + new
        target = expert_param_target(name)
        return target if target is not None else super()._param_target(name)


class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM):
    """Granite-MoE with a shared MLP in every layer (`shared_mlp.input_linear` (2S, H), gate rows first, and
    `shared_mlp.output_linear` (H, S)): SiLU-gated, shared_intermediate_size wide, its output added unscaled to the
    experts' before residual_multiplier, as transformers' GraniteMoeShared adds it."""

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> GraniteMoeModelConfig:
        """config.json -> GraniteMoeModelConfig with shared_intermediate_size (see parse_granitemoe_config)."""
        return parse_granitemoe_config(raw, source, shared_mlp=True)
