"""MiniMax-M2 / M2.1 (`MiniMaxM2ForCausalLM`, MiniMaxAI/MiniMax-M2): Llama's pre-norm block with OLMo 2's attention
(the whole query and key projections RMS-normed before RoPE, gathered across tensor-parallel ranks; RoPE over the
first `rotary_dim` features of each head) and a sparse MoE MLP in every layer: sigmoid router scores, the experts
chosen by score + `e_score_correction_bias`, weighted by their unbiased scores renormalized over the top
`num_experts_per_tok` of `num_local_experts`, each `intermediate_size` wide, no shared expert and no groups.

As transformers' MiniMaxM2 computes it: no sliding windows, no attention biases; the MiniMax fields it does not read
are checked where they would mean another computation (`use_qk_norm`, `qk_norm_type`, `scoring_func`,
`shared_intermediate_size`, `attn_type_list`). The published checkpoints are block-FP8 (`quantization_config`
quant_method "fp8", e4m3 codes with one `weight_scale_inv` per 128 x 128 block), dequantized at load as DeepSeek-V3's
are; BF16 conversions load as they are."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from torch import Tensor

from flashllm.models.block_fp8 import block_fp8_size
from flashllm.models.deepseek_moe import SharedExpertsMoEConfig, SharedExpertsMoEForCausalLM, without_mtp_layers
from flashllm.models.errors import ModelLoadError
from flashllm.models.llama import LlamaAttention
from flashllm.models.llama_config import parse_llama_config
from flashllm.models.mixtral import experts_and_top_k, moe_config
from flashllm.models.olmoe import OlmoeAttention

# transformers' MiniMaxM2Config defaults, where config.json leaves a field out (Llama's differ)
MINIMAX_M2_DEFAULTS: dict[str, Any] = {
    "vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62,
    "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 196608,
    "rms_norm_eps": 1e-6, "rope_theta": 5000000.0, "bos_token_id": 200034, "eos_token_id": 200020,
}
# fields transformers' MiniMaxM2 never reads that flashllm's Llama parser would
_NOT_READ = ("sliding_window", "use_sliding_window", "layer_types", "max_window_layers", "attention_bias", "mlp_bias")
# MiniMax's own fields: the value transformers' MiniMaxM2 computes as (any other is refused)
_AS_COMPUTED: dict[str, Any] = {"use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
                                "shared_intermediate_size": 0, "use_routing_bias": True}


def _check_minimax_fields(raw: dict[str, Any], source: str) -> None:
    """Refuse MiniMax fields that say something transformers' MiniMaxM2 does not compute (one line)."""
    for key, expected in _AS_COMPUTED.items():
        if raw.get(key) is not None and raw[key] != expected:
            raise ModelLoadError(f"{source}: {key}={raw[key]!r} is not supported; MiniMax-M2 computes {key}="
                                 f"{expected!r} (as transformers' MiniMaxM2ForCausalLM does)")
    kinds = raw.get("attn_type_list")
    if kinds is not None and (not isinstance(kinds, list) or any(kind != 1 for kind in kinds)):
        raise ModelLoadError(f"{source}: attn_type_list={kinds!r} asks for linear-attention layers (0); MiniMax-M2's "
                             "layers are all softmax attention (1), the only kind flashllm runs")


def parse_minimax_m2_config(raw: dict[str, Any], source: str = "config.json") -> SharedExpertsMoEConfig:
    """config.json -> SharedExpertsMoEConfig (module docstring), with transformers' MiniMaxM2Config defaults; a legacy
    `rotary_dim` gives partial_rotary_factor = rotary_dim / head_dim unless that is written. Raises ModelLoadError
    (one line); a quantization_config other than block FP8 (fp8_block, dequantized at load) is refused."""
    if raw.get("quantization_config") is not None:  # parse_llama_config would also take GPTQ / AWQ
        block_fp8_size(raw["quantization_config"], source, "MiniMaxM2ForCausalLM")
    _check_minimax_fields(raw, source)
    view = {**MINIMAX_M2_DEFAULTS, **{k: v for k, v in raw.items() if k not in _NOT_READ}}
    rotary_dim = view.get("rotary_dim")
    if rotary_dim is not None and view.get("partial_rotary_factor") is None:
        if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or not isinstance(view["head_dim"], int):
            raise ModelLoadError(f"{source}: rotary_dim={rotary_dim!r} must be an int (with an int head_dim)")
        view["partial_rotary_factor"] = rotary_dim / view["head_dim"]
    base = parse_llama_config(view, source)
    num_experts, top_k = experts_and_top_k(view, "num_local_experts", 256, 8, source)
    return moe_config(
        base, SharedExpertsMoEConfig, num_experts=num_experts, num_experts_per_tok=top_k,
        moe_intermediate_size=base.intermediate_size, shared_expert_intermediate_size=0, norm_topk_prob=True,
        sparse_layers=(True,) * base.num_hidden_layers, qkv_bias=False, first_k_dense_replace=0,
        n_routed_experts=num_experts, n_shared_experts=0, sigmoid_scoring=True, group_limited=False,
        n_group=1, topk_group=1, routed_scaling_factor=1.0, choice_bias=True)


class MiniMaxM2ForCausalLM(SharedExpertsMoEForCausalLM):
    """MiniMax-M2: `self_attn.q_norm` / `k_norm` of the projections' widths; Mixtral's `block_sparse_moe.gate` and
    `block_sparse_moe.experts.N.w1|w3|w2` (or transformers 5's `mlp.gate` and stacked `mlp.experts.*`) with
    `block_sparse_moe.e_score_correction_bias` (transformers 5: `mlp.e_score_correction_bias`), held by the router.
    Layers past num_hidden_layers (next-token-prediction modules) are skipped."""

    attention_class: ClassVar[type[LlamaAttention]] = OlmoeAttention
    renamed_modules: ClassVar[dict[str, str]] = {".block_sparse_moe.": ".mlp.",
                                                 ".mlp.e_score_correction_bias": ".mlp.gate.e_score_correction_bias"}
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ("fp8",)  # block FP8, dequantized at load

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> SharedExpertsMoEConfig:
        """config.json -> SharedExpertsMoEConfig, validated (parse_minimax_m2_config)."""
        return parse_minimax_m2_config(raw, source)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """MixtralForCausalLM.load_weights over the checkpoint less any layers past num_hidden_layers (block-FP8
        weights arrive dequantized: models/loader.py)."""
        return super().load_weights(without_mtp_layers(weights, self.config.num_hidden_layers))
