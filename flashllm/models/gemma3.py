"""Gemma 3 text decoder (Gemma3ForCausalLM, gemma-3-1b): Llama's projections with Gemma's sandwich norms of
(1 + weight), a GeGLU MLP, a scaled embedding, and sliding-window layers with their own RoPE base. Gemma 2
(Gemma2ForCausalLM) is that block without q / k norms and with capped scores; Gemma 1 (GemmaForCausalLM) is Llama's
pre-norm block with Gemma's norms, MLP and embedding."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.gemma3_config import (
    Gemma3ModelConfig,
    parse_gemma2_config,
    parse_gemma3_config,
    parse_gemma_config,
)
from flashllm.models.layers.attention import Attention
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.block import PreNormBlock
from flashllm.models.layers.embedding import LMHead, VocabEmbedding
from flashllm.models.layers.linear import plus_one_weight_loader
from flashllm.models.layers.mlp import GatedMLP
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import HiddenTaps, LlamaAttention, LlamaForCausalLM, run_decoder_stack
from flashllm.registry.fusions import LM_HEAD, LMHeadFusion


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + w), all in fp32, then cast to x.dtype (transformers' Gemma3RMSNorm).

    The checkpoint stores w, the offset from 1; the fp32 `weight` parameter holds 1 + w from loading on, so
    ops.rms_norm over fp32 rows (its plain `x * weight`) computes Gemma's norm. With `residual`, x + residual
    is formed in x.dtype first (the residual stream's rounding) and (normed, x + residual) returned, as RMSNorm.
    """

    def __init__(self, hidden_size: int, eps: float, ops: Any, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self._rms_norm = ops.rms_norm
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32, device=device), requires_grad=False)
        self.weight.weight_loader = plus_one_weight_loader

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """x (T, H) -> normed (T, H) in x.dtype; with residual (T, H): (norm(x + residual), x + residual)."""
        if residual is not None:
            x = x + residual
        normed = self._rms_norm(x.float(), self.weight, self.eps).to(x.dtype)
        return normed if residual is None else (normed, x)


class ScaledVocabEmbedding(VocabEmbedding):
    """The embedding rows times sqrt(hidden_size), that factor rounded to the model dtype first (as transformers'
    Gemma3TextScaledWordEmbedding does: sqrt(1152) is 34.0 in bf16). The tied LM head reads the unscaled table."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(num_embeddings, embedding_dim, dtype, device, tp_rank, tp_size)
        self.normalizer = float(torch.tensor(embedding_dim**0.5, dtype=dtype))

    def forward(self, input_ids: Tensor) -> Tensor:
        """input_ids (T,) int64 -> (T, hidden) in the weight dtype."""
        return super().forward(input_ids) * self.normalizer


class GeGLUMLP(GatedMLP):
    """down_proj(gelu(gate_proj(x), approximate) * up_proj(x)) through ops.gelu_and_mul."""

    def __init__(self, hidden_size: int, intermediate_size: int, approximate: str, ops: Any, dtype: torch.dtype,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(hidden_size, intermediate_size, False, ops, dtype, device, tp_rank, tp_size)
        self.approximate = approximate
        self._gelu_and_mul = ops.gelu_and_mul

    def forward(self, x: Tensor) -> Tensor:
        """x (T, hidden) -> (T, hidden)."""
        return self.down_proj(self._gelu_and_mul(self.gate_up_proj(x), approximate=self.approximate))


class Gemma3Attention(LlamaAttention):
    """LlamaAttention's qkv_proj -> per-head q / k norm -> RoPE -> paged attention -> o_proj, with Gemma's
    (1 + w) head norms, scores scaled by query_pre_attn_scalar ** -0.5 and this layer's rotary table. Gemma 2:
    no head norms, scores capped by attn_logit_softcapping."""

    def __init__(self, config: Gemma3ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        bias = config.attention_bias
        super().__init__(config, layer_idx, rotary_emb, ops, dtype, device, bias, bias, tp_rank, tp_size)
        # Llama's attention built head_dim ** -0.5 and plain RMSNorms; Gemma's differ (they hold no other state)
        self.attn = Attention(self.num_heads, self.head_dim, config.query_pre_attn_scalar**-0.5, self.num_kv_heads,
                              ops, sliding_window=config.sliding_windows[layer_idx],
                              logit_softcap=config.attn_logit_softcapping)
        if config.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, ops, device)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, ops, device)


class Gemma3DecoderLayer(nn.Module):
    """Sandwich-norm block: r += post_attention_norm(attn(input_norm(r))); r += post_feedforward_norm(
    mlp(pre_feedforward_norm(r))). Called as run_decoder_stack's layers: it takes and returns the residual
    stream r split as (hidden, residual), r = hidden + residual, so each add fuses into the next norm."""

    def __init__(self, config: Gemma3ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(config, layer_idx, rotary_emb, ops, dtype, device, tp_rank, tp_size)
        self.mlp = GeGLUMLP(config.hidden_size, config.intermediate_size, config.gelu_approximate, ops, dtype,
                            device, tp_rank, tp_size)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps, ops, device)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, ops, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, ops, device)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, ops, device)

    def forward(self, positions: Tensor, hidden: Tensor, residual: Tensor | None, kv_cache: tuple[Tensor, ...],
                attn_metadata: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """hidden (T, H), residual (T, H) or None before the first layer -> (block output, residual stream)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, kv_cache, attn_metadata))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaDecoderLayer(PreNormBlock):
    """Gemma 1's pre-norm block (PreNormBlock's forward) with Gemma's norms and GeGLU."""

    def __init__(self, config: Gemma3ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(config, layer_idx, rotary_emb, ops, dtype, device, tp_rank, tp_size)
        self.mlp = GeGLUMLP(config.hidden_size, config.intermediate_size, config.gelu_approximate, ops, dtype,
                            device, tp_rank, tp_size)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, ops, device)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, ops, device)


