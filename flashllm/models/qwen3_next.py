"""Qwen3-Next decoder (Qwen3NextForCausalLM): layers of Gated DeltaNet linear attention (layers/gated_deltanet.py,
a recurrent state per sequence) and, every full_attention_interval-th layer, gated full attention (q_proj yields
each head's query and a sigmoid output gate; (1 + w) q / k RMSNorms; RoPE over partial_rotary_factor of each head);
(1 + w) RMSNorms throughout; Qwen2-MoE's sparse MLP with a sigmoid-gated shared expert where decoder_sparse_step and
mlp_only_layers say. The checkpoints' multi-token-prediction tensors (`mtp.*`) are skipped, as transformers skips
them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.afmoe import AfmoeAttention
from flashllm.models.block_fp8 import is_block_fp8
from flashllm.models.checkpoint_tensor import materialize
from flashllm.models.gemma3 import GemmaRMSNorm
from flashllm.models.hf_config import (
    MAX_HEAD_DIM,
    MAX_INTERMEDIATE_SIZE,
    MAX_NUM_HEADS,
    MAX_NUM_LAYERS,
    ModelLoadError,
    flag,
    positive_int,
)
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.block import PreNormBlock
from flashllm.models.layers.embedding import VocabEmbedding
from flashllm.models.layers.gated_deltanet import GatedDeltaNet, RecurrentCache
from flashllm.models.layers.recurrent import state_spans
from flashllm.models.llama import run_decoder_stack
from flashllm.models.llama_config import parse_llama_config
from flashllm.models.mixtral import MakeMLP, MoEModel, MoEModelConfig, experts_and_top_k, moe_config
from flashllm.models.qwen2_moe import Qwen2MoeForCausalLM, _mlp_only_layers, non_negative_size

# Qwen3NextConfig's defaults (transformers 5.25) for the fields a config.json may omit
DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 48,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "hidden_act": "silu",
}
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True, slots=True)
class Qwen3NextModelConfig(MoEModelConfig):
    """MoEModelConfig plus Qwen3-Next's layer kinds and Gated DeltaNet sizes.

    full_attention_layers[i]: layer i is gated full attention (else Gated DeltaNet); linear_num_key_heads /
    linear_num_value_heads, linear_key_head_dim / linear_value_head_dim: the linear attention's heads (each key head
    serves num_value / num_key value heads); linear_conv_kernel_dim: its short convolution's width."""

    full_attention_layers: tuple[bool, ...] = ()
    linear_num_key_heads: int = 1
    linear_num_value_heads: int = 1
    linear_key_head_dim: int = 1
    linear_value_head_dim: int = 1
    linear_conv_kernel_dim: int = 1

    @property
    def num_parameters(self) -> int:
        """MoEModelConfig's count with each linear-attention layer's projections in place of attention's, plus the
        full attention layers' output gates."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        keys = self.linear_num_key_heads * self.linear_key_head_dim
        values = self.linear_num_value_heads * self.linear_value_head_dim
        linear = (h * (2 * keys + 2 * values + 2 * self.linear_num_value_heads) + h * values
                  + (2 * keys + values) * self.linear_conv_kernel_dim)
        full = sum(self.full_attention_layers)
        gates = full * h * self.num_attention_heads * d
        return MoEModelConfig.num_parameters.fget(self) - (self.num_hidden_layers - full) * (attn - linear) + gates


def parse_qwen3_next_config(raw: dict[str, Any], source: str = "config.json") -> Qwen3NextModelConfig:
    """Validate a Qwen3-Next config.json as transformers' Qwen3NextConfig reads it (its defaults where a field is
    absent): Llama's fields with partial_rotary_factor 0.25, layer_types (or every full_attention_interval-th layer,
    4 by default, full attention), the linear_* sizes, num_experts / num_experts_per_tok / moe_intermediate_size /
    shared_expert_intermediate_size / norm_topk_prob / decoder_sparse_step / mlp_only_layers. Block-FP8 checkpoints
    are dequantized at load (models/block_fp8.py); other pre-quantized ones are refused. Raises ModelLoadError (one line naming the field)."""
    qc = raw.get("quantization_config")
    if qc is not None and not is_block_fp8(qc):  # block FP8 is dequantized at load (parse_llama_config checks it)
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        raise ModelLoadError(f"{source}: quantization_config (quant_method={method!r}) is not supported; Qwen3-Next "
                             "checkpoints load as float or as block FP8 (the official -FP8 releases)")
    # Qwen3NextConfig has no sliding window: such keys in a config.json are ignored there, so here too
    full = {**DEFAULTS, **{k: v for k, v in raw.items() if k not in ("sliding_window", "use_sliding_window")}}
    base = parse_llama_config(full, source, rotary_default=0.25)
    layers = base.num_hidden_layers
    num_experts, top_k = experts_and_top_k(full, "num_experts", 512, 10, source)
    step = positive_int(full, "decoder_sparse_step", 1, MAX_NUM_LAYERS, source)
    dense = _mlp_only_layers(full, layers, source)
    num_k = positive_int(full, "linear_num_key_heads", 16, MAX_NUM_HEADS, source)
    num_v = positive_int(full, "linear_num_value_heads", 32, MAX_NUM_HEADS, source)
    if num_v % num_k:
        raise ModelLoadError(f"{source}: linear_num_value_heads={num_v} is not a multiple of linear_num_key_heads="
                             f"{num_k}; each key head serves an equal group of value heads")
    return moe_config(
        base, Qwen3NextModelConfig, num_experts=num_experts, num_experts_per_tok=top_k,
        moe_intermediate_size=positive_int(full, "moe_intermediate_size", 512, MAX_INTERMEDIATE_SIZE, source),
        shared_expert_intermediate_size=non_negative_size(full, "shared_expert_intermediate_size", 512, source),
        norm_topk_prob=flag(full, "norm_topk_prob", source) if "norm_topk_prob" in full else True,
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
        qkv_bias=base.attention_bias,
        full_attention_layers=tuple(t == "full_attention" for t in _layer_types(full, layers, source)),
        linear_num_key_heads=num_k, linear_num_value_heads=num_v,
        linear_key_head_dim=positive_int(full, "linear_key_head_dim", 128, MAX_HEAD_DIM, source),
        linear_value_head_dim=positive_int(full, "linear_value_head_dim", 128, MAX_HEAD_DIM, source),
        linear_conv_kernel_dim=positive_int(full, "linear_conv_kernel_dim", 4, 64, source),
    )


def _layer_types(raw: dict[str, Any], num_layers: int, source: str) -> list[str]:
    """layer_types, or transformers' default: every full_attention_interval-th layer (1-based) full attention."""
    types = raw.get("layer_types")
    if types is None:
        interval = positive_int(raw, "full_attention_interval", 4, MAX_NUM_LAYERS, source)
        return [LAYER_TYPES[(i + 1) % interval == 0] for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise ModelLoadError(f"{source}: layer_types={types!r} must list one of {LAYER_TYPES} per layer "
                             f"({num_layers} layers)")
    return types


class Qwen3NextAttention(AfmoeAttention):
    """Gated full attention: o_proj(attn(q, k, v) * sigmoid(gate)), the gate the second half of each head's q_proj
    rows (split from the queries at load, Qwen3NextForCausalLM.load_weights, into `attn_gate`); the per-head q / k
    norms are (1 + w) RMSNorms."""

    def __init__(self, config: Qwen3NextModelConfig, layer_idx: int, rotary_emb: nn.Module, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, layer_idx, rotary_emb, ops, dtype, device, tp_rank, tp_size)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, ops, device)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, ops, device)


