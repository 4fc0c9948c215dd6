"""OLMo (first generation) GGUF files (`olmo`: OLMo-1B-hf, OLMo-7B-hf, OLMo-7B-0424 / 0724): run as flashllm's
OlmoForCausalLM.

What llama.cpp does with them (src/models/olmo.cpp, its hparams and tensors in src/llama-model.cpp, the converter's
OlmoModel): Llama's projections without any bias; every norm (before attention, before the MLP, the final one) a
LayerNorm with neither scale nor shift (the file holds no norm tensors) over eps `olmo.attention.layer_norm_epsilon`,
which the loader requires and the converter always writes as 1e-5; q, k and v each clamped to
[-`olmo.attention.clamp_kqv`, clamp_kqv] before RoPE where that key is positive; RoPE over adjacent pairs, for which
the converter reorders Q/K rows (the loader undoes it); no rope factors; the head `output.weight`, or `token_embd`
where the file has none (OLMo-1B's tied head). Refused: an eps other than 1e-5 (transformers' OlmoLayerNorm, and so
flashllm, fixes it), attention biases or norm / rope_freqs tensors (llama.cpp's olmo loader creates none, so it
rejects the file).
"""

from __future__ import annotations

import math
from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.graph_checks import check_tensors, layer_norm_eps
from flashllm.models.gguf.reader import GGUFFile

ARCH = "olmo"
NORM_EPS = 1e-5  # transformers' OlmoLayerNorm's, whatever config.json says
# tensors llama.cpp's olmo loader does not create (checked in the first layer): it refuses a file holding them
_UNREAD = ("output_norm.weight", "rope_freqs.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight",
           "blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias", "blk.0.attn_output.bias")


def olmo_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The OlmoForCausalLM config.json fields of an `olmo` file (module docstring)."""
    eps = layer_norm_eps(gf, ARCH)
    if not math.isclose(eps, NORM_EPS, rel_tol=1e-6):
        raise ModelLoadError(f"{gf.name}: {ARCH}.attention.layer_norm_epsilon is {eps:.6g}; llama.cpp's olmo graph "
                             f"normalizes with it, OLMo's LayerNorms (and flashllm) with {NORM_EPS}")
    check_tensors(gf, ARCH, (), _UNREAD)
    clamp = gf.get(f"{ARCH}.attention.clamp_kqv")
    if clamp is not None and (isinstance(clamp, bool) or not isinstance(clamp, (int, float))):
        raise ModelLoadError(f"{gf.name}: {ARCH}.attention.clamp_kqv is {clamp!r}; expected a number")
    return {"clip_qkv": float(clamp) if clamp is not None and clamp > 0 else None, "attention_bias": False}
