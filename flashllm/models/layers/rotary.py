"""Rotary position embedding layer: owns the [cos | sin] table and calls ops.rotary_embedding."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from flashllm.ops.rope_cache import build_cos_sin_cache


class RotaryEmbedding(nn.Module):
    """RoPE for heads of `head_dim`, rotating the first `rotary_dim` features.

    cos_sin_cache: (max_position, rotary_dim) fp32 buffer, built once; not part of the state dict
    (checkpoints carry no rope tables, only `inv_freq` that the loader skips). Built by the bound
    rotary kernel's own `cos_sin_table` when it carries one (ops/rotary_embedding.py: a backend whose
    numerics need the angles computed its way), else by ops.rope_cache.build_cos_sin_cache.
    """

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None, ops: Any, device: torch.device,
                 is_neox: bool = True) -> None:
        super().__init__()
        if rotary_dim > head_dim:
            raise ValueError(f"rotary_dim={rotary_dim} exceeds head_dim={head_dim}")
        self.head_dim, self.rotary_dim, self.is_neox = head_dim, rotary_dim, is_neox
        self.max_position = max_position
        self._rotary_embedding = ops.rotary_embedding
        build = getattr(ops.rotary_embedding, "cos_sin_table", None) or build_cos_sin_cache
        cache = build(rotary_dim, max_position, base, rope_scaling, torch.float32)
        self.register_buffer("cos_sin_cache", cache.to(device), persistent=False)

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """positions (T,) int64; q (T, Hq, D); k (T, Hk, D) -> rotated (q, k), same shapes."""
        return self._rotary_embedding(positions, q, k, self.cos_sin_cache, self.is_neox)
