"""Phi-3.5-MoE (`PhimoeForCausalLM`, transformers' name, and `PhiMoEForCausalLM`, the name
microsoft/Phi-3.5-MoE-instruct's config.json writes): Mixtral's stack with LayerNorms (weight and bias, eps
`rms_norm_eps`) for every norm, biases on all four attention projections where `attention_bias` says, an LM head
with a bias where `lm_head_bias` says, and SparseMixer routing in place of softmax top-k.

SparseMixer at inference, as transformers' `sparsemixer` computes it outside training: the first expert is the
router logits' argmax; its weight is the softmax, over the experts whose logit lies within 2 * router_jitter_noise
(relative to max(|logit|, the top logit)) of the top, taken at that expert. The second is the argmax once the first
is masked out, weighted by the softmax over the remaining experts within the same relative band of the second's
logit. Always two experts (transformers ignores num_experts_per_tok there; another value is refused); the input
jitter is training-only and not read.

LongRoPE as Phi-3's (models/phi3.py: the short set while a sequence stays within original_max_position_embeddings
O, the long set past it), each set's cos / sin scaled by `short_mscale` / `long_mscale` instead of the computed
attention factor. transformers 5.25's PhimoeRotaryEmbedding recomputes the frequencies without the sequence length,
so it rotates by the short factors at every length (only the mscale switches past O); flashllm uses the long
factors there, as Phi-3.5-MoE's own code and transformers 4 do. O is the rope dict's
`original_max_position_embeddings`, else max_position_embeddings (as transformers 5 standardizes it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.errors import ModelLoadError
from flashllm.models.hf_config import flag, normalize_rope
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.moe import SparseMoeBlock
from flashllm.models.layers.norm import LayerNorm
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import run_decoder_stack
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
from flashllm.models.mixtral import MixtralForCausalLM, MoEModel, MoEModelConfig, every_layer_sparse
from flashllm.models.olmo2 import refuse_prequantized
from flashllm.models.phi import BiasedLMHead
from flashllm.models.phi3 import (
    LongRopeRotaryEmbedding,
    LongRopeStack,
    Phi3ForCausalLM,
    ShortRopeStack,
    _longrope,
    _sliding_windows,
)

# transformers' PhimoeConfig defaults where config.json leaves a field out (Llama's differ)
PHIMOE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32064, "hidden_size": 4096, "intermediate_size": 6400, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5,
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "rope_theta": 1e6}
DEFAULT_ROUTER_JITTER = 0.01


@dataclass(frozen=True, slots=True)
class PhimoeModelConfig(MoEModelConfig):
    """MoEModelConfig (every layer sparse, two experts of num_experts, each intermediate_size wide) plus
    router_jitter_noise (SparseMixer's relative band, module docstring) and lm_head_bias."""

    router_jitter_noise: float = DEFAULT_ROUTER_JITTER
    lm_head_bias: bool = False


def parse_phimoe_config(raw: dict[str, Any], source: str = "config.json") -> PhimoeModelConfig:
    """Validate a PhiMoE config.json (module docstring) with transformers' PhimoeConfig defaults. Refuses
    pre-quantized checkpoints, num_experts_per_tok other than 2, a rope type other than default / longrope, longrope
    without numeric short_mscale / long_mscale, and partial rotary. Raises ModelLoadError (one line)."""
    refuse_prequantized(raw, source)
    fields = {**PHIMOE_DEFAULTS, **raw}
    theta, scaling = normalize_rope(fields, source)
    if scaling is not None and scaling["rope_type"] != "longrope":
        raise ModelLoadError(f"{source}: rope type {scaling['rope_type']!r} is not supported for PhiMoE; expected "
                             "default RoPE or 'longrope' (with short_mscale / long_mscale), as Phi-3.5-MoE writes")
    if (scaling or {}).get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"{source}: partial_rotary_factor={scaling['partial_rotary_factor']!r} is not supported; "
                             "transformers' PhiMoE rotates whole heads (expected 1.0)")
    base = parse_llama_config({**fields, "rope_theta": theta, "rope_scaling": None, "rope_parameters": None,
                               "partial_rotary_factor": None, "sliding_window": None, "mlp_bias": False}, source)
    jitter = fields.get("router_jitter_noise", DEFAULT_ROUTER_JITTER)
    if isinstance(jitter, bool) or not isinstance(jitter, int | float) or not 0 <= jitter < float("inf"):
        raise ModelLoadError(f"{source}: router_jitter_noise={jitter!r} must be a non-negative number")
    config = every_layer_sparse(base, raw, 16, 2, source, PhimoeModelConfig, qkv_bias=base.attention_bias,
                                router_jitter_noise=float(jitter), lm_head_bias=flag(raw, "lm_head_bias", source))
    if config.num_experts_per_tok != 2 or config.num_experts < 2:
        raise ModelLoadError(f"{source}: num_experts_per_tok={config.num_experts_per_tok} with num_local_experts="
                             f"{config.num_experts}; SparseMixer routes exactly 2 experts per token, so expected 2 "
                             "(and at least 2 experts)")
    return dataclasses.replace(config, rope_scaling=_mscaled_longrope(scaling, base, source),
                               sliding_windows=_sliding_windows(raw, base, source), raw=raw)


