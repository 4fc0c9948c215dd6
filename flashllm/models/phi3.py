"""Phi-3 / Phi-3.5 / Phi-4 (`Phi3ForCausalLM`): Llama's decoder with q, k, v and gate, up fused in the
checkpoint, LongRoPE, partial rotary and an optional sliding window.

LongRoPE (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini) divides each rotary frequency by a per-feature factor:
the short factors while a sequence fits the training length `original_max_position_embeddings` (O), the
long ones past it, and cos / sin scaled by one attention factor. A token at position p of a sequence whose
prompt has L tokens uses the long set when L > O or p >= O. A chunked or preempted prompt keeps its set (it
is read from the prompt length, not from the tokens computed so far), and prefix-cache blocks of prompts
longer than O are keyed apart from the others (prefix_cache_salt). Sequences that stay within O tokens, and
prompts longer than O, then get exactly transformers' logits. A sequence that grows past O while decoding
keeps the keys it cached with the short set: transformers' generate() instead drops its cache there and
re-encodes the whole sequence with the long set (Phi3ForCausalLM.prepare_inputs_for_generation); doing that
here needs the scheduler to recompute the sequence, which it does not, so such tokens follow transformers'
forward with its KV cache rather than its generate(), and the load says so once. A model whose
max_position_embeddings <= O only ever uses the short set, in one table read by position.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor

from flashllm.models.errors import ModelLoadError
from flashllm.models.hf_config import MAX_POSITION_EMBEDDINGS, normalize_rope, positive_int
from flashllm.models.layers.prequantized import split_output_features
from flashllm.models.layers.rotary import RotaryEmbedding, token_prompt_lens
from flashllm.models.llama import LlamaForCausalLM, LlamaModel, run_decoder_stack
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
from flashllm.ops.attention_metadata import AttentionMetadata
from flashllm.ops.rope_cache import cos_sin_rows, longrope_inv_freq

logger = logging.getLogger(__name__)

# transformers' Phi3Config defaults, for fields a config.json may leave out
PHI3_DEFAULT_MAX_POSITION = 4096
PHI3_DEFAULT_ORIGINAL_MAX_POSITION = 4096
# rope types transformers' Phi3Config accepts; it reads the older names "su" and "yarn" as LongRoPE
_LONGROPE_NAMES = ("longrope", "su", "yarn")

# a fused checkpoint projection -> (its parts as Llama names them, which config sizes give their rows)
_FUSED = re.compile(r"(.*)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|qweight|qzeros|scales|g_idx)")


def parse_phi3_config(raw: dict[str, Any], source: str = "config.json") -> LlamaModelConfig:
    """Validate a Phi3 config.json dict and return its Llama-family view.

    rope_scaling / rope_parameters: null (plain RoPE) or LongRoPE (type "longrope", or "su" / "yarn",
    which transformers reads as LongRoPE) with `short_factor` and `long_factor` of rotary_dim / 2 positive
    numbers each; the training length is the top-level `original_max_position_embeddings` (default 4096,
    as transformers reads it). partial_rotary_factor: the rope dict's, else the top-level one. sliding_window:
    null or a positive int for every layer (one of at least max_position_embeddings is full attention).
    Raises ModelLoadError (one line) on another rope type or a field that is not as above.
    """
    fields = dict(raw)
    if raw.get("max_position_embeddings") is None:
        fields["max_position_embeddings"] = PHI3_DEFAULT_MAX_POSITION
    theta, scaling = normalize_rope(raw, source)
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if isinstance(rope, dict) and rope.get("partial_rotary_factor") is not None:
        fields["partial_rotary_factor"] = rope["partial_rotary_factor"]  # transformers prefers the rope dict's
    # Phi-3 has no projection biases whatever the fields say (transformers' Phi3 builds none)
    fields.update(rope_theta=theta, rope_scaling=None, rope_parameters=None, attention_bias=False, mlp_bias=False,
                  sliding_window=None)
    config = parse_llama_config(fields, source)
    longrope = _longrope(raw, scaling, config, source)
    return dataclasses.replace(config, rope_scaling=longrope, sliding_windows=_sliding_windows(raw, config, source),
                               raw=raw)


def _longrope(raw: dict[str, Any], scaling: dict[str, Any] | None, config: LlamaModelConfig,
              source: str) -> dict[str, Any] | None:
    """The LongRoPE dict (rope_type "longrope", both factor sets, original_max_position_embeddings), or None."""
    if scaling is None:
        return None
    if scaling["rope_type"] not in _LONGROPE_NAMES:
        raise ModelLoadError(f"{source}: rope type {scaling['rope_type']!r} is not supported for Phi3ForCausalLM; "
                             "transformers' Phi3 takes default RoPE or 'longrope' only")
    fields = {"original_max_position_embeddings": PHI3_DEFAULT_ORIGINAL_MAX_POSITION, **raw}
    original = positive_int(fields, "original_max_position_embeddings", None, MAX_POSITION_EMBEDDINGS, source)
    if original < 2:
        raise ModelLoadError(f"{source}: original_max_position_embeddings={original} must be at least 2")
    longrope = {**scaling, "rope_type": "longrope", "original_max_position_embeddings": original}
    for long in (False, True):
        try:
            inv_freq, factor = longrope_inv_freq(config.rotary_dim, config.rope_theta, longrope,
                                                 config.max_position_embeddings, long)
        except (ValueError, TypeError, ArithmeticError) as exc:
            raise ModelLoadError(f"{source}: invalid longrope settings: {exc}") from None
        if not (torch.isfinite(inv_freq).all() and 0 < factor < float("inf")):
            raise ModelLoadError(f"{source}: longrope settings give non-finite frequencies or attention factor")
    return longrope


def _sliding_windows(raw: dict[str, Any], config: LlamaModelConfig, source: str) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ModelLoadError(f"{source}: sliding_window={window!r} must be a positive int or null")
    if window is not None and window >= config.max_position_embeddings:
        window = None  # a query at p < max_position sees keys p - W < k <= p: all of them
    return (window,) * config.num_hidden_layers


def longrope_rows(config: LlamaModelConfig, long: bool, num_positions: int) -> Tensor:
    """(num_positions, rotary_dim) fp32 [cos | sin] of one LongRoPE factor set (long or short), times its attention
    factor: longrope_inv_freq's, or the set's own where rope_scaling holds "mscales" (short, long) (PhiMoE's
    short_mscale / long_mscale, models/phimoe.py)."""
    scaling = config.rope_scaling or {}
    inv_freq, factor = longrope_inv_freq(config.rotary_dim, config.rope_theta, scaling,
                                         config.max_position_embeddings, long)
    mscales = scaling.get("mscales")
    return cos_sin_rows(inv_freq, factor if mscales is None else mscales[long], num_positions)


class LongRopeRotaryEmbedding(RotaryEmbedding):
    """LongRoPE's two tables in one cos_sin_cache: rows [0, O) the short set's positions 0..O-1, rows
    [O, O + max_position) the long set's positions 0..max_position-1 (O = original_max_position_embeddings).
    forward() takes rows (table_rows maps positions to them); both tables carry the attention factor."""

    def __init__(self, config: LlamaModelConfig, ops: Any, device: torch.device) -> None:
        original = int((config.rope_scaling or {})["original_max_position_embeddings"])
        max_position = config.max_position_embeddings
        tables = [longrope_rows(config, False, original), longrope_rows(config, True, max_position)]
        super().__init__(config.head_dim, config.rotary_dim, max_position, config.rope_theta, None, ops, device,
                         cos_sin_cache=torch.cat(tables))
        self.original = original

    def table_rows(self, positions: Tensor, attn_metadata: AttentionMetadata) -> Tensor:
        """positions (T,) int64 -> (T,) int64 rows of cos_sin_cache: the long table's for a token at or past
        position O or of a sequence whose prompt is longer than O (attn_metadata.prompt_lens), else the short's."""
        prompt_lens = token_prompt_lens(positions.shape[0], attn_metadata)
        long = (positions >= self.original) | (prompt_lens > self.original)
        return torch.where(long, positions + self.original, positions)


