"""Qwen (first generation, `QWenLMHeadModel`): read natively from its own config.json fields and tensor names.

The architecture is Qwen2's decoder with as many key/value heads as query heads: RMSNorm, one
fused `c_attn` projection with a bias, neox RoPE over `rotary_pct` of each head, and the MLP
`c_proj(w1(x) * silu(w2(x)))`. So the model is built from the Llama layers (and keeps their fused
cpu fast paths) and only its config fields and checkpoint names are Qwen's own.

Two inference-time extensions of the published code, both active only past `seq_length` (the
context reaches config.json's max_position_embeddings): `use_logn_attn` scales the queries of
positions past `seq_length` by log(position + 1) / log(seq_length), exactly per token;
`use_dynamic_ntk` raises the RoPE base to base * alpha ** (d / (d - 2)) (d the rotary dimension),
alpha = 2 ** ceil(log2(L / seq_length) + 1) - 1 for a prompt of L tokens (1 up to seq_length).

A sequence keeps the alpha of its prompt length for all of its decode steps, as QWen's own code
does when it decodes with its KV cache: the keys in the paged cache are then all rotated by one
base, and a step's logits equal a full recompute of the sequence with that base. (Recomputing alpha
from the growing length at each step would leave the cached keys rotated by an older base than the
new queries; only re-encoding the whole cache could make that consistent.) A preempted sequence
recomputes with its prompt's alpha too. Prefix-cache blocks are keyed by alpha beside their tokens
(prefix_cache_salt), so blocks are shared between prompts of one alpha only; prompts of up to
seq_length tokens (alpha 1) share them as any model's do. Each alpha has its own [cos | sin] table:
the stack maps a token's position to its row in the table of its sequence's alpha.
"""

from __future__ import annotations

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
from flashllm.models.llama import LlamaModel, run_decoder_stack
from flashllm.models.llama_config import LlamaModelConfig
from flashllm.models.qwen2 import Qwen2ForCausalLM
from flashllm.ops.attention_metadata import AttentionMetadata
from flashllm.ops.rope_cache import build_cos_sin_cache

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

    max_position_embeddings is the usable context, config.json's (past seq_length see the module docstring).
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


def ntk_table(prompt_len: int, seq_length: int) -> int:
    """Which RoPE table a prompt of `prompt_len` tokens uses under dynamic NTK: the fewest doublings of
    seq_length that reach prompt_len (0 up to seq_length). Its alpha is 2 ** (table + 1) - 1, which is
    QWen's 2 ** ceil(log2(prompt_len / seq_length) + 1) - 1 (at least 1) in integers."""
    table = 0
    while seq_length << table < prompt_len:
        table += 1
    return table


