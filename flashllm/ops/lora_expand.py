"""lora_expand: the second half of batched multi-LoRA, adding each row's h @ B_i^T into its output slice."""

from __future__ import annotations

import torch
from torch import Tensor

USES: frozenset[str] = frozenset()


def lora_expand(out: Tensor, h: Tensor, lora_b: Tensor, lora_indices: Tensor, offset: int) -> Tensor:
    """out[t, offset:offset + N] += h[t] @ lora_b[lora_indices[t]].T, in place, for rows with an adapter.

    Shapes: out (T, N_out) float, the base layer's output (N_out >= offset + N); h (T, R) float
    (lora_shrink's result, or R columns of it: a strided view is fine); lora_b (L, N, R) float,
    the B matrices of L adapter slots with the LoRA scale already folded in; lora_indices (T,)
    int64 in [-1, L). The sum is formed in fp32 and rounded once into out.dtype; rows with index
    -1 are left exactly as they were. Returns out.
    """
    n = lora_b.shape[1]
    if offset < 0 or offset + n > out.shape[1]:
        raise ValueError(f"lora_expand: slice [{offset}, {offset + n}) does not fit out's {out.shape[1]} columns")
    slots = lora_indices.clamp(min=0)
    delta = torch.einsum("tr,tnr->tn", h.float(), lora_b[slots].float())  # (T, N)
    target = out[:, offset:offset + n]
    updated = (target.float() + delta).to(out.dtype)
    target.copy_(torch.where((lora_indices >= 0)[:, None], updated, target))
    return out
