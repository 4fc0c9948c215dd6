"""EXAONE 4.0 GGUF files (`exaone4`): run as flashllm's Exaone4ForCausalLM.

What llama.cpp does with them (src/models/exaone4.cpp, its hparams in src/llama-model.cpp, the converter's
Exaone4Model): Llama's projections, per-head `attn_q_norm` / `attn_k_norm` before RoPE over half-split pairs (Q/K
rows as in the checkpoint), `post_attention_norm` / `post_ffw_norm` after each branch and no norm before. Sliding
windows only for a 64-layer file (EXAONE-4.0-32B): layer i slides when i % 4 < 3, over
`exaone4.attention.sliding_window` (4096 when absent), and only the sliding layers rotate; any other layer count
runs full attention with RoPE on every layer, so such a file carrying a sliding window is refused rather than run
one of two ways.
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.olmo2 import LAYER_NAMES
from flashllm.models.gguf.reader import GGUFFile

HYBRID_LAYERS = 64     # the block count llama.cpp runs with sliding windows (EXAONE-4.0-32B)
SLIDING_PATTERN = 4    # llama.cpp's set_swa_pattern(4)
DEFAULT_WINDOW = 4096
__all__ = ["LAYER_NAMES", "exaone4_config_fields", "layer_types"]


def layer_types(num_layers: int) -> list[str]:
    """transformers' layer_types of llama.cpp's rule: sliding layers only at 64 layers, where i % 4 < 3."""
    hybrid = num_layers == HYBRID_LAYERS
    return ["sliding_attention" if hybrid and i % SLIDING_PATTERN < SLIDING_PATTERN - 1 else "full_attention"
            for i in range(num_layers)]


def exaone4_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The Exaone4ForCausalLM config.json fields of an `exaone4` file (module docstring)."""
    layers = raw["num_hidden_layers"]
    window = gf.get("exaone4.attention.sliding_window")
    if layers != HYBRID_LAYERS:
        if window:
            raise ModelLoadError(f"{gf.name}: exaone4.attention.sliding_window is set on a {layers}-layer file; "
                                 f"llama.cpp slides only {HYBRID_LAYERS}-layer ones and would ignore it")
        return {"sliding_window": None, "layer_types": layer_types(layers)}
    window = DEFAULT_WINDOW if window is None else window
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ModelLoadError(f"{gf.name}: exaone4.attention.sliding_window is {window!r}; expected a positive number")
    return {"sliding_window": window, "layer_types": layer_types(layers)}
