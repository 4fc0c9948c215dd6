"""Hunyuan MoE (`HunYuanMoEV1ForCausalLM`: tencent/Hunyuan-A13B-Instruct): the dense Hunyuan's attention (per-head
q / k RMSNorms after RoPE, the RoPE base stretched by a fixed NTK alpha) over a mixture of experts in every layer:
softmax router scores (`mlp.gate.wg`), the top `moe_topk` of `num_experts` experts renormalized, plus one always-on,
ungated shared MLP (`mlp.shared_mlp`). As transformers' HunYuanMoEV1 computes it, the routed experts and the shared
MLP are all `intermediate_size` wide; `moe_intermediate_size`, `num_shared_expert`, `moe_topk` and `num_experts`
may be per-layer lists (the A13B checkpoint writes them so), accepted where every layer has the same value."""

from __future__ import annotations

from typing import Any, ClassVar

from flashllm.models.deepseek_moe import SharedExpertsMoEConfig, SharedExpertsMoEForCausalLM
from flashllm.models.errors import ModelLoadError
from flashllm.models.hf_config import MAX_INTERMEDIATE_SIZE, flag, positive_int
from flashllm.models.hunyuan import HunyuanAttention, parse_hunyuan_config
from flashllm.models.llama import LlamaAttention
from flashllm.models.mixtral import MAX_NUM_EXPERTS, moe_config
from flashllm.models.olmo2 import refuse_prequantized
from flashllm.models.qwen3 import Qwen3MoeForCausalLM

# transformers' HunYuanMoEV1Config defaults where config.json leaves a field out and Llama's differ
HUNYUAN_MOE_DEFAULTS: dict[str, Any] = {"bos_token_id": 1, "eos_token_id": 2}


def _uniform(raw: dict[str, Any], key: str, default: int, limit: int, num_layers: int, source: str) -> int:
    """config.json's `key`, a positive int up to `limit` or a per-layer list of one repeated such int."""
    value = raw.get(key, default)
    if isinstance(value, list):
        if len(value) != num_layers or len(set(value)) != 1:
            raise ModelLoadError(f"{source}: {key}={value!r}; flashllm runs one value for every layer (a list of "
                                 f"{num_layers} equal values, or an int)")
        value = value[0]
    return positive_int({key: value}, key, default, limit, source)


def parse_hunyuan_moe_config(raw: dict[str, Any], source: str = "config.json") -> SharedExpertsMoEConfig:
    """Validate a HunYuanMoEV1ForCausalLM config.json (module docstring) with transformers' HunYuanMoEV1Config
    defaults (num_experts 1, moe_topk 1); refuses cross-layer attention (use_cla), more than one shared expert,
    expert sizes transformers would not build and pre-quantized checkpoints (quantize at load with --quant_type).
    Raises ModelLoadError (one line naming the field)."""
    refuse_prequantized(raw, source)
    base = parse_hunyuan_config({**HUNYUAN_MOE_DEFAULTS, **raw}, source)
    layers, width = base.num_hidden_layers, base.intermediate_size
    if flag(raw, "use_cla", source):
        raise ModelLoadError(f"{source}: use_cla=true (cross-layer attention) is not supported; expected false, "
                             "as every published Hunyuan MoE sets it")
    if "num_shared_expert" in raw and _uniform(raw, "num_shared_expert", 1, MAX_NUM_EXPERTS, layers, source) != 1:
        raise ModelLoadError(f"{source}: num_shared_expert={raw['num_shared_expert']!r}; transformers' HunYuanMoEV1 "
                             "builds one shared MLP per layer, so expected 1")
    moe_width = _uniform(raw, "moe_intermediate_size", width, MAX_INTERMEDIATE_SIZE, layers, source)
    if moe_width != width:
        raise ModelLoadError(f"{source}: moe_intermediate_size={raw['moe_intermediate_size']!r} differs from "
                             f"intermediate_size={width}; transformers' HunYuanMoEV1 sizes every expert by "
                             "intermediate_size")
    experts = _uniform(raw, "num_experts", 1, MAX_NUM_EXPERTS, layers, source)
    top_k = _uniform(raw, "moe_topk", 1, MAX_NUM_EXPERTS, layers, source)
    if top_k > experts:
        raise ModelLoadError(f"{source}: moe_topk={top_k} exceeds num_experts={experts}; a token cannot go to more "
                             "experts than the layer has")
    bias = flag(raw, "attention_bias", source)
    return moe_config(
        base, SharedExpertsMoEConfig, num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
        shared_expert_intermediate_size=width, norm_topk_prob=True, sparse_layers=(True,) * layers, qkv_bias=bias,
        n_routed_experts=experts, n_shared_experts=1, sigmoid_scoring=False, group_limited=False, choice_bias=False)


class HunYuanMoEV1ForCausalLM(SharedExpertsMoEForCausalLM):
    """Hunyuan MoE: Llama's projection names, `self_attn.query_layernorm` / `key_layernorm`, the router
    `mlp.gate.wg`, per-expert `mlp.experts.N.gate_proj|up_proj|down_proj` (or transformers 5's stacked tensors) and
    the shared `mlp.shared_mlp.*`; biases on all four attention projections where attention_bias says. Pre-quantized
    checkpoints are refused (none is tested here)."""

    renamed_modules: ClassVar[dict[str, str]] = {
        ".self_attn.query_layernorm.": ".self_attn.q_norm.", ".self_attn.key_layernorm.": ".self_attn.k_norm.",
        ".mlp.gate.wg.": ".mlp.gate.", ".mlp.shared_mlp.": ".mlp.shared_experts."}
    attention_class: ClassVar[type[LlamaAttention]] = HunyuanAttention
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> SharedExpertsMoEConfig:
        """config.json -> SharedExpertsMoEConfig, validated (see parse_hunyuan_moe_config)."""
        return parse_hunyuan_moe_config(raw, source)

    attention_biases = staticmethod(Qwen3MoeForCausalLM.attention_biases)  # q, k, v and o by attention_bias