def _mscaled_longrope(scaling: dict[str, Any] | None, base: LlamaModelConfig, source: str) -> dict[str, Any] | None:
    """Phi-3's validated LongRoPE dict with "mscales": (short_mscale, long_mscale) (phi3.longrope_rows), or None."""
    if scaling is None:
        return None
    mscales = tuple(scaling.get(key) for key in ("short_mscale", "long_mscale"))
    if not all(isinstance(m, int | float) and not isinstance(m, bool) and 0 < m < float("inf") for m in mscales):
        raise ModelLoadError(f"{source}: longrope short_mscale / long_mscale = {mscales!r} must both be positive "
                             "numbers, as transformers' PhimoeConfig requires")
    original = scaling.get("original_max_position_embeddings", base.max_position_embeddings)
    longrope = _longrope({"original_max_position_embeddings": original}, scaling, base, source)
    return {**longrope, "mscales": tuple(float(m) for m in mscales)}


def _masked_pick(scores: Tensor, candidates: Tensor, jitter_eps: float) -> tuple[Tensor, Tensor]:
    """One SparseMixer pick: the argmax of `candidates` (T, E) (scores with earlier picks at -inf), weighted by the
    softmax over the candidates within 2 * jitter_eps of it relative to max(|score|, its logit) -> ((T, 1), (T, 1))."""
    top, ids = candidates.max(dim=-1, keepdim=True)
    outside = (top - scores) / scores.abs().clamp(min=top) > 2 * jitter_eps
    return torch.softmax(candidates.masked_fill(outside, float("-inf")), dim=-1).gather(-1, ids), ids


def sparsemixer(router_logits: Tensor, jitter_eps: float) -> tuple[Tensor, Tensor]:
    """router_logits (T, E) -> (topk_weights (T, 2) fp32, topk_ids (T, 2) int64), SparseMixer's two picks at inference
    (module docstring), computed in the logits' dtype as transformers computes them."""
    first_weight, first = _masked_pick(router_logits, router_logits, jitter_eps)
    second_weight, second = _masked_pick(router_logits, router_logits.scatter(-1, first, float("-inf")), jitter_eps)
    return torch.cat((first_weight, second_weight), dim=-1).float(), torch.cat((first, second), dim=-1)


