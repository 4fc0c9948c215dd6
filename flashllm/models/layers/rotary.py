"""Rotary position embedding layer: owns the [cos | sin] table and calls ops.rotary_embedding."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from flashllm.ops.attention_metadata import AttentionMetadata
from flashllm.ops.rope_cache import build_cos_sin_cache


class RotaryEmbedding(nn.Module):
    """RoPE for heads of `head_dim`, rotating the first `rotary_dim` features.

    cos_sin_cache: (max_position, rotary_dim) fp32 buffer, built once; not part of the state dict
    (checkpoints carry no rope tables, only `inv_freq` that the loader skips). Built by the bound
    rotary kernel's own `cos_sin_table` when it carries one (ops/rotary_embedding.py: a backend whose
    numerics need the angles computed its way), else by ops.rope_cache.build_cos_sin_cache; or given
    whole as `cos_sin_cache` (rows the forward's positions index: a model that keeps several tables).
    """

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None, ops: Any, device: torch.device,
                 is_neox: bool = True, cos_sin_cache: Tensor | None = None) -> None:
        super().__init__()
        if rotary_dim > head_dim:
            raise ValueError(f"rotary_dim={rotary_dim} exceeds head_dim={head_dim}")
        self.head_dim, self.rotary_dim, self.is_neox = head_dim, rotary_dim, is_neox
        self.max_position = max_position
        self._rotary_embedding = ops.rotary_embedding
        if cos_sin_cache is None:
            build = getattr(ops.rotary_embedding, "cos_sin_table", None) or build_cos_sin_cache
            cos_sin_cache = build(rotary_dim, max_position, base, rope_scaling, torch.float32)
        self.register_buffer("cos_sin_cache", cos_sin_cache.to(device), persistent=False)

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """positions (T,) int64; q (T, Hq, D); k (T, Hk, D) -> rotated (q, k), same shapes."""
        return self._rotary_embedding(positions, q, k, self.cos_sin_cache, self.is_neox)


def token_prompt_lens(num_tokens: int, attn_metadata: AttentionMetadata) -> Tensor:
    """(num_tokens,) each token's sequence's prompt length: attn_metadata.prompt_lens (B,) spread over the
    tokens by cu_seqlens_q, or seq_lens where the caller did not fill prompt_lens (a prefill of a whole
    prompt, where the two agree). Padding tokens past the last sequence take the last sequence's."""
    md = attn_metadata
    lengths = md.prompt_lens if md.prompt_lens is not None else md.seq_lens
    tokens = torch.arange(num_tokens, dtype=md.cu_seqlens_q.dtype, device=md.cu_seqlens_q.device)
    seq = torch.searchsorted(md.cu_seqlens_q[1:], tokens, right=True).clamp_(max=lengths.shape[0] - 1)
    return lengths[seq]
