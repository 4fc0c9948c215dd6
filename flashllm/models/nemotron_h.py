"""NVIDIA Nemotron-H (`NemotronHForCausalLM`: Nemotron-H-8B / 47B / 56B, NVIDIA-Nemotron-Nano-9B / 12B-v2), as
transformers' NemotronHConfig / NemotronHForCausalLM read and run it (the LM head never tied): every layer is ONE
pre-norm block (`norm` -> `mixer`, added to the residual stream) whose mixer is, per `hybrid_override_pattern`
character (or `layers_block_type` entry), the Mamba-2 mixer ("M", "linear_attention"; flashllm.models.layers.mamba2, in_proj /
out_proj biased by `use_bias`, its gated norm's eps layer_norm_epsilon), grouped-query attention without positions
("*", "full_attention"; NoPE, no biases whatever attention_bias says) or an ungated MLP up_proj -> `mlp_hidden_act`
(relu2) -> down_proj ("-", "mlp"). The final norm is `norm_f`. Attention layers page their K/V; Mamba layers keep a
conv and an SSM state per sequence; MLP layers keep nothing. MoE layers ("E", "moe": Nemotron 3 Nano) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.bamba import HybridCausalLM, HybridModel
from flashllm.models.granite_moe_hybrid import NoRotary
from flashllm.models.hf_config import ModelLoadError
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.embedding import VocabEmbedding
from flashllm.models.layers.mamba2 import Mamba2Mixer, Mamba2Sizes
from flashllm.models.layers.mlp import PLAIN_ACTIVATIONS, PlainMLP
from flashllm.models.layers.norm import RMSNorm
from flashllm.models.llama import LlamaAttention, LlamaForCausalLM
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
from flashllm.models.mamba2 import mixer_sizes
from flashllm.models.olmo2 import refuse_prequantized

# transformers' NemotronHConfig defaults where config.json leaves a field out
NEMOTRON_H_DEFAULTS: dict[str, Any] = {
    "vocab_size": 131072, "hidden_size": 4096, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 4096,
    "intermediate_size": 21504, "mlp_hidden_act": "relu2", "mlp_bias": False, "ssm_state_size": 128,
    "mamba_num_heads": 128, "mamba_head_dim": 64, "mamba_hidden_act": "silu", "n_groups": 8, "conv_kernel": 4,
    "use_conv_bias": True, "chunk_size": 128, "use_bias": False, "layer_norm_epsilon": 1e-5,
}
# legacy config.json names NemotronHConfig still takes, each over the current name
_LEGACY = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_dt_limit": "time_step_limit",
           "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size"}
_MIXER_NAMES = {"num_heads": "mamba_num_heads", "head_dim": "mamba_head_dim", "n_groups": "n_groups",
                "state_size": "ssm_state_size", "conv_kernel": "conv_kernel", "use_bias": "use_bias",
                "use_conv_bias": "use_conv_bias", "time_step_limit": "time_step_limit", "chunk_size": "chunk_size",
                "hidden_act": "mamba_hidden_act"}  # no expand: the inner width is mamba_num_heads x mamba_head_dim
_BLOCK_TYPES = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
_DEFAULT_PATTERN = "ME*-"  # NemotronHConfig's layers_block_type without a pattern or list
# fields of Llama's parser that mean nothing here (no RoPE, no window): left out so they refuse nothing
_UNUSED = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor", "sliding_window",
           "use_sliding_window", "layer_types", "hidden_act", "num_hidden_layers")


@dataclass(frozen=True, slots=True)
class NemotronHConfig(LlamaModelConfig):
    """LlamaModelConfig (attention's and the MLPs' fields; rms_norm_eps = layer_norm_epsilon, hidden_act =
    mlp_hidden_act) plus the Mamba layers' sizes and the layer pattern ("M" / "*" / "-" per layer)."""

    mixer: Mamba2Sizes | None = None
    pattern: str = ""


def _pattern(raw: dict[str, Any], source: str) -> str:
    """The layers as pattern characters: layers_block_type (or its alias layer_types) over hybrid_override_pattern,
    as NemotronHConfig reads them."""
    listed = raw.get("layers_block_type", raw.get("layer_types"))
    if listed is not None:
        if not isinstance(listed, list) or not listed or any(t not in _BLOCK_TYPES for t in listed):
            raise ModelLoadError(f"{source}: layers_block_type={listed!r} must be a non-empty list of "
                                 f"{sorted(_BLOCK_TYPES)}")
        return "".join(_BLOCK_TYPES[t] for t in listed)
    pattern = raw.get("hybrid_override_pattern", _DEFAULT_PATTERN)
    if not isinstance(pattern, str) or not pattern or set(pattern) - set(_BLOCK_TYPES.values()):
        raise ModelLoadError(f"{source}: hybrid_override_pattern={pattern!r} must be a non-empty string of 'M' "
                             "(Mamba), '*' (attention), '-' (MLP) and 'E' (MoE)")
    return pattern


