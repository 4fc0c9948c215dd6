"""Mamba-2 (`Mamba2ForCausalLM`: state-spaces/mamba2-*, mistralai/Mamba-Codestral-7B-v0.1), as
transformers' Mamba2Config / Mamba2ForCausalLM read and run it: an embedding, pre-norm blocks `norm` (RMSNorm) ->
`mixer` (the Mamba-2 mixer, flashllm.models.layers.mamba2) with the residual add, the final RMSNorm `norm_f` and the
LM head. No attention layer: every layer keeps a per-sequence state (a conv state and an SSM state), so nothing is
paged and kv_cache_shape() has 0 layers. With `residual_in_fp32` (the default) the residual stream is float32, as
transformers keeps it. Only the silu activation exists in the mixer's kernels; other hidden_act values are refused."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.base import CausalLM
from flashllm.models.decoder_fields import checkpoint_fields
from flashllm.models.hf_config import (
    MAX_HEAD_DIM,
    MAX_HIDDEN_SIZE,
    MAX_NUM_HEADS,
    MAX_NUM_LAYERS,
    MAX_VOCAB_SIZE,
    ModelLoadError,
    config_architecture,
    flag,
    positive_float,
    positive_int,
)
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.embedding import LMHead, VocabEmbedding
from flashllm.models.layers.mamba2 import Mamba2Mixer, Mamba2Sizes
from flashllm.models.layers.norm import RMSNorm
from flashllm.models.layers.recurrent import state_spans
from flashllm.models.olmo2 import refuse_prequantized

# transformers' Mamba2Config defaults (mamba2-2.7b-like shape) where config.json leaves a field out
MAMBA2_DEFAULTS: dict[str, Any] = {
    "num_heads": 128, "head_dim": 64, "vocab_size": 32768, "hidden_size": 4096, "state_size": 128,
    "num_hidden_layers": 64, "layer_norm_epsilon": 1e-5, "bos_token_id": 0, "eos_token_id": 2, "expand": 2,
    "conv_kernel": 4, "n_groups": 8, "use_bias": False, "use_conv_bias": True, "hidden_act": "silu",
    "residual_in_fp32": True, "time_step_limit": (0.0, float("inf")), "chunk_size": 256, "tie_word_embeddings": False,
}
# a recurrent model has no position limit of its own; the longest context flashllm lets it take by default
MAMBA2_MAX_CONTEXT = 1 << 20
MAX_CONV_KERNEL = 64
MAX_STATE_SIZE = 4096


def time_step_limit(raw: dict[str, Any], key: str, source: str) -> tuple[float, float]:
    """config.json's (min, max) limits of dt: two numbers, 0 <= min <= max (max may be infinite)."""
    value = raw.get(key)
    if value is None:
        return 0.0, float("inf")
    if isinstance(value, (list, tuple)):  # transformers writes infinity as {"__float__": "Infinity"}
        value = [float(v["__float__"]) if isinstance(v, dict) and set(v) == {"__float__"} else v for v in value]
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
            or not 0 <= value[0] <= value[1] or math.isnan(value[1])):
        raise ModelLoadError(f"{source}: {key}={value!r} must be [min, max] with 0 <= min <= max")
    return float(value[0]), float(value[1])


def mixer_sizes(raw: dict[str, Any], names: dict[str, str], hidden: int, eps: float, source: str) -> Mamba2Sizes:
    """The mixer's sizes from config.json's fields, under the family's names (`names`: Mamba2Sizes field or
    `expand` -> config key), validated: heads x head_dim = expand x hidden_size (where `names` has an `expand`),
    n_groups dividing the heads."""
    def num(key: str, maximum: int) -> int:
        return positive_int(raw, names[key], None, maximum, source)

    heads, head_dim, groups = num("num_heads", MAX_NUM_HEADS * 64), num("head_dim", MAX_HEAD_DIM), num("n_groups",
                                                                                                       MAX_NUM_HEADS)
    expand = num("expand", 64) if "expand" in names else None  # without one, the width is heads x head_dim
    if expand is not None and heads * head_dim != expand * hidden:
        raise ModelLoadError(f"{source}: {names['num_heads']}={heads} x {names['head_dim']}={head_dim} must equal "
                             f"{names['expand']}={expand} x hidden_size={hidden}, the mixer's inner width")
    if heads % groups:
        raise ModelLoadError(f"{source}: {names['n_groups']}={groups} does not divide {names['num_heads']}={heads}; "
                             "each group of B / C serves an equal number of heads")
    if raw.get(names["hidden_act"], "silu") != "silu":
        raise ModelLoadError(f"{source}: {names['hidden_act']}={raw.get(names['hidden_act'])!r} is not supported; "
                             "the Mamba-2 mixer in flashllm implements 'silu'")
    return Mamba2Sizes(
        hidden_size=hidden, num_heads=heads, head_dim=head_dim, n_groups=groups,
        state_size=num("state_size", MAX_STATE_SIZE), conv_kernel=num("conv_kernel", MAX_CONV_KERNEL),
        use_bias=flag(raw, names["use_bias"], source), use_conv_bias=flag(raw, names["use_conv_bias"], source),
        norm_eps=eps, time_step_limit=time_step_limit(raw, names["time_step_limit"], source),
        chunk_size=num("chunk_size", 1 << 16),
    )


_MAMBA2_NAMES = {name: name for name in ("num_heads", "head_dim", "n_groups", "state_size", "conv_kernel",
                                         "use_bias", "use_conv_bias", "time_step_limit", "chunk_size", "expand",
                                         "hidden_act")}


