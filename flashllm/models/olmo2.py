"""OLMo 2 (`Olmo2ForCausalLM`, allenai/OLMo-2-*) and OLMo 3 (`Olmo3ForCausalLM`): Llama's projections with the norms
moved after each branch.

A layer computes x + post_attention_norm(attn(x)), then + post_feedforward_norm(mlp(.)): no norm before attention
or the MLP. The attention RMS-normalizes the whole query projection (every head together, one weight of
num_heads x head_dim) and the whole key projection before RoPE. Those norms span every head, so under tensor
parallelism each rank gathers the ranks' query and key slices, normalizes the whole projections and keeps its own
heads (the key heads must split evenly over the ranks).

OLMo 3 adds sliding-window layers (`layer_types`; by default three sliding layers, then a full one) with their own
RoPE: the full layers rotate by `rope_parameters.full_attention` (or the legacy `rope_theta` / `rope_scaling`, YaRN
in the long-context checkpoints), the sliding ones by `rope_parameters.sliding_attention` (legacy: the same base,
unscaled), as transformers' Olmo3Config reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.errors import ModelLoadError
from flashllm.models.hf_config import MAX_NUM_LAYERS, normalize_rope, positive_int
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.embedding import VocabEmbedding
from flashllm.models.layers.mlp import GatedMLP
from flashllm.models.layers.norm import RMSNorm
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import HiddenTaps, LlamaAttention, LlamaForCausalLM, LlamaModel, run_decoder_stack
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config

OLMO3_ROPE_THETA = 500000.0  # transformers' Olmo3Config default_theta
LAYER_TYPES = ("full_attention", "sliding_attention")  # indexed by "is sliding"


def refuse_prequantized(raw: dict[str, Any], source: str) -> None:
    """Raise ModelLoadError (one line, naming config.json's architecture) for a checkpoint with a quantization_config,
    for the families that load float checkpoints only (OLMo 2 / 3 and the others calling this)."""
    if raw.get("quantization_config") is not None:
        names = raw.get("architectures")
        name = names[0] if isinstance(names, list) and names and isinstance(names[0], str) else "this architecture"
        raise ModelLoadError(f"{source}: {name} loads float checkpoints only (quantize them at load with --quant_type); "
                             "drop quantization_config or use a float checkpoint")


class Olmo2Attention(LlamaAttention):
    """LlamaAttention with q_norm / k_norm over the whole query / key projection (all heads), before RoPE."""

    def __init__(self, config: LlamaModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        if config.num_key_value_heads % tp_size:
            raise ValueError(f"{config.architecture} normalizes each token's keys over all key heads at once, so its "
                             f"{config.num_key_value_heads} key heads must split evenly over the ranks; choose a "
                             f"--tensor-parallel-size that divides {config.num_key_value_heads}")
        bias = config.attention_bias
        super().__init__(config, layer_idx, rotary_emb, ops, dtype, device, bias, bias, tp_rank, tp_size)
        eps = config.rms_norm_eps
        # the whole projections' widths: every rank normalizes the gathered projections (_normed)
        self.q_norm = RMSNorm(config.num_attention_heads * self.head_dim, eps, ops, dtype, device)
        self.k_norm = RMSNorm(config.num_key_value_heads * self.head_dim, eps, ops, dtype, device)
        self.tp_rank, self.tp_size = tp_rank, tp_size

    def _normed(self, norm: RMSNorm, x: Tensor) -> Tensor:
        """This rank's slice (T, w) of a projection, normed over the whole projection: the ranks' slices gathered in
        rank order (T, tp * w), normed, and this rank's columns kept."""
        if self.tp_size == 1:
            return norm(x.contiguous())
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(self.tp_size)]
        torch.distributed.all_gather(parts, x.contiguous())
        width = x.shape[-1]
        return norm(torch.cat(parts, dim=-1)).narrow(-1, self.tp_rank * width, width)

    def forward(self, positions: Tensor, hidden: Tensor, kv_cache: tuple[Tensor, Tensor],
                attn_metadata: AttentionMetadata) -> Tensor:
        """positions (T,), hidden (T, hidden) -> (T, hidden)."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = self._normed(self.q_norm, q).reshape(-1, self.num_heads, self.head_dim)
        k = self._normed(self.k_norm, k).reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v.reshape(-1, self.num_kv_heads, self.head_dim), kv_cache, attn_metadata))


class Olmo2DecoderLayer(nn.Module):
    """x + post_attention_layernorm(attn(x)), then + post_feedforward_layernorm(mlp(.)). Called as
    run_decoder_stack's layers, with the residual stream split as (hidden, residual), x = hidden + residual."""

    def __init__(self, config: LlamaModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int, tp_size: int,
                 attention_class: type[nn.Module], mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = attention_class(config, layer_idx, rotary_emb, ops, dtype, device, tp_rank, tp_size)
        self.mlp = mlp if mlp is not None else GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias,
                                                        ops, dtype, device, tp_rank, tp_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)

    def forward(self, positions: Tensor, hidden: Tensor, residual: Tensor | None, kv_cache: tuple[Tensor, ...],
                attn_metadata: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """hidden (T, H), residual (T, H) or None before the first layer -> (branch output, residual stream)."""
        x = hidden if residual is None else hidden + residual
        x = x + self.post_attention_layernorm(self.self_attn(positions, x, kv_cache, attn_metadata))
        return self.post_feedforward_layernorm(self.mlp(x)), x


class Olmo2Model(nn.Module):
    """Llama's embedding, rotary table and final norm around OLMo 2's post-norm layers (HF's `model.` prefix); layer
    i's MLP from make_mlp(config, i) where given (FlexOlmo's MoE), else gated."""

    hidden_taps: HiddenTaps | None = None  # run_decoder_stack keeps tapped layers' inputs here
    attention_class: ClassVar[type[nn.Module]] = Olmo2Attention  # (config, layer_idx, rotary, ops, ...) -> module

    def __init__(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1, make_mlp: Callable[[Any, int], nn.Module] | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device, tp_rank, tp_size)
        self.rotary_emb = LlamaModel.build_rotary(config, ops, device)
        local = getattr(config, "local_rope", None)  # OLMo 3's sliding layers rotate by their own table
        self.rotary_emb_local = None if local is None else RotaryEmbedding(
            config.head_dim, config.rotary_dim, config.max_position_embeddings, local[0], local[1], ops, device)
        self.layers = nn.ModuleList(
            Olmo2DecoderLayer(config, i, self.rotary_emb if window is None or local is None else self.rotary_emb_local,
                              ops, dtype, device, tp_rank, tp_size, self.attention_class,
                              None if make_mlp is None else make_mlp(config, i))
            for i, window in enumerate(config.sliding_windows)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """input_ids (T,), positions (T,) -> final hidden states (T, hidden)."""
        return run_decoder_stack(self, input_ids, positions, kv_caches, attn_metadata)


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2 (module docstring): Llama's checkpoint names with `self_attn.q_norm` / `k_norm` of the projections'
    widths and `post_attention_layernorm` / `post_feedforward_layernorm` in place of the pre-norms."""

    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """Llama's config.json fields; a pre-quantized checkpoint is refused (float weights only: quantize at load
        with --quant_type)."""
        refuse_prequantized(raw, source)
        return parse_llama_config(raw, source)

    def build_stack(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> Olmo2Model:
        """OLMo 2's post-norm stack."""
        return Olmo2Model(config, ops, dtype, device, tp_rank, tp_size)


@dataclass(frozen=True, slots=True)
class Olmo3ModelConfig(LlamaModelConfig):
    """LlamaModelConfig (rope_theta / rope_scaling: the full layers'; sliding_windows per layer_types) plus
    local_rope: the sliding layers' (rope_theta, rope_scaling)."""

    local_rope: tuple[float, dict[str, Any] | None] = (OLMO3_ROPE_THETA, None)


def parse_olmo3_config(raw: dict[str, Any], source: str = "config.json") -> Olmo3ModelConfig:
    """Validate an Olmo3ForCausalLM config.json (module docstring); ModelLoadError (one line) otherwise."""
    refuse_prequantized(raw, source)
    layers = positive_int(raw, "num_hidden_layers", None, MAX_NUM_LAYERS, source)
    types = raw.get("layer_types") or [LAYER_TYPES[(i + 1) % 4 != 0] for i in range(layers)]
    params = raw.get("rope_parameters")
    if params:
        if not isinstance(params, dict) or not set(params) <= set(LAYER_TYPES):
            raise ModelLoadError(f"{source}: rope_parameters={params!r} must map {' and '.join(LAYER_TYPES)} to their "
                                 "RoPE settings, as transformers writes OLMo 3's")
        full = normalize_rope({"rope_parameters": params.get("full_attention") or {},
                               "rope_theta": OLMO3_ROPE_THETA}, f"{source} rope_parameters.full_attention")
        local = normalize_rope({"rope_parameters": params.get("sliding_attention") or {},
                                "rope_theta": OLMO3_ROPE_THETA}, f"{source} rope_parameters.sliding_attention")
    else:
        full = normalize_rope({**raw, "rope_theta": raw.get("rope_theta", OLMO3_ROPE_THETA)}, source)
        if full[0] != OLMO3_ROPE_THETA:
            # transformers gives the sliding layers its default base then, not rope_theta: refused as ambiguous
            raise ModelLoadError(f"{source}: rope_theta={full[0]:g} without per-layer-type rope_parameters: "
                                 f"transformers rotates OLMo 3's sliding layers by {OLMO3_ROPE_THETA:g} then; write "
                                 "rope_parameters with full_attention and sliding_attention entries")
        local = (full[0], None)
    view = {**raw, "layer_types": types, "sliding_window": raw.get("sliding_window", 4096),
            "use_sliding_window": True, "rope_parameters": None, "rope_theta": full[0], "rope_scaling": full[1]}
    base = parse_llama_config(view, source)
    return Olmo3ModelConfig(**{f.name: getattr(base, f.name) for f in fields(LlamaModelConfig)}, local_rope=local)


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 3: OLMo 2's layers, sliding windows and a second RoPE table for the sliding layers (module docstring)."""

    attention_needs: ClassVar[tuple[str, ...]] = ("sliding window",)
    skipped_weight_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq", "rotary_emb_local.inv_freq")

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> Olmo3ModelConfig:
        """config.json -> Olmo3ModelConfig, validated (parse_olmo3_config)."""
        return parse_olmo3_config(raw, source)
