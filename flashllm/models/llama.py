"""Llama 2 / 3 / 3.1 / 3.2 decoder (and the base Qwen2 reuses): GQA attention, RoPE, SwiGLU MLP."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.base import CausalLM
from flashllm.models.layers.attention import Attention, split_heads
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.block import PreNormBlock
from flashllm.models.layers.embedding import LMHead, VocabEmbedding
from flashllm.models.layers.linear import QKVParallelLinear, RowParallelLinear
from flashllm.models.layers.mlp import GatedMLP
from flashllm.models.layers.norm import RMSNorm
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
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


class LlamaAttention(nn.Module):
    """qkv_proj -> RoPE -> paged attention -> o_proj for one layer."""

    def __init__(self, config: LlamaModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, qkv_bias: bool, o_bias: bool,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, config.num_attention_heads, config.num_key_value_heads,
            qkv_bias, ops, dtype, device, tp_rank, tp_size,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim, config.hidden_size, o_bias, ops, dtype, device,
            tp_rank, tp_size,
        )
        self.rotary_emb = rotary_emb  # one table shared by every layer
        self.attn = Attention(self.num_heads, head_dim, head_dim**-0.5, self.num_kv_heads, ops,
                              sliding_window=config.sliding_windows[layer_idx])
        # Qwen3: every query and key head RMS-normed over head_dim before the rotary embedding
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, ops, dtype, device) if config.qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, ops, dtype, device) if config.qk_norm else None

    def forward(self, positions: Tensor, hidden: Tensor, kv_cache: tuple[Tensor, Tensor],
                attn_metadata: AttentionMetadata) -> Tensor:
        """positions (T,), hidden (T, hidden) -> (T, hidden)."""
        return self.o_proj(self.attend_heads(positions, hidden, kv_cache, attn_metadata))

    def attend_heads(self, positions: Tensor, hidden: Tensor, kv_cache: tuple[Tensor, Tensor],
                     attn_metadata: AttentionMetadata) -> Tensor:
        """positions (T,), hidden (T, hidden) -> this rank's heads' outputs (T, heads x head_dim), before o_proj
        (where AFMoE gates them)."""
        q, k, v = split_heads(self.qkv_proj(hidden), self.num_heads, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        return self.attn(q, k, v, kv_cache, attn_metadata)


class LlamaDecoderLayer(PreNormBlock):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)); the residual add is fused in the norms."""

    def __init__(self, config: LlamaModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, qkv_bias: bool, o_bias: bool,
                 tp_rank: int = 0, tp_size: int = 1, mlp: nn.Module | None = None,
                 attention_class: type[LlamaAttention] = LlamaAttention) -> None:
        super().__init__()
        self.self_attn = attention_class(config, layer_idx, rotary_emb, ops, dtype, device,
                                         qkv_bias, o_bias, tp_rank, tp_size)
        # the gated MLP, or the one given (Granite-MoE's sparse block)
        self.mlp = mlp if mlp is not None else GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias,
                                                        ops, dtype, device, tp_rank, tp_size)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, ops, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, ops, dtype, device)



class HiddenTaps:
    """Which layers' inputs a decoder stack keeps during its forward, for a drafter that reads them (EAGLE-3).

    After each forward, `states` holds one (T, hidden) tensor per tapped layer, in layer order: the residual
    stream entering that layer (layer 0's is the embedding). A stack that runs run_decoder_stack declares
    `hidden_taps = None` and takes a HiddenTaps there. A fused decoder-stack path gets the stack only if it
    keeps them too (registry/fusions.py declared; the cpu backend's does, backends/cpu/decode_stack.py)."""

    def __init__(self, layers: tuple[int, ...]) -> None:
        self.layers = frozenset(layers)
        self.states: list[Tensor] = []


