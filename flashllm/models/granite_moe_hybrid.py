"""IBM Granite 4.0-H (`GraniteMoeHybridForCausalLM`: granite-4.0-h-small / -tiny / -micro, model_type
"granitemoehybrid"), as transformers' GraniteMoeHybridConfig / GraniteMoeHybridForCausalLM read and run it: Granite's
multipliers (embedding, residual, attention score scale, logits) around pre-norm blocks whose token mixer is, per
`layer_types` entry, the Mamba-2 mixer ("mamba") or grouped-query attention ("attention"; RoPE only where
`position_embedding_type` is "rope", none otherwise, as Granite 4.0-H's NoPE), and whose MLP is Granite-MoE-Shared's:
top-k experts (softmax of the top-k router logits) plus an always-on SiLU-gated shared MLP of
`shared_intermediate_size`, or the shared MLP alone with `num_local_experts` 0. Attention layers page their K/V; Mamba
layers keep a conv and an SSM state per sequence."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from flashllm.models.bamba import HybridCausalLM, HybridDecoderLayer, HybridModel
from flashllm.models.granite import MultipliedVocabEmbedding
from flashllm.models.granite_moe import GraniteMoeForCausalLM, GraniteMoeModelConfig, parse_granitemoe_config
from flashllm.models.hf_config import ModelLoadError
from flashllm.models.layers.mamba2 import Mamba2Sizes
from flashllm.models.layers.mlp import GatedMLP
from flashllm.models.layers.moe import SparseMoeBlock
from flashllm.models.layers.norm import RMSNorm
from flashllm.models.llama import LlamaModel
from flashllm.models.mamba2 import mixer_sizes

# transformers' GraniteMoeHybridConfig defaults, where config.json leaves a field out
GRANITE_HYBRID_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
    "shared_intermediate_size": 1024, "mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256,
    "mamba_d_head": "auto", "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True,
    "mamba_proj_bias": False, "num_local_experts": 8,
}
_NAMES = {"num_heads": "mamba_n_heads", "head_dim": "mamba_d_head", "n_groups": "mamba_n_groups",
          "state_size": "mamba_d_state", "conv_kernel": "mamba_d_conv", "use_bias": "mamba_proj_bias",
          "use_conv_bias": "mamba_conv_bias", "time_step_limit": "time_step_limit",
          "chunk_size": "mamba_chunk_size", "expand": "mamba_expand", "hidden_act": "hidden_act"}
# layer_types entries (transformers 5 remaps the legacy names) -> whether the layer attends
_LAYER_TYPES = {"mamba": False, "linear_attention": False, "attention": True, "full_attention": True}


@dataclass(frozen=True, slots=True)
class GraniteMoeHybridConfig(GraniteMoeModelConfig):
    """GraniteMoeModelConfig (num_experts 0: the shared MLP alone) plus the Mamba layers' sizes, which layers attend
    and whether attention turns queries and keys by RoPE."""

    mixer: Mamba2Sizes | None = None
    attention_layers: tuple[bool, ...] = ()
    rope: bool = False


def _attention_layers(raw: dict[str, Any], num_layers: int, source: str) -> tuple[bool, ...]:
    value = raw.get("layer_types")
    if value is None:
        return (False,) * num_layers
    if not isinstance(value, list) or len(value) != num_layers or any(t not in _LAYER_TYPES for t in value):
        raise ModelLoadError(f"{source}: layer_types={value!r} must list num_hidden_layers={num_layers} entries of "
                             "'mamba' / 'attention' (or 'linear_attention' / 'full_attention')")
    return tuple(_LAYER_TYPES[t] for t in value)


def parse_granitemoehybrid_config(raw: dict[str, Any], source: str = "config.json") -> GraniteMoeHybridConfig:
    """config.json -> GraniteMoeHybridConfig: Granite-MoE-Shared's fields (parse_granitemoe_config) over
    GRANITE_HYBRID_DEFAULTS, the mixer's from the mamba_* fields (rms_norm_eps as its gated norm's eps),
    layer_types, and position_embedding_type ("rope": RoPE; null or anything else: none, as transformers reads it).
    Raises ModelLoadError (one line)."""
    view = {**GRANITE_HYBRID_DEFAULTS, **{key: value for key, value in raw.items() if value is not None}}
    experts = view["num_local_experts"]
    dense = isinstance(experts, int) and not isinstance(experts, bool) and experts == 0
    moe = parse_granitemoe_config({**view, "num_local_experts": 1, "num_experts_per_tok": 1} if dense else view,
                                  source, shared_mlp=True)
    if moe.shared_expert_intermediate_size == 0:
        raise ModelLoadError(f"{source}: shared_intermediate_size=0; every GraniteMoeHybrid layer has a shared MLP")
    if view["mamba_d_head"] == "auto" and isinstance(view["mamba_n_heads"], int) and view["mamba_n_heads"] > 0:
        view["mamba_d_head"] = view["mamba_expand"] * moe.hidden_size // view["mamba_n_heads"]
    fields = {f.name: getattr(moe, f.name) for f in dataclasses.fields(GraniteMoeModelConfig)}
    if dense:
        fields |= {"num_experts": 0, "sparse_layers": (False,) * moe.num_hidden_layers}
    return GraniteMoeHybridConfig(**fields, mixer=mixer_sizes(view, _NAMES, moe.hidden_size, moe.rms_norm_eps, source),
                                  attention_layers=_attention_layers(view, moe.num_hidden_layers, source),
                                  rope=view.get("position_embedding_type") == "rope")


class NoRotary(nn.Module):
    """The rotary embedding of attention without positions in it (NoPE): queries and keys pass unturned."""

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """positions (T,), q, k -> q, k."""
        return q, k


class SharedMLPOnly(nn.Module):
    """A layer without experts: the shared MLP alone, under SparseMoeBlock's `shared_expert` name."""

    def __init__(self, shared_expert: GatedMLP) -> None:
        super().__init__()
        self.shared_expert = shared_expert

    def forward(self, x: Tensor) -> Tensor:
        """x (T, hidden) -> (T, hidden)."""
        return self.shared_expert(x)


