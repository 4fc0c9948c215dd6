"""Gemma 3's text config.json (`gemma3_text`) and Gemma 2's (`gemma2`): their fields, parsed and validated before
anything is allocated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flashllm.models.decoder_fields import checkpoint_fields, decoder_sizes
from flashllm.models.hf_config import (
    MAX_HEAD_DIM,
    MAX_NUM_LAYERS,
    ModelLoadError,
    check_rope,
    config_architecture,
    flag,
    normalize_rope,
    positive_float,
    positive_int,
)
from flashllm.models.llama_config import LlamaModelConfig

# transformers' Gemma3TextConfig defaults, for the fields a config.json may leave out
GEMMA3_DEFAULTS: dict[str, Any] = {
    "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
    "max_position_embeddings": 131072, "tie_word_embeddings": True,
}
# transformers' Gemma2Config defaults (the softcaps too: a config.json that leaves them out gets them)
GEMMA2_DEFAULTS: dict[str, Any] = {
    "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "max_position_embeddings": 8192,
    "tie_word_embeddings": True, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
}
# transformers' GemmaConfig defaults (Gemma 1)
GEMMA_DEFAULTS: dict[str, Any] = {"head_dim": 256, "max_position_embeddings": 8192, "tie_word_embeddings": True}
# Gemma 1's config.json `hidden_act`: "gelu" is the official releases' legacy value for the tanh approximation
GEMMA_ACTIVATIONS = {"gelu": "gelu_pytorch_tanh", "gelu_pytorch_tanh": "gelu_pytorch_tanh"}
GLOBAL_ROPE_THETA = 1_000_000.0  # full-attention layers (config.json `rope_theta`)
LOCAL_ROPE_THETA = 10_000.0      # sliding-window layers (config.json `rope_local_base_freq`)
LAYER_TYPES = ("sliding_attention", "full_attention")
# config.json hidden_activation -> gelu_and_mul's `approximate`
GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh"}


@dataclass(frozen=True, slots=True)
class Gemma3ModelConfig(LlamaModelConfig):
    """LlamaModelConfig's fields (rope_theta / rope_scaling: the full-attention layers' RoPE; sliding_windows:
    `sliding_window` on the sliding layers, None on the full ones; qk_norm always set) plus Gemma 3's own:

    query_pre_attn_scalar: attention scores are scaled by its -1/2 power (not head_dim's).
    local_rope_theta / local_rope_scaling: the sliding layers' RoPE (`rope_local_base_freq`, unscaled).
    final_logit_softcapping: logits become cap * tanh(logits / cap) (None: not capped).
    gelu_approximate: the GeGLU MLP's GELU ("tanh" for `gelu_pytorch_tanh`).
    attn_logit_softcapping: attention scores become cap * tanh(score / cap) (Gemma 2; None for Gemma 3).
    Gemma 2 has no per-head q / k norms (qk_norm false) and one RoPE for both kinds of layer.
    """

    query_pre_attn_scalar: float = 256.0
    local_rope_theta: float = LOCAL_ROPE_THETA
    local_rope_scaling: dict[str, Any] | None = None
    final_logit_softcapping: float | None = None
    gelu_approximate: str = "tanh"
    attn_logit_softcapping: float | None = None


def parse_gemma3_config(raw: dict[str, Any], source: str = "config.json") -> Gemma3ModelConfig:
    """Validate a Gemma 3 text config.json (Gemma3ForCausalLM) and return its typed view.

    Both layouts: transformers 5's `layer_types` and per-layer-type `rope_parameters`, and the Hub's
    older `sliding_window_pattern` (every N-th layer full) with `rope_theta`, `rope_scaling` (full layers)
    and `rope_local_base_freq` (sliding layers). Raises ModelLoadError (one line) on what this model cannot
    run: attention logit softcapping (Gemma 2's), bidirectional attention, another activation, a
    pre-quantized checkpoint, or a malformed field.
    """
    if raw.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(f"{source}: attn_logit_softcapping={raw['attn_logit_softcapping']!r} (Gemma 2's tanh cap "
                             "on attention scores) is not part of Gemma 3; expected null")
    _refuse_unsupported(raw, source)
    fields = {**GEMMA3_DEFAULTS, **raw}
    return _parse(raw, fields, source, _ropes(raw, source), qk_norm=True, attn_softcap=None)


def parse_gemma2_config(raw: dict[str, Any], source: str = "config.json") -> Gemma3ModelConfig:
    """Validate a Gemma 2 config.json (Gemma2ForCausalLM): Gemma 3's block without q / k norms, one RoPE
    (`rope_parameters` or `rope_theta` / `rope_scaling`) for every layer, sliding and full layers alternating
    (the even ones slide; `layer_types` where given), attention scores capped by attn_logit_softcapping and logits
    by final_logit_softcapping (transformers' defaults 50 and 30 where absent, none where null). Raises
    ModelLoadError (one line) as parse_gemma3_config does."""
    _refuse_unsupported(raw, source)
    fields = {**GEMMA2_DEFAULTS, **raw}
    layers = positive_int(fields, "num_hidden_layers", None, MAX_NUM_LAYERS, source)
    if fields.get("layer_types") is None:
        fields["layer_types"] = [LAYER_TYPES[i % 2] for i in range(layers)]
    rope = normalize_rope(raw, source)
    softcap = fields.get("attn_logit_softcapping")
    return _parse(raw, fields, source, (rope, rope), qk_norm=False,
                  attn_softcap=None if softcap is None else positive_float(fields, "attn_logit_softcapping", 0, source))


def parse_gemma_config(raw: dict[str, Any], source: str = "config.json") -> Gemma3ModelConfig:
    """Validate a Gemma 1 config.json (GemmaForCausalLM): Llama's pre-norm layers with Gemma's norms, GeGLU (its
    `hidden_act`, where "gelu" means the tanh approximation, as transformers reads it) and scaled embedding; full
    attention, scores scaled by head_dim ** -0.5, one RoPE. Raises ModelLoadError (one line) otherwise."""
    _refuse_unsupported(raw, source)
    fields = {**GEMMA_DEFAULTS, **raw}
    act = raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GEMMA_ACTIVATIONS:
        raise ModelLoadError(f"{source}: hidden_act={act!r} is not supported; Gemma's GeGLU MLP runs "
                             f"{sorted(GEMMA_ACTIVATIONS)} (both the tanh approximation)")
    layers = positive_int(fields, "num_hidden_layers", None, MAX_NUM_LAYERS, source)
    head_dim = positive_int(fields, "head_dim", None, MAX_HEAD_DIM, source)
    fields.update(layer_types=[LAYER_TYPES[1]] * layers, query_pre_attn_scalar=head_dim, final_logit_softcapping=None)
    rope = normalize_rope(raw, source)
    return _parse({**raw, "hidden_activation": GEMMA_ACTIVATIONS[act]}, fields, source, (rope, rope), qk_norm=False,
                  attn_softcap=None)


def _parse(raw: dict[str, Any], fields: dict[str, Any], source: str,
           ropes: tuple[tuple[float, dict | None], tuple[float, dict | None]], qk_norm: bool,
           attn_softcap: float | None) -> Gemma3ModelConfig:
    """The Gemma3ModelConfig of either family's fields (raw over the family's defaults)."""
    sizes = decoder_sizes(fields, source, max_position_default=fields["max_position_embeddings"])
    act = raw.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in GELU_APPROXIMATIONS:
        raise ModelLoadError(f"{source}: hidden_activation={act!r} is not supported; Gemma's GeGLU MLP "
                             f"runs {sorted(GELU_APPROXIMATIONS)}")
    (theta, scaling), (local_theta, local_scaling) = ropes
    for base, rope in ((theta, scaling), (local_theta, local_scaling)):
        check_rope(sizes["head_dim"], base, rope, sizes["max_position_embeddings"], source)
    softcap = fields.get("final_logit_softcapping")
    return Gemma3ModelConfig(
        architecture=config_architecture(raw, source),
        model_type=str(raw.get("model_type", "")),
        rms_norm_eps=positive_float(raw, "rms_norm_eps", 1e-6, source),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=sizes["head_dim"],
        attention_bias=flag(raw, "attention_bias", source),
        mlp_bias=False,
        hidden_act=act,
        sliding_windows=_sliding_windows(fields, sizes["num_hidden_layers"], source),
        raw=raw,
        qk_norm=qk_norm,
        query_pre_attn_scalar=positive_float(fields, "query_pre_attn_scalar", 256.0, source),
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
        final_logit_softcapping=None if softcap is None else positive_float(fields, "final_logit_softcapping", 0,
                                                                            source),
        gelu_approximate=GELU_APPROXIMATIONS[act],
        attn_logit_softcapping=attn_softcap,
        **sizes,
        **checkpoint_fields(fields, source),
    )


def _refuse_unsupported(raw: dict[str, Any], source: str) -> None:
    if flag(raw, "use_bidirectional_attention", source):
        raise ModelLoadError(f"{source}: use_bidirectional_attention=true is an encoder's attention; flashllm "
                             "runs Gemma as a causal LM only")
    if raw.get("quantization_config") is not None:
        raise ModelLoadError(f"{source}: Gemma loads float checkpoints only (quantize them at load with "
                             "--quant_type); drop quantization_config or use a float checkpoint")


def _ropes(raw: dict[str, Any], source: str) -> tuple[tuple[float, dict | None], tuple[float, dict | None]]:
    """((theta, scaling) of the full layers, (theta, scaling) of the sliding layers), from either layout."""
    params = raw.get("rope_parameters")
    if params is None:
        full = normalize_rope({"rope_scaling": raw.get("rope_scaling"),
                               "rope_theta": raw.get("rope_theta", GLOBAL_ROPE_THETA)}, source)
        return full, (positive_float(raw, "rope_local_base_freq", LOCAL_ROPE_THETA, source), None)
    if not isinstance(params, dict) or not set(params) <= set(LAYER_TYPES):
        raise ModelLoadError(f"{source}: rope_parameters={params!r} must map {' and '.join(LAYER_TYPES)} to their "
                             "RoPE settings, as transformers writes Gemma 3's")
    full = normalize_rope({"rope_parameters": params.get("full_attention") or {}, "rope_theta": GLOBAL_ROPE_THETA},
                          f"{source} rope_parameters.full_attention")
    local = normalize_rope({"rope_parameters": params.get("sliding_attention") or {}, "rope_theta": LOCAL_ROPE_THETA},
                           f"{source} rope_parameters.sliding_attention")
    return full, local


def _sliding_windows(fields: dict[str, Any], num_layers: int, source: str) -> tuple[int | None, ...]:
    """`sliding_window` on each sliding layer, None on each full one: `layer_types` where given, else
    transformers' rule for `sliding_window_pattern` N (layer i is full when (i + 1) % N == 0)."""
    layer_types = fields.get("layer_types")
    if layer_types is None:
        pattern = positive_int(fields, "sliding_window_pattern", None, MAX_NUM_LAYERS, source)
        layer_types = [LAYER_TYPES[(i + 1) % pattern == 0] for i in range(num_layers)]
    if (not isinstance(layer_types, list) or len(layer_types) != num_layers
            or any(t not in LAYER_TYPES for t in layer_types)):
        raise ModelLoadError(f"{source}: layer_types must list {num_layers} entries, each one of {LAYER_TYPES}")
    window = fields.get("sliding_window")
    if "sliding_attention" in layer_types and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ModelLoadError(f"{source}: sliding_window={window!r} must be a positive int (the sliding layers' window)")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)
