"""Qwen (first generation, `QWenLMHeadModel`): read natively from its own config.json fields and tensor names.

The architecture is Qwen2's decoder with as many key/value heads as query heads: RMSNorm, one
fused `c_attn` projection with a bias, neox RoPE over `rotary_pct` of each head, and the MLP
`c_proj(w1(x) * silu(w2(x)))`. So the model is built from the Llama layers (and keeps their fused
cpu fast paths) and only its config fields and checkpoint names are Qwen's own.

Two inference-time extensions of the published code: `use_logn_attn` scales the queries of
positions past `seq_length` by log(position + 1) / log(seq_length), done here exactly per token;
`use_dynamic_ntk` raises the RoPE base by a factor chosen from each prompt's length once it
exceeds `seq_length`, which a shared paged (and prefix-cached) KV cache cannot reproduce, so the
usable context is then capped at `seq_length`, where both extensions are the identity.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from flashllm.models.errors import ModelLoadError
from flashllm.models.hf_config import (
    MAX_HEAD_DIM,
    MAX_HIDDEN_SIZE,
    MAX_INTERMEDIATE_SIZE,
    MAX_NUM_HEADS,
    MAX_NUM_LAYERS,
    MAX_POSITION_EMBEDDINGS,
    MAX_VOCAB_SIZE,
    check_rope,
    checkpoint_dtype,
    config_architecture,
    flag,
    parse_quantization_config,
    positive_float,
    positive_int,
    token_ids,
)
from flashllm.models.layers.prequantized import split_output_features
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama_config import LlamaModelConfig
from flashllm.models.qwen2 import Qwen2ForCausalLM

logger = logging.getLogger(__name__)

# QWenConfig's defaults (configuration_qwen.py), for fields a config.json may leave out
_DEFAULTS: dict[str, Any] = {
    "layer_norm_epsilon": 1e-6, "rotary_emb_base": 10000.0, "rotary_pct": 1.0, "seq_length": 8192,
    "max_position_embeddings": 8192, "use_dynamic_ntk": True, "use_logn_attn": True, "no_bias": True,
}

# checkpoint name inside `transformer.h.N.` -> the Llama layer's name inside `model.layers.N.`
_LAYER_NAMES = {
    "ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn.c_proj": "self_attn.o_proj",
    "mlp.w2": "mlp.gate_proj", "mlp.w1": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj",  # silu(w2) * w1
}
_TOP_NAMES = {"transformer.wte.weight": "model.embed_tokens.weight", "transformer.ln_f.weight": "model.norm.weight"}
_LAYER_TENSOR = re.compile(r"transformer\.h\.(\d+)\.(ln_1|ln_2|attn\.c_attn|attn\.c_proj|mlp\.w1|mlp\.w2|mlp\.c_proj)"
                           r"\.(weight|bias|qweight|qzeros|scales|g_idx)")  # the last four: GPTQ / AWQ


@dataclass(frozen=True, slots=True)
class QWenModelConfig(LlamaModelConfig):
    """A QWen config.json in Llama terms (intermediate_size is the MLP's width: QWen's own // 2;
    head_dim is kv_channels; num_key_value_heads = num_attention_heads), plus QWen's own fields.

    max_position_embeddings is the usable context: config.json's, or seq_length when
    use_dynamic_ntk is on (see the module docstring).
    """

    seq_length: int = 8192
    use_logn_attn: bool = False
    use_dynamic_ntk: bool = False


def parse_qwen_config(raw: dict[str, Any], source: str = "config.json") -> QWenModelConfig:
    """Validate a QWen config.json dict and return its typed view.

    Raises ModelLoadError (one line, naming the field) on a missing or non-positive size, sizes
    that disagree (kv_channels * num_attention_heads != hidden_size, an odd intermediate_size),
    a rotary_pct giving no even rotary dimension, scale_attn_weights false, or a
    quantization_config flashllm cannot load (GPTQ and AWQ ones, Qwen-7B-Chat-Int4's, it can).
    """
    sizes = _sizes(raw, source)
    inputs = (sizes["hidden_size"], sizes["num_attention_heads"] * sizes["head_dim"], sizes["intermediate_size"])
    quantization = parse_quantization_config(raw.get("quantization_config"), inputs, source)
    if raw.get("scale_attn_weights", True) is not True:
        raise ModelLoadError(f"{source}: scale_attn_weights={raw['scale_attn_weights']!r} is not supported; "
                             "flashllm's QWen scales attention scores by 1/sqrt(kv_channels)")
    values = {k: raw[k] if raw.get(k) is not None else v for k, v in _DEFAULTS.items()}
    pct = positive_float(values, "rotary_pct", 1.0, source)
    rotary_dim = int(sizes["head_dim"] * pct)
    if pct > 1.0 or rotary_dim <= 0 or rotary_dim % 2:
        raise ModelLoadError(f"{source}: rotary_pct={pct} with kv_channels={sizes['head_dim']} gives rotary "
                             f"dimension {rotary_dim}; expected a fraction in (0, 1] giving a positive even one")
    theta = positive_float(values, "rotary_emb_base", 10000.0, source)
    seq_length = positive_int(values, "seq_length", None, MAX_POSITION_EMBEDDINGS, source)
    max_position = positive_int(values, "max_position_embeddings", None, MAX_POSITION_EMBEDDINGS, source)
    dynamic_ntk = flag(values, "use_dynamic_ntk", source)
    if dynamic_ntk and max_position > seq_length:
        logger.warning("%s: use_dynamic_ntk is on, so flashllm caps the context at seq_length=%d: past it QWen "
                       "changes the RoPE base per prompt length, which flashllm does not implement "
                       "(max_position_embeddings=%d is not used)", source, seq_length, max_position)
        max_position = seq_length
    check_rope(rotary_dim, theta, None, max_position, source)
    no_bias = flag(values, "no_bias", source)
    return QWenModelConfig(
        architecture=config_architecture(raw, source), model_type=str(raw.get("model_type", "qwen")),
        num_key_value_heads=sizes["num_attention_heads"], max_position_embeddings=max_position,
        rms_norm_eps=positive_float(values, "layer_norm_epsilon", 1e-6, source), rope_theta=theta,
        rope_scaling=None, rotary_dim=rotary_dim, tie_word_embeddings=flag(raw, "tie_word_embeddings", source),
        attention_bias=not no_bias, mlp_bias=not no_bias, hidden_act="silu", torch_dtype=_dtype(raw, source),
        bos_token_id=token_ids(raw, "bos_token_id", source), eos_token_id=token_ids(raw, "eos_token_id", source),
        sliding_windows=(None,) * sizes["num_hidden_layers"], raw=raw, seq_length=seq_length,
        use_logn_attn=flag(values, "use_logn_attn", source), use_dynamic_ntk=dynamic_ntk, quantization=quantization,
        **sizes,
    )


def _sizes(raw: dict[str, Any], source: str) -> dict[str, int]:
    hidden = positive_int(raw, "hidden_size", None, MAX_HIDDEN_SIZE, source)
    heads = positive_int(raw, "num_attention_heads", None, MAX_NUM_HEADS, source)
    if raw.get("kv_channels") is None and hidden % heads:
        raise ModelLoadError(f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={heads}")
    kv_channels = positive_int(raw, "kv_channels", hidden // heads, MAX_HEAD_DIM, source)
    if kv_channels * heads != hidden:
        # QWen splits c_attn's output in hidden_size-wide q, k, v: the projections only agree when equal
        raise ModelLoadError(f"{source}: kv_channels={kv_channels} * num_attention_heads={heads} = "
                             f"{kv_channels * heads} differs from hidden_size={hidden}; QWen needs them equal")
    intermediate = positive_int(raw, "intermediate_size", None, MAX_INTERMEDIATE_SIZE, source)
    if intermediate % 2:
        raise ModelLoadError(f"{source}: intermediate_size={intermediate} is odd; QWen's w1 and w2 each take "
                             "half of it, so it must be even")
    return {"hidden_size": hidden, "num_attention_heads": heads, "head_dim": kv_channels,
            "intermediate_size": intermediate // 2,
            "num_hidden_layers": positive_int(raw, "num_hidden_layers", None, MAX_NUM_LAYERS, source),
            "vocab_size": positive_int(raw, "vocab_size", None, MAX_VOCAB_SIZE, source)}


def _dtype(raw: dict[str, Any], source: str) -> torch.dtype | None:
    """`torch_dtype` / `dtype` when given, else QWen's own bf16 / fp16 / fp32 switches (all false: unknown)."""
    declared = checkpoint_dtype(raw, source)
    if declared is not None:
        return declared
    chosen = [dtype for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32))
              if flag(raw, key, source)]
    if len(chosen) > 1:
        raise ModelLoadError(f"{source}: more than one of bf16, fp16 and fp32 is true; set at most one")
    return chosen[0] if chosen else None


