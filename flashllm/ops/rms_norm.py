"""rms_norm: RMSNorm over the hidden dimension, optionally fused with the residual add."""

from __future__ import annotations

import torch
from torch import Tensor

USES: frozenset[str] = frozenset()


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Root-mean-square normalization of each row of `x`, scaled by `weight`.

    Shapes: x (T, H) float; weight (H,); residual (T, H) in x.dtype or None.

    Numerics: the mean of squares, the rsqrt and the scaling by it run in fp32; the normalized
    rows are cast to x.dtype and then multiplied by `weight` (cast to x.dtype). This is the order
    transformers' Llama/Qwen RMSNorm uses, so tiny-model parity tests are not one rounding off.
    Kernels that multiply by the weight in fp32 before a single cast stay within tolerances.

    With `residual`, `x + residual` is formed first in x.dtype (the rounding a residual stream in
    x.dtype really has), normalized, and `(normed, x + residual)` is returned; the second element
    is the new residual stream. Without it, only `normed` (T, H) in x.dtype is returned.
    Inputs are never modified here; kernels may update `x`/`residual` in place, so callers must
    use the returned tensors.
    """
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"rms_norm: x has hidden size {x.shape[-1]} but weight has {weight.shape[-1]}; "
            "they must match (check the norm layer's hidden_size)"
        )
    if residual is not None:
        x = x + residual
    x_fp32 = x.float()
    inv_rms = torch.rsqrt(x_fp32.pow(2).mean(dim=-1, keepdim=True) + eps)
    normed = (x_fp32 * inv_rms).to(x.dtype) * weight.to(x.dtype)
    if residual is None:
        return normed
    return normed, x
