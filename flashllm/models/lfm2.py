"""LFM2 (`Lfm2ForCausalLM`: LiquidAI/LFM2-350M / -700M / -1.2B / -2.6B), as transformers' Lfm2Config /
Lfm2ForCausalLM read and run it: a hybrid stack whose layers (`layer_types`, else `full_attn_idxs`) are either
grouped-query attention with per-head q / k RMSNorms (`q_layernorm` / `k_layernorm`) before RoPE and an `out_proj`, or
a gated short convolution: `in_proj` -> B, C, x (each hidden_size wide), a depthwise causal convolution of width
`conv_L_cache` over B * x carrying each sequence's last inputs, C * the convolution, `out_proj`. Every layer is
pre-norm (`operator_norm`, `ffn_norm`) with a SwiGLU feed-forward (`w1` gate, `w3` up, `w2` down) whose width
`block_auto_adjust_ff_dim` derives from intermediate_size (2/3 of it, x `block_ffn_dim_multiplier`, rounded up to
`block_multiple_of`); the final norm is `embedding_norm`; the embeddings are tied by default. Tensor parallelism splits
the attention heads and the convolution's channels over the ranks."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from flashllm.models.chatglm import FusedGateUpLinear
from flashllm.models.hf_config import MAX_INTERMEDIATE_SIZE, MAX_NUM_LAYERS, ModelLoadError, flag, positive_int
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.block import PreNormBlock
from flashllm.models.layers.linear import RowParallelLinear
from flashllm.models.layers.mlp import GatedMLP
from flashllm.models.layers.norm import RMSNorm
from flashllm.models.layers.recurrent import StateSpans, causal_conv1d, channel_param, split_caches, state_spans
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import LlamaAttention, LlamaForCausalLM
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
from flashllm.models.olmo2 import refuse_prequantized
from flashllm.models.starcoder2 import Starcoder2Model

# transformers' Lfm2Config defaults where config.json leaves a field out (null counts as left out, except for
# block_ffn_dim_multiplier, whose null means "no multiplier")
LFM2_DEFAULTS: dict[str, Any] = {
    "vocab_size": 65536, "hidden_size": 2560, "intermediate_size": 12288, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 128000, "norm_eps": 1e-5,
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True, "rope_theta": 1e6, "conv_bias": False,
    "conv_L_cache": 3, "block_multiple_of": 256, "block_auto_adjust_ff_dim": True,
}
LAYER_TYPES = ("conv", "full_attention")


@dataclasses.dataclass(frozen=True, slots=True)
class Lfm2ModelConfig(LlamaModelConfig):
    """LlamaModelConfig (intermediate_size the feed-forward's derived width, rms_norm_eps LFM2's norm_eps, q / k norms
    on) plus which layers attend (`attention_layers[i]`; the others are short convolutions), whether the convolution's
    projections and filter are biased (`conv_bias`) and its width (`conv_kernel`, config.json's conv_L_cache)."""

    attention_layers: tuple[bool, ...] = ()
    conv_bias: bool = False
    conv_kernel: int = 3

    @property
    def num_parameters(self) -> int:
        """Attention or convolution projections per layer, the feed-forwards, the embedding and the LM head."""
        hidden = self.hidden_size
        return (mixer_parameters(self) + self.num_hidden_layers * 3 * hidden * self.intermediate_size
                + 2 * self.vocab_size * hidden)


def mixer_parameters(config: Any) -> int:
    """Weights of an LFM2-style config's mixers: each attention layer's q, k, v and o projections, each convolution
    layer's in_proj, out_proj and filter."""
    hidden, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    attention = hidden * config.head_dim * (2 * heads + 2 * kv)
    conv = 4 * hidden * hidden + hidden * config.conv_kernel
    return sum(attention if attends else conv for attends in config.attention_layers)


def parse_lfm2_config(raw: dict[str, Any], source: str = "config.json") -> Lfm2ModelConfig:
    """config.json -> Lfm2ModelConfig over LFM2_DEFAULTS, as Lfm2Config reads it: `tie_embedding` and `block_ff_dim`
    stand for tie_word_embeddings and intermediate_size where given; layer_types, else the layers in full_attn_idxs
    attend (every layer without either); hidden_act, attention_bias and partial_rotary_factor are ignored (LFM2's
    layers are fixed). A pre-quantized checkpoint is refused (quantize at load with --quant_type). Raises
    ModelLoadError (one line)."""
    base, _, hybrid = parse_hybrid_fields(raw, source, LFM2_DEFAULTS, derived_ff_dim=True)
    return Lfm2ModelConfig(**{f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaModelConfig)}, **hybrid)


