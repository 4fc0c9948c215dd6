"""The GLM family's config.json (ChatGLM2/3 and GLM-4 `ChatGLMModel`, transformers' `GlmForCausalLM` and `Glm4ForCausalLM`),
validated."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from flashllm.models.decoder_fields import checkpoint_fields, decoder_sizes
from flashllm.models.hf_config import (
    MAX_HEAD_DIM,
    MAX_HIDDEN_SIZE,
    MAX_INTERMEDIATE_SIZE,
    MAX_NUM_HEADS,
    MAX_NUM_LAYERS,
    MAX_POSITION_EMBEDDINGS,
    MAX_VOCAB_SIZE,
    CheckpointQuant,
    ModelLoadError,
    check_rope,
    config_architecture,
    flag,
    normalize_rope,
    partial_rotary,
    positive_float,
    positive_int,
)

SUPPORTED = ("ChatGLM2-6B, ChatGLM3-6B and GLM-4 checkpoints (ChatGLMModel / ChatGLMForConditionalGeneration "
             "with padded_vocab_size and ffn_hidden_size) and transformers' GlmForCausalLM")
# config.json fields only first-generation ChatGLM-6B (2D positions, GLM-130B-style blocks) has
_CHATGLM1_MARKERS = ("position_encoding_2d", "inner_hidden_size", "gmask_token_id")
# ChatGLM's base for RoPE frequencies, which `rope_ratio` multiplies (ChatGLM3-32k, GLM-4)
_CHATGLM_ROPE_BASE = 10000.0


@dataclass(frozen=True, slots=True)
class GLMConfig:
    """What flashllm's GLM decoder needs, the same whichever config.json layout it came from.

    Every GLM block is pre-norm RMSNorm -> attention with a fused qkv projection -> RMSNorm -> SwiGLU
    MLP (gate and up rows fused, gate first). Rotary embedding turns the first `rotary_dim` features of
    each head (half of them in every released checkpoint) in adjacent pairs (GPT-J style, not NeoX
    halves), at frequencies rope_theta ** (-2i / rotary_dim). `qkv_bias`: the qkv projection has a bias;
    `linear_bias`: the attention output and both MLP projections have one (ChatGLM's add_bias_linear);
    `final_norm`: an RMSNorm after the last block (ChatGLM's post_layer_norm); `post_norms`: RMSNorms after the
    attention and after the MLP too, before each residual add (GLM-4-0414's Glm4ForCausalLM).
    """

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    qkv_bias: bool
    linear_bias: bool
    final_norm: bool
    tie_word_embeddings: bool
    torch_dtype: torch.dtype | None
    bos_token_id: int | list[int] | None
    eos_token_id: int | list[int] | None
    raw: dict[str, Any] = field(repr=False, compare=False)
    quantization: CheckpointQuant | None = None
    post_norms: bool = False

    @property
    def num_parameters(self) -> int:
        """Weights of the attention and MLP projections of every layer, the embedding and the output layer."""
        attn = self.hidden_size * self.head_dim * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_hidden_layers * (attn + mlp) + 2 * self.vocab_size * self.hidden_size


def parse_chatglm_config(raw: dict[str, Any], source: str = "config.json") -> GLMConfig:
    """A ChatGLM2/3 or GLM-4 config.json (as its remote code reads it) -> GLMConfig.

    Raises ModelLoadError (one line) for first-generation ChatGLM-6B, GLM-4V, ChatGLM's own quantized
    checkpoints, features no released checkpoint uses (LayerNorm, post-layernorm residuals, fp32
    residuals), missing or non-positive sizes, and group counts that do not divide the head count.
    """
    architecture = config_architecture(raw, source)
    _refuse_unsupported_chatglm(raw, architecture, source)
    hidden = positive_int(raw, "hidden_size", None, MAX_HIDDEN_SIZE, source)
    num_heads = positive_int(raw, "num_attention_heads", None, MAX_NUM_HEADS, source)
    head_dim = _head_dim(raw, "kv_channels", hidden, num_heads, source)
    num_kv_heads = num_heads
    if flag(raw, "multi_query_attention", source):
        num_kv_heads = positive_int(raw, "multi_query_group_num", 1, MAX_NUM_HEADS, source)
        _check_groups(num_heads, num_kv_heads, "multi_query_group_num", source)
    if head_dim % 4 != 0:  # ChatGLM rotates kv_channels // 2 features, in pairs
        raise ModelLoadError(f"{source}: kv_channels={head_dim} must be a multiple of 4 (ChatGLM rotates half "
                             "of each head's features, in pairs)")
    rope_theta = _CHATGLM_ROPE_BASE * positive_float(raw, "rope_ratio", 1.0, source)
    max_position = positive_int(raw, "seq_length", 2048, MAX_POSITION_EMBEDDINGS, source)
    check_rope(head_dim // 2, rope_theta, None, max_position, source)
    return GLMConfig(
        architecture=architecture,
        hidden_size=hidden,
        intermediate_size=positive_int(raw, "ffn_hidden_size", None, MAX_INTERMEDIATE_SIZE, source),
        num_hidden_layers=positive_int(raw, "num_layers", None, MAX_NUM_LAYERS, source),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rotary_dim=head_dim // 2,
        vocab_size=_padded_vocab_size(raw, source),
        max_position_embeddings=max_position,
        rms_norm_eps=positive_float(raw, "layernorm_epsilon", 1e-5, source),
        rope_theta=rope_theta,
        rope_scaling=None,
        qkv_bias=flag(raw, "add_qkv_bias", source),
        linear_bias=flag(raw, "add_bias_linear", source),
        final_norm=flag(raw, "post_layer_norm", source) if "post_layer_norm" in raw else True,
        raw=raw,
        **checkpoint_fields(raw, source),
    )


def _refuse_unsupported_chatglm(raw: dict[str, Any], architecture: str, source: str) -> None:
    """One-line refusals of the ChatGLMModel checkpoints flashllm does not run."""
    marker = next((m for m in _CHATGLM1_MARKERS if m in raw), None)
    if marker is not None or ("padded_vocab_size" not in raw and "ffn_hidden_size" not in raw):
        found = f" ({marker})" if marker else " (no padded_vocab_size or ffn_hidden_size)"
        raise ModelLoadError(f"{source}: {architecture} here is first-generation ChatGLM-6B{found}, which flashllm "
                             f"does not run (2D position encoding); supported: {SUPPORTED}")
    if "vision_config" in raw:
        raise ModelLoadError(f"{source}: {architecture} with a vision_config is GLM-4V (multimodal), which flashllm "
                             f"does not run; supported: {SUPPORTED}")
    bits = raw.get("quantization_bit") or 0
    if bits or raw.get("quantization_config") is not None:
        raise ModelLoadError(f"{source}: this is a quantized ChatGLM checkpoint (quantization_bit={bits!r}, "
                             f"quantization_config={raw.get('quantization_config')!r}); flashllm loads the float "
                             "checkpoint: use it and pass --quant_type to quantize at load")
    if "rmsnorm" in raw and not flag(raw, "rmsnorm", source):
        raise ModelLoadError(f"{source}: rmsnorm=false (LayerNorm blocks) is not supported; flashllm's GLM decoder "
                             "uses RMSNorm, as every ChatGLM2/3 and GLM-4 checkpoint does")
    if raw.get("pre_seq_len") is not None:
        raise ModelLoadError(f"{source}: pre_seq_len={raw['pre_seq_len']!r} marks a P-tuning v2 checkpoint (a learned "
                             "prefix encoder), which flashllm does not run; merge or drop the prefix and set it to null")
    for key in ("apply_residual_connection_post_layernorm", "fp32_residual_connection", "interleaved_qkv"):
        if flag(raw, key, source):
            raise ModelLoadError(f"{source}: {key}=true is not supported; flashllm's GLM decoder reads the released "
                                 f"checkpoints' layout (q, k, v rows one after the other; the residual added un-normed, in "
                                 f"the model dtype), all of which have {key}=false")


def parse_glm_config(raw: dict[str, Any], source: str = "config.json") -> GLMConfig:
    """transformers' GlmForCausalLM config.json (model_type "glm") -> GLMConfig.

    Its defaults are transformers' GlmConfig ones where config.json leaves a field out
    (attention_bias true, partial_rotary_factor 0.5). Raises ModelLoadError (one line) on missing or
    non-positive sizes, head counts that do not divide, an activation other than silu, a quantized
    checkpoint, or invalid rope settings.
    """
    architecture = config_architecture(raw, source)
    sizes = decoder_sizes(raw, source, max_position_default=131072)
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: hidden_act={raw['hidden_act']!r} is not supported; GLM's MLP is SwiGLU (silu)")
    if raw.get("quantization_config") is not None:
        raise ModelLoadError(f"{source}: pre-quantized GlmForCausalLM checkpoints are not supported yet; load the "
                             "float checkpoint and pass --quant_type")
    rotary_dim, rope_raw = partial_rotary(raw, sizes["head_dim"], 0.5, source)
    rope_theta, rope_scaling = normalize_rope(rope_raw, source)
    check_rope(rotary_dim, rope_theta, rope_scaling, sizes["max_position_embeddings"], source)
    return GLMConfig(
        architecture=architecture,
        rotary_dim=rotary_dim,
        rms_norm_eps=positive_float(raw, "rms_norm_eps", 1.5625e-07, source),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        qkv_bias=flag(raw, "attention_bias", source) if "attention_bias" in raw else True,
        linear_bias=False,
        final_norm=True,
        raw=raw,
        **sizes,
        **checkpoint_fields(raw, source),
    )


def parse_glm4_config(raw: dict[str, Any], source: str = "config.json") -> GLMConfig:
    """transformers' Glm4ForCausalLM config.json (model_type "glm4", GLM-4-0414 / GLM-Z1) -> GLMConfig: GLM's fields
    and defaults (parse_glm_config), blocks with the post-attention and post-MLP norms."""
    return dataclasses.replace(parse_glm_config(raw, source), post_norms=True)


def _head_dim(raw: dict[str, Any], key: str, hidden: int, num_heads: int, source: str) -> int:
    if raw.get(key) is None and hidden % num_heads != 0:
        raise ModelLoadError(f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={num_heads} "
                             f"and {key} is not given")
    return positive_int(raw, key, hidden // num_heads, MAX_HEAD_DIM, source)


def _check_groups(num_heads: int, num_groups: int, key: str, source: str) -> None:
    if num_heads % num_groups != 0:
        raise ModelLoadError(f"{source}: num_attention_heads={num_heads} is not divisible by {key}={num_groups}; "
                             "each key/value head serves an equal group of query heads")


def _padded_vocab_size(raw: dict[str, Any], source: str) -> int:
    """Rows of ChatGLM's embedding and output layer: padded_vocab_size (vocab_size when a config lacks it)."""
    key = "padded_vocab_size" if raw.get("padded_vocab_size") is not None else "vocab_size"
    return positive_int(raw, key, None, MAX_VOCAB_SIZE, source)