def run_decoder_stack(stack: nn.Module, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                      attn_metadata: AttentionMetadata) -> Tensor:
    """A pre-norm stack's forward: `stack.embed_tokens` (plus `stack.embed_positions(positions)` where the stack
    has one), then each of `stack.layers` (which take and
    return the residual stream beside the hidden states), then `stack.norm`; (T,) ids -> (T, hidden).
    With `stack.hidden_taps` set, the tapped layers' input streams are kept there (see HiddenTaps)."""
    hidden = stack.embed_tokens(input_ids)
    if getattr(stack, "embed_positions", None) is not None:  # learned absolute positions (GPT-2, StarCoder 1)
        hidden = hidden + stack.embed_positions(positions)
    residual = None
    taps: HiddenTaps | None = getattr(stack, "hidden_taps", None)
    if taps is not None:
        taps.states = []
    for index, (layer, kv_cache) in enumerate(zip(stack.layers, kv_caches, strict=True)):
        if taps is not None and index in taps.layers:
            # the layers fuse the residual add into their input norm: the stream is hidden + residual
            taps.states.append(hidden if residual is None else hidden + residual)
        hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata)
    hidden, _ = stack.norm(hidden, residual)
    return hidden


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's `model.` prefix)."""

    hidden_taps: HiddenTaps | None = None  # run_decoder_stack keeps tapped layers' inputs here
    attention_class: ClassVar[type[LlamaAttention]] = LlamaAttention  # a subclass's own (Hunyuan's)

    def __init__(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 qkv_bias: bool, o_bias: bool, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device,
                                           tp_rank, tp_size)
        self.rotary_emb = self.build_rotary(config, ops, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.rotary_emb, ops, dtype, device, qkv_bias, o_bias,
                              tp_rank, tp_size, mlp=self.build_mlp(config, ops, dtype, device, tp_rank, tp_size),
                              attention_class=self.attention_class)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)

    @staticmethod
    def build_mlp(config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device, tp_rank: int,
                  tp_size: int) -> nn.Module | None:
        """A layer's MLP; None: the gated SwiGLU one. A subclass with another MLP (Arcee's ungated relu²) returns
        its own (and takes no fused decoder-stack path, see fusions)."""
        return None

    @staticmethod
    def build_rotary(config: LlamaModelConfig, ops: Any, device: torch.device) -> RotaryEmbedding:
        """The rotary table every layer shares, from config's rope fields; a subclass with its own rope
        (Phi-3's LongRoPE) returns its own (and takes no fused decoder-stack path, see fusions)."""
        return RotaryEmbedding(config.head_dim, config.rotary_dim, config.max_position_embeddings,
                               config.rope_theta, config.rope_scaling, ops, device, is_neox=not config.rope_interleaved)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """input_ids (T,), positions (T,) -> final hidden states (T, hidden)."""
        return run_decoder_stack(self, input_ids, positions, kv_caches, attn_metadata)


