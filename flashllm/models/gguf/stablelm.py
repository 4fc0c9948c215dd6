"""StableLM GGUF files (`stablelm`: StableLM 2 1.6B / 12B, StableLM-3B-4E1T, StableCode): run as flashllm's
StableLmForCausalLM.

What llama.cpp does with them (src/models/stablelm.cpp, the converter's StableLMModel): LayerNorms with a bias
(`attn_norm`, `output_norm`, and `ffn_norm` where the file has one; eps `stablelm.attention.layer_norm_epsilon`);
q / k / v as `attn_q` / `attn_k` / `attn_v` (or one `attn_qkv`, all q rows, then k, then v) with biases where the file
has them and none on `attn_output`; where the file has `attn_q_norm` / `attn_k_norm` (StableLM 2 12B; the converter
stacks the checkpoint's one-LayerNorm-per-head `q_layernorm.norms.H.weight` into one (heads, head_dim) tensor, head
order), each query / key head LayerNormed over its features with its own scale row and no bias, before RoPE; NEOX
rotary (rows as in the checkpoint) over the first `stablelm.rope.dimension_count` features of each head, base
`rope.freq_base` (10000 where the file has none: the converter writes none); the gated SiLU MLP without biases; the
parallel residual x + attn(ln(x)) + mlp(ln(x)) in a layer without `ffn_norm` (the graph decides by that tensor, never
by `stablelm.use_parallel_residual`, which the converter writes true where config.json leaves it out), else the
sequential block; an `output` head, which the loader requires (never tied to the embedding).

llama.cpp decides those options layer by layer; flashllm's StableLM takes one setting for every layer, so a file whose
layers differ (or with only some of the q / k / v biases, one of the two head norms, or an ffn_norm without its bias)
is refused.
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.graph_checks import check_tensors, layer_norm_eps, rotary_factor
from flashllm.models.gguf.reader import GGUFFile

ARCH = "stablelm"
# the tensors llama.cpp's stablelm loader requires / that its graph never reads
_REQUIRED = ("output.weight", "output_norm.bias", "blk.0.attn_norm.bias")
_UNREAD = ("blk.0.attn_output.bias", "blk.0.ffn_up.bias", "blk.0.ffn_down.bias", "blk.0.ffn_gate.bias")
# a layer's optional parts -> the tensors that must all be present or all absent (flashllm's one flag each)
_OPTIONS = {"qkv bias": (("attn_q.bias", "attn_k.bias", "attn_v.bias"), ("attn_qkv.bias",)),
            "q / k norms": (("attn_q_norm.weight", "attn_k_norm.weight"),),
            "ffn_norm": (("ffn_norm.weight", "ffn_norm.bias"),)}


def _layer_options(gf: GGUFFile, layer: int) -> dict[str, bool]:
    """Which optional parts layer `layer` has; ModelLoadError for a part only half there."""
    found = {}
    for option, groups in _OPTIONS.items():
        present = [[f"blk.{layer}.{part}" in gf.tensors for part in group] for group in groups]
        whole = [all(group) for group in present]
        if any(any(group) and not all(group) for group in present):
            parts = ", ".join(part for group in groups for part in group)
            raise ModelLoadError(f"{gf.name}: layer {layer} holds only some of {parts}; flashllm's StableLM has all "
                                 f"of its {option} or none")
        found[option] = any(whole)
    return found


def stablelm_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The StableLmForCausalLM config.json fields of a `stablelm` file (module docstring)."""
    eps = layer_norm_eps(gf, ARCH)
    check_tensors(gf, ARCH, _REQUIRED, _UNREAD)
    options = _layer_options(gf, 0)
    for layer in range(1, raw["num_hidden_layers"]):
        if _layer_options(gf, layer) != options:
            raise ModelLoadError(f"{gf.name}: layer {layer}'s q / k / v biases, q / k norms or ffn_norm differ from "
                                 "layer 0's; flashllm's StableLM runs every layer alike")
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    return {"layer_norm_eps": eps, "partial_rotary_factor": rotary_factor(gf, ARCH, head_dim),
            "use_qkv_bias": options["qkv bias"], "qk_layernorm": options["q / k norms"],
            "use_parallel_residual": not options["ffn_norm"], "tie_word_embeddings": False}