class QWenRotaryEmbedding(RotaryEmbedding):
    """RoPE with QWen's dynamic NTK tables and logn query scaling.

    cos_sin_cache: (num_tables * max_position, rotary_dim) fp32, table t (alpha 2 ** (t + 1) - 1) in rows
    [t * max_position, (t + 1) * max_position); one table without dynamic NTK. forward() takes those rows
    (table_rows maps positions to them). logn: (max_position,) fp32 query factors, or None when off:
    log(p + 1) / log(seq_length) at position p once p + 1 > seq_length, else 1. Keys are never scaled.
    """

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float, ops: Any,
                 device: torch.device, seq_length: int, dynamic_ntk: bool, logn: bool) -> None:
        super().__init__(head_dim, rotary_dim, max_position, base, None, ops, device)
        self.num_tables = ntk_table(max_position, seq_length) + 1 if dynamic_ntk else 1
        if self.num_tables > 1:
            tables = [build_cos_sin_cache(rotary_dim, max_position, base * (2 ** (t + 1) - 1) ** (
                rotary_dim / (rotary_dim - 2)), None, torch.float32).to(device) for t in range(1, self.num_tables)]
            self.cos_sin_cache = torch.cat([self.cos_sin_cache, *tables])
        # a prompt longer than thresholds[t] uses a table after t
        thresholds = torch.tensor([seq_length << t for t in range(self.num_tables - 1)], dtype=torch.int32)
        self.register_buffer("thresholds", thresholds.to(device), persistent=False)
        lengths = torch.arange(1, max_position + 1, dtype=torch.float64)
        factors = torch.where(lengths > seq_length, lengths.log() / math.log(seq_length), torch.ones_like(lengths))
        self.register_buffer("logn", factors.to(torch.float32).to(device) if logn else None, persistent=False)

    def table_rows(self, positions: Tensor, attn_metadata: AttentionMetadata) -> Tensor:
        """positions (T,) int64 -> (T,) int64 rows of cos_sin_cache: each token's position in the table its
        sequence's prompt length picks (attn_metadata.prompt_lens; seq_lens where not given)."""
        if self.num_tables == 1:
            return positions
        md = attn_metadata
        lengths = md.prompt_lens if md.prompt_lens is not None else md.seq_lens
        table = (lengths[:, None] > self.thresholds).sum(-1)  # (B,)
        # each token's sequence; padding tokens past the last sequence take its table (their rows are unused)
        tokens = torch.arange(positions.shape[0], dtype=md.cu_seqlens_q.dtype, device=positions.device)
        seq = torch.searchsorted(md.cu_seqlens_q[1:], tokens, right=True).clamp_(max=lengths.shape[0] - 1)
        return positions + table[seq] * self.max_position

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """positions (T,) int64 table rows (table_rows); q (T, Hq, D); k (T, Hk, D) -> rotated (q times its
        logn factor, k)."""
        q, k = super().forward(positions, q, k)
        if self.logn is None:
            return q, k
        return q * self.logn[positions % self.max_position].to(q.dtype)[:, None, None], k


class QWenStack(LlamaModel):
    """The Llama decoder stack with one QWenRotaryEmbedding shared by every layer; its forward maps each
    token's position to its row in that embedding's tables before the layers run."""

    def __init__(self, config: QWenModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 qkv_bias: bool, o_bias: bool, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, ops, dtype, device, qkv_bias, o_bias, tp_rank, tp_size)
        beyond = config.max_position_embeddings > config.seq_length
        self.rotary_emb = QWenRotaryEmbedding(
            config.head_dim, config.rotary_dim, config.max_position_embeddings, config.rope_theta, ops, device,
            config.seq_length, config.use_dynamic_ntk and beyond, config.use_logn_attn and beyond)
        for layer in self.layers:
            layer.self_attn.rotary_emb = self.rotary_emb

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """input_ids (T,), positions (T,) -> final hidden states (T, hidden)."""
        rows = self.rotary_emb.table_rows(positions, attn_metadata)
        return run_decoder_stack(self, input_ids, rows, kv_caches, attn_metadata)


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
        rotary = self.model.rotary_emb
        # the runner fills attn_metadata.prompt_lens only for a model that reads them
        self.reads_prompt_lens = isinstance(rotary, QWenRotaryEmbedding) and rotary.num_tables > 1

    def build_stack(self, config: QWenModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> LlamaModel:
        """QWenStack where logn or dynamic NTK can act (max_position_embeddings > seq_length; the fused
        decoder stack, plain RoPE, does not describe it), else the plain Llama stack."""
        if (config.use_logn_attn or config.use_dynamic_ntk) and config.max_position_embeddings > config.seq_length:
            return QWenStack(config, ops, dtype, device, qkv_bias, o_bias, tp_rank, tp_size)
        return super().build_stack(config, ops, dtype, device, qkv_bias, o_bias, tp_rank, tp_size)

    def prefix_cache_salt(self, num_prompt_tokens: int) -> bytes:
        """Under dynamic NTK, the alpha a prompt of this length picks (b"" for alpha 1): cached keys were
        rotated by its base, so blocks are shared only between prompts of one alpha."""
        if not self.reads_prompt_lens:
            return b""
        table = min(ntk_table(num_prompt_tokens, self.config.seq_length), self.model.rotary_emb.num_tables - 1)
        return f"qwen-dynamic-ntk-alpha-{2 ** (table + 1) - 1}".encode() if table else b""

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
