"""Phi-3 / Phi-3.5 / Phi-4(-mini) GGUF files (`phi3`): fused projections, LongRoPE factor tensors, partial rotary.

What llama.cpp does with a `phi3` file (src/models/phi3.cpp, its hparams, tensors and graph; src/llama-model.cpp's
get_rope_factors and rope types; src/llama-context.cpp's attention factor; convert_hf_to_gguf.py's Phi3MiniModel):

- `blk.N.attn_qkv` is the checkpoint's `qkv_proj` (q rows, then k, then v) and `blk.N.ffn_up` its `gate_up_proj`
  (gate rows, then up: the graph's SwiGLU takes silu of the first half times the second), both as stored. They
  split here along rows, between whole rows of blocks, so quantized blocks stay as stored.
- Q/K rows are not reordered: llama.cpp runs phi3 with NEOX (half-split) rotary, over `rope.dimension_count`
  features of each head (the converter writes int(partial_rotary_factor * hidden) // heads).
- LongRoPE: the converter writes `rope_factors_long.weight` and `rope_factors_short.weight` (rope_dims / 2 divisors
  each), `rope.scaling.attn_factor` (cos and sin are multiplied by it; llama.cpp's default is 1) and
  `rope.scaling.original_context_length`; `context_length` is max_position_embeddings. llama.cpp picks the long
  set for a whole context larger than the original length; flashllm, as transformers, per sequence (models/phi3.py).
- `attention.sliding_window` (0: none) is written by the converter, but llama.cpp's phi3 currently disables it and
  runs every layer with full attention; flashllm applies the window, as the checkpoint's model does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.reader import GGUFFile

LONG_FACTORS = "rope_factors_long.weight"
SHORT_FACTORS = "rope_factors_short.weight"
FACTOR_TENSORS = (LONG_FACTORS, SHORT_FACTORS)


def fused_rows(config: Any) -> dict[str, tuple[tuple[str, int], ...]]:
    """GGUF layer part of a fused tensor -> (checkpoint module, its rows) of each part, in the tensor's row order."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    ffn = config.intermediate_size
    return {"attn_qkv": (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)),
            "ffn_up": (("mlp.gate_proj", ffn), ("mlp.up_proj", ffn))}


def phi3_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The Phi3 config.json fields of a `phi3` file: partial rotary, LongRoPE from the factor tensors, the window."""
    if raw.get("rope_scaling") is not None:
        raise ModelLoadError(f"{gf.name}: phi3.rope.scaling.type {raw['rope_scaling']['rope_type']!r}: llama.cpp's phi3 "
                             "scales RoPE only by the rope_factors tensors (LongRoPE); not supported")
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    rope_dims = _whole(gf, "phi3.rope.dimension_count", head_dim)
    if rope_dims > head_dim or rope_dims % 2:
        raise ModelLoadError(f"{gf.name}: phi3.rope.dimension_count={rope_dims}; expected an even number of at most "
                             f"the {head_dim} head features")
    partial = rope_dims / head_dim
    if int(head_dim * partial) != rope_dims:
        raise ModelLoadError(f"{gf.name}: rope over {rope_dims} of {head_dim} head features is no "
                             "partial_rotary_factor flashllm's Phi3 can express")
    window = _whole(gf, "phi3.attention.sliding_window", 0)
    original = _whole(gf, "phi3.rope.scaling.original_context_length", raw["max_position_embeddings"])
    fields: dict[str, Any] = {"partial_rotary_factor": partial, "sliding_window": window or None,
                              "original_max_position_embeddings": original}
    longrope = _longrope(gf, rope_dims)
    if longrope is not None:
        fields["rope_scaling"] = longrope
    return fields


def _longrope(gf: GGUFFile, rope_dims: int) -> dict[str, Any] | None:
    """The LongRoPE rope_scaling of the factor tensors and attn_factor, None for a file without them."""
    present = [name for name in FACTOR_TENSORS if name in gf.tensors]
    attn_factor = gf.get("phi3.rope.scaling.attn_factor")
    if not present:
        if attn_factor is not None and attn_factor != 1.0:
            raise ModelLoadError(f"{gf.name}: phi3.rope.scaling.attn_factor={attn_factor!r} without rope_factors "
                                 "tensors; flashllm's Phi3 scales cos / sin only under LongRoPE, re-convert the file")
        return None
    if len(present) != len(FACTOR_TENSORS):
        raise ModelLoadError(f"{gf.name} holds {present[0]} without its pair ({', '.join(FACTOR_TENSORS)}); "
                             "LongRoPE needs both factor sets, the file is incomplete")
    if attn_factor is None:
        attn_factor = 1.0  # llama.cpp's rope_attn_factor default
    if isinstance(attn_factor, bool) or not isinstance(attn_factor, (int, float)) or not 0 < attn_factor < 1e3:
        raise ModelLoadError(f"{gf.name}: phi3.rope.scaling.attn_factor is {attn_factor!r}; expected a positive number")
    sets = {}
    for key, name in (("long_factor", LONG_FACTORS), ("short_factor", SHORT_FACTORS)):
        tensor = gf.tensors[name]
        values = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
        if tensor.tensor_type.name != "F32" or values.size != rope_dims // 2:
            raise ModelLoadError(f"{gf.name}: {name} must be F32 with rope.dimension_count / 2 = {rope_dims // 2} "
                                 f"values; it is {tensor.tensor_type.name} with {values.size}")
        sets[key] = [float(v) for v in values]
    return {"rope_type": "longrope", **sets, "attention_factor": float(attn_factor)}


def _whole(gf: GGUFFile, key: str, default: int) -> int:
    value = gf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelLoadError(f"{gf.name}: {key} is {value!r}; expected a whole number")
    return value
