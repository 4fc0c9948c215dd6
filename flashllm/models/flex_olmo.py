"""FlexOlmo (`FlexOlmoForCausalLM`, allenai/FlexOlmo-7x7B-1T and its variants): OLMo 2's post-norm layers, x +
post_attention_norm(attn(x)) then + post_feedforward_norm(moe(.)), with OLMo 2's whole-projection q / k norms and
OLMoE's sparse MLP (softmax router, top `num_experts_per_tok` of `num_experts` experts, weights renormalized only when
`norm_topk_prob`, no shared expert) in every layer. Float checkpoints only."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from flashllm.models.llama import LlamaAttention
from flashllm.models.mixtral import MakeMLP, MoEModelConfig
from flashllm.models.olmo2 import Olmo2Attention, Olmo2Model, refuse_prequantized
from flashllm.models.olmoe import OlmoeForCausalLM, parse_olmoe_config

# transformers' FlexOlmoConfig defaults (FlexOlmo-7x7B-1T's sizes) where a config.json leaves a field out
FLEX_OLMO_DEFAULTS: dict[str, Any] = {
    "vocab_size": 100352, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
    "eos_token_id": 100257, "tie_word_embeddings": False,
}
FLEX_OLMO_EXPERTS = (7, 5)  # (num_experts, num_experts_per_tok) defaults


def parse_flex_olmo_config(raw: dict[str, Any], source: str = "config.json") -> MoEModelConfig:
    """config.json -> MoEModelConfig as OLMoE's (every layer sparse, moe_intermediate_size = intermediate_size) over
    FlexOlmoConfig's defaults; `num_local_experts` is transformers' alias of num_experts. Raises ModelLoadError (one
    line), for pre-quantized checkpoints too."""
    refuse_prequantized(raw, source)
    if "num_experts" not in raw and "num_local_experts" in raw:
        raw = {**raw, "num_experts": raw["num_local_experts"]}
    return parse_olmoe_config(raw, source, FLEX_OLMO_DEFAULTS, FLEX_OLMO_EXPERTS)


class FlexOlmoModel(Olmo2Model):
    """OLMo 2's post-norm stack with each layer's MLP from make_mlp (the sparse MoE block), under the MoE stack's
    constructor signature (the attention is always OLMo 2's; the biases come from config.attention_bias)."""

    def __init__(self, config: MoEModelConfig, make_mlp: MakeMLP, ops: Any, dtype: torch.dtype, device: torch.device,
                 qkv_bias: bool, o_bias: bool, tp_rank: int = 0, tp_size: int = 1,
                 attention_class: type[LlamaAttention] = Olmo2Attention) -> None:
        super().__init__(config, ops, dtype, device, tp_rank, tp_size, make_mlp=make_mlp)


class FlexOlmoForCausalLM(OlmoeForCausalLM):
    """FlexOlmo (module docstring): OLMoE's checkpoint names (router `mlp.gate`, `mlp.experts.N.*` or transformers 5's
    stacked experts, `self_attn.q_norm` / `k_norm` of the projections' widths) with `post_attention_layernorm` /
    `post_feedforward_layernorm` after each branch and no input norm; tensor and expert parallel."""

    stack_class: ClassVar[Any] = FlexOlmoModel
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> MoEModelConfig:
        """config.json -> MoEModelConfig (parse_flex_olmo_config)."""
        return parse_flex_olmo_config(raw, source)
