"""ToyGelu: a small decoder this plugin adds, whose config.json Llama's parser refuses (GPT-2 names, GeGLU MLP)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.base import CausalLM
from flashllm.models.hf_config import (
    MAX_HIDDEN_SIZE,
    MAX_INTERMEDIATE_SIZE,
    MAX_NUM_HEADS,
    MAX_NUM_LAYERS,
    MAX_POSITION_EMBEDDINGS,
    MAX_VOCAB_SIZE,
    CheckpointQuant,
    ModelLoadError,
    checkpoint_dtype,
    config_architecture,
    flag,
    positive_float,
    positive_int,
    token_ids,
)
from flashllm.models.layers.attention import Attention
from flashllm.models.layers.embedding import LMHead, VocabEmbedding
from flashllm.models.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from flashllm.models.layers.norm import RMSNorm
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.ops.attention_metadata import AttentionMetadata

# config.json hidden_act -> gelu_and_mul's `approximate`
GELU_APPROXIMATIONS = {"gelu": "none", "gelu_pytorch_tanh": "tanh"}


@dataclass(frozen=True, slots=True)
class ToyGeluConfig:
    """ToyGelu's config.json fields, validated; the properties supply the generic fields flashllm reads."""

    architecture: str
    vocab_size: int
    n_embd: int
    n_layer: int
    n_head: int
    n_inner: int
    n_positions: int
    norm_eps: float
    rope_theta: float
    gelu_approximate: str
    torch_dtype: torch.dtype | None
    bos_token_id: int | list[int] | None
    eos_token_id: int | list[int] | None
    tie_word_embeddings: bool
    raw: dict[str, Any] = field(repr=False, compare=False)
    quantization: CheckpointQuant | None = None

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def max_position_embeddings(self) -> int:
        return self.n_positions

    @property
    def num_parameters(self) -> int:
        per_layer = 4 * self.n_embd * self.n_embd + 3 * self.n_embd * self.n_inner
        return self.n_layer * per_layer + 2 * self.vocab_size * self.n_embd


def parse_toy_config(raw: dict[str, Any], source: str) -> ToyGeluConfig:
    """config.json -> ToyGeluConfig; ModelLoadError (one line) on anything ToyGelu cannot run."""
    act = raw.get("hidden_act")
    if act not in GELU_APPROXIMATIONS:
        raise ModelLoadError(f"{source}: hidden_act={act!r}; ToyGelu's MLP is GeGLU, one of {sorted(GELU_APPROXIMATIONS)}")
    if raw.get("quantization_config") is not None:
        raise ModelLoadError(f"{source}: ToyGelu loads float checkpoints only; drop quantization_config")
    n_embd = positive_int(raw, "n_embd", None, MAX_HIDDEN_SIZE, source)
    n_head = positive_int(raw, "n_head", None, MAX_NUM_HEADS, source)
    if n_embd % n_head:
        raise ModelLoadError(f"{source}: n_embd={n_embd} is not a multiple of n_head={n_head}")
    return ToyGeluConfig(
        architecture=config_architecture(raw, source),
        vocab_size=positive_int(raw, "vocab_size", None, MAX_VOCAB_SIZE, source),
        n_embd=n_embd,
        n_layer=positive_int(raw, "n_layer", None, MAX_NUM_LAYERS, source),
        n_head=n_head,
        n_inner=positive_int(raw, "n_inner", 4 * n_embd, MAX_INTERMEDIATE_SIZE, source),
        n_positions=positive_int(raw, "n_positions", 1024, MAX_POSITION_EMBEDDINGS, source),
        norm_eps=positive_float(raw, "norm_eps", 1e-5, source),
        rope_theta=positive_float(raw, "rope_theta", 10000.0, source),
        gelu_approximate=GELU_APPROXIMATIONS[act],
        torch_dtype=checkpoint_dtype(raw, source),
        bos_token_id=token_ids(raw, "bos_token_id", source),
        eos_token_id=token_ids(raw, "eos_token_id", source),
        tie_word_embeddings=flag(raw, "tie_word_embeddings", source),
        raw=raw,
    )


