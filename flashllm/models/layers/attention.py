"""Paged attention layer: store the new keys/values in the layer's cache, then attend over it."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from flashllm.models.layers.attention_metadata import AttentionMetadata


class Attention(nn.Module):
    """Causal (GQA) attention of a flat varlen batch over one layer's paged KV cache.

    Holds no weights: projections and RoPE belong to the model's attention block.
    kv_cache: (k_cache, v_cache), each (num_blocks, block_size, num_kv_heads, head_dim).
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, ops: Any,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self._write_kv_cache = ops.write_kv_cache
        self._paged_attention = ops.paged_attention

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: tuple[Tensor, Tensor],
                attn_metadata: AttentionMetadata) -> Tensor:
        """q (T, Hq, D), k and v (T, Hk, D) of the new tokens -> (T, Hq * D)."""
        k_cache, v_cache = kv_cache
        # the op reads the new tokens' keys from the cache, so they must land there first
        self._write_kv_cache(k, v, k_cache, v_cache, attn_metadata.slot_mapping)
        out = self._paged_attention(
            q, k_cache, v_cache, attn_metadata.block_tables, attn_metadata.cu_seqlens_q,
            attn_metadata.seq_lens, self.scale, sliding_window=self.sliding_window,
        )
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
