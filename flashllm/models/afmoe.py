"""AFMoE (`AfmoeForCausalLM`: Arcee's Trinity Nano / Mini / Large), as transformers' Afmoe computes it.

Attention: per-head q / k RMSNorms, RoPE on the sliding-window layers only (the full-attention layers are NoPE),
and the output gated per feature by sigmoid(`self_attn.gate_proj(x)`) before o_proj. Which layers slide:
`layer_types`, else every `global_attn_every_n_layers`-th layer (4 by default) is full, the rest slide.
Each layer is sandwich-normed: x + post_attention_norm(attn(input_norm(x))), then + post_mlp_norm(mlp(
pre_mlp_norm(.))). The first `num_dense_layers` layers keep a dense gated MLP; the others route each token to the
top-k experts by sigmoid score plus `expert_bias` (which only chooses), weigh them by their unbiased scores
renormalized to sum to one and times `route_scale`, and add `num_shared_experts` shared experts (one gated MLP of
num_shared_experts x moe_intermediate_size features). With `mup_enabled` the embeddings are multiplied by
sqrt(hidden_size). Float checkpoints only. As in transformers' Afmoe, the routing fields the released config.json
files also write (`score_func`, `route_norm`, `n_group`, `topk_group`) are not read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.deepseek_moe import SharedExpertsMoEConfig, SharedExpertsMoEForCausalLM
from flashllm.models.errors import ModelLoadError
from flashllm.models.gemma3 import Gemma3DecoderLayer
from flashllm.models.granite import MultipliedVocabEmbedding
from flashllm.models.hf_config import MAX_NUM_LAYERS, flag, positive_float, positive_int
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.linear import ColumnParallelLinear
from flashllm.models.layers.norm import RMSNorm
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import LlamaAttention
from flashllm.models.llama_config import parse_llama_config
from flashllm.models.mixtral import MakeMLP, MoEModel, experts_and_top_k, moe_config
from flashllm.models.olmo2 import refuse_prequantized
from flashllm.models.smollm3 import NoPositionEmbedding

LAYER_TYPES = ("full_attention", "sliding_attention")  # indexed by "is sliding"
# transformers' AfmoeConfig defaults, where config.json leaves a field out
AFMOE_DEFAULTS: dict[str, Any] = {"vocab_size": 200192, "hidden_size": 2048, "intermediate_size": 6144,
                                  "num_hidden_layers": 32, "num_attention_heads": 16, "head_dim": 128,
                                  "max_position_embeddings": 16384, "rms_norm_eps": 1e-5, "sliding_window": 1024,
                                  "tie_word_embeddings": False}
AFMOE_MOE_DEFAULTS: dict[str, Any] = {"num_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 1408,
                                      "num_shared_experts": 2, "num_dense_layers": 1, "route_scale": 1.0,
                                      "global_attn_every_n_layers": 4}


@dataclass(frozen=True, slots=True)
class AfmoeModelConfig(SharedExpertsMoEConfig):
    """SharedExpertsMoEConfig (routing: sigmoid, the choice bias, no groups, always renormalized) plus
    rope_layers[i]: whether layer i rotates (its sliding ones), and embedding_multiplier: sqrt(hidden_size) where
    mup_enabled, else 1."""

    rope_layers: tuple[bool, ...] = ()
    embedding_multiplier: float = 1.0

    @property
    def num_parameters(self) -> int:
        """SharedExpertsMoEConfig's count plus the attention output gates."""
        gates = self.num_hidden_layers * self.hidden_size * self.num_attention_heads * self.head_dim
        return SharedExpertsMoEConfig.num_parameters.fget(self) + gates


def _count(raw: dict[str, Any], key: str, maximum: int, source: str) -> int:
    """`raw[key]` as an int in 0..maximum (AFMoE's defaults where absent)."""
    value = raw.get(key, AFMOE_MOE_DEFAULTS[key])
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise ModelLoadError(f"{source}: {key}={value!r} must be an int in 0..{maximum}")
    return value


