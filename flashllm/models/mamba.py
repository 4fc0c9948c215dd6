"""Mamba (`MambaForCausalLM`: state-spaces/mamba-*-hf) and FalconMamba (`FalconMambaForCausalLM`: tiiuae/falcon-mamba-7b),
as transformers' MambaConfig / FalconMambaConfig read them and MambaForCausalLM / FalconMambaForCausalLM run them: an
embedding `backbone.embeddings` (old checkpoints: `backbone.embedding`), blocks x + mixer(RMSNorm(x)) of the selective
state-space mixer (flashllm.models.layers.mamba), a final RMSNorm `backbone.norm_f` and an LM head tied to the
embedding by default. No attention and no positions: each sequence carries a convolution and an SSM state per layer
(CausalLM.state_cache_shapes). With `residual_in_fp32` (the default) the residual stream is kept in float32, as
transformers keeps it. FalconMamba differs only inside the mixer: dt, B and C are RMS-normalized (no scale,
`mixer_rms_eps`) before dt_proj and the scan."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.base import CausalLM
from flashllm.models.decoder_fields import checkpoint_fields
from flashllm.models.errors import ModelLoadError
from flashllm.models.hf_config import (
    MAX_HIDDEN_SIZE,
    MAX_INTERMEDIATE_SIZE,
    MAX_NUM_LAYERS,
    MAX_POSITION_EMBEDDINGS,
    MAX_VOCAB_SIZE,
    flag,
    positive_float,
    positive_int,
)
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.embedding import LMHead, VocabEmbedding
from flashllm.models.layers.mamba import MambaMixer
from flashllm.models.layers.norm import RMSNorm
from flashllm.models.layers.recurrent import StateSpans, split_caches, state_spans
from flashllm.models.olmo2 import refuse_prequantized

# transformers' MambaConfig defaults (mamba-130m's shape) where config.json leaves a field out; FalconMambaConfig's
# are the same plus mixer_rms_eps
MAMBA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 50280, "hidden_size": 768, "state_size": 16, "num_hidden_layers": 32, "layer_norm_epsilon": 1e-5,
    "bos_token_id": 0, "eos_token_id": 0, "expand": 2, "conv_kernel": 4, "use_bias": False, "use_conv_bias": True,
    "hidden_act": "silu", "residual_in_fp32": True, "time_step_rank": "auto", "tie_word_embeddings": True,
}
FALCON_MAMBA_MIXER_RMS_EPS = 1e-6
# no attention layer: the op table is still resolved for a head size, and Mamba has no position limit
NOMINAL_HEAD_DIM = 64
MAX_STATE_SIZE = 1024
MAX_CONV_KERNEL = 64


@dataclass(frozen=True, slots=True)
class MambaModelConfig:
    """A Mamba / FalconMamba config.json, validated: the mixer's sizes (intermediate_size as given, else expand x
    hidden_size, as transformers lets a given one win; time_step_rank resolved from "auto" as ceil(hidden_size / 16)), its biases, the norms' eps (mixer_rms_eps None:
    no inner norms, Mamba) and the generic fields."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    state_size: int
    num_hidden_layers: int
    conv_kernel: int
    time_step_rank: int
    use_bias: bool
    use_conv_bias: bool
    layer_norm_epsilon: float
    residual_in_fp32: bool
    mixer_rms_eps: float | None
    torch_dtype: torch.dtype | None
    bos_token_id: int | list[int] | None
    eos_token_id: int | list[int] | None
    tie_word_embeddings: bool
    raw: dict[str, Any]
    quantization: None = None
    head_dim: int = NOMINAL_HEAD_DIM
    max_position_embeddings: int = MAX_POSITION_EMBEDDINGS

    @property
    def num_parameters(self) -> int:
        """Embedding (and an untied head) plus each layer's mixer and norm."""
        h, i, n, r = self.hidden_size, self.intermediate_size, self.state_size, self.time_step_rank
        mixer = h * 2 * i + i * (self.conv_kernel + 1) + i * (r + 2 * n) + (r + 1) * i + i * (n + 1) + i * h
        heads = 1 if self.tie_word_embeddings else 2
        return heads * self.vocab_size * h + self.num_hidden_layers * (mixer + h) + h