class PhimoeSparseMoeBlock(SparseMoeBlock):
    """SparseMoeBlock routed by SparseMixer: the router `gate`, num_experts experts of intermediate_size, no shared
    expert."""

    def __init__(self, config: PhimoeModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config.hidden_size, config.num_experts, 2, config.moe_intermediate_size, False, 0, ops,
                         dtype, device, tp_rank, tp_size, expert_parallel=config.expert_parallel)
        self.jitter_eps = config.router_jitter_noise

    def forward(self, x: Tensor) -> Tensor:
        """x (T, hidden) -> (T, hidden) in x.dtype."""
        topk_weights, topk_ids = sparsemixer(self.gate(x), self.jitter_eps)
        return self.experts(x, topk_weights, topk_ids)


class PhimoeModel(MoEModel):
    """Mixtral's stack with LayerNorms and Phi-3's rotary tables: plain RoPE, LongRoPE's short table alone where
    max_position_embeddings <= O, else both tables picked per token (phi3.LongRopeRotaryEmbedding)."""

    norm_class: ClassVar[type[nn.Module]] = LayerNorm

    @staticmethod
    def build_rotary(config: LlamaModelConfig, ops: Any, device: torch.device) -> RotaryEmbedding:
        """The rotary table (class docstring)."""
        scaling = config.rope_scaling
        if scaling is None:
            return MoEModel.build_rotary(config, ops, device)
        short_only = config.max_position_embeddings <= scaling["original_max_position_embeddings"]
        return (ShortRopeStack if short_only else LongRopeStack).build_rotary(config, ops, device)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """input_ids (T,), positions (T,) -> final hidden states (T, hidden); under both LongRoPE tables each
        position is first mapped to its row (LongRopeRotaryEmbedding.table_rows)."""
        if isinstance(self.rotary_emb, LongRopeRotaryEmbedding):
            positions = self.rotary_emb.table_rows(positions, attn_metadata)
        return run_decoder_stack(self, input_ids, positions, kv_caches, attn_metadata)


class PhimoeForCausalLM(MixtralForCausalLM):
    """PhiMoE (module docstring): the Hub's `block_sparse_moe.gate` / `block_sparse_moe.experts.N.w1|w3|w2` (or
    transformers 5's `mlp.router` / `mlp.experts.gate_up_proj|down_proj`), LayerNorm weights and biases, `lm_head.bias`
    where lm_head_bias. Float checkpoints only; no fused decoder step (LayerNorms, SparseMixer)."""

    renamed_modules: ClassVar[dict[str, str]] = {".block_sparse_moe.": ".mlp.", ".mlp.router.": ".mlp.gate."}
    required_ops: ClassVar[tuple[str, ...]] = ("fused_moe", "layer_norm")
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()
    attention_needs: ClassVar[tuple[str, ...]] = ("sliding window",)
    stack_class: ClassVar[type[MoEModel]] = PhimoeModel
    prefix_cache_salt = Phi3ForCausalLM.prefix_cache_salt

    def __init__(self, config: PhimoeModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, ops, dtype, device, tp_rank, tp_size)
        # the runner fills attn_metadata.prompt_lens only for a model that reads them
        self.reads_prompt_lens = isinstance(self.model.rotary_emb, LongRopeRotaryEmbedding)
        if config.lm_head_bias:
            del self.lm_head  # freed before the biased one is allocated
            self.lm_head = BiasedLMHead(config.vocab_size, config.hidden_size, ops, dtype, device, tp_rank, tp_size)
            if config.tie_word_embeddings:
                self.lm_head.tie_to(self.model.embed_tokens)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> PhimoeModelConfig:
        """config.json -> PhimoeModelConfig, validated (see parse_phimoe_config)."""
        return parse_phimoe_config(raw, source)

    @staticmethod
    def attention_biases(config: MoEModelConfig) -> tuple[bool, bool]:
        """(qkv_proj has a bias, o_proj has a bias): `attention_bias` sets both."""
        return config.qkv_bias, config.qkv_bias

    @staticmethod
    def make_mlp(config: PhimoeModelConfig, layer_idx: int, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int, tp_size: int) -> nn.Module:
        """Every layer's MLP: the SparseMixer-routed block."""
        return PhimoeSparseMoeBlock(config, ops, dtype, device, tp_rank, tp_size)
