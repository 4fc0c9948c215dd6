"""MiniCPM3 (`MiniCPM3ForCausalLM`, openbmb/MiniCPM3-4B): DeepSeek-V2's multi-head latent attention over the paged
latent cache, dense SwiGLU MLPs, half-split (not interleaved) RoPE, and MiniCPM's three scalings: embeddings x
scale_emb, each branch x scale_depth / sqrt(num_hidden_layers), the final hidden states / (hidden_size /
dim_model_base) before the LM head."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from flashllm.models.deepseek import DeepseekDecoderLayer, DeepseekModel, DeepseekV2ForCausalLM
from flashllm.models.deepseek_config import V2, DeepseekModelConfig, parse_deepseek_config
from flashllm.models.granite import MultipliedVocabEmbedding
from flashllm.models.hf_config import (
    MAX_HIDDEN_SIZE,
    MAX_NUM_HEADS,
    MAX_NUM_LAYERS,
    ModelLoadError,
    config_architecture,
    flag,
    normalize_rope,
    positive_float,
    positive_int,
)
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.embedding import VocabEmbedding
from flashllm.ops.rope_cache import cos_sin_rows, longrope_inv_freq

MINICPM3 = "MiniCPM3ForCausalLM"
# MiniCPM3Config's defaults (openbmb/MiniCPM3-4B's values) where they differ from DeepSeek-V2's
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 73448, "hidden_size": 2560, "intermediate_size": 6400, "num_hidden_layers": 62,
    "num_attention_heads": 40, "num_key_value_heads": 40, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True, "kv_lora_rank": 256, "q_lora_rank": 768,
    "qk_nope_head_dim": 64, "qk_rope_head_dim": 32,
}
# a dense DeepSeek-V2 (every layer below first_k_dense_replace); the routing fields are never read
_DENSE_ROUTING = {"n_routed_experts": 1, "num_experts_per_tok": 1, "n_shared_experts": 0, "moe_intermediate_size": 1,
                  "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False, "moe_layer_freq": 1}


@dataclass(frozen=True, slots=True)
class MiniCPM3ModelConfig(DeepseekModelConfig):
    """DeepseekModelConfig's MLA fields (every layer dense, rope_interleaved False) plus MiniCPM's scalars:

    embedding_multiplier: scale_emb, the input embeddings' factor.
    residual_multiplier: scale_depth / sqrt(num_hidden_layers), each attention and MLP output's factor.
    logits_scaling: hidden_size / dim_model_base; the final hidden states are divided by it.
    short_rope: LongRoPE's short factor set when rope_scaling is "longrope" (positions never pass
    original_max_position_embeddings, so the long set is never used), else None.
    """

    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    short_rope: dict[str, Any] | None = None


def parse_minicpm3_config(raw: dict[str, Any], source: str = "config.json") -> MiniCPM3ModelConfig:
    """Validate a MiniCPM3ForCausalLM config.json, MiniCPM3Config's defaults where absent. Raises ModelLoadError (one
    line) for what transformers' class computes differently or flashllm cannot run."""
    config_architecture(raw, source, (MINICPM3,))
    view = {**_DEFAULTS, **raw}
    if flag(view, "mlp_bias", source):
        raise ModelLoadError(f"{source}: mlp_bias=true is not supported; MiniCPM3's MLPs have no biases")
    heads = positive_int(view, "num_attention_heads", None, MAX_NUM_HEADS, source)
    hidden = positive_int(view, "hidden_size", None, MAX_HIDDEN_SIZE, source)
    layers = positive_int(view, "num_hidden_layers", None, MAX_NUM_LAYERS, source)
    theta, scaling = normalize_rope(view, source)
    longrope = scaling is not None and scaling["rope_type"] == "longrope"
    view = {**view, **_DENSE_ROUTING, "architectures": [V2], "first_k_dense_replace": layers,
            "v_head_dim": view.get("v_head_dim") or hidden // heads,
            "rope_parameters": None, "rope_theta": theta, "rope_scaling": None if longrope else scaling}
    deepseek = parse_deepseek_config(view, source)
    depth, base = raw.get("scale_depth", 1.4), raw.get("dim_model_base", 256)
    fields = {f.name: getattr(deepseek, f.name) for f in dataclasses.fields(DeepseekModelConfig)}
    return MiniCPM3ModelConfig(
        **{**fields, "architecture": MINICPM3, "model_type": str(raw.get("model_type", "")), "raw": raw,
           "rope_interleaved": False},
        embedding_multiplier=positive_float({"scale_emb": raw.get("scale_emb", 12.0)}, "scale_emb", None, source),
        residual_multiplier=(1.0 if depth is None
                             else positive_float({"scale_depth": depth}, "scale_depth", None, source) / math.sqrt(layers)),
        logits_scaling=hidden / (hidden if base is None else positive_int({"dim_model_base": base}, "dim_model_base",
                                                                           None, MAX_HIDDEN_SIZE, source)),
        short_rope=_short_rope(scaling, deepseek, source) if longrope else None,
    )


