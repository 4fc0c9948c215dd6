"""OLMo 2 GGUF files (`olmo2`): run as flashllm's Olmo2ForCausalLM.

What llama.cpp does with them (src/models/olmo2.cpp, its hparams and tensors in src/llama-model.cpp, the converter's
Olmo2Model): Llama's projections; `attn_q_norm` / `attn_k_norm` normalize the whole query / key projection (all
heads together) before RoPE over half-split pairs (Q/K rows as in the checkpoint); `post_attention_norm` and
`post_ffw_norm` normalize each branch's output before its residual add, and no norm precedes the branches. A file
with `olmo2.attention.sliding_window` (OLMo 3, whose sliding layers llama.cpp places by a pattern of 4) is refused:
flashllm runs OLMo 2 only.
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.reader import GGUFFile

# GGUF layer tensor part -> checkpoint module where OLMo 2's differ from Llama's
LAYER_NAMES = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


def olmo2_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The Olmo2ForCausalLM config.json fields of an `olmo2` file (module docstring)."""
    if gf.get("olmo2.attention.sliding_window"):
        raise ModelLoadError(f"{gf.name}: olmo2.attention.sliding_window is set (an OLMo 3 file); flashllm runs "
                             "OLMo 2's full attention only")
    return {"attention_bias": "blk.0.attn_q.bias" in gf.tensors}