def parse_nemotron_h_config(raw: dict[str, Any], source: str = "config.json") -> NemotronHConfig:
    """config.json -> NemotronHConfig over NEMOTRON_H_DEFAULTS (legacy mamba_* names taken as NemotronHConfig takes
    them); num_hidden_layers is the pattern's length. MoE layers and pre-quantized checkpoints are refused. Raises
    ModelLoadError (one line). The head is never tied: NemotronHForCausalLM ties no weights whatever
    tie_word_embeddings says (its lm_head.weight is always its own)."""
    refuse_prequantized(raw, source)
    view = {**NEMOTRON_H_DEFAULTS, **{key: value for key, value in raw.items() if value is not None}}
    view |= {new: raw[old] for old, new in _LEGACY.items() if raw.get(old) is not None}
    pattern = _pattern(view, source)
    if "E" in pattern:
        raise ModelLoadError(f"{source}: Nemotron-H MoE layers ('E' / 'moe' in the layer pattern) are not supported; "
                             "flashllm runs Nemotron-H's Mamba-2 ('M'), attention ('*') and MLP ('-') layers")
    llama_view = {key: value for key, value in view.items() if key not in _UNUSED}
    llama_view |= {"num_hidden_layers": len(pattern), "rms_norm_eps": view["layer_norm_epsilon"],
                   "hidden_act": view["mlp_hidden_act"], "attention_bias": False, "tie_word_embeddings": False}
    activations = ("relu2", *(name for name in PLAIN_ACTIVATIONS if name != "relu2"))
    base = parse_llama_config(llama_view, source, activations=activations)
    return NemotronHConfig(**{f.name: getattr(base, f.name) for f in fields(LlamaModelConfig)},
                           mixer=mixer_sizes(view, _MIXER_NAMES, base.hidden_size, base.rms_norm_eps, source),
                           pattern=pattern)


class NemotronHBlock(nn.Module):
    """norm -> mixer (Mamba-2, attention or MLP by `kind`) added to the residual stream; the add is fused into the
    next norm, so the block returns its output beside the stream it was not yet added to (HybridModel's layers)."""

    def __init__(self, kind: str, config: NemotronHConfig, layer_idx: int, ops: Any, dtype: torch.dtype,
                 device: torch.device, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)
        self.is_attention, self.keeps_state = kind == "*", kind == "M"
        self.self_attn = None  # LlamaForCausalLM.fusions reads it: no fused decoder stack
        self.mixer: nn.Module
        if kind == "M":
            self.mixer = Mamba2Mixer(config.mixer, ops, dtype, device, tp_rank, tp_size)
        elif kind == "*":
            self.mixer = LlamaAttention(config, layer_idx, NoRotary(), ops, dtype, device, False, False, tp_rank,
                                        tp_size)
        else:
            self.mixer = PlainMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, config.hidden_act,
                                  ops, dtype, device, tp_rank, tp_size)

    def forward(self, positions: Tensor, hidden: Tensor, residual: Tensor | None, kv_cache: Any,
                attn_metadata: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """hidden (T, H), residual (T, H) or None before the first layer -> (mixer output, residual stream);
        kv_cache: attention's (k_cache, v_cache), a Mamba layer's (state or None, StateSpans), an MLP's None."""
        if residual is None:
            residual, normed = hidden, self.norm(hidden)
        else:
            normed, residual = self.norm(hidden, residual)
        if self.is_attention:
            return self.mixer(positions, normed, kv_cache, attn_metadata), residual
        if self.keeps_state:
            state, spans = kv_cache
            return self.mixer(normed, state, spans), residual
        return self.mixer(normed), residual


class NemotronHForCausalLM(HybridCausalLM, LlamaForCausalLM):
    """Nemotron-H (module docstring): `model.embeddings` / `backbone.*` (NVIDIA's own checkpoints) load as the
    stack's embed_tokens, `norm_f` as its final norm, q / k / v fused into each attention layer's qkv_proj."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    renamed_modules: ClassVar[dict[str, str]] = {
        "backbone.": "model.", "model.embeddings.": "model.embed_tokens.", "model.norm_f.": "model.norm.",
    }
    kv_scale_suffixes: ClassVar[tuple[str, ...]] = ()
    attention_module: ClassVar[str] = "mixer"
    mamba_module: ClassVar[str] = "mixer"
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> NemotronHConfig:
        """config.json -> NemotronHConfig (parse_nemotron_h_config)."""
        return parse_nemotron_h_config(raw, source)

    def build_stack(self, config: NemotronHConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> HybridModel:
        """One NemotronHBlock per pattern character between the embedding and the final norm."""
        layers = [NemotronHBlock(kind, config, i, ops, dtype, device, tp_rank, tp_size)
                  for i, kind in enumerate(config.pattern)]
        embed = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device, tp_rank, tp_size)
        return HybridModel(embed, layers, RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device))
