"""Gemma 3 text GGUF files (`gemma3`, gemma-3-1b-it and up) and Gemma 2 ones (`gemma2`): the config fields llama.cpp
derives rather than stores, and its tensor names.

What llama.cpp does with a `gemma3` file (src/llama-model.cpp, its gemma3 hparams; src/models/gemma3.cpp, the graph;
convert_hf_to_gguf.py's Gemma3Model, the converter):

- Sliding layers: with `gemma3.attention.sliding_window` > 0, the pattern is hard-coded to 6: layer i slides when
  i % 6 < 5 (every sixth layer, 5, 11, ..., attends to everything), as transformers' `sliding_window_pattern` 6.
  Without the key (or 0) every layer attends to everything (files of configs whose pattern was 1).
- RoPE: `rope.freq_base` (and `rope.scaling.*`) is the full layers'; the sliding layers' base is hard-coded to
  10000 and unscaled (transformers' `rope_local_base_freq`, whose value the converter does not write).
- Attention scale: query_pre_attn_scalar is not stored: the scale is key_length ** -0.5, except for 62-layer
  files (Gemma 3 27B), where it is (embedding_length // head_count) ** -0.5.
- Norms: the converter stores every Gemma RMSNorm weight (`*norm.weight`) as 1 + w, because llama.cpp's norm
  multiplies by the stored weight, where transformers' Gemma norm multiplies by 1 + w (ArchMap.norm_offset).
- Q/K rows are not reordered (llama.cpp runs gemma3 with NEOX, half-split, rotary).
- `final_logit_softcapping` is applied only by the graph without sliding layers; a file carrying it with a
  sliding window is refused rather than run one of two ways.

`gemma` files (Gemma 1, src/models/gemma.cpp): Llama's pre-norm layers (`attn_norm`, `ffn_norm`) with the norms stored
as 1 + w, GeGLU, the scaled embedding, full attention scaled by key_length ** -0.5, one RoPE.

`gemma2` files (src/models/gemma2.cpp, its hparams in src/llama-model.cpp, the converter's Gemma2Model): the same
norms and names without q / k norms; layer i slides when i % 2 == 0 (pattern 2), window
`gemma2.attention.sliding_window` (4096 when absent); one RoPE base for every layer; attention scores capped by
`gemma2.attn_logit_softcapping` and logits by `gemma2.final_logit_softcapping`, always (llama.cpp's defaults 50 and 30
when a key is absent); the attention scale as gemma3's rule, with 46 layers (Gemma 2 27B) taking
(embedding_length // head_count) ** -0.5.
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.reader import GGUFFile

SLIDING_PATTERN = 6          # llama.cpp's set_swa_pattern(6) for gemma3
LOCAL_ROPE_THETA = 10000.0   # llama.cpp's rope_freq_base_train_swa for gemma3
LAYERS_OF_27B = 62           # the block count llama.cpp types as 27B (its attention scale differs)
GEMMA2_LAYERS_OF_27B = 46    # the same for gemma2
GEMMA2_WINDOW = 4096         # llama.cpp's n_swa for a gemma2 file without the key
GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}  # llama.cpp's hparams defaults
NORM_OFFSET = 1.0            # what the converter adds to every Gemma norm weight
# GGUF layer tensor part -> checkpoint module where Gemma 3's differ from Llama's (the sandwich norms)
LAYER_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"}


def layer_types(num_layers: int, sliding: bool) -> list[str]:
    """transformers' layer_types of llama.cpp's gemma3 rule: layer i slides when i % 6 < 5 (with a window)."""
    return ["sliding_attention" if sliding and i % SLIDING_PATTERN < SLIDING_PATTERN - 1 else "full_attention"
            for i in range(num_layers)]


def attention_scalar(num_layers: int, hidden: int, heads: int, head_dim: int, layers_of_27b: int = LAYERS_OF_27B) -> int:
    """query_pre_attn_scalar as llama.cpp derives it: head_dim, or hidden // heads for the 27B model's layer count
    (62 for gemma3, 46 for gemma2)."""
    return hidden // heads if num_layers == layers_of_27b else head_dim


def gemma2_layer_types(num_layers: int) -> list[str]:
    """transformers' layer_types of llama.cpp's gemma2 rule: the even layers slide."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def gemma_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The GemmaForCausalLM config.json fields of a `gemma` file (module docstring)."""
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    return {"hidden_act": "gelu_pytorch_tanh", "head_dim": head_dim, "attention_bias": False}


def gemma2_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The Gemma 2 config.json fields of a `gemma2` file (module docstring)."""
    window = gf.get("gemma2.attention.sliding_window", GEMMA2_WINDOW)
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ModelLoadError(f"{gf.name}: gemma2.attention.sliding_window is {window!r}; expected a positive number")
    caps = {}
    for key, default in GEMMA2_SOFTCAPS.items():
        value = gf.get(f"gemma2.{key}", default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ModelLoadError(f"{gf.name}: gemma2.{key} is {value!r}; expected a positive number")
        caps[key] = float(value)
    layers, hidden, heads = raw["num_hidden_layers"], raw["hidden_size"], raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or hidden // heads
    return {
        "hidden_activation": "gelu_pytorch_tanh", "head_dim": head_dim, "layer_types": gemma2_layer_types(layers),
        "sliding_window": window, "attention_bias": False, **caps,
        "query_pre_attn_scalar": attention_scalar(layers, hidden, heads, head_dim, GEMMA2_LAYERS_OF_27B),
    }


def gemma3_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The Gemma 3 config.json fields of a `gemma3` file, from `raw` (the generic fields) and the rules above."""
    window = gf.get("gemma3.attention.sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ModelLoadError(f"{gf.name}: gemma3.attention.sliding_window is {window!r}; expected a whole number")
    softcap = gf.get("gemma3.final_logit_softcapping")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap <= 0):
        raise ModelLoadError(f"{gf.name}: gemma3.final_logit_softcapping is {softcap!r}; expected a positive number")
    if window and softcap is not None:
        raise ModelLoadError(f"{gf.name}: gemma3.final_logit_softcapping with sliding-window layers: llama.cpp's "
                             "graph for such files ignores the cap, the model it was converted from applies it; "
                             "re-convert without final_logit_softcapping")
    layers, hidden, heads = raw["num_hidden_layers"], raw["hidden_size"], raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or hidden // heads
    fields: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
        "head_dim": head_dim, "layer_types": layer_types(layers, bool(window)),
        "rope_local_base_freq": LOCAL_ROPE_THETA, "attention_bias": False,
        "query_pre_attn_scalar": attention_scalar(layers, hidden, heads, head_dim),
    }
    if window:
        fields["sliding_window"] = window
    if softcap is not None:
        fields["final_logit_softcapping"] = float(softcap)
    return fields
