"""gpt-oss GGUF files (`gpt-oss`): run as flashllm's GptOssForCausalLM.

What llama.cpp does with them (src/models/openai-moe-iswa.cpp, its hparams in src/llama-model.cpp, the converter's
GptOssModel): biased q / k / v / o projections, NEOX rotary (Q/K rows as in the checkpoint), the per-head
`attn_sinks` in every layer's softmax, `post_attention_norm` before the MoE branch; a biased router `ffn_gate_inp`
whose top-k logits are softmaxed, the experts' gate / up / down stacks (MXFP4 in the published files) with their
own biases and the clamped SwiGLU (alpha 1.702, limit 7, hard-coded). Even layers slide over
`gpt-oss.attention.sliding_window` tokens (its swa pattern of 2). YaRN comes from `rope.scaling.*` and runs with
ggml's rounded correction range (transformers' `truncate: true`; the published config.json says false), so a file
runs as llama.cpp runs it.
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.reader import GGUFFile

ARCH = "gpt-oss"
# GGUF layer tensor part -> checkpoint module where gpt-oss's differ from Llama's (the norm before the MoE branch)
LAYER_NAMES = {"post_attention_norm": "post_attention_layernorm"}
# GGUF layer tensor -> checkpoint parameter: the sinks, and the experts' biases (gate and up halves of
# gate_up_proj_bias, as GptOssForCausalLM._param_target reads them)
LAYER_PARAMS = {"attn_sinks.weight": "self_attn.sinks", "ffn_gate_exps.bias": "mlp.experts.gate_proj_bias",
                "ffn_up_exps.bias": "mlp.experts.up_proj_bias", "ffn_down_exps.bias": "mlp.experts.down_proj_bias"}
SWA_PATTERN = 2  # llama.cpp's set_swa_pattern(2): layer i slides when i % 2 == 0


def gpt_oss_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The GptOssForCausalLM config.json fields of a `gpt-oss` file (module docstring); the MoE counts and sizes
    come from moe.moe_config_fields."""
    window = gf.get(f"{ARCH}.attention.sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ModelLoadError(f"{gf.name}: {ARCH}.attention.sliding_window is {window!r}; llama.cpp's gpt-oss graph "
                             "needs a positive window for its sliding layers")
    layers = raw["num_hidden_layers"]
    missing = [name for name in ("blk.0.attn_sinks.weight", "blk.0.ffn_gate_inp.bias", "blk.0.ffn_down_exps.bias")
               if name not in gf.tensors]
    if missing:
        raise ModelLoadError(f"{gf.name} lacks {missing[0]}; every gpt-oss layer has sinks and biased experts")
    return {"sliding_window": window, "rope_scaling": raw.get("rope_scaling"),
            "layer_types": ["sliding_attention" if i % SWA_PATTERN == 0 else "full_attention" for i in range(layers)]}