class LognRotaryEmbedding(RotaryEmbedding):
    """RoPE, then QWen's logn attention: the query of position p (0-based) is multiplied by
    log(p + 1) / log(seq_length) when p + 1 > seq_length, so attention stays sharp past the
    training length. The keys are untouched.

    logn: (max_position,) fp32 buffer of the factors (1 up to seq_length).
    """

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float, ops: Any,
                 device: torch.device, seq_length: int) -> None:
        super().__init__(head_dim, rotary_dim, max_position, base, None, ops, device)
        lengths = torch.arange(1, max_position + 1, dtype=torch.float64)
        logn = torch.where(lengths > seq_length, lengths.log() / math.log(seq_length), torch.ones_like(lengths))
        self.register_buffer("logn", logn.to(torch.float32).to(device), persistent=False)

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """positions (T,) int64; q (T, Hq, D); k (T, Hk, D) -> (rotated q times its factor, rotated k)."""
        q, k = super().forward(positions, q, k)
        return q * self.logn[positions].to(q.dtype)[:, None, None], k


class QWenLMHeadModel(Qwen2ForCausalLM):
    """First-generation Qwen (Qwen-7B / 14B / 72B and their -Chat models), from its own checkpoint.

    Checkpoint names (transformer.wte, transformer.h.N.{ln_1, attn.c_attn, attn.c_proj, ln_2,
    mlp.w1, mlp.w2, mlp.c_proj}, transformer.ln_f, lm_head) load into the Llama layers; the fused
    `c_attn` (3 * hidden, hidden) is split into its q, k and v rows as it loads, which keeps
    tensor-parallel ranks reading only their slices. GPTQ / AWQ checkpoints (Qwen-7B-Chat-Int4)
    split c_attn's packed tensors along their output features the same way.
    """

    prequantized_methods: ClassVar[tuple[str, ...] | None] = ("gptq", "awq")  # c_attn split in packed words
    tokenizer_files: ClassVar[tuple[str, ...] | None] = ("qwen.tiktoken",)

    def __init__(self, config: QWenModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, ops, dtype, device, tp_rank, tp_size)
        if config.use_logn_attn and config.max_position_embeddings > config.seq_length:
            # one shared table, as the Llama stack has; a non-standard rotary also tells fusions()
            # that the fused decoder stack (plain RoPE) does not describe this model
            rotary = LognRotaryEmbedding(config.head_dim, config.rotary_dim, config.max_position_embeddings,
                                         config.rope_theta, ops, device, config.seq_length)
            self.model.rotary_emb = rotary
            for layer in self.model.layers:
                layer.self_attn.rotary_emb = rotary

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> QWenModelConfig:
        """config.json -> QWenModelConfig, validated (see parse_qwen_config)."""
        return parse_qwen_config(raw, source)

    @staticmethod
    def attention_biases(config: LlamaModelConfig) -> tuple[bool, bool]:
        """(qkv bias, o_proj bias): c_attn always has one; c_proj has one only when no_bias is false."""
        return True, config.attention_bias

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Load a QWen checkpoint: its names are mapped to the Llama layers' (see the class docstring);
        names it does not know pass through unchanged, to be reported by CausalLM.load_weights."""
        return super().load_weights(self._llama_named(weights))

    def _llama_named(self, weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in weights:
            if name in _TOP_NAMES:
                yield _TOP_NAMES[name], tensor
                continue
            match = _LAYER_TENSOR.fullmatch(name)
            if match is None:
                yield name, tensor
                continue
            layer, module, kind = match.groups()
            prefix = f"model.layers.{layer}."
            if module != "attn.c_attn":
                yield f"{prefix}{_LAYER_NAMES[module]}.{kind}", tensor
                continue
            rows = self.config.num_attention_heads * self.config.head_dim
            if kind in ("weight", "bias") and (tensor.dim() < 1 or tensor.shape[0] != 3 * rows):
                raise ModelLoadError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; expected "
                                     f"{3 * rows} rows (q, k and v of {rows} each) as config.json says")
            parts = split_output_features(name, tensor, (rows,) * 3, self.config.quantization)
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
                yield f"{prefix}self_attn.{proj}.{kind}", part
