"""StarCoder 2 GGUF files (`starcoder2`): run as flashllm's Starcoder2ForCausalLM.

What llama.cpp does with them (src/models/starcoder2.cpp, the converter's StarCoder2Model): LayerNorms with a bias
(`attn_norm`, `ffn_norm`, `output_norm`, eps `starcoder2.attention.layer_norm_epsilon`), q / k / v / output
projections with biases, NEOX rotary (Q/K rows as in the checkpoint), the ungated MLP ffn_down(gelu(ffn_up(x))) with
biases and ggml's tanh-approximated GELU, full attention on every layer (the converter drops the checkpoint's
sliding window), the LM head tied to the embedding where the file has no `output.weight`.
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.reader import GGUFFile

ARCH = "starcoder2"
# GGUF layer tensor part -> checkpoint module where StarCoder 2's differ from Llama's
LAYER_NAMES = {"ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}


def starcoder2_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The Starcoder2ForCausalLM config.json fields of a `starcoder2` file (module docstring)."""
    eps = gf.get(f"{ARCH}.attention.layer_norm_epsilon")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise ModelLoadError(f"{gf.name}: {ARCH}.attention.layer_norm_epsilon is {eps!r}; llama.cpp's {ARCH} graph "
                             "needs the LayerNorms' positive eps")
    return {"norm_epsilon": float(eps), "use_bias": "blk.0.attn_q.bias" in gf.tensors,
            "hidden_act": "gelu_pytorch_tanh", "sliding_window": None}
