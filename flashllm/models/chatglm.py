"""ChatGLM2 / ChatGLM3 / GLM-4 (`ChatGLMModel` checkpoints), transformers' `GlmForCausalLM` and `Glm4ForCausalLM`
(GLM-4-0414: GLM's block with norms after attention and MLP): one GLM decoder.

A GLM block is a pre-norm Llama-style block with three differences: the checkpoint stores q, k and v
as one `query_key_value` tensor (with a bias) and gate and up as one `dense_h_to_4h` tensor; keys and
values have few heads (ChatGLM's multi-query groups); rotary embedding turns only the first half of
each head's features, in adjacent pairs (GPT-J style, `is_neox=False`). The modules here carry
ChatGLM's checkpoint names, so a ChatGLM checkpoint loads without renaming; GlmForCausalLM, which
stores the same tensors under Llama-style names, renames them on load.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.base import CausalLM
from flashllm.models.chatglm_config import GLMConfig, parse_chatglm_config, parse_glm4_config, parse_glm_config
from flashllm.models.layers.attention import Attention, split_heads
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.block import PreNormBlock
from flashllm.models.layers.embedding import LMHead, VocabEmbedding
from flashllm.models.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from flashllm.models.layers.norm import RMSNorm
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.registry.fusions import (
    DECODER_STACK,
    LM_HEAD,
    DecoderLayerWeights,
    DecoderStackFusion,
    LinearWeights,
    LMHeadFusion,
    RMSNormWeights,
    RotaryTable,
)


def _load_fused_rows(loader: Any, param: Tensor, loaded: Tensor, sizes: tuple[int, ...]) -> None:
    """Split a checkpoint tensor whose rows are the projections of `sizes`, one after the other, and hand
    each part to `loader(param, part, shard_id)` (which cuts this rank's slice of it)."""
    if loaded.dim() < 1 or loaded.shape[0] != sum(sizes):
        raise ValueError(f"the fused tensor has shape {tuple(loaded.shape)}; expected {sum(sizes)} rows "
                         f"({' + '.join(map(str, sizes))}); the checkpoint does not match its config.json")
    start = 0
    for shard_id, size in enumerate(sizes):
        loader(param, loaded.narrow(0, start, size), shard_id)
        start += size


class FusedQKVLinear(QKVParallelLinear):
    """QKVParallelLinear that also loads [q | k | v] stored as one checkpoint tensor (shard_id None)."""

    def weight_loader(self, param: Tensor, loaded_weight: Tensor, shard_id: Any = None) -> None:
        """Fused (q+2kv rows) tensors split into shards q, k, v; a single shard loads as in QKVParallelLinear."""
        if shard_id is not None:
            super().weight_loader(param, loaded_weight, shard_id)
            return
        q_rows = self.num_heads * self.tp_size * self.head_dim
        kv_rows = self.total_num_kv_heads * self.head_dim
        _load_fused_rows(super().weight_loader, param, loaded_weight, (q_rows, kv_rows, kv_rows))


class FusedGateUpLinear(MergedColumnParallelLinear):
    """MergedColumnParallelLinear that also loads [gate | up] stored as one checkpoint tensor (shard_id None)."""

    def weight_loader(self, param: Tensor, loaded_weight: Tensor, shard_id: Any = None) -> None:
        """A fused (2 * intermediate rows) tensor splits into shards gate, up; a single shard loads as usual."""
        if shard_id is not None:
            super().weight_loader(param, loaded_weight, shard_id)
            return
        _load_fused_rows(super().weight_loader, param, loaded_weight,
                         tuple(n * self.tp_size for n in self.output_sizes))


class GLMAttention(nn.Module):
    """query_key_value -> partial interleaved RoPE -> paged attention -> dense, for one layer."""

    def __init__(self, config: GLMConfig, rotary_emb: RotaryEmbedding, ops: Any, dtype: torch.dtype,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        head_dim = config.head_dim
        self.query_key_value = FusedQKVLinear(
            config.hidden_size, head_dim, config.num_attention_heads, config.num_key_value_heads,
            config.qkv_bias, ops, dtype, device, tp_rank, tp_size,
        )
        self.num_heads, self.num_kv_heads = self.query_key_value.num_heads, self.query_key_value.num_kv_heads
        self.head_dim = head_dim
        self.dense = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size,
                                       config.linear_bias, ops, dtype, device, tp_rank, tp_size)
        self.rotary_emb = rotary_emb  # one table shared by every layer
        self.attn = Attention(self.num_heads, head_dim, head_dim**-0.5, self.num_kv_heads, ops)

    def forward(self, positions: Tensor, hidden: Tensor, kv_cache: tuple[Tensor, ...],
                attn_metadata: AttentionMetadata) -> Tensor:
        """positions (T,), hidden (T, hidden) -> (T, hidden)."""
        q, k, v = split_heads(self.query_key_value(hidden), self.num_heads, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.dense(self.attn(q, k, v, kv_cache, attn_metadata))


class GLMMLP(nn.Module):
    """dense_4h_to_h(silu(gate) * up), gate and up the two halves of dense_h_to_4h's output (gate first)."""

    def __init__(self, config: GLMConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.dense_h_to_4h = FusedGateUpLinear(config.hidden_size, [inter, inter], config.linear_bias, ops,
                                               dtype, device, tp_rank, tp_size)
        self.dense_4h_to_h = RowParallelLinear(inter, config.hidden_size, config.linear_bias, ops, dtype, device,
                                               tp_rank, tp_size)
        self._silu_and_mul = ops.silu_and_mul

    def forward(self, x: Tensor) -> Tensor:
        """x (T, hidden) -> (T, hidden)."""
        return self.dense_4h_to_h(self._silu_and_mul(self.dense_h_to_4h(x)))


class GLMBlock(PreNormBlock):
    """Pre-norm block: x + attention(norm(x)), then + mlp(norm(.)); the residual add is fused in the norms."""

    def __init__(self, config: GLMConfig, rotary_emb: RotaryEmbedding, ops: Any, dtype: torch.dtype,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, ops, dtype, device)
        self.self_attention = GLMAttention(config, rotary_emb, ops, dtype, device, tp_rank, tp_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, ops, dtype, device)
        self.mlp = GLMMLP(config, ops, dtype, device, tp_rank, tp_size)

    def attend(self, positions: Tensor, hidden: Tensor, kv_cache: tuple[Tensor, ...],
               attn_metadata: AttentionMetadata) -> Tensor:
        """The block's attention under ChatGLM's checkpoint name."""
        return self.self_attention(positions, hidden, kv_cache, attn_metadata)


class Glm4Block(GLMBlock):
    """GLM-4-0414's block: x + post_attn_norm(attention(norm(x))), then + post_mlp_norm(mlp(norm(.)))."""

    def __init__(self, config: GLMConfig, rotary_emb: RotaryEmbedding, ops: Any, dtype: torch.dtype,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, rotary_emb, ops, dtype, device, tp_rank, tp_size)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)

    def attend(self, positions: Tensor, hidden: Tensor, kv_cache: tuple[Tensor, ...],
               attn_metadata: AttentionMetadata) -> Tensor:
        """GLM's attention, then the post-attention norm (before the residual add)."""
        return self.post_self_attn_layernorm(super().attend(positions, hidden, kv_cache, attn_metadata))

    def feed_forward(self, hidden: Tensor) -> Tensor:
        """GLM's MLP, then the post-MLP norm (before the residual add)."""
        return self.post_mlp_layernorm(self.mlp(hidden))


class GLMEncoder(nn.Module):
    """The blocks and the final norm (ChatGLM's `transformer.encoder`)."""

    def __init__(self, config: GLMConfig, rotary_emb: RotaryEmbedding, ops: Any, dtype: torch.dtype,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        block = Glm4Block if config.post_norms else GLMBlock
        self.layers = nn.ModuleList(block(config, rotary_emb, ops, dtype, device, tp_rank, tp_size)
                                    for _ in range(config.num_hidden_layers))
        self.final_layernorm = (RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)
                                if config.final_norm else None)

    def forward(self, positions: Tensor, hidden: Tensor, kv_caches: list[tuple[Tensor, ...]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """hidden (T, H) embeddings -> (T, H) final hidden states."""
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata)
        if self.final_layernorm is None:
            return hidden + residual
        hidden, _ = self.final_layernorm(hidden, residual)
        return hidden


class GLMEmbedding(nn.Module):
    """ChatGLM's `transformer.embedding`: the word embedding table alone."""

    def __init__(self, config: GLMConfig, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.word_embeddings = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device, tp_rank, tp_size)

    def forward(self, input_ids: Tensor) -> Tensor:
        """input_ids (T,) -> (T, hidden)."""
        return self.word_embeddings(input_ids)


class GLMTransformer(nn.Module):
    """ChatGLM's `transformer.`: embedding, the rotary table, the encoder and the output layer."""

    def __init__(self, config: GLMConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.embedding = GLMEmbedding(config, dtype, device, tp_rank, tp_size)
        self.rotary_pos_emb = RotaryEmbedding(config.head_dim, config.rotary_dim, config.max_position_embeddings,
                                              config.rope_theta, config.rope_scaling, ops, device, is_neox=False)
        self.encoder = GLMEncoder(config, self.rotary_pos_emb, ops, dtype, device, tp_rank, tp_size)
        self.output_layer = LMHead(config.vocab_size, config.hidden_size, ops, dtype, device, tp_rank, tp_size)
        if config.tie_word_embeddings:
            self.output_layer.tie_to(self.embedding.word_embeddings)


class ChatGLMForConditionalGeneration(CausalLM):
    """ChatGLM2-6B, ChatGLM3-6B and GLM-4 (`ChatGLMModel` / `ChatGLMForConditionalGeneration` in config.json).

    Checkpoint tensors load under their own names (transformer.embedding.word_embeddings,
    transformer.encoder.layers.N.{input_layernorm, self_attention.query_key_value, self_attention.dense,
    post_attention_layernorm, mlp.dense_h_to_4h, mlp.dense_4h_to_h}, transformer.encoder.final_layernorm,
    transformer.output_layer); the fused query_key_value and dense_h_to_4h tensors are split into their
    projections as they load, so tensor parallel ranks each read their own heads.

    It computes what ChatGLM's published modeling code does; in fp16/bf16 two roundings differ: its rope
    table is cast to the model dtype before the rotation (flashllm rotates in fp32), and its RMSNorm
    multiplies the weight by the fp32 normalized activations before casting (flashllm casts first, as
    transformers' Llama and GLM do). `original_rope`, `apply_query_key_layer_scaling` and
    `attention_softmax_in_fp32` change nothing here: the first is unused by that code, the other two
    cancel out or are what the attention kernels do anyway.
    """

    skipped_weight_suffixes: ClassVar[tuple[str, ...]] = ("rotary_pos_emb.inv_freq",)
    kv_scale_suffixes: ClassVar[tuple[str, ...]] = (".self_attention.k_scale", ".self_attention.v_scale")
    lm_head_weight_name: ClassVar[str] = "transformer.output_layer.weight"
    weight_only_quant: ClassVar[tuple[str, ...] | None] = ("w8a16", "w4a16")
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()  # chatglm_config refuses quantization_bit / _config
    tokenizer_files: ClassVar[tuple[str, ...] | None] = ("tokenizer.model",)  # sentencepiece, [gMASK] / sop

    def __init__(self, config: GLMConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, ops, dtype, device, tp_rank, tp_size)
        self.max_position = config.max_position_embeddings
        self.ops = ops  # the op table the layers bound; fusions() tells backends which kernels those are
        self.transformer = GLMTransformer(config, ops, dtype, device, tp_rank, tp_size)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> GLMConfig:
        """config.json -> GLMConfig, validated (see flashllm.models.chatglm_config.parse_chatglm_config)."""
        return parse_chatglm_config(raw, source)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """Hidden states of a flat batch: input_ids (T,) int64, positions (T,) int64 -> (T, hidden).

        kv_caches: one (k_cache, v_cache) per layer, each (num_blocks, block_size, num_kv_heads,
        head_dim); the tokens' K/V are written into them.
        """
        layers = self.transformer.encoder.layers
        if len(kv_caches) != len(layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(layers)} layers; "
                             "allocate one (k_cache, v_cache) pair per layer (see kv_cache_shape())")
        hidden = self.transformer.embedding(input_ids)
        return self.transformer.encoder(positions, hidden, kv_caches, attn_metadata)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden (N, hidden) -> logits (N, padded_vocab_size) in the model dtype."""
        return self.transformer.output_layer(hidden)

    def kv_cache_shape(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads on this rank, head_dim) of the paged KV cache."""
        attn = self.transformer.encoder.layers[0].self_attention
        return len(self.transformer.encoder.layers), attn.num_kv_heads, attn.head_dim

    def fusions(self) -> dict[str, Any]:
        """The fused fast paths this model offers (flashllm/registry/fusions.py), read from its loaded layers.

        LM_HEAD while compute_logits is this class's and the output layer a plain LMHead. DECODER_STACK
        while the forward is this class's, every block this file's GLMBlock with one attention geometry
        and the shared rotary table, and there is a final norm: a GLM block is then exactly the record's
        standard block, its rotary table saying that half of each head turns, in adjacent pairs.
        """
        found: dict[str, Any] = {}
        transformer = self.transformer
        head = transformer.output_layer
        if type(self).compute_logits is ChatGLMForConditionalGeneration.compute_logits and type(head) is LMHead:
            tied = head.weight is transformer.embedding.word_embeddings.weight
            found[LM_HEAD] = LMHeadFusion(head.weight.data, head.qweight, head.num_embeddings, head.tp_size, tied=tied)
        stack = self._decoder_stack()
        if stack is not None:
            found[DECODER_STACK] = stack
        return found

    def _decoder_stack(self) -> DecoderStackFusion | None:
        transformer = self.transformer
        encoder, rotary, embed = transformer.encoder, transformer.rotary_pos_emb, transformer.embedding
        layers = encoder.layers
        if not (type(self).forward is ChatGLMForConditionalGeneration.forward and type(transformer) is GLMTransformer
                and type(encoder) is GLMEncoder and type(embed) is GLMEmbedding
                and type(embed.word_embeddings) is VocabEmbedding and type(encoder.final_layernorm) is RMSNorm
                and type(rotary) is RotaryEmbedding and len(layers) > 0):
            return None
        first = layers[0].self_attention
        if not all(_standard_block(layer, first, rotary) for layer in layers):
            return None
        return DecoderStackFusion(
            layers=tuple(_layer_weights(layer) for layer in layers), num_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads, head_dim=first.head_dim, scale=first.attn.scale,
            intermediate_size=layers[0].mlp.dense_h_to_4h.output_sizes[0], activation="silu",
            rotary=RotaryTable(rotary.cos_sin_cache, rotary.rotary_dim, rotary.is_neox),
            embed_tokens=embed.word_embeddings.weight.data, embed_tp_size=embed.word_embeddings.tp_size,
            norm=RMSNormWeights.of(encoder.final_layernorm), ops=self.ops)


def _standard_block(layer: nn.Module, first: GLMAttention, rotary: RotaryEmbedding) -> bool:
    """Whether `layer` computes what DecoderLayerWeights describes, with `first`'s attention geometry and
    the shared `rotary` table (its modules are this file's classes, not subclasses)."""
    attn = getattr(layer, "self_attention", None)
    return (type(layer) is GLMBlock and type(attn) is GLMAttention and type(layer.mlp) is GLMMLP
            and type(attn.attn) is Attention and attn.rotary_emb is rotary and attn.attn.sliding_window is None
            and type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
            and (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.attn.scale)
            == (first.num_heads, first.num_kv_heads, first.head_dim, first.attn.scale))


def _layer_weights(layer: GLMBlock) -> DecoderLayerWeights:
    """One standard block's weights as the fusion record holds them (query_key_value as qkv_proj, dense as
    o_proj, dense_h_to_4h as gate_up_proj, dense_4h_to_h as down_proj)."""
    attn, mlp, linear = layer.self_attention, layer.mlp, LinearWeights.of
    norm = RMSNormWeights.of
    return DecoderLayerWeights(norm(layer.input_layernorm), norm(layer.post_attention_layernorm),
                               linear(attn.query_key_value), linear(attn.dense), linear(mlp.dense_h_to_4h),
                               linear(mlp.dense_4h_to_h), None)


# transformers' GlmForCausalLM name -> the ChatGLM name of the same tensor ({} is the layer index)
_GLM_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(pattern), target) for pattern, target in (
    (r"model\.embed_tokens\.", "transformer.embedding.word_embeddings."),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.", r"transformer.encoder.layers.\1.self_attention.dense."),
    (r"model\.layers\.(\d+)\.self_attn\.", r"transformer.encoder.layers.\1.self_attention."),
    (r"model\.layers\.(\d+)\.mlp\.gate_up_proj\.", r"transformer.encoder.layers.\1.mlp.dense_h_to_4h."),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.", r"transformer.encoder.layers.\1.mlp.dense_4h_to_h."),
    (r"model\.layers\.(\d+)\.", r"transformer.encoder.layers.\1."),
    (r"model\.norm\.", "transformer.encoder.final_layernorm."),
    (r"lm_head\.", "transformer.output_layer."),
))


class GlmForCausalLM(ChatGLMForConditionalGeneration):
    """transformers' native GLM (model_type "glm", e.g. glm-4-9b-chat-hf): ChatGLM's decoder, Llama's names.

    Its q_proj / k_proj / v_proj load as the shards of query_key_value, gate_up_proj (already fused,
    gate first) as dense_h_to_4h, o_proj as dense and down_proj as dense_4h_to_h. Error messages about
    missing tensors name the ChatGLM layout the weights are held in.
    """

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {"query_key_value": ["q_proj", "k_proj", "v_proj"]}
    skipped_weight_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    tokenizer_files: ClassVar[tuple[str, ...] | None] = ("tokenizer.json",)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> GLMConfig:
        """config.json -> GLMConfig, validated (see flashllm.models.chatglm_config.parse_glm_config)."""
        return parse_glm_config(raw, source)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Rename each transformers tensor to its ChatGLM name, then load as ChatGLM does."""
        return super().load_weights(_renamed(weights))


def _renamed(weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    for name, tensor in weights:
        for pattern, target in _GLM_RENAMES:
            if pattern.match(name):
                name = pattern.sub(target, name, count=1)
                break
        yield name, tensor


class Glm4ForCausalLM(GlmForCausalLM):
    """transformers' Glm4ForCausalLM (model_type "glm4": GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1): GlmForCausalLM's
    names and decoder, each block with post_self_attn_layernorm and post_mlp_layernorm (Glm4Block). Its blocks are
    not the fused decode step's standard block, so that step is not declared for it."""

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> GLMConfig:
        """config.json -> GLMConfig with post norms (flashllm.models.chatglm_config.parse_glm4_config)."""
        return parse_glm4_config(raw, source)
