"""Hunyuan MoE GGUF files (`hunyuan-moe`: Hunyuan-A13B-Instruct): run as flashllm's HunYuanMoEV1ForCausalLM.

What llama.cpp does with them (src/models/hunyuan-moe.cpp: its hparams, tensors and graph; the converter's
HunYuanMoEModel): the dense Hunyuan's attention (per-head `attn_q_norm` / `attn_k_norm` after RoPE over half-split
pairs, Q/K rows as in the checkpoint, the NTK alpha folded into `rope.freq_base` by the converter, q / k / v / o
biases where the file holds them); then in every layer the router `ffn_gate_inp` over `expert_count` experts, softmax
scores, the top `expert_used_count` renormalized and unscaled (the graph hard-codes both), the stacked experts sized
by `feed_forward_length` (the loader's n_ff, which the converter writes as intermediate_size), plus one ungated
shared MLP `ffn_*_shexp` of `expert_shared_feed_forward_length` features (feed_forward_length where absent), whatever
`expert_shared_count` says; `output`, or `token_embd` where the file has none.

Refused: rope scaling beyond the folded alpha (the graph reads none), only some of the attention biases (flashllm's
Hunyuan MoE biases all four projections or none), and a shared MLP of another width than the experts (transformers'
HunYuanMoEV1, and so flashllm, sizes both by intermediate_size).
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf import deepseek2
from flashllm.models.gguf.moe import MAX_EXPERTS
from flashllm.models.gguf.reader import GGUFFile

ARCH = "hunyuan-moe"
LAYER_NAMES = {part: module for part, module in deepseek2.LAYER_NAMES.items() if part.endswith("_shexp")}
_BIASES = ("attn_q", "attn_k", "attn_v", "attn_output")


def hunyuan_moe_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The HunYuanMoEV1ForCausalLM config.json fields of a `hunyuan-moe` file (module docstring)."""
    if raw.get("rope_scaling") is not None:
        raise ModelLoadError(f"{gf.name}: rope scaling {raw['rope_scaling']['rope_type']!r}; llama.cpp's {ARCH} graph "
                             "takes its NTK alpha folded into rope.freq_base and no scaling")
    biased = [part for part in _BIASES if f"blk.0.{part}.bias" in gf.tensors]
    if biased and len(biased) != len(_BIASES):
        raise ModelLoadError(f"{gf.name} holds biases for {', '.join(biased)} only; flashllm's Hunyuan MoE biases q, k, "
                             "v and o together or none")
    width = raw["intermediate_size"]
    shared = deepseek2.uint_meta(gf, ARCH, "expert_shared_feed_forward_length", width)
    if shared != width:
        raise ModelLoadError(f"{gf.name}: {ARCH}.expert_shared_feed_forward_length={shared} differs from "
                             f"feed_forward_length={width}; transformers' HunYuanMoEV1 sizes the shared MLP and the "
                             "experts alike, by intermediate_size")
    experts = deepseek2.uint_meta(gf, ARCH, "expert_count", maximum=MAX_EXPERTS)
    return {"num_experts": experts, "moe_topk": deepseek2.uint_meta(gf, ARCH, "expert_used_count", maximum=experts),
            "moe_intermediate_size": width, "num_shared_expert": 1, "attention_bias": bool(biased), "use_cla": False}
