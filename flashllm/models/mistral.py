"""Mistral decoder: Llama's layers with sliding-window attention on every layer (Mistral-7B v0.1), or on the layers
`layer_types` names (Ministral-8B-Instruct-2410's `MinistralForCausalLM`)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from flashllm.models.errors import ModelLoadError
from flashllm.models.llama import LlamaForCausalLM
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config

# transformers' MistralConfig default: a config.json without the `sliding_window` key attends over
# this many tokens (a key set to null means full attention, as in Mistral-7B v0.2 and later)
DEFAULT_SLIDING_WINDOW = 4096
LAYER_TYPES = ("full_attention", "sliding_attention")  # indexed by "is sliding"
# transformers' MinistralConfig defaults where config.json leaves a field out (8 key / value heads, not one per query
# head as Llama's)
MINISTRAL_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6,
    "bos_token_id": 1, "eos_token_id": 2,
}


def parse_mistral_config(raw: dict[str, Any], source: str = "config.json",
                         layer_types: bool = False) -> LlamaModelConfig:
    """config.json -> LlamaModelConfig with sliding_windows set from `sliding_window`.

    `sliding_window`: a positive int, null (full attention) or absent (DEFAULT_SLIDING_WINDOW, transformers'
    default). Mistral windows every layer (Qwen2's use_sliding_window / max_window_layers do not apply); with
    layer_types (Ministral, over MINISTRAL_DEFAULTS) the window is on the layers `layer_types` calls
    "sliding_attention" (absent: every layer, or none when the window is null). Other fields as
    parse_llama_config; ModelLoadError (one line) on a bad window or layer_types.
    """
    if layer_types:
        raw = {**MINISTRAL_DEFAULTS, **raw}
    config = parse_llama_config(raw, source)
    window = raw.get("sliding_window", DEFAULT_SLIDING_WINDOW)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ModelLoadError(f"{source}: sliding_window={window!r} must be a positive int or null")
    layers = config.num_hidden_layers
    types = (raw.get("layer_types") if layer_types else None) or [LAYER_TYPES[window is not None]] * layers
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ModelLoadError(f"{source}: layer_types={types!r}; expected {layers} entries, each one of {LAYER_TYPES}")
    if window is None and LAYER_TYPES[1] in types:
        raise ModelLoadError(f"{source}: layer_types has sliding_attention layers but sliding_window is null; give "
                             "the window, or make every layer full_attention")
    windows = tuple(window if t == LAYER_TYPES[1] else None for t in types)
    return dataclasses.replace(config, sliding_windows=windows)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama's decoder (GQA, RoPE, SwiGLU, no biases) whose layers attend over the last
    `sliding_window` tokens: a query at position p sees keys p - W < k <= p.

    The KV cache keeps every token (the window is a mask in paged_attention, so prefix caching
    and chunked prefill work unchanged); an explicit `head_dim` (Mistral-Nemo) is honoured.
    """

    attention_needs: ClassVar[tuple[str, ...]] = ("sliding window",)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig, every layer windowed (see parse_mistral_config)."""
        return parse_mistral_config(raw, source)


class MinistralForCausalLM(MistralForCausalLM):
    """Ministral (Ministral-8B-Instruct-2410, model_type "ministral"): Mistral's decoder with the window on the
    layers `layer_types` names (Ministral-8B interleaves sliding and full layers); transformers' MinistralConfig
    defaults for omitted fields."""

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig with per-layer windows (see parse_mistral_config)."""
        return parse_mistral_config(raw, source, layer_types=True)
