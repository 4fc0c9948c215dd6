"""Apertus GGUF files (`apertus`: Apertus-8B / 70B and their -Instruct): run as flashllm's ApertusForCausalLM.

What llama.cpp does with them (src/models/apertus.cpp: its hparams, tensors and graph; the converter's ApertusModel):
Llama's RMSNorms (`attn_norm`, `ffn_norm`, `output_norm`, eps `attention.layer_norm_rms_epsilon`); each query and key
head RMS-normed by `attn_q_norm` / `attn_k_norm` (head_dim wide) before RoPE over half-split pairs (Q/K rows as in the
checkpoint), with llama3's per-frequency divisors from `rope_freqs` where the file has it; the ungated MLP
ffn_down(xielu(ffn_up(x))), whose xIELU scalars are metadata, not tensors: `xielu.alpha_p`, `xielu.alpha_n`,
`xielu.beta` and `xielu.eps` (no arch prefix), each an array of one value per layer or one value for every layer, the
alphas as the checkpoint stores them (the graph takes their softplus, as transformers does); an `output` head, which
the loader requires. Its graph adds no q / k / v biases, and an `attn_output` bias only: a file with any attention
bias (flashllm's Apertus biases all four projections or none), norm biases or an `ffn_gate`, or without `output`, is
refused, as is one lacking an xIELU key or holding the wrong number of values.
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.graph_checks import check_tensors
from flashllm.models.gguf.reader import GGUFFile

ARCH = "apertus"
XIELU_SCALARS = ("alpha_p", "alpha_n", "beta", "eps")  # the keys `xielu.<name>`, the config fields `xielu_<name>`
_REQUIRED = ("output.weight", "blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight")
_UNREAD = ("blk.0.ffn_gate.weight", "blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias",
           "blk.0.attn_output.bias", "blk.0.attn_q_norm.bias", "blk.0.attn_k_norm.bias")


def apertus_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The ApertusForCausalLM config.json fields of an `apertus` file (module docstring): RoPE spelled out as
    rope_parameters (a file without rope_freqs runs plain RoPE, not ApertusConfig's llama3 default) and each
    layer's xIELU scalars as `xielu_<name>` lists, which ApertusForCausalLM loads where the checkpoint has no
    act_fn tensors."""
    check_tensors(gf, ARCH, _REQUIRED, _UNREAD)
    layers = raw["num_hidden_layers"]
    fields: dict[str, Any] = {"hidden_act": "xielu", "attention_bias": False,
                              "rope_parameters": {"rope_type": "default", **(raw.get("rope_scaling") or {}),
                                                  "rope_theta": raw["rope_theta"]}}
    for name in XIELU_SCALARS:
        fields[f"xielu_{name}"] = _per_layer(gf, f"xielu.{name}", layers)
    return fields


def _per_layer(gf: GGUFFile, key: str, layers: int) -> list[float]:
    """`key`'s value for each of `layers` layers (one number: every layer's), as llama.cpp's get_key_or_arr reads
    it; ModelLoadError where it is missing, not numbers, or an array of another length."""
    value = gf.get(key)
    values = value if isinstance(value, list) else [value] * layers
    if len(values) != layers or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        found = f"an array of {len(value)}" if isinstance(value, list) else repr(value)
        raise ModelLoadError(f"{gf.name}: {key} is {found}; llama.cpp's {ARCH} loader requires one number or "
                             f"{layers} (one per layer)")
    return [float(v) for v in values]