def _layer_types(raw: dict[str, Any], layers: int, source: str) -> list[str]:
    """config.json's layer_types, else transformers' rule: every global_attn_every_n_layers-th layer is full."""
    types = raw.get("layer_types")
    if types is None:
        every = positive_int(raw, "global_attn_every_n_layers", 4, MAX_NUM_LAYERS, source)
        types = [LAYER_TYPES[(i + 1) % every != 0] for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ModelLoadError(f"{source}: layer_types must list {layers} entries, each one of {LAYER_TYPES}")
    return types


def parse_afmoe_config(raw: dict[str, Any], source: str = "config.json") -> AfmoeModelConfig:
    """Validate an AfmoeForCausalLM config.json (module docstring) with transformers' AfmoeConfig defaults.
    Raises ModelLoadError (one line naming the field)."""
    refuse_prequantized(raw, source)
    view = {**AFMOE_DEFAULTS, **raw}
    layers = positive_int(view, "num_hidden_layers", None, MAX_NUM_LAYERS, source)
    types = _layer_types(view, layers, source)
    if view.get("sliding_window") is None and "sliding_attention" in types:
        raise ModelLoadError(f"{source}: sliding_window is null but layer_types has sliding layers; give the window")
    base = parse_llama_config({**view, "layer_types": types, "use_sliding_window": True}, source)
    base = dataclasses.replace(base, qk_norm=True)
    experts, top_k = experts_and_top_k({**AFMOE_MOE_DEFAULTS, **raw}, "num_experts", 64, 6, source)
    moe_width = positive_int({**AFMOE_MOE_DEFAULTS, **raw}, "moe_intermediate_size", None, 1 << 20, source)
    shared = _count(raw, "num_shared_experts", experts, source)
    first_sparse = _count(raw, "num_dense_layers", layers, source)
    scale = positive_float(raw, "route_scale", 1.0, source)
    multiplier = base.hidden_size**0.5 if flag(raw, "mup_enabled", source) else 1.0
    return moe_config(
        base, AfmoeModelConfig, num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_width,
        shared_expert_intermediate_size=shared * moe_width, norm_topk_prob=True,
        sparse_layers=tuple(i >= first_sparse for i in range(layers)), qkv_bias=base.attention_bias,
        first_k_dense_replace=first_sparse, n_routed_experts=experts, n_shared_experts=shared, sigmoid_scoring=True,
        group_limited=False, routed_scaling_factor=scale, choice_bias=True,
        rope_layers=tuple(t == "sliding_attention" for t in types), embedding_multiplier=multiplier)


class AfmoeAttention(LlamaAttention):
    """LlamaAttention (per-head q / k norms, this layer's rotary table or none) with its output gated:
    o_proj(attn(q, k, v) * sigmoid(attn_gate(x))), attn_gate the checkpoint's `self_attn.gate_proj`, split by
    heads over the ranks as the queries are."""

    def __init__(self, config: AfmoeModelConfig, layer_idx: int, rotary_emb: nn.Module, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        bias = config.attention_bias
        super().__init__(config, layer_idx, rotary_emb, ops, dtype, device, bias, bias, tp_rank, tp_size)
        self.attn_gate = ColumnParallelLinear(config.hidden_size, config.num_attention_heads * self.head_dim, False,
                                              ops, dtype, device, tp_rank, tp_size)

    def forward(self, positions: Tensor, hidden: Tensor, kv_cache: tuple[Tensor, Tensor],
                attn_metadata: AttentionMetadata) -> Tensor:
        """positions (T,), hidden (T, hidden) -> (T, hidden)."""
        out = self.attend_heads(positions, hidden, kv_cache, attn_metadata)  # (T, heads on this rank x head_dim)
        return self.o_proj(out * torch.sigmoid(self.attn_gate(hidden)))


class AfmoeDecoderLayer(nn.Module):
    """The sandwich-norm block (Gemma 3's forward: input / post-attention / pre-MLP / post-MLP RMSNorms, the
    latter two loaded from `pre_mlp_layernorm` / `post_mlp_layernorm`) around AfmoeAttention and the layer's MLP."""

    forward = Gemma3DecoderLayer.forward

    def __init__(self, config: AfmoeModelConfig, layer_idx: int, rotary_emb: nn.Module, mlp: nn.Module, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.self_attn = AfmoeAttention(config, layer_idx, rotary_emb, ops, dtype, device, tp_rank, tp_size)
        self.mlp = mlp
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, ops, dtype, device)
        self.post_attention_layernorm = RMSNorm(h, eps, ops, dtype, device)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, ops, dtype, device)
        self.post_feedforward_layernorm = RMSNorm(h, eps, ops, dtype, device)


class AfmoeModel(MoEModel):
    """Embedding (times embedding_multiplier), AFMoE's layers and the final norm; MoEModel's forward."""

    def __init__(self, config: AfmoeModelConfig, make_mlp: MakeMLP, ops: Any, dtype: torch.dtype,
                 device: torch.device, qkv_bias: bool, o_bias: bool, tp_rank: int = 0, tp_size: int = 1,
                 attention_class: type[LlamaAttention] = LlamaAttention) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = MultipliedVocabEmbedding(config, dtype, device, tp_rank, tp_size)
        self.rotary_emb: RotaryEmbedding = self.build_rotary(config, ops, device)
        self.layers = nn.ModuleList(
            AfmoeDecoderLayer(config, i, self.rotary_emb if rotates else NoPositionEmbedding(), make_mlp(config, i),
                              ops, dtype, device, tp_rank, tp_size)
            for i, rotates in enumerate(config.rope_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)


def without_empty_shared_experts(weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """The checkpoint's tensors less the empty `shared_experts` ones transformers writes for a config with no shared
    experts (a gated MLP zero features wide, which adds nothing; flashllm builds none)."""
    return ((name, tensor) for name, tensor in weights if not (".shared_experts." in name and tensor.numel() == 0))


class AfmoeForCausalLM(SharedExpertsMoEForCausalLM):
    """AFMoE (module docstring). Checkpoint names: `self_attn.q|k|v|o_proj`, `self_attn.gate_proj` (the output
    gate), `self_attn.q_norm|k_norm`, four norms per layer, `mlp.router.gate`, `mlp.expert_bias`, per-expert
    `mlp.experts.N.gate_proj|up_proj|down_proj` (or transformers 5's stacked tensors), `mlp.shared_experts.*`;
    dense `mlp.gate_proj|up_proj|down_proj` before num_dense_layers."""

    attention_needs: ClassVar[tuple[str, ...]] = ("sliding window",)
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()
    renamed_modules: ClassVar[dict[str, str]] = {
        ".self_attn.gate_proj.": ".self_attn.attn_gate.", ".mlp.router.gate.": ".mlp.gate.",
        ".mlp.expert_bias": ".mlp.gate.e_score_correction_bias",
        ".pre_mlp_layernorm.": ".pre_feedforward_layernorm.", ".post_mlp_layernorm.": ".post_feedforward_layernorm.",
    }
    stack_class: ClassVar[type[MoEModel]] = AfmoeModel

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> AfmoeModelConfig:
        """config.json -> AfmoeModelConfig, validated (see parse_afmoe_config)."""
        return parse_afmoe_config(raw, source)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """MixtralForCausalLM.load_weights over the checkpoint less empty shared-expert tensors."""
        return super().load_weights(without_empty_shared_experts(weights))

