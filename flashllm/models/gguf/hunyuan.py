"""Hunyuan dense GGUF files (`hunyuan-dense`: Hunyuan-0.5B / 1.8B / 4B / 7B-Instruct): run as flashllm's
HunYuanDenseV1ForCausalLM.

What llama.cpp does with them (src/models/hunyuan-dense.cpp, the converter's HunYuanModel): Llama's tensors with
per-head `attn_q_norm` / `attn_k_norm` applied after RoPE, NEOX rotary (Q/K rows as in the checkpoint), the NTK alpha
already folded into `rope.freq_base` by the converter (base * alpha ** (d / (d - 2)), as transformers reads the
checkpoint), no further rope scaling.
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.reader import GGUFFile

ARCH = "hunyuan-dense"


def hunyuan_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The HunYuanDenseV1ForCausalLM config.json fields of a `hunyuan-dense` file (module docstring)."""
    if "blk.0.attn_q_norm.weight" not in gf.tensors:
        raise ModelLoadError(f"{gf.name} has no blk.0.attn_q_norm.weight; llama.cpp's {ARCH} graph norms every query "
                             "and key head after RoPE, so the file is incomplete")
    if raw.get("rope_scaling") is not None:
        raise ModelLoadError(f"{gf.name}: {ARCH}.rope.scaling.type {raw['rope_scaling']['rope_type']!r}; llama.cpp's "
                             f"{ARCH} graph takes its NTK alpha folded into rope.freq_base and no scaling")
    return {}