@dataclass(frozen=True, slots=True)
class Mamba2Config:
    """config.json of a Mamba-2 checkpoint, validated (HFModelConfig's generic fields plus the mixer's sizes)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_norm_epsilon: float
    residual_in_fp32: bool
    mixer: Mamba2Sizes
    max_position_embeddings: int
    torch_dtype: torch.dtype | None
    bos_token_id: int | list[int] | None
    eos_token_id: int | list[int] | None
    tie_word_embeddings: bool
    raw: dict[str, Any] = field(repr=False, compare=False)
    quantization: None = None

    @property
    def head_dim(self) -> int:
        """The mixer's head size (no attention head exists; the op table is resolved for this)."""
        return self.mixer.head_dim

    @property
    def num_parameters(self) -> int:
        """in_proj, out_proj and the embedding and head: the bulk of the weights."""
        m = self.mixer
        per_layer = self.hidden_size * (m.inner_size + m.conv_dim + m.num_heads) + m.inner_size * self.hidden_size
        return self.num_hidden_layers * per_layer + 2 * self.vocab_size * self.hidden_size


def parse_mamba2_config(raw: dict[str, Any], source: str = "config.json") -> Mamba2Config:
    """config.json -> Mamba2Config over MAMBA2_DEFAULTS (transformers' Mamba2Config's). A pre-quantized checkpoint
    is refused. Raises ModelLoadError (one line)."""
    refuse_prequantized(raw, source)
    fields = {**MAMBA2_DEFAULTS, **{key: value for key, value in raw.items() if value is not None}}
    hidden = positive_int(fields, "hidden_size", None, MAX_HIDDEN_SIZE, source)
    eps = positive_float(fields, "layer_norm_epsilon", 1e-5, source)
    return Mamba2Config(
        architecture=config_architecture(raw, source),
        vocab_size=positive_int(fields, "vocab_size", None, MAX_VOCAB_SIZE, source),
        hidden_size=hidden,
        num_hidden_layers=positive_int(fields, "num_hidden_layers", None, MAX_NUM_LAYERS, source),
        layer_norm_epsilon=eps,
        residual_in_fp32=flag(fields, "residual_in_fp32", source),
        mixer=mixer_sizes(fields, _MAMBA2_NAMES, hidden, eps, source),
        max_position_embeddings=MAMBA2_MAX_CONTEXT,
        raw=raw,
        **checkpoint_fields(fields, source),
    )


class Mamba2Block(nn.Module):
    """norm -> mixer, added to the residual stream."""

    def __init__(self, config: Mamba2Config, ops: Any, dtype: torch.dtype, device: torch.device, tp_rank: int,
                 tp_size: int) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon, ops, dtype, device)
        self.mixer = Mamba2Mixer(config.mixer, ops, dtype, device, tp_rank, tp_size)


class Mamba2Backbone(nn.Module):
    """embeddings, layers, norm_f (the checkpoint's `backbone.` names)."""

    def __init__(self, config: Mamba2Config, ops: Any, dtype: torch.dtype, device: torch.device, tp_rank: int,
                 tp_size: int) -> None:
        super().__init__()
        self.embeddings = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device, tp_rank, tp_size)
        self.layers = nn.ModuleList(Mamba2Block(config, ops, dtype, device, tp_rank, tp_size)
                                    for _ in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon, ops, dtype, device)


class Mamba2ForCausalLM(CausalLM):
    """Mamba-2 (module docstring). `backbone.embedding.weight` (older checkpoints) loads as `backbone.embeddings`."""

    renamed_modules: ClassVar[dict[str, str]] = {"backbone.embedding.": "backbone.embeddings."}
    weight_only_quant: ClassVar[tuple[str, ...] | None] = ("w8a16", "w4a16")  # in_proj, out_proj (LinearBase)
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()
    tokenizer_files: ClassVar[tuple[str, ...] | None] = ("tokenizer.json",)

    def __init__(self, config: Mamba2Config, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, ops, dtype, device, tp_rank, tp_size)
        self.dtype = dtype
        self.backbone = Mamba2Backbone(config, ops, dtype, device, tp_rank, tp_size)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, ops, dtype, device, tp_rank, tp_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.backbone.embeddings)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> Mamba2Config:
        """config.json -> Mamba2Config (parse_mamba2_config)."""
        return parse_mamba2_config(raw, source)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """input_ids (T,) -> hidden (T, hidden) in the model dtype; kv_caches holds one (conv_state, ssm_state)
        tuple per layer (no attention caches)."""
        spans = state_spans(attn_metadata)
        residual_dtype = torch.float32 if self.config.residual_in_fp32 else self.dtype
        hidden = self.backbone.embeddings(input_ids).to(residual_dtype)
        for layer, state in zip(self.backbone.layers, kv_caches or [None] * len(self.backbone.layers), strict=True):
            hidden = hidden + layer.mixer(layer.norm(hidden.to(self.dtype)), state, spans)
        return self.backbone.norm_f(hidden.to(self.dtype))

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden (N, hidden) -> logits (N, vocab_size)."""
        return self.lm_head(hidden)

    def kv_cache_shape(self) -> tuple[int, int, int]:
        """No attention layer: (0, 1, head_dim)."""
        return 0, 1, self.config.head_dim

    def state_cache_shapes(self) -> list[tuple[tuple[tuple[int, ...], torch.dtype], ...]]:
        """Per layer: (conv state (channels, K - 1) in the model dtype, SSM state (heads, head_dim, d_state) float32)
        on this rank."""
        return [layer.mixer.state_shapes(self.dtype) for layer in self.backbone.layers]
