"""The template's one kernel: rms_norm written plainly in torch, registered with the caps it has proven."""

from __future__ import annotations

import torch
from flashllm.registry.backend import Backend, Caps
from torch import Tensor

# Claim only what tests/test_conformance.py runs: each dtype here becomes conformance cases.
RMS_NORM_CAPS = Caps(
    dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
    graph_safe=True,  # pure tensor ops, no host synchronization and no data-dependent shapes
)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm of each row of `x`, scaled by `weight`; with `residual`, fused with the residual add.

    Shapes: x (T, H) float16/bfloat16/float32; weight (H,); residual (T, H) in x.dtype or None.
    Returns normed (T, H) in x.dtype, or (normed, x + residual) when `residual` is given.

    Unlike the reference, which casts the normalized rows to x.dtype before scaling by the
    weight, this multiplies by the weight in fp32 and rounds once: one rounding fewer, which the
    per-dtype tolerances of flashllm.ops.tolerances allow. The residual sum stays in x.dtype,
    because that rounded sum is the residual stream the next layer reads.
    """
    if residual is not None:
        x = x + residual
    x_fp32 = x.float()
    variance = x_fp32.square().mean(dim=-1, keepdim=True)  # (T, 1)
    normed = (x_fp32 * torch.rsqrt(variance + eps) * weight.float()).to(x.dtype)
    if residual is None:
        return normed
    return normed, x


def register(backend: Backend) -> None:
    """Register every kernel of this package on `backend`; flashllm checks each signature here."""
    backend.kernel("rms_norm", RMS_NORM_CAPS)(rms_norm)
