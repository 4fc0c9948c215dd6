"""Meta's Code World Model (`CwmForCausalLM`, facebook/cwm): Llama's decoder (GQA, bias-free projections, SwiGLU,
head_dim 128) whose layers `layer_types` calls "sliding_attention" attend over the last `sliding_window` tokens (by
default every layer but each fourth, from the first), with llama3-scaled RoPE by default."""

from __future__ import annotations

from typing import Any, ClassVar

from flashllm.models.errors import ModelLoadError
from flashllm.models.hf_config import MAX_NUM_LAYERS, positive_int
from flashllm.models.llama_config import LlamaModelConfig
from flashllm.models.mistral import LAYER_TYPES, MistralForCausalLM, parse_mistral_config
from flashllm.models.olmo2 import refuse_prequantized

CWM = "CwmForCausalLM"
CWM_ROPE_THETA = 1_000_000.0  # CwmConfig's default_theta
# transformers' CwmConfig defaults (cwm-32b's sizes) where a config.json leaves a field out
CWM_DEFAULTS: dict[str, Any] = {
    "vocab_size": 128256, "hidden_size": 6144, "intermediate_size": 21504, "num_hidden_layers": 64,
    "num_attention_heads": 48, "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "tie_word_embeddings": False, "head_dim": 128,
    "sliding_window": 8192,
}
# the RoPE CwmConfig gives a config.json without rope_parameters or rope_scaling (whatever its rope_theta says)
CWM_ROPE: dict[str, Any] = {"rope_type": "llama3", "rope_theta": CWM_ROPE_THETA, "factor": 16.0,
                            "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}
WINDOW_PATTERN = 4  # by default layer i is full when i % 4 == 0, else sliding


def parse_cwm_config(raw: dict[str, Any], source: str = "config.json") -> LlamaModelConfig:
    """Validate a CwmForCausalLM config.json as transformers' CwmConfig reads it: its defaults where a field is
    absent or null, layer_types by WINDOW_PATTERN, CWM_ROPE when no RoPE dict is given. Refuses a top-level
    rope_theta that CwmConfig would ignore, a window of 0 / null (CwmConfig's window is an int), q / k / v / o or MLP
    biases, and pre-quantized checkpoints (one-line ModelLoadError)."""
    refuse_prequantized(raw, source)
    view = {**CWM_DEFAULTS, **{key: value for key, value in raw.items() if value is not None}}
    for key in ("attention_bias", "mlp_bias"):
        if view.get(key):
            raise ModelLoadError(f"{source}: {key}={view[key]!r} is not supported; {CWM}'s projections have no biases")
    if isinstance(view["sliding_window"], bool) or not isinstance(view["sliding_window"], int) or (
            view["sliding_window"] <= 0):
        raise ModelLoadError(f"{source}: sliding_window={raw.get('sliding_window')!r} must be a positive int "
                             f"({CWM}'s sliding layers always have a window)")
    if not raw.get("rope_parameters") and not raw.get("rope_scaling"):
        theta = raw.get("rope_theta", CWM_ROPE_THETA)
        if theta != CWM_ROPE_THETA:
            raise ModelLoadError(f"{source}: rope_theta={theta!r} without rope_parameters: transformers' CwmConfig "
                                 f"ignores it and rotates by {CWM_ROPE}; write rope_parameters")
        view["rope_parameters"] = CWM_ROPE
    else:
        view.setdefault("rope_theta", CWM_ROPE_THETA)
    if "layer_types" not in view:
        layers = positive_int(view, "num_hidden_layers", None, MAX_NUM_LAYERS, source)
        view["layer_types"] = [LAYER_TYPES[i % WINDOW_PATTERN != 0] for i in range(layers)]
    return parse_mistral_config(view, source, layer_types=True)


class CwmForCausalLM(MistralForCausalLM):
    """CWM: Llama's checkpoint names and layers with per-layer sliding windows (module docstring); float
    checkpoints only."""

    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig with per-layer windows (see parse_cwm_config)."""
        return parse_cwm_config(raw, source)
