"""GGUF export of Phi-3 / Phi-3.5 / Phi-4(-mini) checkpoints (Phi3ForCausalLM) as llama.cpp's converter writes them:
the fused `qkv_proj` and `gate_up_proj` as `attn_qkv` and `ffn_up`, rows as stored (llama.cpp runs phi3 with NEOX
rotary), RoPE over the partial_rotary_factor's features, LongRoPE's factor sets as the `rope_factors_long` /
`rope_factors_short` tensors with `rope.scaling.attn_factor` and `rope.scaling.original_context_length`, and the
sliding window (0 for none).

llama.cpp's phi3 currently ignores the sliding window (it runs full attention and logs so), so a llama.cpp baseline
of a windowed model (Phi-3-mini-4k: 2047) parts from the checkpoint past the window; flashllm, loading the file,
applies the window. The conventions are kept in flashllm.models.gguf.phi3 next to the loader that reads them back.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from flashllm.models.gguf.phi3 import LONG_FACTORS, SHORT_FACTORS
from flashllm.models.phi3 import PHI3_DEFAULT_ORIGINAL_MAX_POSITION
from flashllm.ops.rope_cache import longrope_inv_freq, rope_type_of

logger = logging.getLogger(__name__)

ARCHITECTURE = "Phi3ForCausalLM"
# HF module names (after the layer index) of the fused checkpoint projections -> GGUF's
LAYER_NAMES = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
ROPE_TYPES = ("longrope",)  # written here (factor tensors), not by the generic rope keys


def check(config: Any) -> None:
    """Refuse shapes llama.cpp's phi3 cannot hold (its q and output projections are hidden x hidden); warn that it
    runs a sliding window as full attention. Raises ValueError."""
    if config.num_attention_heads * config.head_dim != config.hidden_size:
        raise ValueError(f"{config.num_attention_heads} heads of {config.head_dim} features != hidden_size "
                         f"{config.hidden_size}: llama.cpp's phi3 sizes attn_qkv and attn_output by the hidden size")
    if rope_type_of(config.rope_scaling) not in ("default", *ROPE_TYPES):
        raise ValueError(f"rope type {rope_type_of(config.rope_scaling)!r}: llama.cpp's phi3 takes plain RoPE or "
                         "LongRoPE's factor tensors")
    if any(window is not None for window in config.sliding_windows):
        logger.warning("llama.cpp's phi3 runs the sliding window (%s) as full attention; its results part from the "
                       "checkpoint's past the window", config.sliding_windows[0])


def add_hparams(writer: Any, config: Any) -> None:
    """The original context length, the sliding window (0: none) and LongRoPE's attention factor."""
    longrope = config.rope_scaling
    raw_original = config.raw.get("original_max_position_embeddings", PHI3_DEFAULT_ORIGINAL_MAX_POSITION)
    writer.add_rope_scaling_orig_ctx_len(int(longrope["original_max_position_embeddings"]) if longrope else raw_original)
    writer.add_sliding_window(config.sliding_windows[0] or 0)
    if longrope:
        _, attention_factor = longrope_inv_freq(config.rotary_dim, config.rope_theta, longrope,
                                                config.max_position_embeddings, long=True)
        writer.add_rope_scaling_attn_factors(attention_factor)


def extra_tensors(config: Any) -> dict[str, np.ndarray]:
    """LongRoPE's long and short factor sets (rotary_dim / 2 F32 values each); none for plain RoPE."""
    if not config.rope_scaling:
        return {}
    return {name: np.asarray(config.rope_scaling[key], dtype=np.float32)
            for name, key in ((LONG_FACTORS, "long_factor"), (SHORT_FACTORS, "short_factor"))}
