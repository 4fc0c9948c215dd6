"""Bamba (`BambaForCausalLM`: ibm-ai-platform/Bamba-9B and its v2), as transformers' BambaConfig / BambaForCausalLM
read and run it: Llama's pre-norm blocks (`input_layernorm`, `pre_ff_layernorm`, the gated SwiGLU `feed_forward`) whose
token mixer is, per layer, either Llama's attention (the layers in `attn_layer_indices`; RoPE over half of each head,
which BambaConfig fixes whatever config.json says) or the Mamba-2 mixer `mamba` (flashllm.models.layers.mamba2; its
gated norm's eps is rms_norm_eps, its activation hidden_act). Attention layers page their K/V; Mamba layers keep a conv
and an SSM state per sequence (state_cache_shapes)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.hf_config import ModelLoadError
from flashllm.models.layers.attention import Attention
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.block import PreNormBlock
from flashllm.models.layers.embedding import VocabEmbedding
from flashllm.models.layers.mamba2 import Mamba2Mixer, Mamba2Sizes
from flashllm.models.layers.mlp import GatedMLP
from flashllm.models.layers.norm import RMSNorm
from flashllm.models.layers.recurrent import StateSpans, state_spans
from flashllm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
from flashllm.models.mamba2 import mixer_sizes
from flashllm.models.olmo2 import refuse_prequantized

# transformers' BambaConfig defaults (Bamba-9B's shape) where config.json leaves a field out
BAMBA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 128000, "tie_word_embeddings": False, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu",
    "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 262144,
    "mamba_n_heads": 128, "mamba_d_head": "auto", "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_conv": 4,
    "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_proj_bias": False,
    "attention_bias": False, "mlp_bias": False,
}
BAMBA_ROTARY = 0.5  # BambaConfig sets partial_rotary_factor 0.5 over anything config.json says
_BAMBA_NAMES = {"num_heads": "mamba_n_heads", "head_dim": "mamba_d_head", "n_groups": "mamba_n_groups",
                "state_size": "mamba_d_state", "conv_kernel": "mamba_d_conv", "use_bias": "mamba_proj_bias",
                "use_conv_bias": "mamba_conv_bias", "time_step_limit": "time_step_limit",
                "chunk_size": "mamba_chunk_size", "expand": "mamba_expand", "hidden_act": "hidden_act"}


@dataclass(frozen=True, slots=True)
class BambaConfig(LlamaModelConfig):
    """LlamaModelConfig (the attention layers', MLPs' and norms' fields) plus the Mamba layers' sizes and which
    layers attend."""

    mixer: Mamba2Sizes | None = None
    attn_layer_indices: tuple[int, ...] = ()


def _attention_layers(raw: dict[str, Any], num_layers: int, source: str) -> tuple[int, ...]:
    value = raw.get("attn_layer_indices")
    if value is None:
        return ()
    if (not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value)
            or not all(0 <= i < num_layers for i in value)):
        raise ModelLoadError(f"{source}: attn_layer_indices={value!r} must be a list of layer indices in "
                             f"0..{num_layers - 1}")
    return tuple(sorted(set(value)))


def parse_bamba_config(raw: dict[str, Any], source: str = "config.json") -> BambaConfig:
    """config.json -> BambaConfig over BAMBA_DEFAULTS: Llama's fields with RoPE over half of each head, the Mamba
    mixer's from the mamba_* fields (mamba_d_head "auto": mamba_expand x hidden_size / mamba_n_heads) with
    rms_norm_eps as its gated norm's eps. A pre-quantized checkpoint is refused. Raises ModelLoadError (one line)."""
    refuse_prequantized(raw, source)
    view = {**BAMBA_DEFAULTS, **{key: value for key, value in raw.items() if value is not None}}
    rope = view.get("rope_parameters")
    if isinstance(rope, dict):
        view["rope_parameters"] = {k: v for k, v in rope.items() if k != "partial_rotary_factor"}
    view["partial_rotary_factor"] = BAMBA_ROTARY
    base = parse_llama_config(view, source)
    if view["mamba_d_head"] == "auto" and isinstance(view["mamba_n_heads"], int) and view["mamba_n_heads"] > 0:
        view["mamba_d_head"] = view["mamba_expand"] * base.hidden_size // view["mamba_n_heads"]
    return BambaConfig(**{f.name: getattr(base, f.name) for f in fields(LlamaModelConfig)},
                       mixer=mixer_sizes(view, _BAMBA_NAMES, base.hidden_size, base.rms_norm_eps, source),
                       attn_layer_indices=_attention_layers(view, base.num_hidden_layers, source))


class HybridDecoderLayer(PreNormBlock):
    """Llama's pre-norm block whose token mixer is attention (`self_attn`, scores scaled by `attention_scale` where
    given) or the Mamba-2 mixer (`mamba`), and whose MLP is `mlp`; both branch outputs multiplied by
    residual_multiplier (Granite's; 1.0 changes nothing) before they join the residual stream. A Mamba layer's
    kv_cache is (its (conv_state, ssm_state) or None, the batch's StateSpans)."""

    def __init__(self, config: LlamaModelConfig, mixer: Mamba2Sizes | None, layer_idx: int, rotary_emb: nn.Module,
                 mlp: nn.Module, ops: Any, dtype: torch.dtype, device: torch.device, tp_rank: int, tp_size: int,
                 residual_multiplier: float = 1.0, attention_scale: float | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)
        self.mlp, self.residual_multiplier = mlp, residual_multiplier
        self.is_attention = mixer is None
        self.self_attn: LlamaAttention | None = None  # LlamaForCausalLM.fusions reads it: no fused decoder stack
        if self.is_attention:
            self.self_attn = LlamaAttention(config, layer_idx, rotary_emb, ops, dtype, device,
                                            config.attention_bias, config.attention_bias, tp_rank, tp_size)
            if attention_scale is not None:
                attn = self.self_attn
                attn.attn = Attention(attn.num_heads, attn.head_dim, attention_scale, attn.num_kv_heads, ops)
        else:
            self.mamba = Mamba2Mixer(mixer, ops, dtype, device, tp_rank, tp_size)

    def attend(self, positions: Tensor, hidden: Tensor, kv_cache: tuple[Any, ...],
               attn_metadata: AttentionMetadata) -> Tensor:
        """Attention over the paged cache, or the mixer over the sequences' states; times residual_multiplier."""
        if self.is_attention:
            return self.self_attn(positions, hidden, kv_cache, attn_metadata) * self.residual_multiplier
        state, spans = kv_cache
        return self.mamba(hidden, state, spans) * self.residual_multiplier

    def feed_forward(self, hidden: Tensor) -> Tensor:
        """The MLP times residual_multiplier."""
        return self.mlp(hidden) * self.residual_multiplier


class HybridModel(nn.Module):
    """embed_tokens, the layers (attention or Mamba, HybridDecoderLayer) and the final norm `norm`."""

    def __init__(self, embed_tokens: nn.Module, layers: list[HybridDecoderLayer], norm: RMSNorm) -> None:
        super().__init__()
        self.embed_tokens, self.layers, self.norm = embed_tokens, nn.ModuleList(layers), norm

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """(T,) ids -> (T, hidden); kv_caches: the attention layers' caches, then the Mamba layers' states (absent:
        every sequence starts from zeros and keeps nothing)."""
        spans = state_spans(attn_metadata)
        hidden, residual = self.embed_tokens(input_ids), None
        for layer, cache in zip(self.layers, self.layer_caches(kv_caches, spans), strict=True):
            hidden, residual = layer(positions, hidden, residual, cache, attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def layer_caches(self, kv_caches: list[tuple[Tensor, ...]], spans: StateSpans) -> list[tuple[Any, ...]]:
        """Each layer's kv_cache argument, in layer order, from the runner's [attention caches..., states...]; None
        for a layer whose `keeps_state` is false (neither attention nor recurrent: an MLP-only layer)."""
        attention = [layer for layer in self.layers if layer.is_attention]
        caches, states = iter(kv_caches[:len(attention)]), iter(kv_caches[len(attention):])
        return [next(caches) if layer.is_attention else (next(states, None), spans)
                if getattr(layer, "keeps_state", True) else None for layer in self.layers]


class HybridCausalLM:
    """forward, kv_cache_shape and state_cache_shapes of a CausalLM whose `model` is a HybridModel (mixed in before
    the Llama-family class that loads its weights). Each layer holds its attention as `attention_module` and its
    Mamba mixer as `mamba_module` (names of the layer's submodules)."""

    model: HybridModel
    attention_module: ClassVar[str] = "self_attn"
    mamba_module: ClassVar[str] = "mamba"

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """input_ids (T,) -> hidden (T, hidden) (HybridModel.forward)."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def kv_cache_shape(self) -> tuple[int, int, int]:
        """(attention layers, KV heads on this rank, head_dim); (0, 1, head_dim) with none."""
        attention = [getattr(layer, self.attention_module) for layer in self.model.layers if layer.is_attention]
        if not attention:
            return 0, 1, self.config.head_dim
        return len(attention), attention[0].num_kv_heads, attention[0].head_dim

    def state_cache_shapes(self) -> list[tuple[tuple[tuple[int, ...], torch.dtype], ...]]:
        """Per Mamba layer, in layer order: (conv state in the model dtype, SSM state float32) on this rank."""
        dtype = self.model.norm.weight.dtype
        return [getattr(layer, self.mamba_module).state_shapes(dtype) for layer in self.model.layers
                if not layer.is_attention and getattr(layer, "keeps_state", True)]


class BambaForCausalLM(HybridCausalLM, LlamaForCausalLM):
    """Bamba (module docstring): Llama's loading (fused qkv / gate_up), `feed_forward` as mlp, `pre_ff_layernorm` as the
    post-attention norm and `final_layernorm` as the final norm."""

    renamed_modules: ClassVar[dict[str, str]] = {
        ".feed_forward.": ".mlp.", ".pre_ff_layernorm.": ".post_attention_layernorm.",
        "model.final_layernorm.": "model.norm.",
    }
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> BambaConfig:
        """config.json -> BambaConfig (parse_bamba_config)."""
        return parse_bamba_config(raw, source)

    def build_stack(self, config: BambaConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> HybridModel:
        """Bamba's stack: a gated MLP in every layer, attention with half-head RoPE where attn_layer_indices says."""
        rotary = LlamaModel.build_rotary(config, ops, device)
        layers = [HybridDecoderLayer(config, None if i in config.attn_layer_indices else config.mixer, i, rotary,
                                     GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, ops,
                                              dtype, device, tp_rank, tp_size), ops, dtype, device, tp_rank, tp_size)
                  for i in range(config.num_hidden_layers)]
        embed = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device, tp_rank, tp_size)
        return HybridModel(embed, layers, RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device))