class GraniteMoeHybridForCausalLM(HybridCausalLM, GraniteMoeForCausalLM):
    """Granite 4.0-H (module docstring): Granite-MoE-Shared's loading (experts, router, the shared MLP's input_linear
    cut into gate and up) with `mamba.*` into each Mamba layer's mixer; the logits divided by logits_scaling."""

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> GraniteMoeHybridConfig:
        """config.json -> GraniteMoeHybridConfig (parse_granitemoehybrid_config)."""
        return parse_granitemoehybrid_config(raw, source)

    @classmethod
    def with_expert_parallel(cls, config: GraniteMoeHybridConfig) -> GraniteMoeHybridConfig:
        """--enable-expert-parallel: refused for the dense variant, which has no experts to place."""
        if config.num_experts == 0:
            raise ModelLoadError("this GraniteMoeHybrid checkpoint has no experts (num_local_experts 0); drop "
                                 "--enable-expert-parallel")
        return super().with_expert_parallel(config)

    def build_stack(self, config: GraniteMoeHybridConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> HybridModel:
        """Granite's multiplied embedding, the hybrid layers with Granite-MoE-Shared's MLPs, the final norm."""
        rotary = LlamaModel.build_rotary(config, ops, device) if config.rope else NoRotary()

        def mlp() -> nn.Module:
            if config.num_experts == 0:
                return SharedMLPOnly(GatedMLP(config.hidden_size, config.shared_expert_intermediate_size, False, ops,
                                              dtype, device, tp_rank, tp_size))
            return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                                  config.moe_intermediate_size, True, config.shared_expert_intermediate_size, ops,
                                  dtype, device, tp_rank, tp_size, expert_parallel=config.expert_parallel,
                                  shared_expert_gated=False)

        layers = [HybridDecoderLayer(config, None if config.attention_layers[i] else config.mixer, i, rotary, mlp(),
                                     ops, dtype, device, tp_rank, tp_size, config.residual_multiplier,
                                     config.attention_multiplier)
                  for i in range(config.num_hidden_layers)]
        return HybridModel(MultipliedVocabEmbedding(config, dtype, device, tp_rank, tp_size), layers,
                           RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device))
