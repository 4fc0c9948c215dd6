"""Gated (SwiGLU) MLP: fused gate_up projection, ops.silu_and_mul, down projection."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from flashllm.models.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), with gate and up fused into gate_up_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias, ops, dtype, device,
            tp_rank, tp_size,
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias, ops, dtype, device, tp_rank, tp_size
        )
        self._silu_and_mul = ops.silu_and_mul

    def forward(self, x: Tensor) -> Tensor:
        """x (T, hidden) -> (T, hidden)."""
        return self.down_proj(self._silu_and_mul(self.gate_up_proj(x)))
