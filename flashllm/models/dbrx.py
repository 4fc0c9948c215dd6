"""DBRX (`DbrxForCausalLM`: databricks/dbrx-base / dbrx-instruct), as transformers' DbrxConfig / DbrxForCausalLM read
and run it: Mixtral's pre-norm MoE stack with LayerNorms without bias (eps 1e-5) for every norm, attention from one
fused `Wqkv` (q rows, then k, then v; grouped keys: `attn_config.kv_n_heads`) whose output is clamped to
[-clip_qkv, clip_qkv] where `attn_config.clip_qkv` is set, no projection biases; every layer a mixture of
`ffn_config.moe_num_experts` SiLU-gated experts, `ffn_config.ffn_hidden_size` wide, the top `moe_top_k` of the
router's softmax divided by their p-norm (p = `moe_normalize_expert_weights`, 1: renormalized; null: as scored).
Jitter (`moe_jitter_eps`) and dropouts are training-only.

Checkpoint layout (the Hub's, which transformers 5 keeps): `transformer.wte`, `transformer.blocks.N.norm_attn_norm.
{norm_1, attn.Wqkv, attn.out_proj, norm_2}`, `transformer.blocks.N.ffn.router.layer`, `transformer.norm_f`,
`lm_head`, and each layer's experts as three tensors of (E * I, H) rows: `ffn.experts.mlp.w1` (gate), `v1` (up) and
`w2` (expert e's rows [e * I, (e + 1) * I) are its down projection transposed). Each is cut per expert as it loads
(views), so a tensor- or expert-parallel rank copies only its part.

RoPE base: `attn_config.rope_theta` where config.json sets it (the published checkpoints' 500000, what DBRX was
trained with), else the top-level rope_theta / rope_parameters (default 10000). transformers 5.25's DbrxConfig never
reads attn_config.rope_theta, so it rotates the published checkpoints by a base of 10000; flashllm does not follow it
there. Untied embeddings only (transformers refuses tie_word_embeddings).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.errors import ModelLoadError
from flashllm.models.hf_config import flag, normalize_rope, positive_float, positive_int
from flashllm.models.layers.moe import SparseMoeBlock, select_experts
from flashllm.models.layers.norm import LayerNorm
from flashllm.models.llama import LlamaAttention
from flashllm.models.llama_config import parse_llama_config
from flashllm.models.mixtral import MAX_NUM_EXPERTS, MixtralForCausalLM, MoEModel, MoEModelConfig, moe_config
from flashllm.models.mpt import split_wqkv
from flashllm.models.olmo import OlmoAttention
from flashllm.models.olmo2 import refuse_prequantized

DBRX_LAYERNORM_EPS = 1e-5  # nn.LayerNorm's default, which transformers' DBRX norms keep
# transformers' DbrxConfig / DbrxAttentionConfig / DbrxFFNConfig defaults
DBRX_DEFAULTS: dict[str, Any] = {"d_model": 2048, "n_heads": 16, "n_layers": 24, "max_seq_len": 2048,
                                 "vocab_size": 32000}
ATTN_DEFAULTS: dict[str, Any] = {"kv_n_heads": 1, "clip_qkv": None}
FFN_DEFAULTS: dict[str, Any] = {"ffn_hidden_size": 3584, "moe_num_experts": 4, "moe_top_k": 1,
                                "moe_normalize_expert_weights": 1.0, "ffn_act_fn": None}
_EXPERTS = re.compile(r"(.*\.experts)\.mlp\.(w1|v1|w2)")
_EXPERT_PART = {"w1": "w1", "v1": "w3", "w2": "w2"}  # Mixtral's per-expert names (gate, up, down)


@dataclass(frozen=True, slots=True)
class DbrxModelConfig(MoEModelConfig):
    """MoEModelConfig (every layer sparse, experts ffn_hidden_size wide, no shared expert) plus clip_qkv (the bound q,
    k and v are clamped to; None: no clamp) and expert_weights_norm (the p of the top-k weights' p-norm; None: the
    weights as scored)."""

    clip_qkv: float | None = None
    expert_weights_norm: float | None = 1.0


def _sub_config(raw: dict[str, Any], key: str, defaults: dict[str, Any], source: str) -> dict[str, Any]:
    value = raw.get(key)
    if value is not None and not isinstance(value, dict):
        raise ModelLoadError(f"{source}: {key} must be an object or null, got {value!r:.60}")
    return {**defaults, **(value or {})}


def _rope_theta(raw: dict[str, Any], attn: dict[str, Any], source: str) -> float:
    """attn_config.rope_theta where set (module docstring), else the top-level base; only default RoPE."""
    theta, scaling = normalize_rope(raw, source)
    if scaling is not None:
        raise ModelLoadError(f"{source}: rope type {scaling['rope_type']!r} is not supported for DBRX; expected "
                             "default RoPE, as every DBRX checkpoint uses")
    return positive_float(attn, "rope_theta", None, f"{source} attn_config") if "rope_theta" in attn else theta


def parse_dbrx_config(raw: dict[str, Any], source: str = "config.json") -> DbrxModelConfig:
    """Validate a DBRX config.json (module docstring) with transformers' defaults for what it leaves out. Refuses
    pre-quantized checkpoints, tied embeddings, an activation other than SiLU and non-default RoPE. Raises
    ModelLoadError (one line)."""
    refuse_prequantized(raw, source)
    given = {**DBRX_DEFAULTS, **raw}
    attn = _sub_config(raw, "attn_config", ATTN_DEFAULTS, source)
    ffn = _sub_config(raw, "ffn_config", FFN_DEFAULTS, source)
    if flag(raw, "tie_word_embeddings", source):
        raise ModelLoadError(f"{source}: tie_word_embeddings=true is not supported for DBRX (transformers refuses it "
                             "too); expected false")
    act = (ffn["ffn_act_fn"] or {"name": "silu"}).get("name", "silu")
    if act != "silu":
        raise ModelLoadError(f"{source}: ffn_config.ffn_act_fn name {act!r} is not supported; flashllm's experts "
                             "run SiLU-gated (expected 'silu')")
    fields = {"hidden_size": given["d_model"], "num_attention_heads": given["n_heads"],
              "num_hidden_layers": given["n_layers"], "max_position_embeddings": given["max_seq_len"],
              "vocab_size": given["vocab_size"], "num_key_value_heads": attn["kv_n_heads"],
              "intermediate_size": ffn["ffn_hidden_size"], "rms_norm_eps": DBRX_LAYERNORM_EPS,
              "rope_theta": _rope_theta(raw, attn, source), "model_type": "dbrx"}
    keep = ("architectures", "dtype", "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id")
    base = parse_llama_config({**fields, **{key: raw[key] for key in keep if key in raw}}, source)
    experts = positive_int(ffn, "moe_num_experts", None, MAX_NUM_EXPERTS, f"{source} ffn_config")
    top_k = positive_int(ffn, "moe_top_k", None, MAX_NUM_EXPERTS, f"{source} ffn_config")
    if top_k > experts:
        raise ModelLoadError(f"{source}: ffn_config.moe_top_k={top_k} exceeds moe_num_experts={experts}; a token "
                             "cannot go to more experts than the layer has")
    norm = ffn["moe_normalize_expert_weights"]
    clip = attn["clip_qkv"]
    return moe_config(
        base, DbrxModelConfig, num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=base.intermediate_size, norm_topk_prob=norm is not None,
        sparse_layers=(True,) * base.num_hidden_layers, qkv_bias=False,
        clip_qkv=None if clip is None else positive_float(attn, "clip_qkv", None, f"{source} attn_config"),
        expert_weights_norm=None if norm is None else positive_float(ffn, "moe_normalize_expert_weights", None,
                                                                     f"{source} ffn_config"))


class BiasFreeLayerNorm(LayerNorm):
    """LayerNorm with a scale and no shift (DBRX's norm_1, norm_2 and norm_f)."""

    def __init__(self, hidden_size: int, eps: float, ops: Any, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(hidden_size, eps, ops, dtype, device, bias=False)


class DbrxSparseMoeBlock(SparseMoeBlock):
    """SparseMoeBlock whose top-k softmax weights are divided by their p-norm (config.expert_weights_norm)."""

    def __init__(self, config: DbrxModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                         config.moe_intermediate_size, False, 0, ops, dtype, device, tp_rank, tp_size,
                         expert_parallel=config.expert_parallel)
        self.norm_p = config.expert_weights_norm

    def forward(self, x: Tensor) -> Tensor:
        """x (T, hidden) -> (T, hidden) in x.dtype."""
        topk_weights, topk_ids = select_experts(self.gate(x), self.top_k, renormalize=False)
        if self.norm_p is not None:
            topk_weights = topk_weights / torch.linalg.vector_norm(topk_weights, self.norm_p, dim=-1, keepdim=True)
        return self.experts(x, topk_weights, topk_ids)


class DbrxModel(MoEModel):
    """Mixtral's stack with bias-free LayerNorms."""

    norm_class: ClassVar[type[nn.Module]] = BiasFreeLayerNorm


class DbrxForCausalLM(MixtralForCausalLM):
    """DBRX (module docstring): the Hub's names renamed to Mixtral's, each Wqkv cut into q / k / v and each expert
    tensor into its experts' projections as they load. Float checkpoints only; no fused decoder step."""

    renamed_modules: ClassVar[dict[str, str]] = {
        "transformer.wte.": "model.embed_tokens.", "transformer.blocks.": "model.layers.",
        "transformer.norm_f.": "model.norm.", ".norm_attn_norm.norm_1.": ".input_layernorm.",
        ".norm_attn_norm.norm_2.": ".post_attention_layernorm.", ".norm_attn_norm.attn.out_proj.": ".self_attn.o_proj.",
        ".norm_attn_norm.attn.": ".self_attn.", ".ffn.router.layer.": ".mlp.gate.", ".ffn.": ".mlp."}
    required_ops: ClassVar[tuple[str, ...]] = ("fused_moe", "layer_norm")
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()
    attention_class: ClassVar[type[LlamaAttention]] = OlmoAttention  # q, k and v clamped to clip_qkv
    stack_class: ClassVar[type[MoEModel]] = DbrxModel

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> DbrxModelConfig:
        """config.json -> DbrxModelConfig, validated (see parse_dbrx_config)."""
        return parse_dbrx_config(raw, source)

    @staticmethod
    def make_mlp(config: DbrxModelConfig, layer_idx: int, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int, tp_size: int) -> nn.Module:
        """Every layer's MLP: the p-normed top-k block."""
        return DbrxSparseMoeBlock(config, ops, dtype, device, tp_rank, tp_size)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """MixtralForCausalLM.load_weights over the Wqkv and expert tensors cut into their parts."""
        c = self.config
        split = split_wqkv(weights, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim)
        return super().load_weights(self._split_experts(split))

    def _split_experts(self, weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """`<layer>.ffn.experts.mlp.{w1,v1,w2}` (E * I, H) -> `<layer>.ffn.experts.<e>.{w1,w3,w2}.weight`, expert e's
        (I, H) gate and up rows and its (H, I) down projection (views); other tensors pass through."""
        e, i, h = self.config.num_experts, self.config.moe_intermediate_size, self.config.hidden_size
        for name, tensor in weights:
            match = _EXPERTS.fullmatch(name)
            if match is None:
                yield name, tensor
                continue
            if tuple(tensor.shape) != (e * i, h):
                raise ValueError(f"{name} has shape {tuple(tensor.shape)} but the model expects {(e * i, h)} "
                                 "(moe_num_experts * ffn_hidden_size, d_model); the checkpoint does not match its "
                                 "config.json")
            prefix, part = match.groups()
            per_expert = tensor.view(e, i, h)
            for expert in range(e):
                rows = per_expert[expert]
                yield f"{prefix}.{expert}.{_EXPERT_PART[part]}.weight", rows.t() if part == "w2" else rows
