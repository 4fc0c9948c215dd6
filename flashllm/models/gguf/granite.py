"""IBM Granite 3.x GGUF files (`granite`, and `granitemoe` with experts): the four scalars llama.cpp reads, as the
Granite models' multipliers.

What llama.cpp does with a `granite` file (src/models/granite.cpp, its hparams, tensors and graph;
src/llama-graph.cpp's build_inp_embd; convert_hf_to_gguf.py's GraniteModel, a LlamaModel):

- The converter renames transformers' multipliers: `embedding_multiplier` -> `granite.embedding_scale`,
  `residual_multiplier` -> `granite.residual_scale`, `attention_multiplier` -> `granite.attention.scale`,
  `logits_scaling` -> `granite.logit_scale`, each written only when set and non-zero.
- The graph applies each only when it is non-zero: an absent or 0 embedding or residual scale multiplies by
  nothing (1), an absent or 0 attention scale is head_dim ** -0.5 (not transformers' default 1.0), and the
  logits are divided by `logit_scale`, which llama.cpp requires (a file without it does not load there).
- `granite.rope.scaling.finetuned` false turns RoPE off (Granite-4 hybrid's attention layers); the Granite 3.x
  models flashllm runs always rotate, so such a file is refused.
- Q/K rows are reordered as for llama (GraniteModel derives from LlamaModel; llama.cpp runs granite with
  interleaved, "normal", rotary); tensor names are llama's, biases optional on q, k, v, o and the MLP.
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.reader import GGUFFile

# GGUF key (after "granite.") -> GraniteForCausalLM's config.json field
SCALE_KEYS = {"embedding_scale": "embedding_multiplier", "residual_scale": "residual_multiplier",
              "attention.scale": "attention_multiplier", "logit_scale": "logits_scaling"}


def granite_config_fields(gf: GGUFFile, raw: dict[str, Any], arch: str = "granite") -> dict[str, Any]:
    """The Granite config.json fields of a `granite` (or `granitemoe`) file: its four multipliers as llama.cpp's
    graph applies the stored scales (see the module docstring), and the biases the file holds."""
    if gf.get(f"{arch}.rope.scaling.finetuned", True) is not True:
        raise ModelLoadError(f"{gf.name}: {arch}.rope.scaling.finetuned is false (llama.cpp then runs attention "
                             "without RoPE, a Granite-4 hybrid layer); flashllm's Granite models always rotate")
    scales = {}
    for key in SCALE_KEYS:
        value = gf.get(f"{arch}.{key}")
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise ModelLoadError(f"{gf.name}: {arch}.{key} is {value!r}; expected a number >= 0 (0: unset)")
        scales[key] = float(value) if value else None
    if scales["logit_scale"] is None:
        raise ModelLoadError(f"{gf.name} has no positive {arch}.logit_scale, which llama.cpp requires of a granite "
                             "file (it divides the logits by it); the file is incomplete, re-convert it")
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    defaults = {"embedding_scale": 1.0, "residual_scale": 1.0, "attention.scale": head_dim ** -0.5}
    fields: dict[str, Any] = {field: scales[key] or defaults[key] for key, field in SCALE_KEYS.items()}
    fields.update(attention_bias="blk.0.attn_q.bias" in gf.tensors, mlp_bias="blk.0.ffn_up.bias" in gf.tensors)
    return fields


def granitemoe_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The GraniteMoeForCausalLM config.json fields of a `granitemoe` file: Granite's (granite_config_fields); the
    experts come from moe.py (llama.cpp's granite MoE graph: softmax top-k renormalized, every layer sparse)."""
    return granite_config_fields(gf, raw, "granitemoe")
