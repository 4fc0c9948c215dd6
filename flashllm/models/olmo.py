"""OLMo, first generation (`OlmoForCausalLM`: allenai/OLMo-1B-hf, OLMo-7B-hf, OLMo-7B-0424-hf / 0724-hf), as
transformers' OlmoConfig / OlmoForCausalLM read and run it: Llama's pre-norm stack (GQA attention, RoPE, SwiGLU MLP)
whose norms are LayerNorms with neither a scale nor a shift (transformers' OlmoLayerNorm: fp32, eps fixed at 1e-5,
whatever config.json says), `clip_qkv` clamping q, k and v to [-clip_qkv, clip_qkv] before RoPE where set, biases on
the q / k / v and output projections where `attention_bias`, none on the MLP; the LM head tied where
`tie_word_embeddings` (OLMo-1B-hf). OLMo 2 / 3 (post-norms, q / k norms) live in olmo2.py.

The norms hold no tensors, so the stack is not Llama's standard block: the model takes the per-op path (the plain LM
head's fused path stays offered)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import Tensor

from flashllm.models.hf_config import positive_float
from flashllm.models.layers.attention import split_heads
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.norm import LayerNorm
from flashllm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
from flashllm.models.olmo2 import refuse_prequantized

# transformers' OlmoConfig defaults (OLMo-7B's shape) where config.json leaves a field out (Llama's differ)
OLMO_DEFAULTS: dict[str, Any] = {
    "vocab_size": 50304, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "max_position_embeddings": 2048, "bos_token_id": None, "eos_token_id": 50279,
    "tie_word_embeddings": False, "attention_bias": False, "clip_qkv": None,
}
OLMO_NORM_EPS = 1e-5  # OlmoLayerNorm's, not read from config.json


@dataclass(frozen=True, slots=True)
class OlmoModelConfig(LlamaModelConfig):
    """LlamaModelConfig of an OLMo config.json (rms_norm_eps holds the norms' fixed 1e-5), plus clip_qkv: the bound
    q, k and v are clamped to (None: no clamp)."""

    clip_qkv: float | None = None


def parse_olmo_config(raw: dict[str, Any], source: str = "config.json") -> OlmoModelConfig:
    """config.json -> OlmoModelConfig with OlmoConfig's defaults for omitted fields; the MLP has no bias and the
    attention no sliding window (OLMo has neither), the activation must be silu. A pre-quantized checkpoint is refused
    (quantize at load with --quant_type). Raises ModelLoadError (one line)."""
    refuse_prequantized(raw, source)
    given = {**OLMO_DEFAULTS, **raw}
    clip = positive_float(given, "clip_qkv", None, source)  # transformers clamps whenever it is not null
    view = given | {"rms_norm_eps": OLMO_NORM_EPS, "mlp_bias": False, "sliding_window": None}
    base = parse_llama_config(view, source)
    return OlmoModelConfig(**{f.name: getattr(base, f.name) for f in fields(LlamaModelConfig)} | {"raw": raw},
                           clip_qkv=clip)


class OlmoAttention(LlamaAttention):
    """LlamaAttention with q, k and v clamped to [-clip_qkv, clip_qkv] before RoPE where config.clip_qkv is set
    (elementwise, so each tensor-parallel rank clamps its own heads)."""

    def __init__(self, config: OlmoModelConfig, *args: Any) -> None:
        super().__init__(config, *args)
        self.clip_qkv = config.clip_qkv

    def forward(self, positions: Tensor, hidden: Tensor, kv_cache: tuple[Tensor, Tensor],
                attn_metadata: AttentionMetadata) -> Tensor:
        """positions (T,), hidden (T, hidden) -> (T, hidden)."""
        qkv = self.qkv_proj(hidden)  # (T, (heads + 2 x kv heads) x head_dim) on this rank
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q, k, v = split_heads(qkv, self.num_heads, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


def unit_layer_norm(config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device) -> LayerNorm:
    """A LayerNorm with neither scale nor shift over hidden_size (OlmoLayerNorm)."""
    return LayerNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device, bias=False, weight=False)


class OlmoModel(LlamaModel):
    """Llama's stack with OLMo's attention and every norm (each layer's two and the final one) a LayerNorm without
    parameters."""

    attention_class: ClassVar[type[LlamaAttention]] = OlmoAttention

    def __init__(self, config: OlmoModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 qkv_bias: bool, o_bias: bool, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, ops, dtype, device, qkv_bias, o_bias, tp_rank, tp_size)
        for layer in self.layers:
            layer.input_layernorm = unit_layer_norm(config, ops, dtype, device)
            layer.post_attention_layernorm = unit_layer_norm(config, ops, dtype, device)
        self.norm = unit_layer_norm(config, ops, dtype, device)


class OlmoForCausalLM(LlamaForCausalLM):
    """OLMo (module docstring): Llama's checkpoint names, with no norm tensors."""

    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()
    required_ops: ClassVar[tuple[str, ...]] = ("layer_norm",)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> OlmoModelConfig:
        """config.json -> OlmoModelConfig (parse_olmo_config)."""
        return parse_olmo_config(raw, source)

    def build_stack(self, config: OlmoModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> OlmoModel:
        """OLMo's stack of parameter-free LayerNorms."""
        return OlmoModel(config, ops, dtype, device, qkv_bias, o_bias, tp_rank, tp_size)
