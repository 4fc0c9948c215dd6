"""Ministral 3 (`Ministral3ForCausalLM`; the language model of Ministral-3 3B / 8B / 14B, served text-only through
`Mistral3ForConditionalGeneration`): Mistral's decoder with YaRN and one more rope field, `llama_4_scaling_beta`:
after RoPE every query is scaled by 1 + beta * ln(1 + floor(position / original_max_position_embeddings)), which is
1 within the original context and grows in steps past it, as transformers' Ministral3Attention scales them (the
factor rounded to the activation dtype, then multiplied in). The attention is not Llama's, so the model takes the
per-op path."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from flashllm.models.errors import ModelLoadError
from flashllm.models.hf_config import positive_float
from flashllm.models.layers.attention import split_heads
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import LlamaAttention, LlamaModel
from flashllm.models.llama_config import LlamaModelConfig
from flashllm.models.mistral import MistralForCausalLM

# transformers' Ministral3Config defaults where config.json leaves a field out
MINISTRAL3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 34,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-5, "sliding_window": None, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 11,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                        "original_max_position_embeddings": 16384, "beta_fast": 32.0, "beta_slow": 1.0,
                        "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1},
}


def query_scaling(config: LlamaModelConfig, source: str) -> tuple[float, int]:
    """(beta, original context) of the rope settings' `llama_4_scaling_beta`; ModelLoadError (one line) without it."""
    scaling = config.rope_scaling or {}
    if scaling.get("llama_4_scaling_beta") is None or scaling.get("original_max_position_embeddings") is None:
        raise ModelLoadError(f"{source}: Ministral 3's rope settings need llama_4_scaling_beta and "
                             "original_max_position_embeddings (the query scaling past the original context)")
    beta = positive_float(scaling, "llama_4_scaling_beta", None, source)
    return beta, int(scaling["original_max_position_embeddings"])


class Ministral3Attention(LlamaAttention):
    """LlamaAttention whose queries are scaled by position after RoPE (module docstring)."""

    def __init__(self, config: LlamaModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, qkv_bias: bool, o_bias: bool,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, layer_idx, rotary_emb, ops, dtype, device, qkv_bias, o_bias, tp_rank, tp_size)
        self.beta, self.original = query_scaling(config, "config.json")

    def forward(self, positions: Tensor, hidden: Tensor, kv_cache: tuple[Tensor, Tensor],
                attn_metadata: AttentionMetadata) -> Tensor:
        """positions (T,), hidden (T, hidden) -> (T, hidden)."""
        q, k, v = split_heads(self.qkv_proj(hidden), self.num_heads, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        scale = 1 + self.beta * torch.log1p(torch.floor(positions.float() / self.original))
        q = q * scale.to(q.dtype)[:, None, None]
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class Ministral3Model(LlamaModel):
    """Llama's stack with Ministral 3's attention in every layer."""

    attention_class = Ministral3Attention


class Ministral3ForCausalLM(MistralForCausalLM):
    """Ministral 3's language model: Mistral's checkpoint names and window rule, Ministral3Config's defaults."""

    attention_needs: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json over Ministral3Config's defaults -> LlamaModelConfig (its window null unless given)."""
        fields = {**MINISTRAL3_DEFAULTS, **{key: value for key, value in raw.items()
                                            if value is not None or key == "sliding_window"}}
        if "rope_parameters" not in raw and raw.get("rope_scaling") is not None:
            fields.pop("rope_parameters")  # the legacy layout names its own rope
        config = super().parse_config(fields, source)
        query_scaling(config, source)
        return config

    def build_stack(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> LlamaModel:
        """Llama's stack with the position-scaled queries."""
        return Ministral3Model(config, ops, dtype, device, qkv_bias, o_bias, tp_rank, tp_size)
