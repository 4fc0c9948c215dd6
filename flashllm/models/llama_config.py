"""The Llama family's config.json (Llama, Qwen2): its fields, parsed and validated before anything is allocated."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from flashllm.models.block_fp8 import block_fp8_size, is_block_fp8
from flashllm.models.decoder_fields import checkpoint_fields, decoder_sizes
from flashllm.models.hf_config import (
    CheckpointQuant,
    ModelLoadError,
    check_rope,
    config_architecture,
    flag,
    normalize_rope,
    parse_quantization_config,
    partial_rotary,
    positive_float,
)


@dataclass(frozen=True, slots=True)
class LlamaModelConfig:
    """The fields of a Llama-family config.json that flashllm's decoder uses, validated.

    `rope_scaling` is None for plain RoPE, else an HF-form dict with a "rope_type" key (e.g.
    {"rope_type": "llama3", "factor": 8.0, ...}), the same layout whatever config.json used.
    `torch_dtype` is the checkpoint's declared dtype (None when config.json does not say).
    `sliding_windows[i]` is the attention window of layer i (None = full attention).
    `quantization` describes a GPTQ / AWQ checkpoint's packed linear weights (None: float).
    `qk_norm`: each query and key head is RMS-normed over head_dim (its own (head_dim,) scales,
    `self_attn.q_norm` / `self_attn.k_norm`) before the rotary embedding, as in Qwen3.
    `rope_interleaved`: RoPE turns adjacent feature pairs (2i, 2i + 1) (GPT-J style, ERNIE 4.5), not halves.
    `fp8_block`: the (rows, cols) of one scale of a block-FP8 checkpoint (models/block_fp8.py), dequantized as it
    loads (None: not block FP8).
    """

    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rotary_dim: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    torch_dtype: torch.dtype | None
    bos_token_id: int | list[int] | None
    eos_token_id: int | list[int] | None
    sliding_windows: tuple[int | None, ...]
    raw: dict[str, Any] = field(repr=False, compare=False)
    quantization: CheckpointQuant | None = None
    qk_norm: bool = False
    rope_interleaved: bool = False
    fp8_block: tuple[int, int] | None = None

    @property
    def num_parameters(self) -> int:
        """Weights of the attention and MLP projections of every layer, the embedding and the LM head."""
        return _num_parameters(self.hidden_size, self.intermediate_size, self.num_hidden_layers,
                               self.num_attention_heads, self.num_key_value_heads, self.head_dim, self.vocab_size)


def parse_llama_config(raw: dict[str, Any], source: str = "config.json", rotary_default: float = 1.0,
                       activations: tuple[str, ...] = ("silu",), rotary_dim: int | None = None) -> LlamaModelConfig:
    """Validate a Llama-family config.json dict (already checked for `architectures`) and return its typed view.

    rotary_default: the partial_rotary_factor where config.json gives none (GLM-4.5's is 0.5).
    activations: the hidden_act values the family's MLP implements (the gated MLP's: silu).
    rotary_dim: the rotated features as a count, for a family whose config.json gives one (GPT-J's `rotary_dim`,
    which the caller checks against head_dim), in place of partial_rotary_factor.
    Raises ModelLoadError (one line) on a missing or non-positive required field, a size past the
    sanity limits, inconsistent head counts, invalid rope settings or an activation not in `activations`.
    """
    sizes = decoder_sizes(raw, source)
    if rotary_dim is None:
        rotary_dim, rope_raw = partial_rotary(raw, sizes["head_dim"], rotary_default, source)
    else:
        rope_raw = raw
    rope_theta, rope_scaling = normalize_rope(rope_raw, source)
    hidden_act = raw.get("hidden_act", activations[0])
    if hidden_act not in activations:
        raise ModelLoadError(
            f"{source}: hidden_act={hidden_act!r} is not supported; this family's MLP in flashllm implements "
            + ", ".join(repr(name) for name in activations)
        )
    check_rope(rotary_dim, rope_theta, rope_scaling, sizes["max_position_embeddings"], source)
    qc = raw.get("quantization_config")
    fp8_block = block_fp8_size(qc, source, config_architecture(raw, source)) if is_block_fp8(qc) else None
    return LlamaModelConfig(
        architecture=config_architecture(raw, source),
        model_type=str(raw.get("model_type", "")),
        rms_norm_eps=positive_float(raw, "rms_norm_eps", 1e-6, source),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rotary_dim=rotary_dim,
        attention_bias=flag(raw, "attention_bias", source),
        mlp_bias=flag(raw, "mlp_bias", source),
        hidden_act=hidden_act,
        sliding_windows=_sliding_windows(raw, sizes["num_hidden_layers"], source),
        raw=raw,
        quantization=None if fp8_block else parse_quantization_config(qc, _linear_inputs(sizes), source),
        fp8_block=fp8_block,
        **sizes,
        **checkpoint_fields(raw, source),
    )


def _num_parameters(hidden: int, intermediate: int, num_layers: int, num_heads: int, num_kv_heads: int,
                    head_dim: int, vocab: int) -> int:
    attn = hidden * head_dim * (2 * num_heads + 2 * num_kv_heads)
    mlp = 3 * hidden * intermediate
    return num_layers * (attn + mlp) + 2 * vocab * hidden


def _sliding_windows(raw: dict[str, Any], num_layers: int, source: str) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    enabled = raw.get("use_sliding_window", window is not None)
    if not enabled or window is None:
        return (None,) * num_layers
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ModelLoadError(f"{source}: sliding_window={window!r} must be a positive int")
    layer_types = raw.get("layer_types")
    if isinstance(layer_types, list) and len(layer_types) == num_layers:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    # Qwen2's legacy rule: layers from max_window_layers on use the window.
    first = raw.get("max_window_layers", 0)
    return tuple(window if i >= first else None for i in range(num_layers))


def _linear_inputs(sizes: dict[str, int]) -> tuple[int, ...]:
    """in_features of the decoder's linear layers: hidden (qkv, gate_up), heads (o), intermediate (down)."""
    return sizes["hidden_size"], sizes["num_attention_heads"] * sizes["head_dim"], sizes["intermediate_size"]
