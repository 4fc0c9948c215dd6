"""Cohere's config.json (`CohereForCausalLM`, `Cohere2ForCausalLM`): Llama's fields under Cohere's names and defaults,
parsed and validated before anything is allocated."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from flashllm.models.hf_config import MAX_NUM_LAYERS, ModelLoadError, flag, positive_float, positive_int
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config

# transformers' CohereConfig defaults where config.json leaves a field out (or writes null) and Llama's differ
COHERE_DEFAULTS: dict[str, Any] = {"layer_norm_eps": 1e-5, "logit_scale": 0.0625, "tie_word_embeddings": True,
                                   "max_position_embeddings": 8192, "rope_theta": 500000.0, "bos_token_id": 5,
                                   "eos_token_id": 255001}
# Cohere2Config's: RoPE base 10000 (it declares no default_theta), window 4096 on three layers of four
COHERE2_DEFAULTS: dict[str, Any] = {**COHERE_DEFAULTS, "rope_theta": 10000.0}
COHERE2_WINDOW = 4096
COHERE2_PATTERN = 4  # the legacy `sliding_window_pattern`: every 4th layer full
LAYER_TYPES = ("full_attention", "sliding_attention")  # indexed by "is sliding"


@dataclass(frozen=True, slots=True)
class CohereModelConfig(LlamaModelConfig):
    """LlamaModelConfig's fields as Cohere reads them, plus its own:

    rms_norm_eps: the eps of every LayerNorm (config.json's `layer_norm_eps`; Cohere has no RMSNorm).
    rope_interleaved: always true (Cohere rotates adjacent feature pairs).
    logit_scale: the logits are the LM head's product times it.
    use_qk_norm: each query and key head is LayerNormed over head_dim with its own (head_dim,) scale, one row of
      `self_attn.q_norm.weight` (num_heads, head_dim) / `k_norm.weight` (num_kv_heads, head_dim), before RoPE.
    rope_layers: per layer, whether it applies RoPE (Cohere2's full-attention layers do not).
    """

    logit_scale: float = 0.0625
    use_qk_norm: bool = False
    rope_layers: tuple[bool, ...] = ()


def parse_cohere_config(raw: dict[str, Any], source: str = "config.json") -> CohereModelConfig:
    """Validate a CohereForCausalLM config.json (Command R / R+, Aya Expanse): Llama's fields with CohereConfig's
    defaults, no sliding window (CohereConfig has none), RoPE on every layer. ModelLoadError (one line) otherwise."""
    fields = _with_defaults(raw, COHERE_DEFAULTS)
    view = {**fields, "sliding_window": None, "use_sliding_window": False}
    return _cohere_config(view, raw, source, flag(fields, "use_qk_norm", source),
                          (True,) * positive_int(raw, "num_hidden_layers", None, MAX_NUM_LAYERS, source))


def parse_cohere2_config(raw: dict[str, Any], source: str = "config.json") -> CohereModelConfig:
    """Validate a Cohere2ForCausalLM config.json (Command R7B, Command A): Cohere's fields plus its sliding layers,
    `layer_types`, else the legacy `sliding_window_pattern` N (every N-th layer full, 4 by default), as transformers'
    Cohere2Config derives them. Only the sliding layers rotate; the full ones use no positional embedding. Cohere2 has
    no q / k norms (a `use_qk_norm` is ignored, as transformers ignores it). ModelLoadError (one line) otherwise."""
    layers = positive_int(raw, "num_hidden_layers", None, MAX_NUM_LAYERS, source)
    window = raw.get("sliding_window", COHERE2_WINDOW)
    if window is None:
        raise ModelLoadError(f"{source}: sliding_window is null; Cohere 2 rotates only its sliding layers, so "
                             "transformers would run no layer with a position embedding; give the window (4096)")
    types = raw.get("layer_types") or _legacy_layer_types(raw.get("sliding_window_pattern", COHERE2_PATTERN),
                                                          layers, source)
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ModelLoadError(f"{source}: layer_types={types!r}; expected {layers} entries, each one of {LAYER_TYPES}")
    view = {**_with_defaults(raw, COHERE2_DEFAULTS), "sliding_window": window, "layer_types": types,
            "use_sliding_window": True}
    return _cohere_config(view, raw, source, False, tuple(t == "sliding_attention" for t in types))


def _with_defaults(raw: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """config.json over `defaults`, a null field taking its default (as transformers' config classes do); the norms'
    eps under Llama's name, Cohere's MLP without biases whatever `mlp_bias` says (transformers builds it so)."""
    fields = {**defaults, **{key: value for key, value in raw.items() if value is not None}}
    return {**fields, "rms_norm_eps": fields["layer_norm_eps"], "mlp_bias": False}


def _cohere_config(view: dict[str, Any], raw: dict[str, Any], source: str, use_qk_norm: bool,
                   rope_layers: tuple[bool, ...]) -> CohereModelConfig:
    base = parse_llama_config(view, source)
    if base.rotary_dim != base.head_dim:
        raise ModelLoadError(f"{source}: partial_rotary_factor gives rotary_dim={base.rotary_dim} of head_dim="
                             f"{base.head_dim}; Cohere rotates whole heads (transformers ignores the factor): drop it")
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaModelConfig)}
    return CohereModelConfig(**{**fields, "rope_interleaved": True, "raw": raw},
                             logit_scale=positive_float(view, "logit_scale", COHERE_DEFAULTS["logit_scale"], source),
                             use_qk_norm=use_qk_norm, rope_layers=rope_layers)


def _legacy_layer_types(pattern: Any, layers: int, source: str) -> list[str]:
    """Cohere2Config's layer_types for `sliding_window_pattern` N: layer i slides unless (i + 1) % N == 0."""
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
        raise ModelLoadError(f"{source}: sliding_window_pattern={pattern!r}; expected a positive int (every N-th "
                             "layer uses full attention)")
    return [LAYER_TYPES[(i + 1) % pattern != 0] for i in range(layers)]
