"""OLMo 2 (`Olmo2ForCausalLM`, allenai/OLMo-2-*): Llama's projections with the norms moved after each branch.

A layer computes x + post_attention_norm(attn(x)), then + post_feedforward_norm(mlp(.)): no norm before attention
or the MLP. The attention RMS-normalizes the whole query projection (every head together, one weight of
num_heads x head_dim) and the whole key projection before RoPE. Those norms span every head, so a tensor-parallel
rank holding some heads cannot compute them alone: tensor parallelism is refused.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.errors import ModelLoadError
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.embedding import VocabEmbedding
from flashllm.models.layers.mlp import GatedMLP
from flashllm.models.layers.norm import RMSNorm
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import HiddenTaps, LlamaAttention, LlamaForCausalLM, LlamaModel, run_decoder_stack
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config


class Olmo2Attention(LlamaAttention):
    """LlamaAttention with q_norm / k_norm over the whole query / key projection (all heads), before RoPE."""

    def __init__(self, config: LlamaModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        if tp_size != 1:
            raise ValueError(f"{config.architecture} normalizes each token's query and key over all heads at once; "
                             "tensor parallelism (which splits the heads over ranks) is not supported for it: run "
                             "with --tensor-parallel-size 1")
        bias = config.attention_bias
        super().__init__(config, layer_idx, rotary_emb, ops, dtype, device, bias, bias, tp_rank, tp_size)
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.num_heads * self.head_dim, eps, ops, dtype, device)
        self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, eps, ops, dtype, device)

    def forward(self, positions: Tensor, hidden: Tensor, kv_cache: tuple[Tensor, Tensor],
                attn_metadata: AttentionMetadata) -> Tensor:
        """positions (T,), hidden (T, hidden) -> (T, hidden)."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.contiguous()).view(-1, self.num_heads, self.head_dim)
        k = self.k_norm(k.contiguous()).view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v.reshape(-1, self.num_kv_heads, self.head_dim), kv_cache, attn_metadata))


class Olmo2DecoderLayer(nn.Module):
    """x + post_attention_layernorm(attn(x)), then + post_feedforward_layernorm(mlp(.)). Called as
    run_decoder_stack's layers, with the residual stream split as (hidden, residual), x = hidden + residual."""

    def __init__(self, config: LlamaModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, layer_idx, rotary_emb, ops, dtype, device, tp_rank, tp_size)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, ops, dtype, device,
                            tp_rank, tp_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)

    def forward(self, positions: Tensor, hidden: Tensor, residual: Tensor | None, kv_cache: tuple[Tensor, ...],
                attn_metadata: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """hidden (T, H), residual (T, H) or None before the first layer -> (branch output, residual stream)."""
        x = hidden if residual is None else hidden + residual
        x = x + self.post_attention_layernorm(self.self_attn(positions, x, kv_cache, attn_metadata))
        return self.post_feedforward_layernorm(self.mlp(x)), x


class Olmo2Model(nn.Module):
    """Llama's embedding, rotary table and final norm around OLMo 2's post-norm layers (HF's `model.` prefix)."""

    hidden_taps: HiddenTaps | None = None  # run_decoder_stack keeps tapped layers' inputs here

    def __init__(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device, tp_rank, tp_size)
        self.rotary_emb = LlamaModel.build_rotary(config, ops, device)
        self.layers = nn.ModuleList(
            Olmo2DecoderLayer(config, i, self.rotary_emb, ops, dtype, device, tp_rank, tp_size)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """input_ids (T,), positions (T,) -> final hidden states (T, hidden)."""
        return run_decoder_stack(self, input_ids, positions, kv_caches, attn_metadata)


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2 (module docstring): Llama's checkpoint names with `self_attn.q_norm` / `k_norm` of the projections'
    widths and `post_attention_layernorm` / `post_feedforward_layernorm` in place of the pre-norms."""

    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """Llama's config.json fields; a pre-quantized checkpoint is refused (float weights only: quantize at load
        with --quant_type)."""
        if raw.get("quantization_config") is not None:
            raise ModelLoadError(f"{source}: OLMo 2 loads float checkpoints only (quantize them at load with "
                                 "--quant_type); drop quantization_config or use a float checkpoint")
        return parse_llama_config(raw, source)

    def build_stack(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> Olmo2Model:
        """OLMo 2's post-norm stack."""
        return Olmo2Model(config, ops, dtype, device, tp_rank, tp_size)
