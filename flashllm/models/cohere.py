"""Cohere's decoders: `CohereForCausalLM` (Command R, Command R+, Aya Expanse) and `Cohere2ForCausalLM` (Command R7B,
Command A). Llama's projections and gated SiLU MLP in a parallel block with one norm:
x + attn(norm(x)) + mlp(norm(x)), every norm a LayerNorm without bias (fp32 math, `layer_norm_eps`).

What else differs from Llama: RoPE turns adjacent feature pairs (GPT-J style); the logits are the LM head's product
times `logit_scale`; embeddings are tied unless config.json says otherwise. Command R+ (`use_qk_norm`) LayerNorms each
query and key head over head_dim before RoPE, with one scale row per head (a rank keeps its own heads' rows).
Cohere 2 adds sliding-window layers (`layer_types`, or the legacy `sliding_window_pattern`: three sliding layers, then
a full one) and only those rotate: its full-attention layers use no positional embedding at all.

The stack is not Llama's, so no fused cpu decode step applies; the LM head's fused paths apply where `logit_scale` is
a power of two (Command R's 0.0625; not Command R+'s 5 / 6), which the division they declare keeps exact.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.cohere_config import CohereModelConfig, parse_cohere2_config, parse_cohere_config
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.block import ParallelBlock
from flashllm.models.layers.embedding import LMHead, VocabEmbedding
from flashllm.models.layers.mlp import GatedMLP
from flashllm.models.layers.norm import HeadLayerNorm, LayerNorm
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import HiddenTaps, LlamaAttention, LlamaForCausalLM, LlamaModel, run_decoder_stack
from flashllm.models.smollm3 import NoPositionEmbedding
from flashllm.registry.fusions import LM_HEAD, LMHeadFusion


class CohereAttention(LlamaAttention):
    """LlamaAttention (qkv_proj -> q / k norms -> RoPE -> paged attention -> o_proj) with Command R+'s per-head
    LayerNorms where config.use_qk_norm, and RoPE only where config.rope_layers says (Cohere 2's sliding layers)."""

    def __init__(self, config: CohereModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        bias = config.attention_bias
        super().__init__(config, layer_idx, rotary_emb, ops, dtype, device, bias, bias, tp_rank, tp_size)
        if not config.rope_layers[layer_idx]:
            self.rotary_emb = NoPositionEmbedding()
        if config.use_qk_norm:
            eps = config.rms_norm_eps
            self.q_norm = HeadLayerNorm(self.qkv_proj, "q", eps, ops, dtype, device)
            self.k_norm = HeadLayerNorm(self.qkv_proj, "k", eps, ops, dtype, device)


class CohereDecoderLayer(ParallelBlock):
    """The parallel block (ParallelBlock: (x + attn) + mlp, transformers' order of the sums) with one LayerNorm without
    bias."""

    def __init__(self, config: CohereModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.self_attn = CohereAttention(config, layer_idx, rotary_emb, ops, dtype, device, tp_rank, tp_size)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, False, ops, dtype, device, tp_rank, tp_size)
        self.input_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device, bias=False)


class CohereModel(nn.Module):
    """Embedding, Cohere's parallel layers and the final bias-free LayerNorm (HF's `model.` prefix)."""

    hidden_taps: HiddenTaps | None = None  # run_decoder_stack keeps tapped layers' inputs here

    def __init__(self, config: CohereModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device, tp_rank, tp_size)
        self.rotary_emb = LlamaModel.build_rotary(config, ops, device)  # adjacent pairs: config.rope_interleaved
        self.layers = nn.ModuleList(
            CohereDecoderLayer(config, i, self.rotary_emb, ops, dtype, device, tp_rank, tp_size)
            for i in range(config.num_hidden_layers)
        )
        self.norm = LayerNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device, bias=False)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """input_ids (T,), positions (T,) -> final hidden states (T, hidden)."""
        return run_decoder_stack(self, input_ids, positions, kv_caches, attn_metadata)


class CohereForCausalLM(LlamaForCausalLM):
    """Command R / R+, Aya Expanse (module docstring): Llama's checkpoint names (q / k / v and gate / up fused at
    load), no `post_attention_layernorm`, `self_attn.q_norm` / `k_norm` of shape (heads, head_dim) where
    use_qk_norm."""

    required_ops: ClassVar[tuple[str, ...]] = ("layer_norm",)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> CohereModelConfig:
        """config.json -> CohereModelConfig, validated (flashllm.models.cohere_config)."""
        return parse_cohere_config(raw, source)

    def build_stack(self, config: CohereModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> CohereModel:
        """Cohere's parallel-block stack (its attention reads config.attention_bias for q, k, v and o alike)."""
        return CohereModel(config, ops, dtype, device, tp_rank, tp_size)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden (N, hidden) -> logits (N, vocab_size) in the model dtype: the head's product times logit_scale."""
        return self.lm_head(hidden) * self.config.logit_scale

    def fusions(self) -> dict[str, Any]:
        """LM_HEAD with logits_scale = 1 / logit_scale where logit_scale is a power of two (dividing by its inverse
        is then exactly multiplying by it); none otherwise. Never DECODER_STACK: its record is Llama's block."""
        head, scale = self.lm_head, self.config.logit_scale
        if type(head) is not LMHead or math.frexp(scale)[0] != 0.5:
            return {}
        return {LM_HEAD: LMHeadFusion(head.weight.data, head.qweight, head.num_embeddings, head.tp_size,
                                      tied=head.weight is self.model.embed_tokens.weight, logits_scale=1.0 / scale)}


class Cohere2ForCausalLM(CohereForCausalLM):
    """Command R7B, Command A (module docstring): Cohere's layers and names, sliding-window layers with RoPE beside
    full-attention layers without it."""

    attention_needs: ClassVar[tuple[str, ...]] = ("sliding window",)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> CohereModelConfig:
        """config.json -> CohereModelConfig with Cohere 2's sliding layers, validated (parse_cohere2_config)."""
        return parse_cohere2_config(raw, source)
