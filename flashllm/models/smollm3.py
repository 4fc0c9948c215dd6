"""SmolLM3 (`SmolLM3ForCausalLM`, HuggingFaceTB/SmolLM3-3B): Llama's decoder with RoPE left out of some layers (NoPE).

config.json's `no_rope_layers` lists, per layer, 1 where the layer rotates queries and keys and 0 where it does not;
without the list, every `no_rope_layer_interval`-th layer (4 by default: layers 3, 7, ...) is a NoPE layer, as
transformers' SmolLM3Config derives it. Sliding windows follow `layer_types` (transformers puts them on NoPE layers
when `use_sliding_window` is set). The stack is not a plain LlamaModel, so no fused decoder-stack path applies.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from flashllm.models.hf_config import MAX_NUM_LAYERS, ModelLoadError, flag, positive_int
from flashllm.models.llama import LlamaForCausalLM, LlamaModel
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config

NO_ROPE_INTERVAL = 4  # transformers' SmolLM3Config default


@dataclass(frozen=True, slots=True)
class SmolLM3ModelConfig(LlamaModelConfig):
    """LlamaModelConfig plus rope_layers: per layer, whether it applies RoPE."""

    rope_layers: tuple[bool, ...] = ()


def parse_smollm3_config(raw: dict[str, Any], source: str = "config.json") -> SmolLM3ModelConfig:
    """Validate a SmolLM3 config.json (module docstring); ModelLoadError (one line naming the field) otherwise."""
    layers = positive_int(raw, "num_hidden_layers", None, MAX_NUM_LAYERS, source)
    rope_layers = raw.get("no_rope_layers")
    if rope_layers is None:
        interval = positive_int(raw, "no_rope_layer_interval", NO_ROPE_INTERVAL, MAX_NUM_LAYERS, source)
        rope_layers = [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(rope_layers, list) or len(rope_layers) != layers or any(
            isinstance(x, bool) or x not in (0, 1) for x in rope_layers):
        raise ModelLoadError(f"{source}: no_rope_layers={rope_layers!r}; expected {layers} entries, each 1 (the layer "
                             "applies RoPE) or 0 (it does not)")
    view = dict(raw)
    if view.get("layer_types") is None:  # transformers' rule: windows on the NoPE layers when use_sliding_window
        windowed = flag(raw, "use_sliding_window", source) and raw.get("sliding_window") is not None
        view["layer_types"] = ["sliding_attention" if windowed and not rope else "full_attention" for rope in rope_layers]
    base = parse_llama_config(view, source)
    return SmolLM3ModelConfig(**{f.name: getattr(base, f.name) for f in fields(LlamaModelConfig)},
                              rope_layers=tuple(bool(x) for x in rope_layers))


class NoPositionEmbedding(nn.Module):
    """A NoPE layer's stand-in for the rotary embedding: queries and keys pass unchanged."""

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """positions (T,), q (T, Hq, D), k (T, Hk, D) -> (q, k) as given."""
        return q, k


class SmolLM3Model(LlamaModel):
    """LlamaModel whose NoPE layers' attention skips the rotary embedding."""

    def __init__(self, config: SmolLM3ModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 qkv_bias: bool, o_bias: bool, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, ops, dtype, device, qkv_bias, o_bias, tp_rank, tp_size)
        for layer, rotates in zip(self.layers, config.rope_layers, strict=True):
            if not rotates:
                layer.self_attn.rotary_emb = NoPositionEmbedding()


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3: Llama's checkpoint names and layers, NoPE where config.json says (module docstring)."""

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> SmolLM3ModelConfig:
        """config.json -> SmolLM3ModelConfig, validated (parse_smollm3_config)."""
        return parse_smollm3_config(raw, source)

    def build_stack(self, config: SmolLM3ModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> SmolLM3Model:
        """The decoder stack with its NoPE layers."""
        return SmolLM3Model(config, ops, dtype, device, qkv_bias, o_bias, tp_rank, tp_size)
