"""Llama 4 text (`Llama4ForCausalLM`; Scout / Maverick's language model, served text-only in text_only.py): iRoPE,
interleaved layers whose queries and keys turn by RoPE (over adjacent feature pairs, llama3-scaled) and are then
L2-normed without a weight (`use_qk_norm`), and NoPE layers (`no_rope_layers[i] == 0`) that turn nothing and scale
each query by a position-dependent temperature (`attn_temperature_tuning`: 1 + attn_scale * log1p(floor((p + 1) /
floor_scale))). MoE layers (`moe_layers`, or every `interleave_moe_layer_step`-th) route each token to its top-k
experts by sigmoid of the router logit, the score multiplying the expert's INPUT, beside one always-on shared expert;
the other layers are dense gated MLPs of `intermediate_size_mlp`.

Chunked local attention (`attention_chunk_size`: the layers layer_types calls chunked_attention, by default the RoPE
layers, see only keys in the query's own aligned chunk of positions) runs over the plain paged_attention op
(layers/chunked_attention.py), so every backend runs it; the KV block size must divide the chunk size (8192 in
Scout and Maverick; the engine refuses another block size at build).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.errors import ModelLoadError
from flashllm.models.hf_config import MAX_INTERMEDIATE_SIZE, flag, positive_float, positive_int
from flashllm.models.layers.attention import split_heads
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.chunked_attention import ChunkLocalView
from flashllm.models.layers.mlp import GatedMLP
from flashllm.models.layers.moe import FusedMoE, RouterLinear
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import LlamaAttention
from flashllm.models.llama_config import parse_llama_config
from flashllm.models.mixtral import MixtralForCausalLM, MoEModelConfig, experts_and_top_k, moe_config
from flashllm.models.olmo2 import refuse_prequantized
from flashllm.models.qwen3 import Qwen3MoeForCausalLM
from flashllm.models.text_only import TextOnly, stacked_experts, text_config

# transformers' Llama4TextConfig defaults where config.json leaves a field out and Llama's parser would read another
LLAMA4_DEFAULTS: dict[str, Any] = {
    "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
    "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
    "attention_chunk_size": 8192}
DEFAULT_ROPE_THETA = 500000.0  # Llama4TextConfig.default_theta
LAYER_TYPES = ("full_attention", "chunked_attention")


@dataclass(frozen=True, slots=True)
class Llama4ModelConfig(MoEModelConfig):
    """MoEModelConfig plus Llama 4's attention: rope_layers[i] (layer i turns by RoPE; else NoPE), chunked_layers[i]
    (layer i's attention is chunked, attention_chunk_size tokens), use_qk_norm (weightless RMS norm of q and k after
    RoPE, RoPE layers only), attn_temperature_tuning / floor_scale / attn_scale (NoPE layers' query temperature).
    intermediate_size is the dense layers' (config.json's intermediate_size_mlp); moe_intermediate_size and
    shared_expert_intermediate_size are the experts' (config.json's intermediate_size)."""

    rope_layers: tuple[bool, ...] = ()
    chunked_layers: tuple[bool, ...] = ()
    attention_chunk_size: int | None = None
    use_qk_norm: bool = True
    attn_temperature_tuning: bool = True
    floor_scale: int = 8192
    attn_scale: float = 0.1

    @property
    def num_parameters(self) -> int:
        """Every weight (MoEModelConfig's count, less the shared-expert gate Llama 4 has not)."""
        return MoEModelConfig.num_parameters.fget(self) - sum(self.sparse_layers) * self.hidden_size


def _layer_list(raw: dict[str, Any], key: str, num_layers: int, source: str) -> list[Any] | None:
    """config.json's per-layer list `key` (None where absent, null or empty, as transformers reads it), at least
    num_layers long (transformers reads the first num_layers entries)."""
    value = raw.get(key)
    if not value:
        return None
    if not isinstance(value, list) or len(value) < num_layers:
        raise ModelLoadError(f"{source}: {key}={value!r} must list at least num_hidden_layers={num_layers} entries")
    return value[:num_layers]


def _rope_layers(raw: dict[str, Any], num_layers: int, source: str) -> tuple[bool, ...]:
    """no_rope_layers (1: RoPE, 0: NoPE), or every no_rope_layer_interval-th layer NoPE where absent."""
    given = _layer_list(raw, "no_rope_layers", num_layers, source)
    if given is None:
        interval = positive_int(raw, "no_rope_layer_interval", 4, 1 << 20, source)
        return tuple((i + 1) % interval != 0 for i in range(num_layers))
    if any(entry not in (0, 1) or isinstance(entry, float) for entry in given):
        raise ModelLoadError(f"{source}: no_rope_layers={raw['no_rope_layers']!r} must hold 0 (NoPE) or 1 (RoPE) "
                             "per layer")
    return tuple(bool(entry) for entry in given)


def _sparse_layers(raw: dict[str, Any], num_layers: int, source: str) -> tuple[bool, ...]:
    """moe_layers (the MoE layers' indices), or every interleave_moe_layer_step-th layer from step - 1 on."""
    listed = raw.get("moe_layers")
    if listed is None:
        step = positive_int(raw, "interleave_moe_layer_step", 1, 1 << 20, source)
        listed = list(range(step - 1, num_layers, step))
    if not isinstance(listed, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in listed):
        raise ModelLoadError(f"{source}: moe_layers={listed!r} must be a list of layer indices")
    if any(not 0 <= i < num_layers for i in listed):
        raise ModelLoadError(f"{source}: moe_layers={listed!r} holds an index outside 0..{num_layers - 1}")
    return tuple(i in listed for i in range(num_layers))


def _chunked_layers(raw: dict[str, Any], rope_layers: tuple[bool, ...], chunk: int | None,
                    source: str) -> tuple[bool, ...]:
    """layer_types' "chunked_attention" layers, or the RoPE layers where a chunk size is set (transformers')."""
    types = _layer_list(raw, "layer_types", len(rope_layers), source)
    if types is None:
        return tuple(rope and chunk is not None for rope in rope_layers)
    if any(kind not in LAYER_TYPES for kind in types):
        raise ModelLoadError(f"{source}: layer_types={raw['layer_types']!r}; Llama 4 layers are one of {LAYER_TYPES}")
    if chunk is None and "chunked_attention" in types:
        raise ModelLoadError(f"{source}: layer_types has chunked_attention layers but attention_chunk_size is null")
    return tuple(kind == "chunked_attention" for kind in types)


def _flag_on(raw: dict[str, Any], key: str, source: str, counts: bool = False) -> bool:
    """`raw[key]` as a JSON boolean, True where absent (Llama4TextConfig's default for key). counts: a non-negative int
    reads as its truth (the published Scout and Maverick files write attn_temperature_tuning 4, which transformers
    4.51, who wrote them, reads as on; transformers 5.25's strict config refuses the int)."""
    value = raw.get(key, True)
    if counts and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value > 0
    return flag({key: value}, key, source)


def parse_llama4_config(raw: dict[str, Any], source: str = "config.json") -> Llama4ModelConfig:
    """Validate a Llama4ForCausalLM config.json (module docstring) with transformers' Llama4TextConfig defaults.
    Refuses pre-quantized checkpoints (quantize at load with --quant_type), lists that do not cover every layer,
    and MoE layers whose top-k exceeds their experts. Raises ModelLoadError (one line naming the field)."""
    refuse_prequantized(raw, source)
    view = {**LLAMA4_DEFAULTS, **{k: v for k, v in raw.items() if v is not None or k == "attention_chunk_size"}}
    if raw.get("head_dim") is None and "head_dim" in raw:  # null: hidden / heads (Llama4TextConfig.__post_init__)
        view.pop("head_dim")
    rope = view.get("rope_parameters")
    if not (isinstance(rope, dict) and rope.get("rope_theta")):
        view.setdefault("rope_theta", DEFAULT_ROPE_THETA)
    layers = positive_int(view, "num_hidden_layers", None, 1 << 20, source)
    dense_width = positive_int(view, "intermediate_size_mlp", None, MAX_INTERMEDIATE_SIZE, source)
    base = parse_llama_config({**view, "intermediate_size": dense_width, "sliding_window": None}, source)
    expert_width = positive_int(view, "intermediate_size", None, MAX_INTERMEDIATE_SIZE, source)
    experts, top_k = experts_and_top_k(view, "num_local_experts", 16, 1, source)
    chunk = view.get("attention_chunk_size")
    if chunk is not None:
        chunk = positive_int(view, "attention_chunk_size", None, 1 << 40, source)
    rope_layers = _rope_layers(view, layers, source)
    chunked = _chunked_layers(view, rope_layers, chunk, source)
    base = dataclasses.replace(base, rope_interleaved=True)
    return moe_config(
        base, Llama4ModelConfig, num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_width,
        shared_expert_intermediate_size=expert_width, norm_topk_prob=False,
        sparse_layers=_sparse_layers(view, layers, source), qkv_bias=flag(view, "attention_bias", source),
        rope_layers=rope_layers, chunked_layers=chunked, attention_chunk_size=chunk,
        use_qk_norm=_flag_on(view, "use_qk_norm", source),
        attn_temperature_tuning=_flag_on(view, "attn_temperature_tuning", source, counts=True),
        floor_scale=positive_int(view, "floor_scale", 8192, 1 << 40, source),
        attn_scale=positive_float(view, "attn_scale", 0.1, source))


class WeightlessRMSNorm(nn.Module):
    """RMS norm over the last dim with no learned scale (ops.rms_norm with a ones scale): Llama 4's qk_norm."""

    def __init__(self, size: int, eps: float, ops: Any, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps, self._rms_norm = eps, ops.rms_norm
        self.register_buffer("ones", torch.ones(size, dtype=dtype, device=device), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        """x (T, heads, D) -> normed, same shape and dtype."""
        return self._rms_norm(x.reshape(-1, x.shape[-1]), self.ones, self.eps).view(x.shape)


class Llama4Attention(LlamaAttention):
    """LlamaAttention with iRoPE: a RoPE layer turns q and k (adjacent pairs) and then RMS-norms them without a weight
    where use_qk_norm; a NoPE layer turns nothing and scales its queries by the temperature of their positions.
    chunk_view: the model's shared ChunkLocalView where this layer's attention is chunked (set by the model), else
    None."""

    chunk_view: ChunkLocalView | None = None

    def __init__(self, config: Llama4ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, qkv_bias: bool, o_bias: bool,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, layer_idx, rotary_emb, ops, dtype, device, qkv_bias, o_bias, tp_rank, tp_size)
        self.use_rope = config.rope_layers[layer_idx]
        self.qk_norm = (WeightlessRMSNorm(self.head_dim, config.rms_norm_eps, ops, dtype, device)
                        if config.use_qk_norm and self.use_rope else None)
        self.temperature = (config.floor_scale, config.attn_scale) if (
            config.attn_temperature_tuning and not self.use_rope) else None

    def forward(self, positions: Tensor, hidden: Tensor, kv_cache: tuple[Tensor, Tensor],
                attn_metadata: AttentionMetadata) -> Tensor:
        """positions (T,), hidden (T, hidden) -> (T, hidden)."""
        q, k, v = split_heads(self.qkv_proj(hidden), self.num_heads, self.num_kv_heads, self.head_dim)
        if self.use_rope:
            q, k = self.rotary_emb(positions, q, k)
            if self.qk_norm is not None:
                q, k = self.qk_norm(q), self.qk_norm(k)
        elif self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0  # (T,)
            q = (q * scales[:, None, None]).to(q.dtype)
        if self.chunk_view is not None:
            attn_metadata = self.chunk_view.of(attn_metadata, kv_cache[0].shape[1])
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class Llama4MoE(nn.Module):
    """One MoE MLP: the top-k experts by router logit, each fed the token scaled by sigmoid(its logit) (the score
    multiplies the expert's input, not its output), summed, plus the always-on shared expert. Names as the
    checkpoints': router, experts, shared_expert."""

    def __init__(self, config: Llama4ModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        hidden, self.top_k = config.hidden_size, config.num_experts_per_tok
        self.router = RouterLinear(hidden, config.num_experts, False, ops, dtype, device, tp_rank, tp_size)
        self.experts = FusedMoE(config.num_experts, hidden, config.moe_intermediate_size, ops, dtype, device,
                                tp_rank, tp_size, expert_parallel=config.expert_parallel)
        self.shared_expert = GatedMLP(hidden, config.shared_expert_intermediate_size, False, ops, dtype, device,
                                      tp_rank, tp_size)

    def unstreamed_bytes(self) -> int:
        """Expert weight bytes one decode token does not read on this rank: E - k of the (local) experts."""
        return max(self.experts.num_local_experts - self.top_k, 0) * self.experts.expert_nbytes()

    def forward(self, x: Tensor) -> Tensor:
        """x (T, hidden) -> (T, hidden) in x.dtype."""
        tokens, hidden = x.shape
        logits, ids = torch.topk(self.router(x), self.top_k, dim=-1)  # (T, k) each
        scores = torch.sigmoid(logits.float()).to(x.dtype)
        routed_in = (x[:, None, :] * scores[..., None]).reshape(-1, hidden)  # (T * k, hidden): one row per choice
        ones = torch.ones(routed_in.shape[0], 1, dtype=torch.float32, device=x.device)
        routed = self.experts(routed_in, ones, ids.reshape(-1, 1)).view(tokens, self.top_k, hidden).sum(dim=1)
        return self.shared_expert(x) + routed


class Llama4ForCausalLM(MixtralForCausalLM):
    """Llama 4 text: Llama's projection names, each layer's MLP `feed_forward` (router, fused experts
    `experts.gate_up_proj` (E, hidden, 2 x intermediate_size) and `experts.down_proj` (E, intermediate_size, hidden)
    as transformers 5 and the Hub store them, shared_expert; or a dense gate/up/down_proj). Pre-quantized checkpoints
    are refused."""

    renamed_modules: ClassVar[dict[str, str]] = {".feed_forward.": ".mlp."}
    attention_class: ClassVar[type[LlamaAttention]] = Llama4Attention
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()

    def __init__(self, config: Llama4ModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, ops, dtype, device, tp_rank, tp_size)
        view = ChunkLocalView(config.attention_chunk_size) if any(config.chunked_layers) else None
        for layer, chunked in zip(self.model.layers, config.chunked_layers, strict=True):
            layer.self_attn.chunk_view = view if chunked else None

    def check_kv_block_size(self, block_size: int) -> None:
        """Chunked layers need the block size to divide attention_chunk_size (each chunk starts a block)."""
        if any(self.config.chunked_layers) and self.config.attention_chunk_size % block_size:
            raise ValueError(f"Llama 4's chunked attention needs the KV block size to divide attention_chunk_size="
                             f"{self.config.attention_chunk_size}; choose a block_size that divides it")

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> Llama4ModelConfig:
        """config.json -> Llama4ModelConfig, validated (see parse_llama4_config)."""
        return parse_llama4_config(raw, source)

    attention_biases = staticmethod(Qwen3MoeForCausalLM.attention_biases)  # q, k, v and o by attention_bias

    @staticmethod
    def make_mlp(config: Llama4ModelConfig, layer_idx: int, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int, tp_size: int) -> nn.Module:
        """A Llama4MoE where config.sparse_layers says, else a dense gated MLP of intermediate_size_mlp."""
        if config.sparse_layers[layer_idx]:
            return Llama4MoE(config, ops, dtype, device, tp_rank, tp_size)
        return GatedMLP(config.hidden_size, config.intermediate_size, False, ops, dtype, device, tp_rank, tp_size)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """MixtralForCausalLM's load_weights with the fused experts turned from (E, in, out) to flashllm's stacking."""
        config = self.config
        return super().load_weights(stacked_experts(weights, config.hidden_size, config.moe_intermediate_size,
                                                    ".feed_forward.experts."))


class Llama4ForConditionalGeneration(TextOnly, Llama4ForCausalLM):
    """Llama 4 Scout / Maverick text-only: Llama 4's decoder of `text_config` (transformers' Llama4TextConfig defaults)
    under `language_model.`; the vision model and projector are never read."""

    TEXT_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {"llama4_text": {}}  # parse_llama4_config applies them

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> Llama4ModelConfig:
        """parse_llama4_config on text_config(), the text config's nulls kept (a null attention_chunk_size means no
        chunking, not the default)."""
        text = text_config(raw, cls.TEXT_DEFAULTS, source)
        nulls = {key: None for key, value in raw["text_config"].items() if value is None}
        return parse_llama4_config({**text, **nulls}, source)
