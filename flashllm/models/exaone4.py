"""EXAONE 4.0 (`Exaone4ForCausalLM`, LGAI-EXAONE/EXAONE-4.0-*): OLMo 2's post-norm block with Qwen3's per-head q / k
RMSNorms, and in the hybrid checkpoints sliding-window layers beside global ones that use no RoPE.

Which layers slide: `layer_types`, else transformers' rule for `sliding_window_pattern` (an int N: every N-th layer
is global; a string such as "LLLG": "L" local, "G" global, repeated); without `sliding_window` every layer is global.
RoPE: with a sliding window only the sliding layers rotate (the global ones are NoPE); without one, every layer does.
Unlike OLMo 2's whole-projection norms, these norms are per head, so tensor parallelism works.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from flashllm.models.hf_config import MAX_NUM_LAYERS, ModelLoadError, positive_int
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import LlamaAttention
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
from flashllm.models.olmo2 import Olmo2ForCausalLM, Olmo2Model, refuse_prequantized
from flashllm.models.smollm3 import NoPositionEmbedding, SmolLM3ModelConfig

LAYER_TYPES = ("full_attention", "sliding_attention")  # indexed by "is sliding"


def parse_exaone4_config(raw: dict[str, Any], source: str = "config.json") -> SmolLM3ModelConfig:
    """Validate an Exaone4ForCausalLM config.json (module docstring): Llama's fields with per-head q / k norms, the
    sliding layers, and which layers rotate (SmolLM3ModelConfig.rope_layers). ModelLoadError (one line) otherwise."""
    refuse_prequantized(raw, source)
    view, rope_layers = hybrid_layers(raw, source)
    base = dataclasses.replace(parse_llama_config(view, source), qk_norm=True)
    return SmolLM3ModelConfig(**{f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaModelConfig)},
                              rope_layers=rope_layers)


def hybrid_layers(raw: dict[str, Any], source: str) -> tuple[dict[str, Any], tuple[bool, ...]]:
    """(config.json with `layer_types` and `use_sliding_window` filled in for parse_llama_config, per layer whether it
    rotates): EXAONE's sliding layers and NoPE global layers (module docstring); EXAONE MoE reads them alike."""
    layers = positive_int(raw, "num_hidden_layers", None, MAX_NUM_LAYERS, source)
    window = raw.get("sliding_window")
    types = raw.get("layer_types") or _layer_types(raw.get("sliding_window_pattern", 4), window, layers, source)
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ModelLoadError(f"{source}: layer_types must list {layers} entries, each one of {LAYER_TYPES}")
    view = {**raw, "layer_types": types, "use_sliding_window": window is not None}
    return view, tuple(window is None or t == "sliding_attention" for t in types)


def _layer_types(pattern: Any, window: Any, layers: int, source: str) -> list[str]:
    """transformers' layer_types for `sliding_window_pattern` (module docstring)."""
    if window is None:
        return [LAYER_TYPES[0]] * layers
    if isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:
        return [LAYER_TYPES[pattern[i % len(pattern)] == "L"] for i in range(layers)]
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        return [LAYER_TYPES[(i + 1) % pattern != 0] for i in range(layers)]
    raise ModelLoadError(f"{source}: sliding_window_pattern={pattern!r}; expected a positive int or a string of "
                         "'L' (local) and 'G' (global) layers")


class Exaone4Attention(LlamaAttention):
    """LlamaAttention with per-head q / k norms (config.qk_norm), biases off: OLMo 2's layer takes it as its attention."""

    def __init__(self, config: LlamaModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, layer_idx, rotary_emb, ops, dtype, device, False, False, tp_rank, tp_size)


class Exaone4Model(Olmo2Model):
    """OLMo 2's stack with EXAONE 4's attention; the global layers of a hybrid model skip RoPE."""

    attention_class = Exaone4Attention

    def __init__(self, config: SmolLM3ModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, ops, dtype, device, tp_rank, tp_size)
        for layer, rotates in zip(self.layers, config.rope_layers, strict=True):
            if not rotates:
                layer.self_attn.rotary_emb = NoPositionEmbedding()


class Exaone4ForCausalLM(Olmo2ForCausalLM):
    """EXAONE 4.0 (module docstring); checkpoint names as OLMo 2's, q / k norms of one head's width."""

    attention_needs = ("sliding window",)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> SmolLM3ModelConfig:
        """config.json -> the typed config, validated (parse_exaone4_config)."""
        return parse_exaone4_config(raw, source)

    def build_stack(self, config: SmolLM3ModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> nn.Module:
        """EXAONE 4's stack."""
        return Exaone4Model(config, ops, dtype, device, tp_rank, tp_size)
