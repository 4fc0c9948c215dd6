"""Norm layers over ops.rms_norm and ops.layer_norm, with the residual add fused in."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from flashllm.models.layers.linear import QKVParallelLinear, copy_checked, default_weight_loader


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
    see `flashllm.ops.layer_norm` for numerics. Called like RMSNorm, the residual add fused in. Without `weight`
    (OLMo's non-parametric norms) the scale is a fixed unit buffer, exact in the op, that no checkpoint holds."""

    def __init__(self, hidden_size: int, eps: float, ops: Any, dtype: torch.dtype, device: torch.device,
                 bias: bool = True, weight: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self._layer_norm = ops.layer_norm
        if not weight:
            self.register_buffer("weight", torch.ones(hidden_size, dtype=dtype, device=device), persistent=False)
        else:
            self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
            self.weight.weight_loader = default_weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device), requires_grad=False)
            self.bias.weight_loader = default_weight_loader

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """x (T, H) -> normed (T, H); with residual (T, H): (norm(x + residual), x + residual)."""
        return self._layer_norm(x, self.weight, self.bias, self.eps, residual)


class HeadLayerNorm(nn.Module):
    """A q / k norm with a scale row per head (Command R+, StableLM 2 12B): each head LayerNormed over head_dim (no
    bias), then scaled by that head's row of `weight` (heads on this rank, head_dim), as transformers' CohereLayerNorm
    of shape (num_heads, head_dim).

    The checkpoint holds every head's row; this rank loads the rows of the heads its `qkv_proj` shard `shard`
    ("q" or "k") holds (a replicated key head's row where key heads are fewer than ranks). The normalization runs
    in fp32 through ops.layer_norm with a unit scale (exact), the per-head scale multiplies the fp32 result, and
    the product is cast to the input dtype once, in transformers' order.
    """

    def __init__(self, qkv_proj: QKVParallelLinear, shard: str, eps: float, ops: Any, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        head_dim = qkv_proj.head_dim
        _, start, rows, full_rows = qkv_proj.output_shard(shard)
        self.first_head, self.total_heads, self.eps = start // head_dim, full_rows // head_dim, eps
        self._layer_norm = ops.layer_norm
        self.weight = nn.Parameter(torch.ones(rows // head_dim, head_dim, dtype=dtype, device=device),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.register_buffer("unit", torch.ones(head_dim, dtype=torch.float32, device=device), persistent=False)

    def weight_loader(self, param: Tensor, loaded_weight: Tensor, shard_id: Any = None) -> None:
        """Copy this rank's heads' rows of the checkpoint's (num_heads, head_dim) scales."""
        if shard_id is not None:
            raise ValueError(f"this parameter is not fused; got shard_id={shard_id!r}")
        expected = (self.total_heads, param.shape[1])
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"weight has shape {tuple(loaded_weight.shape)} but the model expects {expected} (one "
                             "row per head); the checkpoint does not match its config.json")
        copy_checked(param, loaded_weight.narrow(0, self.first_head, param.shape[0]))

    def forward(self, x: Tensor) -> Tensor:
        """x (T * H, head_dim), token-major rows of this rank's H heads (as LlamaAttention passes them) -> same."""
        normed = self._layer_norm(x.float(), self.unit, None, self.eps)  # (T * H, D) fp32
        return (normed.view(-1, *self.weight.shape) * self.weight.float()).to(x.dtype).view(x.shape)
