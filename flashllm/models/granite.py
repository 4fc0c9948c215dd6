"""IBM Granite 3.x dense decoder (`GraniteForCausalLM`): Llama's layers with four scalars from config.json, the
embedding, each block's branch outputs, the attention scores and the logits each multiplied by one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from flashllm.models.hf_config import positive_float
from flashllm.models.layers.attention import Attention
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.embedding import LMHead, VocabEmbedding
from flashllm.models.layers.norm import RMSNorm
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import HiddenTaps, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, run_decoder_stack
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
from flashllm.registry.fusions import LM_HEAD, LMHeadFusion

# config.json field -> GraniteModelConfig field; absent or null: 1.0, transformers' GraniteConfig default (which
# makes the attention scale 1.0 too, not head_dim ** -0.5)
MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


@dataclass(frozen=True, slots=True)
class GraniteModelConfig(LlamaModelConfig):
    """LlamaModelConfig's fields (no sliding windows: transformers' Granite has none) plus Granite's scalars,
    each a finite positive float:

    embedding_multiplier: the input embeddings are multiplied by it.
    residual_multiplier: each attention and MLP output is multiplied by it before it joins the residual stream.
    attention_multiplier: the softmax scale of the attention scores (in place of head_dim ** -0.5).
    logits_scaling: the logits are divided by it.
    """

    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0


def parse_granite_config(raw: dict[str, Any], source: str = "config.json") -> GraniteModelConfig:
    """Validate a Granite config.json: Llama's fields (see parse_llama_config; a `sliding_window` is ignored, as
    transformers' Granite ignores it) and the four multipliers. Raises ModelLoadError (one line)."""
    llama = parse_llama_config({**raw, "sliding_window": None, "use_sliding_window": False}, source)
    fields = {f.name: getattr(llama, f.name) for f in dataclasses.fields(LlamaModelConfig)}
    scalars = {name: positive_float(raw, name, 1.0, source) for name in MULTIPLIERS}
    return GraniteModelConfig(**{**fields, "raw": raw}, **scalars)


class MultipliedVocabEmbedding(VocabEmbedding):
    """The embedding rows times embedding_multiplier, a Python float as transformers multiplies by (not rounded to
    the model dtype first). A tied LM head reads the unmultiplied table."""

    def __init__(self, config: GraniteModelConfig, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config.vocab_size, config.hidden_size, dtype, device, tp_rank, tp_size)
        self.multiplier = config.embedding_multiplier

    def forward(self, input_ids: Tensor) -> Tensor:
        """input_ids (T,) int64 -> (T, hidden) in the weight dtype."""
        return super().forward(input_ids) * self.multiplier


class GraniteDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block with its scores scaled by attention_multiplier and the attention and MLP outputs
    multiplied by residual_multiplier before each is added to the residual stream. That add is fused into the next
    norm (PreNormBlock), so the multiplication is explicit here, not folded into o_proj / down_proj: quantized
    weights and LoRA deltas see the checkpoint's own projections, as in transformers."""

    def __init__(self, config: GraniteModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1,
                 mlp: nn.Module | None = None) -> None:
        bias = config.attention_bias
        super().__init__(config, layer_idx, rotary_emb, ops, dtype, device, bias, bias, tp_rank, tp_size, mlp)
        attn = self.self_attn  # Llama's Attention holds no weights: only its scale differs
        attn.attn = Attention(attn.num_heads, attn.head_dim, config.attention_multiplier, attn.num_kv_heads, ops)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, positions: Tensor, hidden: Tensor, residual: Tensor | None, kv_cache: tuple[Tensor, ...],
                attn_metadata: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """hidden (T, H), residual (T, H) or None before the first layer -> (multiplied block output, residual
        stream), the stream being hidden + residual as run_decoder_stack reads it."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, attn_metadata) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden) * self.residual_multiplier, residual


class GraniteModel(nn.Module):
    """Multiplied embedding, Granite's decoder layers and final norm (HF's `model.` prefix); layer i's MLP from
    make_mlp(i) where given (Granite-MoE), else gated."""

    hidden_taps: HiddenTaps | None = None  # run_decoder_stack keeps tapped layers' inputs here

    def __init__(self, config: GraniteModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1, make_mlp: Callable[[int], nn.Module] | None = None) -> None:
        super().__init__()
        self.embed_tokens = MultipliedVocabEmbedding(config, dtype, device, tp_rank, tp_size)
        self.rotary_emb = LlamaModel.build_rotary(config, ops, device)
        self.layers = nn.ModuleList(
            GraniteDecoderLayer(config, i, self.rotary_emb, ops, dtype, device, tp_rank, tp_size,
                                None if make_mlp is None else make_mlp(i))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """input_ids (T,), positions (T,) -> final hidden states (T, hidden)."""
        return run_decoder_stack(self, input_ids, positions, kv_caches, attn_metadata)


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite 3.x dense (granite-3.0 / 3.1 / 3.2 / 3.3 2b and 8b): Llama's checkpoint names and layers, GQA, SwiGLU,
    `attention_bias` on q, k, v and o alike, tied or untied head; the four multipliers as GraniteModelConfig says."""

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> GraniteModelConfig:
        """config.json -> GraniteModelConfig, validated (see parse_granite_config)."""
        return parse_granite_config(raw, source)

    def build_stack(self, config: GraniteModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> GraniteModel:
        """Granite's stack (its layers read config.attention_bias for q, k, v and o alike)."""
        return GraniteModel(config, ops, dtype, device, tp_rank, tp_size)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden (N, hidden) -> logits (N, vocab_size) in the model dtype: the head's product / logits_scaling."""
        return self.lm_head(hidden) / self.config.logits_scaling

    def fusions(self) -> dict[str, Any]:
        """LM_HEAD with logits_scale = logits_scaling (a greedy path takes the argmax of the product, which the
        division by a power of two keeps; see LMHeadFusion). Never DECODER_STACK: its record has no multipliers."""
        head = self.lm_head
        if type(head) is not LMHead:
            return {}
        return {LM_HEAD: LMHeadFusion(head.weight.data, head.qweight, head.num_embeddings, head.tp_size,
                                      tied=head.weight is self.model.embed_tokens.weight,
                                      logits_scale=self.config.logits_scaling)}