def parse_hybrid_fields(raw: dict[str, Any], source: str, defaults: dict[str, Any], derived_ff_dim: bool
                        ) -> tuple[LlamaModelConfig, dict[str, Any], dict[str, Any]]:
    """(the Llama fields of an LFM2-style config.json over `defaults`, those fields merged, the hybrid layers' fields
    attention_layers / conv_bias / conv_kernel): parse_lfm2_config's reading, which LFM2-MoE shares; with
    derived_ff_dim the dense feed-forward's width is Lfm2MLP's (and `block_ff_dim` may give intermediate_size),
    without it intermediate_size as given."""
    refuse_prequantized(raw, source)
    fields = {**defaults, **{key: value for key, value in raw.items() if value is not None}}
    aliases = {"tie_embedding": "tie_word_embeddings", **({"block_ff_dim": "intermediate_size"} if derived_ff_dim
                                                           else {})}
    for alias, name in aliases.items():
        if alias in fields:
            fields[name] = fields[alias]
    num_layers = positive_int(fields, "num_hidden_layers", None, MAX_NUM_LAYERS, source)
    rope = fields.get("rope_parameters")
    view = {key: value for key, value in fields.items() if key not in ("partial_rotary_factor", "sliding_window")}
    if isinstance(rope, dict):
        view["rope_parameters"] = {key: value for key, value in rope.items() if key != "partial_rotary_factor"}
    if derived_ff_dim:
        view["intermediate_size"] = _ff_dim(fields, raw, source)
    view |= {"rms_norm_eps": fields["norm_eps"], "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
    base = dataclasses.replace(parse_llama_config(view, source), qk_norm=True, raw=raw)
    return base, fields, {"attention_layers": _attention_layers(fields, num_layers, source),
                          "conv_bias": flag(fields, "conv_bias", source),
                          "conv_kernel": positive_int(fields, "conv_L_cache", None, 64, source)}


def _attention_layers(fields: dict[str, Any], num_layers: int, source: str) -> tuple[bool, ...]:
    """Per layer, whether it attends: `layer_types` ("full_attention" / "conv"), else membership of full_attn_idxs."""
    types = fields.get("layer_types")
    if types is None:
        idxs = fields.get("full_attn_idxs", list(range(num_layers)))
        if not isinstance(idxs, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in idxs):
            raise ModelLoadError(f"{source}: full_attn_idxs={idxs!r} must be a list of layer indices")
        return tuple(i in idxs for i in range(num_layers))
    if not isinstance(types, list) or len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise ModelLoadError(f"{source}: layer_types={types!r}; expected {num_layers} entries, each one of "
                             f"{LAYER_TYPES}")
    return tuple(t == "full_attention" for t in types)


def _ff_dim(fields: dict[str, Any], raw: dict[str, Any], source: str) -> int:
    """The feed-forward's width as Lfm2MLP derives it from intermediate_size (module docstring)."""
    size = positive_int(fields, "intermediate_size", None, MAX_INTERMEDIATE_SIZE, source)
    if not flag(fields, "block_auto_adjust_ff_dim", source):
        return size
    size = int(2 * size / 3)
    multiplier = raw.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is None:
        return size
    if isinstance(multiplier, bool) or not isinstance(multiplier, int | float) or multiplier <= 0:
        raise ModelLoadError(f"{source}: block_ffn_dim_multiplier={multiplier!r} must be a positive number or null")
    multiple = positive_int(fields, "block_multiple_of", None, MAX_INTERMEDIATE_SIZE, source)
    return multiple * -(-int(multiplier * size) // multiple)


class ShortConvCache(NamedTuple):
    """What a short-convolution layer reads and keeps in one forward: its (num_slots, channels, K - 1) conv state
    (None in a pass that keeps no state) and the batch's sequences (recurrent.state_spans, once per forward)."""

    conv_state: Tensor | None
    spans: StateSpans


class Lfm2ShortConv(nn.Module):
    """in_proj -> [B | C | x] (this rank's channels of each), y = C * causal_conv1d(B * x), out_proj (all-reduced)."""

    def __init__(self, config: Lfm2ModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, config.conv_bias
        self.in_proj = FusedGateUpLinear(hidden, [hidden] * 3, bias, ops, dtype, device, tp_rank, tp_size)
        self.channels = self.in_proj.output_sizes[0]
        self.conv = nn.Module()  # the checkpoint's conv.conv: weight (hidden, 1, K), bias (hidden,)
        self.conv.weight = channel_param((self.channels, 1, config.conv_kernel), dtype, device, tp_rank, tp_size)
        self.conv.bias = channel_param((self.channels,), dtype, device, tp_rank, tp_size) if bias else None
        self.out_proj = RowParallelLinear(hidden, hidden, bias, ops, dtype, device, tp_rank, tp_size)

    def state_spec(self) -> tuple[tuple[int, int], torch.dtype]:
        """((channels on this rank, K - 1), model dtype): the last inputs of the convolution one sequence keeps."""
        return (self.channels, self.conv.weight.shape[-1] - 1), self.conv.weight.dtype

    def forward(self, hidden: Tensor, cache: ShortConvCache) -> Tensor:
        """hidden (T, hidden) -> (T, hidden), continuing each sequence from its carried conv state."""
        b, c, x = self.in_proj(hidden).split(self.channels, dim=-1)
        y = causal_conv1d(b * x, self.conv.weight[:, 0], self.conv.bias, cache.conv_state, cache.spans)
        return self.out_proj(c * y)


class Lfm2DecoderLayer(PreNormBlock):
    """Pre-norm block whose mixer is attention (`self_attn`) or a short convolution (`conv`), then the SwiGLU MLP."""

    def __init__(self, config: Lfm2ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        attends = config.attention_layers[layer_idx]
        self.self_attn = LlamaAttention(config, layer_idx, rotary_emb, ops, dtype, device, False, False, tp_rank,
                                        tp_size) if attends else None
        self.conv = None if attends else Lfm2ShortConv(config, ops, dtype, device, tp_rank, tp_size)
        # the SwiGLU feed-forward, or the one given (LFM2-MoE's sparse block)
        self.mlp = mlp if mlp is not None else GatedMLP(config.hidden_size, config.intermediate_size, False, ops, dtype,
                                                        device, tp_rank, tp_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)

    def attend(self, positions: Tensor, hidden: Tensor, kv_cache: tuple[Any, ...],
               attn_metadata: AttentionMetadata) -> Tensor:
        """Attention over its (k_cache, v_cache), or the convolution over its ShortConvCache."""
        if self.conv is not None:
            return self.conv(hidden, kv_cache)
        return self.self_attn(positions, hidden, kv_cache, attn_metadata)


class Lfm2Model(Starcoder2Model):
    """Embedding, LFM2's hybrid layers and the final RMSNorm (`embedding_norm`)."""

    norm_class = RMSNorm

    def build_layer(self, config: Lfm2ModelConfig, layer_idx: int, ops: Any, dtype: torch.dtype,
                    device: torch.device, tp_rank: int, tp_size: int) -> nn.Module:
        """An attention or short-convolution layer, as config.attention_layers says."""
        return Lfm2DecoderLayer(config, layer_idx, self.rotary_emb, ops, dtype, device, tp_rank, tp_size)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """input_ids (T,), positions (T,) -> final hidden states (T, hidden); kv_caches as Lfm2ForCausalLM.forward."""
        return super().forward(input_ids, positions, list(self.layer_caches(kv_caches, attn_metadata)), attn_metadata)

    def layer_caches(self, kv_caches: list[tuple[Tensor, ...]], attn_metadata: AttentionMetadata) -> Iterator[Any]:
        """Each layer's cache in layer order: the attention layers' tuples (first in kv_caches), a ShortConvCache for
        the others (their states after the attention caches; none in a pass that keeps no state)."""
        num_attention = sum(layer.conv is None for layer in self.layers)
        caches, states = map(iter, split_caches(kv_caches, num_attention, len(self.layers) - num_attention,
                                                attn_metadata))
        spans = state_spans(attn_metadata) if num_attention < len(self.layers) else None
        for layer in self.layers:
            yield next(caches) if layer.conv is None else ShortConvCache(next(states)[0], spans)


class Lfm2ForCausalLM(LlamaForCausalLM):
    """LFM2 (module docstring). Checkpoint names load onto Llama's: operator_norm / ffn_norm as the input /
    post-attention norms, feed_forward.w1 / w3 fused into mlp.gate_up_proj and w2 as mlp.down_proj, self_attn.out_proj
    as o_proj, q_layernorm / k_layernorm as the per-head q / k norms, embedding_norm as the final norm; each
    convolution's in_proj is cut into B, C and x rows, a tensor-parallel rank taking its channels of each."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["w1", "w3"],
    }
    renamed_modules: ClassVar[dict[str, str]] = {
        ".operator_norm.": ".input_layernorm.", ".ffn_norm.": ".post_attention_layernorm.",
        ".feed_forward.w2.": ".mlp.down_proj.", ".feed_forward.": ".mlp.", ".self_attn.out_proj.": ".self_attn.o_proj.",
        ".self_attn.q_layernorm.": ".self_attn.q_norm.", ".self_attn.k_layernorm.": ".self_attn.k_norm.",
        "model.embedding_norm.": "model.norm.",
    }
    kv_scale_suffixes: ClassVar[tuple[str, ...]] = ()
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> Lfm2ModelConfig:
        """config.json -> Lfm2ModelConfig (parse_lfm2_config)."""
        return parse_lfm2_config(raw, source)

    def build_stack(self, config: Lfm2ModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> Lfm2Model:
        """LFM2's hybrid stack."""
        return Lfm2Model(config, ops, dtype, device, tp_rank, tp_size)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """Hidden states (T, hidden) of a flat batch. kv_caches: the attention layers' (k_cache, v_cache) in layer
        order (kv_cache_shape()), then each convolution layer's (conv_state,), (num_slots, channels, K - 1) in the
        model dtype (state_cache_shapes()); the states may be left out of a pass with attn_metadata.state_slots None."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def kv_cache_shape(self) -> tuple[int, int, int]:
        """(attention layers, KV heads on this rank, head_dim); (0, ...) for a stack of convolutions only."""
        attention = [layer.self_attn for layer in self.model.layers if layer.self_attn is not None]
        if not attention:
            return 0, max(self.config.num_key_value_heads // self.tp_size, 1), self.config.head_dim
        return len(attention), attention[0].num_kv_heads, attention[0].head_dim

    def state_cache_shapes(self) -> list[tuple[tuple[tuple[int, ...], torch.dtype], ...]]:
        """One (conv_state,) per convolution layer: (channels on this rank, conv_L_cache - 1) in the model dtype."""
        return [(layer.conv.state_spec(),) for layer in self.model.layers if layer.conv is not None]
