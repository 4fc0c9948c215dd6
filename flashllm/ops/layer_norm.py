"""layer_norm: LayerNorm over the hidden dimension (mean removed, optional bias), optionally fused with the residual add."""

from __future__ import annotations

import torch
from torch import Tensor

USES: frozenset[str] = frozenset()


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float,
               residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Layer normalization of each row of `x`: (x - mean) / sqrt(var + eps) * weight + bias.

    Shapes: x (T, H) float; weight (H,); bias (H,) or None (Cohere's norms have none); residual (T, H) in
    x.dtype or None.

    Numerics: the mean, the biased variance, the rsqrt, the scaling by `weight` and the `bias` add run in
    fp32, and the result is cast to x.dtype once, as torch's nn.LayerNorm and Cohere's fp32 LayerNorm
    compute it.

    With `residual`, `x + residual` is formed first in x.dtype (the rounding a residual stream in x.dtype
    really has), normalized, and `(normed, x + residual)` is returned; the second element is the new
    residual stream. Without it, only `normed` (T, H) in x.dtype is returned. Inputs are never modified
    here; kernels may update `x` / `residual` in place, so callers must use the returned tensors.
    """
    hidden = x.shape[-1]
    if weight.shape[-1] != hidden or (bias is not None and bias.shape[-1] != hidden):
        raise ValueError(
            f"layer_norm: x has hidden size {hidden} but weight has {weight.shape[-1]}"
            + ("" if bias is None else f" and bias {bias.shape[-1]}")
            + "; they must match (check the norm layer's hidden_size)"
        )
    if residual is not None:
        x = x + residual
    x_fp32 = x.float()
    mean = x_fp32.mean(dim=-1, keepdim=True)
    centered = x_fp32 - mean
    inv_std = torch.rsqrt(centered.pow(2).mean(dim=-1, keepdim=True) + eps)
    normed = centered * inv_std * weight.float()
    if bias is not None:
        normed = normed + bias.float()
    normed = normed.to(x.dtype)
    if residual is None:
        return normed
    return normed, x
