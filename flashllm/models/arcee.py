"""Arcee (`ArceeForCausalLM`, arcee-ai/AFM-4.5B): Llama's decoder with an ungated MLP, `down_proj(relu(up_proj(x))²)`
(`hidden_act` "relu2"; no gate_proj), YaRN-scaled RoPE in the published checkpoints. The MLP is not the fused cpu
decode step's gated one, so the model takes the per-op path."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from flashllm.models.layers.mlp import PLAIN_ACTIVATIONS, PlainMLP
from flashllm.models.llama import LlamaForCausalLM, LlamaModel
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
from flashllm.models.olmo2 import refuse_prequantized

# transformers' ArceeConfig defaults where config.json leaves a field out (Llama's differ)
ARCEE_DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096}


class ArceeModel(LlamaModel):
    """Llama's stack with the ungated MLP in every layer."""

    @staticmethod
    def build_mlp(config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device, tp_rank: int,
                  tp_size: int) -> nn.Module:
        """up_proj -> hidden_act -> down_proj (PlainMLP)."""
        return PlainMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, config.hidden_act, ops, dtype,
                        device, tp_rank, tp_size)


class ArceeForCausalLM(LlamaForCausalLM):
    """Arcee: Llama's checkpoint names without `mlp.gate_proj` (up / down load unfused)."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """Llama's config.json fields with an ungated activation ("relu2" by default, as transformers' ArceeConfig); a
        pre-quantized checkpoint is refused (float weights only: quantize at load with --quant_type)."""
        refuse_prequantized(raw, source)
        fields = {**ARCEE_DEFAULTS, **raw}
        return parse_llama_config(fields, source, activations=("relu2", *(a for a in PLAIN_ACTIVATIONS if a != "relu2")))

    def build_stack(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> LlamaModel:
        """Llama's stack with the ungated MLP."""
        return ArceeModel(config, ops, dtype, device, qkv_bias, o_bias, tp_rank, tp_size)