def _short_rope(scaling: dict[str, Any], config: DeepseekModelConfig, source: str) -> dict[str, Any]:
    """A LongRoPE rope_scaling whose positions stay within its original length, where transformers only ever uses
    the short factor set; refuses one that would switch to its long set."""
    original, max_position = scaling.get("original_max_position_embeddings"), config.max_position_embeddings
    if isinstance(original, bool) or not isinstance(original, int) or max_position > original:
        raise ModelLoadError(f"{source}: longrope with max_position_embeddings={max_position} past "
                             f"original_max_position_embeddings={original!r} is not supported for {MINICPM3}; "
                             "expected max_position_embeddings <= original_max_position_embeddings")
    try:
        longrope_inv_freq(config.qk_rope_head_dim, config.rope_theta, scaling, max_position, False)
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(f"{source}: invalid longrope settings: {exc}") from None
    return scaling


class MiniCPM3DecoderLayer(DeepseekDecoderLayer):
    """DeepSeek's pre-norm MLA block (always dense here) with the attention and MLP outputs multiplied by
    residual_multiplier before each joins the residual stream (explicitly: the add is fused into the next norm)."""

    def __init__(self, config: MiniCPM3ModelConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.residual_multiplier = config.residual_multiplier

    def attend(self, positions: Tensor, hidden: Tensor, kv_cache: tuple[Tensor, ...],
               attn_metadata: AttentionMetadata) -> Tensor:
        """MLA of the normed hidden (T, H) -> (T, H), times residual_multiplier."""
        return super().attend(positions, hidden, kv_cache, attn_metadata) * self.residual_multiplier

    def feed_forward(self, hidden: Tensor) -> Tensor:
        """The MLP of the normed hidden (T, H) -> (T, H), times residual_multiplier."""
        return super().feed_forward(hidden) * self.residual_multiplier


class MiniCPM3Model(DeepseekModel):
    """DeepSeek's stack with the scaled embedding, MiniCPM3's layers and, under LongRoPE, its short set's table."""

    layer_class = MiniCPM3DecoderLayer

    def __init__(self, config: MiniCPM3ModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, ops, dtype, device, tp_rank, tp_size)
        if config.short_rope is not None:  # the one table every layer shares (the plain one was built above)
            rotary = self.rotary_emb
            inv_freq, factor = longrope_inv_freq(rotary.rotary_dim, config.rope_theta, config.short_rope,
                                                 config.max_position_embeddings, False)
            rotary.cos_sin_cache = cos_sin_rows(inv_freq, factor, rotary.max_position).to(device)

    @staticmethod
    def build_embedding(config: MiniCPM3ModelConfig, dtype: torch.dtype, device: torch.device, tp_rank: int,
                        tp_size: int) -> VocabEmbedding:
        """The embedding rows times scale_emb (a tied head reads the unscaled table)."""
        return MultipliedVocabEmbedding(config, dtype, device, tp_rank, tp_size)


class MiniCPM3ForCausalLM(DeepseekV2ForCausalLM):
    """MiniCPM3 with HF checkpoint names (q_a_proj / q_b_proj or q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj, a
    gated MLP per layer); one latent cache per layer as DeepSeek's. Pre-quantized checkpoints are refused."""

    stack_class = MiniCPM3Model
    required_ops: ClassVar[tuple[str, ...]] = ("latent_attention",)
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> MiniCPM3ModelConfig:
        """config.json -> MiniCPM3ModelConfig, validated (see parse_minicpm3_config)."""
        if raw.get("quantization_config") is not None:
            raise ModelLoadError(f"{source}: pre-quantized {MINICPM3} checkpoints are not supported; load a float "
                                 "checkpoint (--quant_type quantizes it at load)")
        return parse_minicpm3_config(raw, source)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden (N, hidden) -> logits (N, vocab_size): the head of hidden / logits_scaling, transformers' order."""
        return self.lm_head(hidden / self.config.logits_scaling)

    def fusions(self) -> dict[str, Any]:
        """None: the fusion records carry neither MiniCPM's scalings nor a half-split MLA rotary."""
        return {}
