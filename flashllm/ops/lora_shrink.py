"""lora_shrink: the first half of batched multi-LoRA, each row's x @ A_i^T for its own adapter slot i."""

from __future__ import annotations

import torch
from torch import Tensor

USES: frozenset[str] = frozenset()


def lora_shrink(x: Tensor, lora_a: Tensor, lora_indices: Tensor) -> Tensor:
    """Project each row onto its adapter's rank space: h[t] = x[t] @ lora_a[lora_indices[t]].T.

    Shapes: x (T, K) float; lora_a (L, R, K) float, the A matrices of L adapter slots (a slot of
    smaller rank is zero-padded to R; a fused layer stacks its projections' A along R);
    lora_indices (T,) int64 in [-1, L), -1 for rows without an adapter.
    Returns h (T, R) in x.dtype, computed in fp32 and rounded once; rows with index -1 are zero.
    """
    slots = lora_indices.clamp(min=0)
    h = torch.einsum("tk,trk->tr", x.float(), lora_a[slots].float())  # (T, R)
    return torch.where((lora_indices >= 0)[:, None], h, torch.zeros((), device=h.device)).to(x.dtype)
