"""Nemotron (`NemotronForCausalLM`: nvidia/Minitron-4B / 8B, Nemotron-Mini-4B-Instruct, Nemotron-4-340B): StarCoder 2's
pre-norm block of LayerNorms with Llama's attention, where each LayerNorm scales by 1 + w (the checkpoint holds the
offset w from 1, transformers' NemotronLayerNorm1P), the MLP is ungated with a squared ReLU (`hidden_act` "relu2";
`up_proj` / `down_proj`), and RoPE turns the first `partial_rotary_factor` (default 0.5) of each head. The stack is
not Llama's, so the model takes the per-op path."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from flashllm.models.layers.linear import plus_one_weight_loader
from flashllm.models.layers.mlp import PLAIN_ACTIVATIONS
from flashllm.models.layers.norm import LayerNorm
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
from flashllm.models.olmo2 import refuse_prequantized
from flashllm.models.starcoder2 import Starcoder2ForCausalLM, Starcoder2Model

# transformers' NemotronConfig defaults where config.json leaves a field out (Llama's differ)
NEMOTRON_DEFAULTS: dict[str, Any] = {"norm_eps": 1e-5, "max_position_embeddings": 4096, "hidden_act": "relu2"}
NEMOTRON_ROTARY = 0.5  # NemotronConfig's partial_rotary_factor default


class LayerNorm1P(LayerNorm):
    """LayerNorm scaling by 1 + w: the parameter holds 1 + w from loading on, added in the parameter's dtype as
    transformers adds it (so a bf16 model rounds 1 + w to bf16 as there)."""

    def __init__(self, hidden_size: int, eps: float, ops: Any, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(hidden_size, eps, ops, dtype, device)
        self.weight.weight_loader = plus_one_weight_loader


def parse_nemotron_config(raw: dict[str, Any], source: str = "config.json") -> LlamaModelConfig:
    """config.json -> LlamaModelConfig: `norm_eps` as the norms' eps, RoPE over half of each head unless
    `partial_rotary_factor` says otherwise, an ungated activation; a pre-quantized checkpoint is refused (quantize at
    load with --quant_type). Raises ModelLoadError (one line)."""
    refuse_prequantized(raw, source)
    fields = {**NEMOTRON_DEFAULTS, **{key: value for key, value in raw.items() if value is not None}}
    fields["rms_norm_eps"] = fields["norm_eps"]
    activations = ("relu2", *(name for name in PLAIN_ACTIVATIONS if name != "relu2"))
    return parse_llama_config(fields, source, rotary_default=NEMOTRON_ROTARY, activations=activations)


class NemotronModel(Starcoder2Model):
    """StarCoder 2's stack with 1 + w LayerNorms."""

    norm_class = LayerNorm1P


class NemotronForCausalLM(Starcoder2ForCausalLM):
    """Nemotron (module docstring): Llama's checkpoint names without `mlp.gate_proj`; biases where config.json's
    `attention_bias` / `mlp_bias` say, and on every LayerNorm."""

    renamed_modules: ClassVar[dict[str, str]] = {}

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig (parse_nemotron_config)."""
        return parse_nemotron_config(raw, source)

    def build_stack(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> NemotronModel:
        """Nemotron's stack."""
        return NemotronModel(config, ops, dtype, device, tp_rank, tp_size)
