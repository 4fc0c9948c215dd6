"""Phi GGUF files (`phi2`: phi-1, phi-1_5, phi-2): run as flashllm's PhiForCausalLM.

What llama.cpp does with them (src/models/phi2.cpp, the converter's Phi2Model): the parallel block, one LayerNorm
with a bias (`attn_norm`, eps `phi2.attention.layer_norm_epsilon`) feeding both the attention and the MLP, whose
outputs add to the stream; q / k / v as `attn_q` / `attn_k` / `attn_v` or one `attn_qkv` (older conversions), biases
on them where the file has them, `attn_output` with a bias; NEOX rotary (Q/K rows as in the checkpoint) over the
first `rope.dimension_count` features of each head; the ungated MLP ffn_down(gelu(ffn_up(x))) with biases and
ggml's tanh-approximated GELU; `output_norm` with a bias and an `output` head with a bias, both required (the loader
never ties the head to the embedding).
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.graph_checks import check_tensors, layer_norm_eps, rotary_factor
from flashllm.models.gguf.reader import GGUFFile

ARCH = "phi2"
# GGUF layer tensor part -> checkpoint module where Phi's differ from Llama's
LAYER_NAMES = {"attn_output": "self_attn.dense", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
# tensors the phi2 graph requires (its loader refuses a file without them) / never reads
_REQUIRED = ("output.weight", "output.bias", "blk.0.attn_output.bias", "blk.0.ffn_up.bias")
_UNREAD = ("blk.0.ffn_gate.weight", "blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight")


def phi2_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The PhiForCausalLM config.json fields of a `phi2` file (module docstring)."""
    eps = layer_norm_eps(gf, ARCH)
    check_tensors(gf, ARCH, _REQUIRED, _UNREAD)
    if not any(f"blk.0.{part}.bias" in gf.tensors for part in ("attn_q", "attn_qkv")):
        raise ModelLoadError(f"{gf.name} has no q / k / v biases; flashllm's Phi (as transformers') always has them")
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    partial = rotary_factor(gf, ARCH, head_dim)
    return {"layer_norm_eps": float(eps), "partial_rotary_factor": partial, "hidden_act": "gelu_new",
            "tie_word_embeddings": False}
