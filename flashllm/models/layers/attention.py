"""Paged attention layer: store the new keys/values in the layer's cache, then attend over it."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from flashllm.models.layers.attention_metadata import AttentionMetadata


def split_heads(qkv: Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """A fused projection's output (T, (Hq + 2 Hk) D), queries then keys then values, as
    q (T, Hq, D), k (T, Hk, D), v (T, Hk, D) views."""
    num_tokens = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
            v.view(num_tokens, num_kv_heads, head_dim))


class Attention(nn.Module):
    """Causal (GQA) attention of a flat varlen batch over one layer's paged KV cache.

    Holds no weights: projections and RoPE belong to the model's attention block.
    kv_cache: (k_cache, v_cache), each (num_blocks, block_size, num_kv_heads, head_dim), plus
    (k_scale, v_scale) for an int8/fp8 cache (see the write_kv_cache op for their shapes).
    k_scale / v_scale buffers: this layer's calibrated static KV scales, () or (num_kv_heads,)
    float32, when the checkpoint has them (None otherwise); the model runner hands them back in
    kv_cache for `--cachekv_int8_type static`.
    alibi_slopes: (num_heads,) fp32 ALiBi slopes of this rank's query heads, or None (no ALiBi);
    the op table must then come from a request with alibi=True (see registry Caps.alibi).
    logit_softcap: scores become c * tanh(score / c) (Gemma 2), or None; the op table must then come from a
    request with softcap=True (registry Caps.softcap).
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, ops: Any,
                 sliding_window: int | None = None, alibi_slopes: Tensor | None = None,
                 logit_softcap: float | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        if alibi_slopes is not None and tuple(alibi_slopes.shape) != (num_heads,):
            raise ValueError(f"alibi_slopes has shape {tuple(alibi_slopes.shape)}; expected ({num_heads},), "
                             "one slope per query head of this rank")
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
        self._write_kv_cache = ops.write_kv_cache
        self._paged_attention = ops.paged_attention
        self.register_buffer("k_scale", None, persistent=False)
        self.register_buffer("v_scale", None, persistent=False)

    def load_kv_scale(self, which: str, scale: Tensor) -> None:
        """Set the static "k_scale" or "v_scale" from a checkpoint tensor of shape () or (num_kv_heads,).

        Raises ValueError for another name or shape, or a scale that is not finite and positive.
        """
        if which not in ("k_scale", "v_scale"):
            raise ValueError(f"unknown KV scale {which!r}; expected k_scale or v_scale")
        if scale.dim() > 1 or (scale.dim() == 1 and scale.numel() != self.num_kv_heads):
            raise ValueError(f"{which} has shape {tuple(scale.shape)}; expected () or ({self.num_kv_heads},), "
                             "one scale per KV head of this layer")
        scale = scale.to(torch.float32)
        if not bool(torch.isfinite(scale).all() and (scale > 0).all()):
            raise ValueError(f"{which} must be finite and positive, got {scale.tolist()}")
        setattr(self, which, scale)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: tuple[Tensor, ...],
                attn_metadata: AttentionMetadata, sinks: Tensor | None = None) -> Tensor:
        """q (T, Hq, D), k and v (T, Hk, D) of the new tokens -> (T, Hq * D). sinks: (Hq,) fp32 sink logits of this
        rank's query heads (gpt-oss), or None; the op table must then come from a request with sinks=True."""
        k_cache, v_cache, *scales = kv_cache
        k_scale, v_scale = scales if scales else (None, None)
        # the op reads the new tokens' keys from the cache, so they must land there first
        self._write_kv_cache(k, v, k_cache, v_cache, attn_metadata.slot_mapping, k_scale, v_scale)
        out = self._paged_attention(
            q, k_cache, v_cache, attn_metadata.block_tables, attn_metadata.cu_seqlens_q,
            attn_metadata.seq_lens, self.scale, alibi_slopes=self.alibi_slopes, sliding_window=self.sliding_window,
            k_scale=k_scale, v_scale=v_scale, logit_softcap=self.logit_softcap, sinks=sinks,
        )
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