class Gemma3Model(nn.Module):
    """Scaled embedding, decoder layers and final norm (HF's `model.` prefix). Sliding layers rotate with
    `rotary_emb_local` (rope_local_base_freq), full layers with `rotary_emb` (rope_theta, rope_scaling)."""

    hidden_taps: HiddenTaps | None = None  # run_decoder_stack keeps tapped layers' inputs here
    layer_class: ClassVar[type[nn.Module]]  # Gemma3DecoderLayer, set below; GemmaModel's: GemmaDecoderLayer

    def __init__(self, config: Gemma3ModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.embed_tokens = ScaledVocabEmbedding(config.vocab_size, config.hidden_size, dtype, device,
                                                 tp_rank, tp_size)
        dims = (config.head_dim, config.rotary_dim, config.max_position_embeddings)
        self.rotary_emb = RotaryEmbedding(*dims, config.rope_theta, config.rope_scaling, ops, device)
        self.rotary_emb_local = RotaryEmbedding(*dims, config.local_rope_theta, config.local_rope_scaling, ops, device)
        self.layers = nn.ModuleList(
            self.layer_class(config, i, self.rotary_emb if window is None else self.rotary_emb_local, ops, dtype,
                             device, tp_rank, tp_size)
            for i, window in enumerate(config.sliding_windows)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, ops, device)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """input_ids (T,), positions (T,) -> final hidden states (T, hidden)."""
        return run_decoder_stack(self, input_ids, positions, kv_caches, attn_metadata)


Gemma3Model.layer_class = Gemma3DecoderLayer


class GemmaModel(Gemma3Model):
    """Gemma 1's stack: Gemma 3's embedding, RoPE and final norm around pre-norm layers."""

    layer_class = GemmaDecoderLayer


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model: checkpoint names as Llama's (q/k/v and gate/up fused at load) plus the four norms
    a layer and the per-head q_norm / k_norm; tied embeddings; logits capped by final_logit_softcapping where
    set."""

    required_ops: ClassVar[tuple[str, ...]] = ("gelu_and_mul",)
    attention_needs: ClassVar[tuple[str, ...]] = ("sliding window",)
    skipped_weight_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq", "rotary_emb_local.inv_freq")
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> Gemma3ModelConfig:
        """config.json -> Gemma3ModelConfig, validated (see flashllm.models.gemma3_config)."""
        return parse_gemma3_config(raw, source)

    def build_stack(self, config: Gemma3ModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> Gemma3Model:
        """Gemma's stack (its attention reads config.attention_bias for q, k, v and o alike)."""
        return Gemma3Model(config, ops, dtype, device, tp_rank, tp_size)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden (N, hidden) -> logits (N, vocab_size) in the model dtype, cap * tanh(logits / cap) where
        final_logit_softcapping sets a cap."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def fusions(self) -> dict[str, Any]:
        """LM_HEAD while the logits are not capped (compute_logits is then the plain head). Never DECODER_STACK:
        its record is Llama's block (two norms of w, SwiGLU, one rotary table, an unscaled embedding)."""
        head = self.lm_head
        if self.config.final_logit_softcapping is not None or type(head) is not LMHead:
            return {}
        return {LM_HEAD: LMHeadFusion(head.weight.data, head.qweight, head.num_embeddings, head.tp_size,
                                      tied=head.weight is self.model.embed_tokens.weight)}


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2 (gemma-2-2b / 9b / 27b): Gemma 3's sandwich-norm block without per-head q / k norms, one RoPE, and
    attention scores capped by attn_logit_softcapping (kernels whose Caps claim softcap; the cpu backend's runs the
    op's reference body for them)."""

    attention_needs: ClassVar[tuple[str, ...]] = ("sliding window", "attention score softcap")

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> Gemma3ModelConfig:
        """config.json -> Gemma3ModelConfig, validated (see flashllm.models.gemma3_config.parse_gemma2_config)."""
        return parse_gemma2_config(raw, source)


class GemmaForCausalLM(Gemma3ForCausalLM):
    """Gemma 1 (gemma-2b / 7b, CodeGemma): Llama's pre-norm block with Gemma's (1 + w) norms, GeGLU and scaled
    embedding; full attention everywhere, scores scaled by head_dim ** -0.5."""

    attention_needs: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> Gemma3ModelConfig:
        """config.json -> Gemma3ModelConfig, validated (see flashllm.models.gemma3_config.parse_gemma_config)."""
        return parse_gemma_config(raw, source)

    def build_stack(self, config: Gemma3ModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> GemmaModel:
        """Gemma 1's pre-norm stack."""
        return GemmaModel(config, ops, dtype, device, tp_rank, tp_size)