class ToyGeluAttention(nn.Module):
    """wqkv -> RoPE (neox) -> paged attention -> wo; every head has its own K/V head."""

    def __init__(self, config: ToyGeluConfig, rotary: RotaryEmbedding, ops: Any, dtype: torch.dtype,
                 device: torch.device, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        h, d = config.n_embd, config.head_dim
        self.wqkv = QKVParallelLinear(h, d, config.n_head, config.n_head, False, ops, dtype, device, tp_rank, tp_size)
        self.num_heads, self.head_dim = self.wqkv.num_heads, d
        self.wo = RowParallelLinear(h, h, False, ops, dtype, device, tp_rank, tp_size)
        self.rotary = rotary
        self.core = Attention(self.num_heads, d, d**-0.5, self.num_heads, ops)

    def forward(self, positions: Tensor, x: Tensor, kv_cache: tuple[Tensor, ...],
                attn_metadata: AttentionMetadata) -> Tensor:
        """positions (T,), x (T, n_embd) -> (T, n_embd)."""
        q, k, v = self.wqkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q, k = self.rotary(positions, q, k)
        return self.wo(self.core(q, k, v, kv_cache, attn_metadata))


class ToyGeluBlock(nn.Module):
    """x + attn(ln_1(x)), then + mlp(ln_2(.)), the MLP being w_down(gelu(w_gate x) * w_up x)."""

    def __init__(self, config: ToyGeluConfig, rotary: RotaryEmbedding, ops: Any, dtype: torch.dtype,
                 device: torch.device, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        h, inner = config.n_embd, config.n_inner
        self.ln_1 = RMSNorm(h, config.norm_eps, ops, dtype, device)
        self.attn = ToyGeluAttention(config, rotary, ops, dtype, device, tp_rank, tp_size)
        self.ln_2 = RMSNorm(h, config.norm_eps, ops, dtype, device)
        self.w_gate_up = MergedColumnParallelLinear(h, [inner, inner], False, ops, dtype, device, tp_rank, tp_size)
        self.w_down = RowParallelLinear(inner, h, False, ops, dtype, device, tp_rank, tp_size)
        self._gelu_and_mul, self._approximate = ops.gelu_and_mul, config.gelu_approximate

    def forward(self, positions: Tensor, x: Tensor, kv_cache: tuple[Tensor, ...],
                attn_metadata: AttentionMetadata) -> Tensor:
        """positions (T,), x (T, n_embd) -> (T, n_embd)."""
        x = x + self.attn(positions, self.ln_1(x), kv_cache, attn_metadata)
        return x + self.w_down(self._gelu_and_mul(self.w_gate_up(self.ln_2(x)), self._approximate))


class ToyGeluModel(nn.Module):
    """The checkpoint's `transformer.` prefix: wte, h.<i>, ln_f."""

    def __init__(self, config: ToyGeluConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.wte = VocabEmbedding(config.vocab_size, config.n_embd, dtype, device, tp_rank, tp_size)
        rotary = RotaryEmbedding(config.head_dim, config.head_dim, config.n_positions, config.rope_theta, None,
                                 ops, device)
        self.h = nn.ModuleList(ToyGeluBlock(config, rotary, ops, dtype, device, tp_rank, tp_size)
                               for _ in range(config.n_layer))
        self.ln_f = RMSNorm(config.n_embd, config.norm_eps, ops, dtype, device)


class ToyGeluForCausalLM(CausalLM):
    """The toy architecture: flashllm's layers and op table, its own config and checkpoint names."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "wqkv": ["wq", "wk", "wv"],
        "w_gate_up": ["w_gate", "w_up"],
    }

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> ToyGeluConfig:
        """See parse_toy_config."""
        return parse_toy_config(raw, source)

    def __init__(self, config: ToyGeluConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, ops, dtype, device, tp_rank, tp_size)
        self.transformer = ToyGeluModel(config, ops, dtype, device, tp_rank, tp_size)
        self.lm_head = LMHead(config.vocab_size, config.n_embd, ops, dtype, device, tp_rank, tp_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.transformer.wte)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """input_ids (T,), positions (T,) -> hidden (T, n_embd); writes each layer's K/V."""
        x = self.transformer.wte(input_ids)
        for block, kv_cache in zip(self.transformer.h, kv_caches, strict=True):
            x = block(positions, x, kv_cache, attn_metadata)
        return self.transformer.ln_f(x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden (N, n_embd) -> logits (N, vocab_size)."""
        return self.lm_head(hidden)

    def kv_cache_shape(self) -> tuple[int, int, int]:
        """(n_layer, heads on this rank, head_dim)."""
        attn = self.transformer.h[0].attn
        return len(self.transformer.h), attn.num_heads, attn.head_dim
