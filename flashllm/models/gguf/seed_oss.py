"""Seed-OSS GGUF files (`seed_oss`): run as flashllm's SeedOssForCausalLM.

What llama.cpp does with them (src/models/seed-oss.cpp, the converter's SeedOssModel): Llama's projections with
q / k / v biases where the file has them and none on the output projection (its loader creates no `attn_output`
bias), NEOX rotary (Q/K rows as in the checkpoint), the norm before the MLP named `post_attention_norm`, full
attention on every layer, scores scaled by head_dim ** -0.5 unless `seed_oss.attention.scale` says otherwise (such
files are refused here).
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.reader import GGUFFile

# GGUF layer tensor part -> checkpoint module where Seed-OSS's differ from Llama's
LAYER_NAMES = {"post_attention_norm": "post_attention_layernorm"}


def seed_oss_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The SeedOssForCausalLM config.json fields of a `seed_oss` file (module docstring)."""
    if "blk.0.attn_output.bias" in gf.tensors:
        raise ModelLoadError(f"{gf.name} holds blk.0.attn_output.bias, which llama.cpp's seed_oss graph never reads; "
                             "the file is not one it runs")
    if gf.get("seed_oss.attention.scale"):
        raise ModelLoadError(f"{gf.name}: seed_oss.attention.scale is set; flashllm runs Seed-OSS with "
                             "head_dim ** -0.5 only")
    # without key_length llama.cpp's head size is embedding / heads (not SeedOssConfig's default 128)
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    return {"attention_bias": "blk.0.attn_q.bias" in gf.tensors, "attention_out_bias": False, "head_dim": head_dim}
