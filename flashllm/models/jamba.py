"""Jamba (`JambaForCausalLM`: ai21labs/Jamba-v0.1, AI21-Jamba-Mini / -Large 1.5 and 1.6), as transformers' JambaConfig
reads it and JambaForCausalLM runs it: pre-norm blocks whose mixer is attention in the layers i with
i % attn_layer_period == attn_layer_offset and a Mamba mixer (flashllm.models.layers.mamba, with learned RMS norms of
dt, B and C, eps rms_norm_eps) in the others, and whose MLP is a sparse MoE (softmax router `feed_forward.router`,
the top num_experts_per_tok of num_experts experts, weights not renormalized, no shared expert) in the layers i with
i % expert_layer_period == expert_layer_offset (where num_experts > 1) and a dense gated MLP elsewhere, all
intermediate_size wide. Attention has no positional embedding (no RoPE) and no biases; grouped-query heads. The
Mamba layers keep a convolution and an SSM state per sequence (CausalLM.state_cache_shapes), the attention layers
the paged KV cache: forward's kv_caches holds the attention layers' caches first, then the Mamba layers' states."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.errors import ModelLoadError
from flashllm.models.hf_config import MAX_INTERMEDIATE_SIZE, flag, positive_int
from flashllm.models.layers.attention import split_heads
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.block import PreNormBlock
from flashllm.models.layers.embedding import VocabEmbedding
from flashllm.models.layers.mamba import MambaMixer
from flashllm.models.layers.norm import RMSNorm
from flashllm.models.layers.recurrent import StateSpans, split_caches, state_spans
from flashllm.models.llama import LlamaAttention
from flashllm.models.llama_config import parse_llama_config
from flashllm.models.mamba import MAX_CONV_KERNEL, MAX_STATE_SIZE
from flashllm.models.mixtral import (
    MakeMLP,
    MixtralForCausalLM,
    MoEDecoderLayer,
    MoEModelConfig,
    experts_and_top_k,
    moe_config,
)
from flashllm.models.olmo2 import refuse_prequantized
from flashllm.models.qwen2_moe import Qwen2MoeForCausalLM

# transformers' JambaConfig defaults (Jamba-v0.1's shape) where config.json leaves a field out
JAMBA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 65536, "tie_word_embeddings": False, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 262144,
    "num_experts_per_tok": 2, "num_experts": 16, "expert_layer_period": 2, "expert_layer_offset": 1,
    "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
    "mamba_dt_rank": "auto", "mamba_conv_bias": True, "mamba_proj_bias": False,
}


@dataclass(frozen=True, slots=True)
class JambaModelConfig(MoEModelConfig):
    """MoEModelConfig (sparse_layers: the MoE layers) plus attention_layers[i] (layer i attends, else runs Mamba) and
    the Mamba mixers' sizes: d_state, conv width, intermediate size (mamba_expand x hidden_size), dt rank, biases."""

    attention_layers: tuple[bool, ...] = ()
    mamba_d_state: int = 16
    mamba_d_conv: int = 4
    mamba_intermediate_size: int = 1
    mamba_dt_rank: int = 1
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False

    @property
    def num_parameters(self) -> int:
        """MoEModelConfig's count with each Mamba layer's mixer in place of attention."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        i, n, r = self.mamba_intermediate_size, self.mamba_d_state, self.mamba_dt_rank
        mixer = h * 2 * i + i * (self.mamba_d_conv + 1) + i * (r + 2 * n) + (r + 1) * i + i * (n + 1) + i * h
        mamba_layers = self.attention_layers.count(False)
        return MoEModelConfig.num_parameters.fget(self) + mamba_layers * (mixer - attn)


def _period(given: dict[str, Any], name: str, source: str) -> tuple[int, int]:
    """(period, offset) of `<name>_layer_period` / `_offset`, the offset in 0..period - 1 as transformers requires."""
    period = positive_int(given, f"{name}_layer_period", None, 1 << 20, source)
    offset = given[f"{name}_layer_offset"]
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < period:
        raise ModelLoadError(f"{source}: {name}_layer_offset={offset!r} must be an int in 0..{period - 1} (below "
                             f"{name}_layer_period={period})")
    return period, offset


def parse_jamba_config(raw: dict[str, Any], source: str = "config.json") -> JambaModelConfig:
    """config.json -> JambaModelConfig over JAMBA_DEFAULTS (module docstring); num_local_experts names num_experts,
    as in transformers. A hidden_act other than silu (the MLPs'
    and the Mamba convolutions') and pre-quantized checkpoints are refused. Raises ModelLoadError (one line)."""
    refuse_prequantized(raw, source)
    given = {**JAMBA_DEFAULTS, **{key: value for key, value in raw.items() if value is not None}}
    if raw.get("num_experts") is None and raw.get("num_local_experts") is not None:
        given["num_experts"] = raw["num_local_experts"]
    base = parse_llama_config(given, source)
    num_experts, top_k = experts_and_top_k(given, "num_experts", 16, 2, source)
    attn_period, attn_offset = _period(given, "attn", source)
    expert_period, expert_offset = _period(given, "expert", source)
    layers = range(base.num_hidden_layers)
    hidden = base.hidden_size
    expand = positive_int(given, "mamba_expand", None, MAX_INTERMEDIATE_SIZE // hidden or 1, source)
    rank = given["mamba_dt_rank"]
    rank = math.ceil(hidden / 16) if rank == "auto" else positive_int(given, "mamba_dt_rank", None, hidden, source)
    return moe_config(
        base, JambaModelConfig, num_experts=num_experts, num_experts_per_tok=top_k,
        moe_intermediate_size=base.intermediate_size, shared_expert_intermediate_size=0, norm_topk_prob=False,
        sparse_layers=tuple(num_experts > 1 and i % expert_period == expert_offset for i in layers), qkv_bias=False,
        attention_layers=tuple(i % attn_period == attn_offset for i in layers),
        mamba_d_state=positive_int(given, "mamba_d_state", None, MAX_STATE_SIZE, source),
        mamba_d_conv=positive_int(given, "mamba_d_conv", None, MAX_CONV_KERNEL, source),
        mamba_intermediate_size=expand * hidden, mamba_dt_rank=rank,
        mamba_conv_bias=flag(given, "mamba_conv_bias", source), mamba_proj_bias=flag(given, "mamba_proj_bias", source))


class JambaAttention(LlamaAttention):
    """LlamaAttention without a rotary embedding (Jamba's attention sees no positions but the causal order)."""

    def attend_heads(self, positions: Tensor, hidden: Tensor, kv_cache: tuple[Tensor, Tensor],
                     attn_metadata: AttentionMetadata) -> Tensor:
        """hidden (T, hidden) -> this rank's heads' outputs (T, heads x head_dim), before o_proj."""
        q, k, v = split_heads(self.qkv_proj(hidden), self.num_heads, self.num_kv_heads, self.head_dim)
        return self.attn(q, k, v, kv_cache, attn_metadata)


class JambaMambaLayer(PreNormBlock):
    """The pre-norm block with a Mamba mixer (`mamba`) in place of attention; called with the layer's state tuple
    and the batch's StateSpans where an attention block takes its KV cache and the attention metadata."""

    def __init__(self, config: JambaModelConfig, mlp: nn.Module, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.mamba = MambaMixer(config.hidden_size, config.mamba_intermediate_size, config.mamba_d_state,
                                config.mamba_d_conv, config.mamba_dt_rank, config.mamba_proj_bias,
                                config.mamba_conv_bias, ops, dtype, device, tp_rank, tp_size, inner_norm="learned",
                                norm_eps=config.rms_norm_eps)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)

    def attend(self, positions: Tensor, hidden: Tensor, kv_cache: tuple[Tensor, ...], spans: StateSpans) -> Tensor:
        """The Mamba mixer over normed hidden (T, H), its state in kv_cache."""
        return self.mamba(hidden, kv_cache, spans)


class JambaModel(nn.Module):
    """Embedding, the attention and Mamba blocks (config.attention_layers) and the final norm (HF's `model.`)."""

    def __init__(self, config: JambaModelConfig, make_mlp: MakeMLP, ops: Any, dtype: torch.dtype,
                 device: torch.device, qkv_bias: bool, o_bias: bool, tp_rank: int = 0, tp_size: int = 1,
                 attention_class: type[LlamaAttention] = JambaAttention) -> None:
        super().__init__()
        self.attention_layers = config.attention_layers
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device, tp_rank, tp_size)
        self.layers = nn.ModuleList(
            MoEDecoderLayer(config, i, None, make_mlp(config, i), ops, dtype, device, qkv_bias, o_bias, tp_rank,
                            tp_size, attention_class) if attends
            else JambaMambaLayer(config, make_mlp(config, i), ops, dtype, device, tp_rank, tp_size)
            for i, attends in enumerate(config.attention_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """input_ids (T,) -> final hidden states (T, hidden); kv_caches: the attention layers' caches in layer order,
        then the Mamba layers' states in layer order (none for a pass that keeps no state, see split_caches)."""
        num_attention = sum(self.attention_layers)
        caches, states = map(iter, split_caches(kv_caches, num_attention, len(self.layers) - num_attention,
                                                attn_metadata))
        spans = state_spans(attn_metadata)
        hidden, residual = self.embed_tokens(input_ids), None
        for layer, attends in zip(self.layers, self.attention_layers, strict=True):
            if attends:
                hidden, residual = layer(positions, hidden, residual, next(caches), attn_metadata)
            else:
                hidden, residual = layer(positions, hidden, residual, next(states), spans)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class JambaForCausalLM(MixtralForCausalLM):
    """Jamba (module docstring) on Mixtral's loading: checkpoint `feed_forward` modules load as `mlp` (the router as
    its `gate`, experts per expert or stacked into each FusedMoE), `pre_ff_layernorm` as post_attention_layernorm and
    `final_layernorm` as the final norm; q / k / v fuse into qkv_proj and gate / up into gate_up_proj."""

    renamed_modules: ClassVar[dict[str, str]] = {
        ".feed_forward.router.": ".mlp.gate.", ".feed_forward.": ".mlp.",
        ".pre_ff_layernorm.": ".post_attention_layernorm.", "model.final_layernorm.": "model.norm.",
    }
    weight_only_quant: ClassVar[tuple[str, ...] | None] = ()
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()  # parse_jamba_config refuses them
    attention_class: ClassVar[type[LlamaAttention]] = JambaAttention
    stack_class: ClassVar[type[nn.Module]] = JambaModel
    make_mlp = staticmethod(Qwen2MoeForCausalLM.make_mlp)  # sparse where config.sparse_layers says, else dense

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> JambaModelConfig:
        """config.json -> JambaModelConfig (parse_jamba_config)."""
        return parse_jamba_config(raw, source)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """Hidden states (T, hidden) of a flat batch (JambaModel.forward); writes the attention layers' K/V and the
        Mamba layers' states."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def fusions(self) -> dict[str, Any]:
        """None: Mixtral's fused decode stack has no Mamba layer, and the backends run this forward as it is."""
        return {}

    def kv_cache_shape(self) -> tuple[int, int, int]:
        """(attention layers, KV heads on this rank, head_dim); (0, 1, head_dim) without an attention layer."""
        attns = [layer.self_attn for layer in self.model.layers if isinstance(layer, MoEDecoderLayer)]
        if not attns:
            return 0, 1, self.config.head_dim
        return len(attns), attns[0].num_kv_heads, attns[0].head_dim

    def state_cache_shapes(self) -> list[tuple[tuple[tuple[int, ...], torch.dtype], ...]]:
        """Per Mamba layer, in layer order: (conv state (I / tp, d_conv - 1) in the model dtype, SSM state (I / tp,
        d_state) float32)."""
        return [layer.mamba.state_shapes() for layer in self.model.layers if isinstance(layer, JambaMambaLayer)]