class LongRopeStack(LlamaModel):
    """The Llama decoder stack sharing one LongRopeRotaryEmbedding; its forward maps each token's position to
    its row in that embedding's tables before the layers run."""

    @staticmethod
    def build_rotary(config: LlamaModelConfig, ops: Any, device: torch.device) -> RotaryEmbedding:
        """LongRoPE's short and long tables (see LongRopeRotaryEmbedding)."""
        return LongRopeRotaryEmbedding(config, ops, device)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """input_ids (T,), positions (T,) -> final hidden states (T, hidden)."""
        rows = self.rotary_emb.table_rows(positions, attn_metadata)
        return run_decoder_stack(self, input_ids, rows, kv_caches, attn_metadata)


class ShortRopeStack(LlamaModel):
    """The Llama stack with LongRoPE's short table alone, for a model whose positions never reach O."""

    @staticmethod
    def build_rotary(config: LlamaModelConfig, ops: Any, device: torch.device) -> RotaryEmbedding:
        """The short set's table over every position."""
        max_position = config.max_position_embeddings
        return RotaryEmbedding(config.head_dim, config.rotary_dim, max_position, config.rope_theta, None, ops,
                               device, cos_sin_cache=longrope_rows(config, False, max_position))


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-3.5 / Phi-4: Llama's pre-norm block (GQA, SwiGLU, RMSNorm, no biases) from checkpoints
    that store `self_attn.qkv_proj` (q rows, then k, then v) and `mlp.gate_up_proj` (gate rows, then up)
    fused. Each is cut into its parts as it loads (views, unread), so a tensor-parallel rank reads only its
    slice of each part (GPTQ / AWQ packed tensors are cut along their output features the same way).
    RoPE over the first partial_rotary_factor of each head (Phi-4-mini: 0.75); LongRoPE as the module
    docstring says; a sliding window on every layer where config.json gives one (Phi-3-mini-4k: 2047).
    """

    attention_needs: ClassVar[tuple[str, ...]] = ("sliding window",)

    def __init__(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, ops, dtype, device, tp_rank, tp_size)
        # the runner fills attn_metadata.prompt_lens only for a model that reads them
        self.reads_prompt_lens = isinstance(self.model, LongRopeStack)
        if self.reads_prompt_lens and tp_rank == 0:
            original = config.rope_scaling["original_max_position_embeddings"]
            logger.warning("LongRoPE: a sequence whose prompt has at most %d tokens and that decodes past %d keeps "
                           "its short-factor keys; transformers' generate() re-encodes it with the long factors "
                           "there, so its later tokens may differ (docs/models.md#phi-3-longrope)", original, original)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig, validated (see parse_phi3_config)."""
        return parse_phi3_config(raw, source)

    def build_stack(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> LlamaModel:
        """The plain Llama stack for plain RoPE (so the fused decoder stack applies); with LongRoPE the
        short table alone when max_position_embeddings <= O, else both tables picked per token."""
        if config.rope_scaling is None:
            return super().build_stack(config, ops, dtype, device, qkv_bias, o_bias, tp_rank, tp_size)
        short_only = config.max_position_embeddings <= config.rope_scaling["original_max_position_embeddings"]
        stack = ShortRopeStack if short_only else LongRopeStack
        return stack(config, ops, dtype, device, qkv_bias, o_bias, tp_rank, tp_size)

    def prefix_cache_salt(self, num_prompt_tokens: int) -> bytes:
        """b"longrope-long" for a prompt longer than O under LongRoPE (its keys are rotated by the long set
        from position 0 on), b"" otherwise."""
        rotary = self.model.rotary_emb
        if isinstance(rotary, LongRopeRotaryEmbedding) and num_prompt_tokens > rotary.original:
            return b"longrope-long"
        return b""

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """CausalLM.load_weights with each fused qkv_proj / gate_up_proj tensor cut into its parts' names."""
        return super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        parts = {"self_attn.qkv_proj": (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)),
                 "mlp.gate_up_proj": (("mlp.gate_proj", c.intermediate_size), ("mlp.up_proj", c.intermediate_size))}
        for name, tensor in weights:
            match = _FUSED.fullmatch(name)
            if match is None:
                yield name, tensor
                continue
            prefix, module, suffix = match.groups()
            names, sizes = zip(*parts[module], strict=True)
            for part_name, part in zip(names, split_output_features(name, tensor, sizes, c.quantization), strict=True):
                yield f"{prefix}.{part_name}.{suffix}", part
