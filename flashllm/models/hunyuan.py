"""Hunyuan dense (`HunYuanDenseV1ForCausalLM`: tencent/Hunyuan-0.5B / 1.8B / 4B / 7B-Instruct): Llama's decoder with
every query and key head RMS-normed after the rotary embedding (`query_layernorm` / `key_layernorm`), and RoPE
stretched by a fixed NTK `alpha` (the checkpoints say `"type": "dynamic", "alpha": A`; transformers reads that as a
static base of rope_theta * A ** (d / (d - 2)), not as length-dependent dynamic NTK). The norms after RoPE are not
the fused cpu decode step's, so the model takes the per-op path."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from flashllm.models.errors import ModelLoadError
from flashllm.models.hf_config import normalize_rope, positive_float
from flashllm.models.layers.attention import split_heads
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.norm import RMSNorm
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config

HUNYUAN_DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-5}  # transformers' HunYuanDenseV1Config default


def parse_hunyuan_config(raw: dict[str, Any], source: str = "config.json") -> LlamaModelConfig:
    """Llama's fields with Hunyuan's defaults, a fixed NTK alpha folded into rope_theta (module docstring); other rope
    scalings as Llama reads them. Raises ModelLoadError (one line)."""
    theta, scaling = normalize_rope(raw, source)
    fields = {**HUNYUAN_DEFAULTS, **raw}
    if scaling is not None and scaling.get("alpha") is not None:
        if scaling["rope_type"] != "dynamic":
            raise ModelLoadError(f"{source}: rope alpha with rope type {scaling['rope_type']!r}; Hunyuan's checkpoints "
                                 "pair alpha with 'dynamic' (a fixed NTK base)")
        alpha = positive_float(scaling, "alpha", None, source)
        heads = fields.get("num_attention_heads")
        head_dim = fields.get("head_dim") or (fields.get("hidden_size", 0) // heads if heads else 0)
        if not isinstance(head_dim, int) or head_dim <= 2:
            raise ModelLoadError(f"{source}: head_dim={head_dim!r}; rope alpha needs a head size above 2")
        theta = theta * alpha ** (head_dim / (head_dim - 2))
        fields = {**fields, "rope_theta": theta, "rope_scaling": None, "rope_parameters": None}
    return parse_llama_config(fields, source)


class HunyuanAttention(LlamaAttention):
    """qkv_proj -> RoPE -> per-head q / k RMSNorm -> paged attention -> o_proj."""

    def __init__(self, config: LlamaModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, qkv_bias: bool, o_bias: bool,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, layer_idx, rotary_emb, ops, dtype, device, qkv_bias, o_bias, tp_rank, tp_size)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops, dtype, device)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops, dtype, device)

    def forward(self, positions: Tensor, hidden: Tensor, kv_cache: tuple[Tensor, Tensor],
                attn_metadata: AttentionMetadata) -> Tensor:
        """positions (T,), hidden (T, hidden) -> (T, hidden)."""
        q, k, v = split_heads(self.qkv_proj(hidden), self.num_heads, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class HunyuanModel(LlamaModel):
    """Llama's stack with Hunyuan's attention in every layer."""

    attention_class = HunyuanAttention


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    """Hunyuan dense: checkpoint names as Llama's plus `self_attn.query_layernorm` / `key_layernorm`."""

    renamed_modules: ClassVar[dict[str, str]] = {".self_attn.query_layernorm.": ".self_attn.q_norm.",
                                                 ".self_attn.key_layernorm.": ".self_attn.k_norm."}

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig (parse_hunyuan_config)."""
        return parse_hunyuan_config(raw, source)

    def build_stack(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> LlamaModel:
        """Llama's stack with HunyuanAttention."""
        return HunyuanModel(config, ops, dtype, device, qkv_bias, o_bias, tp_rank, tp_size)