class Qwen3NextDecoderLayer(PreNormBlock):
    """(1 + w)-RMSNorm pre-norm block around either gated full attention (`self_attn`, which reads a paged KV
    cache) or Gated DeltaNet (`linear_attn`, whose `kv_cache` is its RecurrentCache), and the layer's MLP."""

    def __init__(self, config: Qwen3NextModelConfig, layer_idx: int, rotary_emb: nn.Module, mlp: nn.Module, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.self_attn: Qwen3NextAttention | None = None
        self.linear_attn: GatedDeltaNet | None = None
        if config.full_attention_layers[layer_idx]:
            self.self_attn = Qwen3NextAttention(config, layer_idx, rotary_emb, ops, dtype, device, tp_rank, tp_size)
        else:
            self.linear_attn = GatedDeltaNet(
                config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
                config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim,
                config.rms_norm_eps, ops, dtype, device, tp_rank, tp_size)
        self.mlp = mlp
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, ops, device)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, ops, device)

    def attend(self, positions: Tensor, hidden: Tensor, kv_cache: Any, attn_metadata: AttentionMetadata) -> Tensor:
        """Normed hidden (T, H) -> the token mixer's output (T, H)."""
        if self.linear_attn is not None:
            return self.linear_attn(hidden, kv_cache)
        return self.self_attn(positions, hidden, kv_cache, attn_metadata)