def parse_mamba_config(raw: dict[str, Any], source: str = "config.json", inner_norms: bool = False) -> MambaModelConfig:
    """config.json -> MambaModelConfig over MAMBA_DEFAULTS (inner_norms: FalconMamba's, with mixer_rms_eps). A
    hidden_act other than silu and pre-quantized checkpoints are refused. Raises ModelLoadError (one line)."""
    refuse_prequantized(raw, source)
    given = {**MAMBA_DEFAULTS, **{key: value for key, value in raw.items() if value is not None}}
    if given["hidden_act"] != "silu":
        raise ModelLoadError(f"{source}: hidden_act={given['hidden_act']!r} is not supported; Mamba's mixer runs "
                             "silu (the checkpoints' value)")
    hidden = positive_int(given, "hidden_size", None, MAX_HIDDEN_SIZE, source)
    expand = positive_int(given, "expand", None, MAX_INTERMEDIATE_SIZE // hidden or 1, source)
    rank = given["time_step_rank"]
    rank = math.ceil(hidden / 16) if rank == "auto" else positive_int(given, "time_step_rank", None, hidden, source)
    names = given.get("architectures")
    return MambaModelConfig(
        architecture=names[0] if isinstance(names, list) and names else "MambaForCausalLM",
        vocab_size=positive_int(given, "vocab_size", None, MAX_VOCAB_SIZE, source), hidden_size=hidden,
        intermediate_size=positive_int(given, "intermediate_size", expand * hidden, MAX_INTERMEDIATE_SIZE, source),
        state_size=positive_int(given, "state_size", None, MAX_STATE_SIZE, source),
        num_hidden_layers=positive_int(given, "num_hidden_layers", None, MAX_NUM_LAYERS, source),
        conv_kernel=positive_int(given, "conv_kernel", None, MAX_CONV_KERNEL, source), time_step_rank=rank,
        use_bias=flag(given, "use_bias", source), use_conv_bias=flag(given, "use_conv_bias", source),
        layer_norm_epsilon=positive_float(given, "layer_norm_epsilon", 1e-5, source),
        residual_in_fp32=flag(given, "residual_in_fp32", source),
        mixer_rms_eps=positive_float(given, "mixer_rms_eps", FALCON_MAMBA_MIXER_RMS_EPS, source) if inner_norms
        else None,
        raw=raw, **checkpoint_fields(given, source))


class MambaBlock(nn.Module):
    """x + mixer(norm(x)); the residual stream in float32 where residual_in_fp32."""

    def __init__(self, config: MambaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon, ops, dtype, device)
        inner = "weightless" if config.mixer_rms_eps is not None else None
        self.mixer = MambaMixer(config.hidden_size, config.intermediate_size, config.state_size, config.conv_kernel,
                                config.time_step_rank, config.use_bias, config.use_conv_bias, ops, dtype, device,
                                tp_rank, tp_size, inner_norm=inner, norm_eps=config.mixer_rms_eps or 0.0)

    def forward(self, residual: Tensor, state: tuple[Tensor, ...], spans: StateSpans) -> Tensor:
        """residual (T, hidden) -> residual after this block (same dtype)."""
        dtype = self.norm.weight.dtype
        return residual + self.mixer(self.norm(residual.to(dtype)), state, spans)


class MambaForCausalLM(CausalLM):
    """Mamba / FalconMamba (module docstring): `backbone.` holds the embedding, the blocks and norm_f."""

    renamed_modules: ClassVar[dict[str, str]] = {"backbone.embedding.": "backbone.embeddings."}
    weight_only_quant: ClassVar[tuple[str, ...] | None] = ("w8a16", "w4a16")  # its four linears (A_log, D, conv stay)
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()  # parse_mamba_config refuses them
    tokenizer_files: ClassVar[tuple[str, ...] | None] = ("tokenizer.json",)
    inner_norms: ClassVar[bool] = False  # FalconMamba's RMS norms of dt, B and C

    def __init__(self, config: MambaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, ops, dtype, device, tp_rank, tp_size)
        self.backbone = nn.Module()
        self.backbone.embeddings = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device,
                                                  tp_rank, tp_size)
        self.backbone.layers = nn.ModuleList(MambaBlock(config, ops, dtype, device, tp_rank, tp_size)
                                             for _ in range(config.num_hidden_layers))
        self.backbone.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon, ops, dtype, device)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, ops, dtype, device, tp_rank, tp_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.backbone.embeddings)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> MambaModelConfig:
        """config.json -> MambaModelConfig (parse_mamba_config)."""
        return parse_mamba_config(raw, source, inner_norms=cls.inner_norms)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """input_ids (T,) -> final hidden states (T, hidden) in the model dtype; kv_caches: one (conv_state,
        ssm_state) tuple per layer (state_cache_shapes), read and written through attn_metadata.state_slots (none
        for a pass that keeps no state, see split_caches)."""
        layers = self.backbone.layers
        _, states = split_caches(kv_caches, 0, len(layers), attn_metadata)
        spans = state_spans(attn_metadata)
        hidden = self.backbone.embeddings(input_ids)
        residual = hidden.float() if self.config.residual_in_fp32 else hidden
        for layer, state in zip(layers, states, strict=True):
            residual = layer(residual, state, spans)
        # transformers norms the float32 stream itself here (its scale applied in float32), then casts
        return self.backbone.norm_f(residual).to(hidden.dtype)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden (N, hidden) -> logits (N, vocab_size) in the model dtype."""
        return self.lm_head(hidden)

    def kv_cache_shape(self) -> tuple[int, int, int]:
        """No attention layer: (0, 1, a nominal head size); the state lives in state_cache_shapes."""
        return 0, 1, self.config.head_dim

    def state_cache_shapes(self) -> list[tuple[tuple[tuple[int, ...], torch.dtype], ...]]:
        """Per layer: (conv state (I / tp, conv_kernel - 1) in the model dtype, SSM state (I / tp, state_size)
        float32)."""
        return [layer.mixer.state_shapes() for layer in self.backbone.layers]


class FalconMambaForCausalLM(MambaForCausalLM):
    """FalconMamba: Mamba with weightless RMS norms (mixer_rms_eps) of dt, B and C inside each mixer. Checkpoint
    tensors of those norms (transformers keeps unit placeholders, not saved) are skipped."""

    inner_norms: ClassVar[bool] = True
    skipped_weight_suffixes: ClassVar[tuple[str, ...]] = (".dt_layernorm.weight", ".b_layernorm.weight",
                                                          ".c_layernorm.weight")
