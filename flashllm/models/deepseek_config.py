"""DeepSeek-V2 / V3 (and GLM-4.7-Flash) config.json: multi-head latent attention sizes, YaRN, and the MoE routing fields,
validated."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from flashllm.models.block_fp8 import block_fp8_size
from flashllm.models.decoder_fields import checkpoint_fields
from flashllm.models.hf_config import (
    MAX_HEAD_DIM,
    MAX_HIDDEN_SIZE,
    MAX_INTERMEDIATE_SIZE,
    MAX_NUM_HEADS,
    MAX_NUM_LAYERS,
    MAX_POSITION_EMBEDDINGS,
    MAX_VOCAB_SIZE,
    ModelLoadError,
    check_rope,
    config_architecture,
    flag,
    normalize_rope,
    partial_rotary,
    positive_float,
    positive_int,
)
from flashllm.models.mixtral import MAX_NUM_EXPERTS

V2, V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"
# transformers' defaults per architecture, where the two classes differ
_DEFAULTS: dict[str, dict[str, Any]] = {
    V2: {"n_shared_experts": 2, "first_k_dense_replace": 0, "routed_scaling_factor": 1.0, "norm_topk_prob": False,
         "n_routed_experts": 64, "moe_intermediate_size": 1407, "num_experts_per_tok": None, "n_group": None,
         "topk_group": None, "topk_method": "greedy", "scoring_func": "softmax"},
    V3: {"n_shared_experts": 1, "first_k_dense_replace": 3, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
         "n_routed_experts": 256, "moe_intermediate_size": 2048, "num_experts_per_tok": 8, "n_group": 8,
         "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid"},
}
GLM4_MOE = "Glm4MoeForCausalLM"  # GLM-4.5 / 4.6 route as V3 does (transformers' Glm4MoeTopkRouter)
_DEFAULTS[GLM4_MOE] = {**_DEFAULTS[V3], "first_k_dense_replace": 1, "routed_scaling_factor": 1.0,
                       "n_routed_experts": 128, "moe_intermediate_size": 1408, "n_group": 1, "topk_group": 1}
# GLM-4.7-Flash: V3's MLA and routing (transformers' Glm4MoeLite classes are DeepseekV3Attention and the GLM-4.5 MoE)
GLM4_MOE_LITE = "Glm4MoeLiteForCausalLM"
_DEFAULTS[GLM4_MOE_LITE] = {**_DEFAULTS[V3], "first_k_dense_replace": 1, "routed_scaling_factor": 1.8,
                            "n_routed_experts": 64, "moe_intermediate_size": 1536, "num_experts_per_tok": 4,
                            "n_group": 1, "topk_group": 1}
# Glm4MoeLiteConfig's size defaults, where DeepSeek's differ (a field config.json writes, null included, wins)
_LITE_SIZES = {"q_lora_rank": 768, "qk_nope_head_dim": 192, "v_head_dim": 256, "max_position_embeddings": 202752,
               "rms_norm_eps": 1e-5}
# topk_method values each architecture's transformers router implements
_TOPK_METHODS = {V2: ("greedy", "group_limited_greedy"), V3: ("noaux_tc",), GLM4_MOE: ("noaux_tc",),
                 GLM4_MOE_LITE: ("noaux_tc",)}


@dataclass(frozen=True, slots=True)
class DeepseekModelConfig:
    """The fields of a DeepSeek-V2/V3 config.json flashllm's MLA decoder uses, validated.

    MLA: q_lora_rank (None: a plain q_proj), kv_lora_rank (L), qk_nope_head_dim (Dn), qk_rope_head_dim (R),
    v_head_dim (Dv); the latent cache holds L + R values per token and layer. softmax_scale is
    (Dn + R)^-0.5 times YaRN's mscale(factor, mscale_all_dim)^2 when rope_scaling is YaRN with one.
    rope_interleaved: RoPE pairs adjacent features (V2 always, V3 unless rope_interleave is false).
    MoE: layers >= first_k_dense_replace route each token to num_experts_per_tok of n_routed_experts
    experts (softmax scores for V2, sigmoid + e_score_correction_bias for V3), within the topk_group
    best of n_group groups when group_limited, beside n_shared_experts always-on experts; weights
    renormalized when norm_topk_prob, then scaled by routed_scaling_factor. Dense layers use
    intermediate_size. fp8_block: the (rows, cols) of one scale of a block-FP8 checkpoint (None: float).
    """

    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rope_interleaved: bool
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: torch.dtype | None
    bos_token_id: int | list[int] | None
    eos_token_id: int | list[int] | None
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float
    first_k_dense_replace: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    sigmoid_scoring: bool
    group_limited: bool
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    fp8_block: tuple[int, int] | None
    raw: dict[str, Any] = field(repr=False, compare=False)
    quantization: None = None  # block FP8 is dequantized at load (fp8_block); no packed formats
    # --enable-expert-parallel: the MoE layers' ranks hold whole experts (models/layers/moe.py FusedMoE)
    expert_parallel: bool = False

    @property
    def choice_bias(self) -> bool:
        """Whether the router holds e_score_correction_bias (V3's sigmoid routing does; V2's softmax has none)."""
        return self.sigmoid_scoring

    @property
    def head_dim(self) -> int:
        """The value head size: what the op table is resolved for (MLA's latent op is not gated on it)."""
        return self.v_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token and layer in the latent cache: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_parameters(self) -> int:
        """Every weight: MLA projections, routers, experts, shared experts, dense MLPs, embedding and head."""
        h, heads = self.hidden_size, self.num_attention_heads
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = h * heads * qk if self.q_lora_rank is None else self.q_lora_rank * (h + heads * qk)
        attn = (q + h * self.latent_dim + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
                + heads * self.v_head_dim * h)
        moe = h * self.n_routed_experts + 3 * h * self.moe_intermediate_size * (self.n_routed_experts
                                                                               + self.n_shared_experts)
        dense = 3 * h * self.intermediate_size
        layers = self.num_hidden_layers
        mlps = self.first_k_dense_replace * dense + (layers - self.first_k_dense_replace) * moe
        return layers * attn + mlps + 2 * self.vocab_size * h


    def flops_per_token(self, mean_context: float) -> float:
        """FLOPs of one token's forward: 2 x the matmul parameters it runs (MLA projections, router, k routed
        and the shared experts, dense MLPs, LM head) + absorbed attention over `mean_context` cached tokens
        (per head: q_nope through W_UK, scores and weighted sum over L + R / L features, W_UV)."""
        h, heads, rank = self.hidden_size, self.num_attention_heads, self.kv_lora_rank
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = h * heads * qk if self.q_lora_rank is None else self.q_lora_rank * (h + heads * qk)
        attn = q + h * self.latent_dim + heads * self.v_head_dim * h
        moe = h * self.n_routed_experts + 3 * h * self.moe_intermediate_size * (self.num_experts_per_tok
                                                                               + self.n_shared_experts)
        dense = 3 * h * self.intermediate_size
        layers, first = self.num_hidden_layers, self.first_k_dense_replace
        params = layers * attn + first * dense + (layers - first) * moe + self.vocab_size * h
        absorbed = heads * (self.qk_nope_head_dim + self.v_head_dim) * rank  # W_UK into q, W_UV out
        attention = layers * (absorbed + heads * (self.latent_dim + rank) * mean_context)
        return 2.0 * (params + attention)


def parse_deepseek_config(raw: dict[str, Any], source: str = "config.json") -> DeepseekModelConfig:
    """Validate a DeepseekV2ForCausalLM / DeepseekV3ForCausalLM config.json, transformers' defaults where absent.

    Raises ModelLoadError (one line naming the field) on anything transformers' classes would
    compute differently from the checkpoint authors' code, or flashllm cannot run.
    """
    architecture = config_architecture(raw, source, (V2, V3, GLM4_MOE_LITE))
    if architecture == GLM4_MOE_LITE:
        raw = _lite_view(raw, source)
    sizes = _sizes(raw, source)
    rope_theta, rope_scaling = normalize_rope(raw, source)
    check_rope(sizes["qk_rope_head_dim"], rope_theta, rope_scaling, sizes["max_position_embeddings"], source)
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: hidden_act={raw.get('hidden_act')!r} is not supported; expected 'silu'")
    routing = grouped_routing(raw, architecture, sizes["num_hidden_layers"], source)
    qk = sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"]
    return DeepseekModelConfig(
        architecture=architecture, model_type=str(raw.get("model_type", "")),
        rms_norm_eps=positive_float(raw, "rms_norm_eps", 1e-6, source),
        rope_theta=rope_theta, rope_scaling=rope_scaling,
        rope_interleaved=architecture == V2 or raw.get("rope_interleave", True) is not False,
        attention_bias=flag(raw, "attention_bias", source),
        softmax_scale=qk**-0.5 * _mscale_squared(rope_scaling),
        fp8_block=block_fp8_size(raw.get("quantization_config"), source, f"{V2} / {V3}"),
        raw=raw, **sizes, **routing, **checkpoint_fields(raw, source),
    )


def _lite_view(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """A Glm4MoeLiteForCausalLM config.json as DeepSeek-V3's fields: Glm4MoeLiteConfig's defaults where absent, and
    first_k_dense_replace from mlp_layer_types (transformers builds the layers from that list, one dense layer then
    sparse ones by default); refuses a list that is not dense layers followed by sparse ones, a first_k_dense_replace
    that disagrees with it, and RoPE over part of qk_rope_head_dim."""
    view = {**_LITE_SIZES, **raw}
    layers = positive_int(raw, "num_hidden_layers", None, MAX_NUM_LAYERS, source)
    types = raw.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    first = next((i for i, kind in enumerate(types) if kind != "dense"), len(types))
    if not isinstance(types, list) or len(types) != layers or any(kind != "sparse" for kind in types[first:]):
        raise ModelLoadError(f"{source}: mlp_layer_types={types!r}; expected {layers} entries, 'dense' ones followed "
                             "by 'sparse' ones (flashllm's MLA decoder makes every layer from the first sparse one MoE)")
    declared = raw.get("first_k_dense_replace")
    if declared is not None and declared != first:
        raise ModelLoadError(f"{source}: first_k_dense_replace={declared!r} but mlp_layer_types makes {first} "
                             "layer(s) dense; transformers follows mlp_layer_types, so the config is ambiguous")
    rope_dim = positive_int(view, "qk_rope_head_dim", 64, MAX_HEAD_DIM, source)
    rotary_dim, view = partial_rotary(view, rope_dim, 1.0, source)
    if rotary_dim != rope_dim:
        raise ModelLoadError(f"{source}: partial_rotary_factor turns {rotary_dim} of qk_rope_head_dim={rope_dim} "
                             f"features; {GLM4_MOE_LITE}'s attention rotates all of them, so expected 1.0")
    return {**view, "first_k_dense_replace": first}


def _sizes(raw: dict[str, Any], source: str) -> dict[str, Any]:
    heads = positive_int(raw, "num_attention_heads", None, MAX_NUM_HEADS, source)
    kv_heads = raw.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        raise ModelLoadError(f"{source}: num_key_value_heads={kv_heads!r} differs from num_attention_heads={heads}; "
                             "MLA up-projects one latent into every head, so they must be equal (or absent)")
    q_lora = raw.get("q_lora_rank")
    return {
        "hidden_size": positive_int(raw, "hidden_size", None, MAX_HIDDEN_SIZE, source),
        "intermediate_size": positive_int(raw, "intermediate_size", None, MAX_INTERMEDIATE_SIZE, source),
        "num_hidden_layers": positive_int(raw, "num_hidden_layers", None, MAX_NUM_LAYERS, source),
        "num_attention_heads": heads,
        "vocab_size": positive_int(raw, "vocab_size", None, MAX_VOCAB_SIZE, source),
        "max_position_embeddings": positive_int(raw, "max_position_embeddings", 2048, MAX_POSITION_EMBEDDINGS,
                                                source),
        "q_lora_rank": None if q_lora is None else positive_int(raw, "q_lora_rank", None, MAX_HIDDEN_SIZE, source),
        "kv_lora_rank": positive_int(raw, "kv_lora_rank", 512, MAX_HIDDEN_SIZE, source),
        "qk_nope_head_dim": positive_int(raw, "qk_nope_head_dim", 128, MAX_HEAD_DIM, source),
        "qk_rope_head_dim": _even(positive_int(raw, "qk_rope_head_dim", 64, MAX_HEAD_DIM, source), source),
        "v_head_dim": positive_int(raw, "v_head_dim", 128, MAX_HEAD_DIM, source),
    }


def _even(rope_dim: int, source: str) -> int:
    if rope_dim % 2:
        raise ModelLoadError(f"{source}: qk_rope_head_dim={rope_dim} must be even (RoPE rotates pairs)")
    return rope_dim


def grouped_routing(raw: dict[str, Any], architecture: str, num_layers: int, source: str) -> dict[str, Any]:
    """The MoE routing fields of a DeepSeek-V2 / V3 (or GLM-4.5) config.json, validated, over the architecture's
    transformers defaults (a null takes the default where there is one): first_k_dense_replace,
    n_routed_experts, num_experts_per_tok, n_shared_experts, moe_intermediate_size, sigmoid_scoring,
    group_limited, n_group, topk_group, norm_topk_prob, routed_scaling_factor."""
    defaults = _DEFAULTS[architecture]
    values = {key: default if raw.get(key) is None else raw[key] for key, default in defaults.items()}
    experts = positive_int(values, "n_routed_experts", None, MAX_NUM_EXPERTS, source)
    top_k = positive_int(values, "num_experts_per_tok", None, MAX_NUM_EXPERTS, source)
    if top_k > experts:
        raise ModelLoadError(f"{source}: num_experts_per_tok={top_k} exceeds n_routed_experts={experts}")
    method, scoring = values["topk_method"], values["scoring_func"]
    sigmoid = defaults["scoring_func"] == "sigmoid"
    if method not in _TOPK_METHODS[architecture] or scoring != defaults["scoring_func"]:
        raise ModelLoadError(f"{source}: topk_method={method!r} with scoring_func={scoring!r} is not what "
                             f"{architecture} routes by; expected topk_method in {_TOPK_METHODS[architecture]} and "
                             f"scoring_func {defaults['scoring_func']!r}")
    norm = flag(values, "norm_topk_prob", source)
    if architecture == V2 and norm:
        raise ModelLoadError(f"{source}: norm_topk_prob=true for {V2}: transformers' class ignores it while "
                             "DeepSeek's own code renormalizes, so the reference is ambiguous; flashllm refuses it")
    group_limited = method != "greedy"
    groups = values if group_limited else {"n_group": 1, "topk_group": 1}
    n_group = positive_int(groups, "n_group", None, MAX_NUM_EXPERTS, source)
    topk_group = positive_int(groups, "topk_group", None, MAX_NUM_EXPERTS, source)
    per_group = experts // n_group
    if experts % n_group or topk_group > n_group or top_k > topk_group * per_group or (
            sigmoid and per_group < 2):
        raise ModelLoadError(f"{source}: n_group={n_group}, topk_group={topk_group} do not fit n_routed_experts="
                             f"{experts} and num_experts_per_tok={top_k}; expected groups dividing the experts "
                             f"(sigmoid scoring: 2 or more each), topk_group <= n_group and k within the chosen groups")
    if raw.get("moe_layer_freq", 1) != 1:
        raise ModelLoadError(f"{source}: moe_layer_freq={raw.get('moe_layer_freq')!r} is not supported; "
                             "transformers' DeepSeek classes make every layer from first_k_dense_replace on MoE")
    first_dense = values["first_k_dense_replace"]
    if isinstance(first_dense, bool) or not isinstance(first_dense, int) or not 0 <= first_dense <= num_layers:
        raise ModelLoadError(f"{source}: first_k_dense_replace={first_dense!r} must be an int in 0..{num_layers}")
    shared = values["n_shared_experts"] or 0
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise ModelLoadError(f"{source}: n_shared_experts={shared!r} must be a non-negative int")
    return {
        "first_k_dense_replace": first_dense, "n_routed_experts": experts, "num_experts_per_tok": top_k,
        "n_shared_experts": shared, "sigmoid_scoring": sigmoid,
        "moe_intermediate_size": positive_int(values, "moe_intermediate_size", None, MAX_INTERMEDIATE_SIZE, source),
        "group_limited": group_limited, "n_group": n_group, "topk_group": topk_group, "norm_topk_prob": norm,
        "routed_scaling_factor": positive_float(values, "routed_scaling_factor", 1.0, source),
    }


def _mscale_squared(rope_scaling: dict[str, Any] | None) -> float:
    """YaRN's softmax correction: mscale(factor, mscale_all_dim)^2 (1 without YaRN or mscale_all_dim)."""
    if not rope_scaling or not rope_scaling.get("mscale_all_dim"):
        return 1.0
    factor = float(rope_scaling.get("factor") or 1.0)
    if factor <= 1:
        return 1.0
    mscale = 0.1 * float(rope_scaling["mscale_all_dim"]) * math.log(factor) + 1.0
    return mscale * mscale