class LlamaForCausalLM(CausalLM):
    """Llama decoder + LM head, with the model API the engine's model runner uses.

    Checkpoint tensors keep HF names; `packed_modules_mapping` says which HF projections are
    fused into one flashllm parameter, in shard order.
    """

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    # checkpoint tensors with no flashllm parameter (RoPE tables are rebuilt from the config)
    skipped_weight_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    # calibrated static int8/fp8 KV cache scales; optional, they live on each layer's Attention
    kv_scale_suffixes: ClassVar[tuple[str, ...]] = (".self_attn.k_scale", ".self_attn.v_scale")
    weight_only_quant: ClassVar[tuple[str, ...] | None] = ("w8a16", "w4a16")
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ("gptq", "awq", "fp8")  # llama_config parses each
    tokenizer_files: ClassVar[tuple[str, ...] | None] = ("tokenizer.json",)

    def __init__(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, ops, dtype, device, tp_rank, tp_size)
        self.max_position = config.max_position_embeddings
        self.ops = ops  # the op table the layers bound; fusions() tells backends which kernels those are
        qkv_bias, o_bias = self.attention_biases(config)
        self.model = self.build_stack(config, ops, dtype, device, qkv_bias, o_bias, tp_rank, tp_size)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, ops, dtype, device,
                              tp_rank, tp_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig, validated (see flashllm.models.llama_config)."""
        return parse_llama_config(raw, source)

    def build_stack(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> LlamaModel:
        """The decoder stack (HF's `model.` prefix): a LlamaModel; a subclass may return a LlamaModel subclass
        (which then takes no fused decoder-stack path, see fusions)."""
        return LlamaModel(config, ops, dtype, device, qkv_bias, o_bias, tp_rank, tp_size)

    @staticmethod
    def attention_biases(config: LlamaModelConfig) -> tuple[bool, bool]:
        """(qkv_proj has a bias, o_proj has a bias): Llama's `attention_bias` sets both."""
        return config.attention_bias, config.attention_bias

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """Hidden states of a flat batch.

        input_ids (T,) int64; positions (T,) int64 (< max_position); kv_caches: one
        (k_cache, v_cache) per layer, each (num_blocks, block_size, num_kv_heads, head_dim) in the
        cache dtype; returns (T, hidden) in the model dtype. Writes the tokens' K/V into the caches.
        """
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.model.layers)} layers; "
                             "allocate one (k_cache, v_cache) pair per layer (see kv_cache_shape())")
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden (N, hidden) -> logits (N, vocab_size) in the model dtype."""
        return self.lm_head(hidden)

    def fusions(self) -> dict[str, Any]:
        """The fused fast paths this model offers a backend (flashllm/registry/fusions.py), read from
        its loaded layers at each call: LM_HEAD while compute_logits is this class's, DECODER_STACK
        while the forward is this class's and every layer the standard Llama block sharing one
        rotary table and one attention geometry (a subclass that changes either declares none)."""
        found: dict[str, Any] = {}
        head = self.lm_head
        if type(self).compute_logits is LlamaForCausalLM.compute_logits and type(head) is LMHead:
            found[LM_HEAD] = LMHeadFusion(head.weight.data, head.qweight, head.num_embeddings, head.tp_size,
                                          tied=head.weight is self.model.embed_tokens.weight)
        stack = self.model
        first = stack.layers[0].self_attn if len(stack.layers) else None
        if (type(self).forward is LlamaForCausalLM.forward and type(stack) is LlamaModel and first is not None
                and type(stack.embed_tokens) is VocabEmbedding and type(stack.norm) is RMSNorm
                and all(_standard_block(layer, first, stack.rotary_emb) for layer in stack.layers)):
            rotary = stack.rotary_emb
            found[DECODER_STACK] = DecoderStackFusion(
                layers=tuple(_layer_weights(layer) for layer in stack.layers),
                num_heads=first.num_heads, num_kv_heads=first.num_kv_heads, head_dim=first.head_dim,
                scale=first.attn.scale, intermediate_size=stack.layers[0].mlp.gate_up_proj.output_sizes[0],
                activation="silu", rotary=RotaryTable(rotary.cos_sin_cache, rotary.rotary_dim, rotary.is_neox),
                embed_tokens=stack.embed_tokens.weight.data, embed_tp_size=stack.embed_tokens.tp_size,
                norm=RMSNormWeights.of(stack.norm), ops=self.ops)
        return found

    def kv_cache_shape(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads on this rank, head_dim) of the paged KV cache."""
        attn = self.model.layers[0].self_attn
        return len(self.model.layers), attn.num_kv_heads, attn.head_dim


def _standard_block(layer: nn.Module, first: LlamaAttention, rotary: RotaryEmbedding) -> bool:
    """Whether `layer` computes what DecoderLayerWeights describes, with `first`'s attention geometry
    and the shared `rotary` table (its modules are this file's classes, not subclasses)."""
    attn = getattr(layer, "self_attn", None)
    return (type(layer) is LlamaDecoderLayer and type(attn) is LlamaAttention and type(layer.mlp) is GatedMLP
            and type(attn.attn) is Attention and attn.rotary_emb is rotary and type(rotary) is RotaryEmbedding
            and type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
            and plain_head_norms(attn)
            and (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.attn.scale)
            == (first.num_heads, first.num_kv_heads, first.head_dim, first.attn.scale))


def plain_head_norms(attn: LlamaAttention) -> bool:
    """Whether the attention's q / k norms are both absent or both this package's RMSNorm."""
    if attn.q_norm is None:
        return attn.k_norm is None
    return type(attn.q_norm) is RMSNorm and type(attn.k_norm) is RMSNorm


def _layer_weights(layer: LlamaDecoderLayer) -> DecoderLayerWeights:
    """One standard block's weights (see _standard_block) as the fusion record holds them."""
    attn, mlp, linear = layer.self_attn, layer.mlp, LinearWeights.of
    norm = RMSNormWeights.of
    return DecoderLayerWeights(norm(layer.input_layernorm), norm(layer.post_attention_layernorm),
                               linear(attn.qkv_proj), linear(attn.o_proj), linear(mlp.gate_up_proj),
                               linear(mlp.down_proj), attn.attn.sliding_window, **head_norms(attn))


def head_norms(attn: LlamaAttention) -> dict[str, RMSNormWeights]:
    """The attention's per-head q / k norms as DecoderLayerWeights fields (none where it has none)."""
    if attn.q_norm is None:
        return {}
    return {"q_norm": RMSNormWeights.of(attn.q_norm), "k_norm": RMSNormWeights.of(attn.k_norm)}
