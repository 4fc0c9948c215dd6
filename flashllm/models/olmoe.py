"""OLMoE (`OlmoeForCausalLM`, allenai/OLMoE-1B-7B-0924 / -0125 and their Instruct tunes): Llama's pre-norm block with
OLMo 2's attention (the whole query and key projections RMS-normed before RoPE, gathered across tensor-parallel ranks)
and a sparse MoE MLP in every layer: softmax router scores, the top `num_experts_per_tok` of `num_experts` experts,
each `intermediate_size` wide, weights renormalized only where `norm_topk_prob` says (default false), no shared
expert. `clip_qkv` (clamping q, k and v) is refused: no published checkpoint sets it."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from flashllm.models.errors import ModelLoadError
from flashllm.models.hf_config import flag
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import LlamaAttention
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
from flashllm.models.mixtral import MoEModelConfig, check_prequantized_experts, experts_and_top_k, moe_config
from flashllm.models.olmo2 import Olmo2Attention
from flashllm.models.qwen2_moe import Qwen2MoeForCausalLM

# transformers' OlmoeConfig defaults where config.json leaves a field out (Llama's differ)
OLMOE_DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096}


def parse_olmoe_config(raw: dict[str, Any], source: str = "config.json", defaults: dict[str, Any] = OLMOE_DEFAULTS,
                       experts: tuple[int, int] = (64, 8)) -> MoEModelConfig:
    """config.json -> MoEModelConfig (module docstring); num_experts and num_experts_per_tok default to `experts`,
    the other fields to `defaults` over Llama's (FlexOlmo passes its own). Raises ModelLoadError (one line)."""
    if raw.get("clip_qkv") is not None:
        raise ModelLoadError(f"{source}: clip_qkv={raw['clip_qkv']!r} is not supported (flashllm does not clamp q, k "
                             "and v); no published OLMoE sets it")
    base: LlamaModelConfig = parse_llama_config({**defaults, **raw}, source)
    num_experts, top_k = experts_and_top_k(raw, "num_experts", *experts, source)
    config = moe_config(base, num_experts=num_experts, num_experts_per_tok=top_k,
                        moe_intermediate_size=base.intermediate_size, shared_expert_intermediate_size=0,
                        norm_topk_prob=flag(raw, "norm_topk_prob", source),
                        sparse_layers=(True,) * base.num_hidden_layers, qkv_bias=base.attention_bias)
    check_prequantized_experts(config, source)
    return config


class OlmoeAttention(Olmo2Attention):
    """OLMo 2's attention (whole-projection q / k norms) under the MoE stack's attention signature."""

    def __init__(self, config: LlamaModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, qkv_bias: bool, o_bias: bool,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, layer_idx, rotary_emb, ops, dtype, device, tp_rank, tp_size)


class OlmoeForCausalLM(Qwen2MoeForCausalLM):
    """OLMoE: Qwen2-MoE's checkpoint names (router `mlp.gate`, `mlp.experts.N.*`) with `self_attn.q_norm` / `k_norm`
    of the projections' widths; attention biases (all four projections) where `attention_bias` says."""

    attention_class: ClassVar[type[LlamaAttention]] = OlmoeAttention

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> MoEModelConfig:
        """config.json -> MoEModelConfig (parse_olmoe_config)."""
        return parse_olmoe_config(raw, source)