class Qwen3NextModel(MoEModel):
    """Embedding, Qwen3-Next's layers and the final (1 + w) norm (HF's `model.` prefix)."""

    def __init__(self, config: Qwen3NextModelConfig, make_mlp: MakeMLP, ops: Any, dtype: torch.dtype,
                 device: torch.device, qkv_bias: bool, o_bias: bool, tp_rank: int = 0, tp_size: int = 1,
                 attention_class: Any = None) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device, tp_rank, tp_size)
        self.rotary_emb = self.build_rotary(config, ops, device)
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(config, i, self.rotary_emb, make_mlp(config, i), ops, dtype, device, tp_rank, tp_size)
            for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, ops, device)
        self.num_attention_layers = sum(config.full_attention_layers)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """input_ids (T,), positions (T,) -> final hidden states (T, hidden). kv_caches: the attention layers'
        (k_cache, v_cache) in layer order, then each linear-attention layer's (conv_state, recurrent_state)."""
        spans = state_spans(attn_metadata)  # once per pass, for every linear-attention layer
        attention = iter(kv_caches[:self.num_attention_layers])
        states = iter(kv_caches[self.num_attention_layers:])
        per_layer = [next(attention) if layer.linear_attn is None else RecurrentCache(*next(states), spans)
                     for layer in self.layers]
        return run_decoder_stack(self, input_ids, positions, per_layer, attn_metadata)


def _split_gated_queries(weights: Iterable[tuple[str, Tensor]], num_heads: int, head_dim: int
                         ) -> Iterator[tuple[str, Tensor]]:
    """The checkpoint's tensors less `mtp.*`, each full-attention q_proj (per head: head_dim query rows, then
    head_dim gate rows) split into the queries (q_proj) and the gate (attn_gate)."""
    for name, tensor in weights:
        if name.startswith("mtp."):
            continue
        if ".self_attn.q_proj." not in name:
            yield name, tensor
            continue
        both = materialize(tensor).reshape(num_heads, 2, head_dim, *tensor.shape[1:])
        yield name, both[:, 0].reshape(num_heads * head_dim, *tensor.shape[1:])
        yield name.replace(".q_proj.", ".attn_gate."), both[:, 1].reshape(num_heads * head_dim, *tensor.shape[1:])


class Qwen3NextForCausalLM(Qwen2MoeForCausalLM):
    """Qwen3-Next (module docstring). Checkpoint names: `linear_attn.in_proj_qkvz|in_proj_ba|conv1d|dt_bias|A_log|
    norm|out_proj` in the linear-attention layers, `self_attn.q_proj` (queries and gate)|k_proj|v_proj|o_proj|q_norm|
    k_norm in the full ones, Qwen2-MoE's `mlp.*`; `mtp.*` skipped. Runs without prefix caching or speculative
    decoding (the recurrent states are not paged by position)."""

    renamed_modules: ClassVar[dict[str, str]] = {".linear_attn.conv1d.weight": ".linear_attn.conv_weight"}
    stack_class: ClassVar[type[MoEModel]] = Qwen3NextModel
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ("fp8",)  # block FP8, dequantized at load
    # --quant_type is not offered: the Gated DeltaNet layers' quantized numerics are untested
    weight_only_quant: ClassVar[tuple[str, ...] | None] = ()

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> Qwen3NextModelConfig:
        """config.json -> Qwen3NextModelConfig, validated (see parse_qwen3_next_config)."""
        return parse_qwen3_next_config(raw, source)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """Hidden states (T, hidden) of a flat batch; writes the attention layers' K/V and the linear-attention
        layers' states (kv_caches as Qwen3NextModel.forward takes them)."""
        expected = self.model.num_attention_layers + len(self.state_cache_shapes())
        if len(kv_caches) != expected:
            raise ValueError(f"got {len(kv_caches)} caches for {expected} layers; allocate kv_cache_shape()'s "
                             "attention caches, then state_cache_shapes()'s states")
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def kv_cache_shape(self) -> tuple[int, int, int]:
        """(full-attention layers, KV heads on this rank, head_dim) of the paged KV cache."""
        attn = next((layer.self_attn for layer in self.model.layers if layer.self_attn is not None), None)
        if attn is None:
            return 0, 1, self.config.head_dim
        return self.model.num_attention_layers, attn.num_kv_heads, attn.head_dim

    def state_cache_shapes(self) -> list[tuple[tuple[tuple[int, ...], torch.dtype], ...]]:
        """Each Gated DeltaNet layer's (conv state, recurrent state) shapes on this rank (GatedDeltaNet.state_shapes)."""
        return [layer.linear_attn.state_shapes() for layer in self.model.layers if layer.linear_attn is not None]

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Qwen2-MoE's loading, less the `mtp.*` tensors, with each q_proj split into queries and output gate."""
        config = self.config
        return super().load_weights(_split_gated_queries(weights, config.num_attention_heads, config.head_dim))
