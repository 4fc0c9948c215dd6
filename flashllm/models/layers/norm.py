"""Norm layers over ops.rms_norm and ops.layer_norm, with the residual add fused in."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from flashllm.models.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    """RMSNorm with a learned (hidden_size,) scale; see `flashllm.ops.rms_norm` for numerics."""

    def __init__(self, hidden_size: int, eps: float, ops: Any, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self._rms_norm = ops.rms_norm
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """x (T, H) -> normed (T, H); with residual (T, H): (norm(x + residual), x + residual)."""
        return self._rms_norm(x, self.weight, self.eps, residual)


class LayerNorm(nn.Module):
    """LayerNorm with a learned (hidden_size,) scale and, unless `bias` is false (Cohere), a (hidden_size,) shift;
    see `flashllm.ops.layer_norm` for numerics. Called like RMSNorm, the residual add fused in."""

    def __init__(self, hidden_size: int, eps: float, ops: Any, dtype: torch.dtype, device: torch.device,
                 bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self._layer_norm = ops.layer_norm
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device), requires_grad=False)
            self.bias.weight_loader = default_weight_loader

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """x (T, H) -> normed (T, H); with residual (T, H): (norm(x + residual), x + residual)."""
        return self._layer_norm(x, self.weight, self.bias, self.eps, residual)
